"""The tensor-parallel collectives as torch custom ops (torch.library), so that a compiled block
(train.compile, parallel/blocks/compile.py) holds each as one opaque node: a tensor-parallel block is
still one graph, with no break at its all-reduces (Dynamo cannot trace into a ProcessGroup call;
it can call an op whose output shape it is told).

An op takes tensors and plain values only, so a group travels as its key (`op_group`), looked up
here; the call itself goes through `comm.Comm`, so every byte is still in the ledger and under
the watchdog, compiled or eager. The outputs are fresh tensors (an op's output may not alias its
input): the same copies the eager functions made before.
"""

from __future__ import annotations

import torch

from shardlm.comm.collectives import Comm

_COMMS: dict[str, Comm] = {}


def op_group(comm: Comm) -> str:
    """`comm`'s key for the ops below (registered on first use)."""
    key = f"{getattr(comm, 'name', 'group')}@{id(comm):x}"
    _COMMS[key] = comm
    return key


@torch.library.custom_op("shardlm::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """The group's sum of x (a new tensor)."""
    out = x.contiguous().clone()
    _COMMS[group].all_reduce(out).wait()
    return out


@all_reduce.register_fake
def _(x: torch.Tensor, group: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("shardlm::gather_seq", mutates_args=())
def gather_seq(x: torch.Tensor, group: str) -> torch.Tensor:
    """(B, t, C) on each rank -> (B, N·t, C), ranks' chunks in order (a (N·t, B, C) buffer,
    transposed: the sequence is outermost in memory)."""
    comm = _COMMS[group]
    chunk = x.transpose(0, 1).contiguous()
    out = torch.empty((comm.size * chunk.shape[0], *chunk.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather(out.view(-1), chunk.view(-1)).wait()
    return out.transpose(0, 1)


@gather_seq.register_fake
def _(x: torch.Tensor, group: str) -> torch.Tensor:
    b, t, *rest = x.shape
    return x.new_empty((_COMMS[group].size * t, b, *rest)).transpose(0, 1)


@torch.library.custom_op("shardlm::reduce_scatter_seq", mutates_args=())
def reduce_scatter_seq(x: torch.Tensor, group: str) -> torch.Tensor:
    """(B, T, C) partial sums on each rank -> this rank's (B, T/N, C) of their sum."""
    comm = _COMMS[group]
    whole = x.transpose(0, 1).contiguous()
    out = torch.empty((whole.shape[0] // comm.size, *whole.shape[1:]), dtype=x.dtype, device=x.device)
    comm.reduce_scatter(out.view(-1), whole.view(-1), scratch_input=True).wait()
    return out.transpose(0, 1)


@reduce_scatter_seq.register_fake
def _(x: torch.Tensor, group: str) -> torch.Tensor:
    b, t, *rest = x.shape
    return x.new_empty((t // _COMMS[group].size, b, *rest)).transpose(0, 1)


@torch.library.custom_op("shardlm::all_reduce_max", mutates_args=())
def all_reduce_max(x: torch.Tensor, group: str) -> torch.Tensor:
    """The group's elementwise max of x (a new tensor): an FP8 scale agreed over the pieces of
    a tensor-parallel tensor (models/fp8.py Fp8Quantiser.share_amax)."""
    import torch.distributed as dist

    out = x.contiguous().clone()
    _COMMS[group].all_reduce(out, op=dist.ReduceOp.MAX).wait()
    return out


@all_reduce_max.register_fake
def _(x: torch.Tensor, group: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def comm_of(group: str) -> Comm:
    """The Comm behind a group's key (op_group): parallel/tensor/async_tp.py's decomposed loops launch
    their pieces' collectives through it."""
    return _COMMS[group]
