"""Tensor parallelism's regions (parallel/tensor/decoder.py applies it): the group state a rank's
tensor-parallel layers share (TPState), Megatron's f / g conjugate functions and their sequence-
parallel forms (all-gather / reduce-scatter along the sequence) as our own autograd functions
over plain tensors, and the helpers that sum or keep in sync what the group shares. Every
collective goes through comm.Comm (the byte ledger, the watchdog) via parallel/tensor/ops.py."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from shardlm.comm.collectives import Comm
from shardlm.parallel.tensor.ops import all_reduce, gather_seq, op_group, reduce_scatter_seq
from shardlm.models.placement import Split


@dataclass
class TPState:
    """The tensor-parallel group of one model, and whether this forward runs sequence-parallel
    (decided per forward by the embedding: only when the sequence divides by the group)."""

    comm: Comm
    sequence_parallel: bool
    sharded: bool = False
    """True while this forward's activations outside attention and MLP are sequence-sharded."""
    splits: dict[str, Split] = field(default_factory=dict)
    group: str = ""
    """The group's key for the collective ops (collective_ops.op_group), set from `comm`."""
    async_tp: bool = False
    """parallel.async_tp: while `sharded`, the column-parallel linears' all-gather and the row-
    parallel ones' reduce-scatter are cut into pieces that overlap their matmuls
    (parallel/tensor/async_tp.py); set by parallelize."""

    def __post_init__(self) -> None:
        self.group = op_group(self.comm)

    @property
    def size(self) -> int:
        return self.comm.size

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def overlapped(self) -> bool:
        """Whether this forward's sequence-parallel collectives overlap their matmuls."""
        return self.async_tp and self.sharded

    def decide(self, ids: torch.Tensor) -> None:
        """This forward's mode, from its (B, T) token ids: sequence-sharded only when the
        sequence divides by the group."""
        self.sharded = self.sequence_parallel and ids.shape[1] % self.size == 0


class CopyToGroup(torch.autograd.Function):
    """Identity forward, all-reduce backward (Megatron's f): before a column-parallel matmul,
    and on a replicated parameter whose gradient each rank computes from different tokens.
    `group`: the group's key (collective_ops.op_group), so a compiled block traces it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    """All-reduce forward, identity backward (Megatron's g): after a row-parallel matmul."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence forward, reduce-scatter backward (sequence parallelism's
    replacement for f)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_seq(grad, ctx.group), None


class _ReduceScatterSequence(torch.autograd.Function):
    """Reduce-scatter along the sequence forward, all-gather backward (the replacement for g)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_seq(grad, ctx.group), None


def into_parallel_region(x: torch.Tensor, tp: TPState) -> torch.Tensor:
    """Before a column-parallel matmul: the whole sequence on every rank."""
    if tp.sharded:
        return _GatherSequence.apply(x, tp.group)
    return CopyToGroup.apply(x, tp.group)


def out_of_parallel_region(x: torch.Tensor, tp: TPState) -> torch.Tensor:
    """After a row-parallel matmul (or the vocabulary-parallel embedding): partial sums summed,
    whole (plain TP) or this rank's sequence chunk (sequence parallel)."""
    if tp.sharded:
        return _ReduceScatterSequence.apply(x, tp.group)
    return _ReduceFromGroup.apply(x, tp.group)


def copy_to_group(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Identity forward, the group's sum of the gradient backward (Megatron's f)."""
    return CopyToGroup.apply(x, op_group(comm))


def reduce_from_group(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """The group's sum of x forward, identity backward (Megatron's g): each rank's gradient
    goes to its own addend (also a MoE block's router statistics over the ranks' token shares)."""
    return _ReduceFromGroup.apply(x, op_group(comm))


def summed(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """The group's sum of x, outside autograd (a copy; x is unchanged)."""
    return all_reduce(x.detach(), op_group(comm))


def synced(param: torch.Tensor, tp: TPState) -> torch.Tensor:
    """A replicated parameter used on sequence-sharded activations: its gradient summed over
    the group (each rank saw different tokens). Plain TP: every rank's gradient is the same."""
    return CopyToGroup.apply(param, tp.group) if tp.sharded else param


@contextmanager
def frozen_kept(model: nn.Module) -> Iterator[None]:
    """Layers replaced inside keep, by name, which parameters are frozen (LoRA's base: apply_lora
    froze every parameter but the adapters, and a new layer's parameters would otherwise train).
    Used by every step that replaces layers after apply_lora (apply_tp, parallel/expert/dispatch.py)."""
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    yield
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
