"""Context parallelism's exchanges as torch custom ops (torch.library), so a compiled block
(train.compile, parallel/blocks/compile.py) holds the ring attention and Ulysses' all-to-all each as
one opaque node with its own backward — no graph break at a send, a receive or an all-to-all
(Dynamo cannot trace into a ProcessGroup call), as tensor parallelism's collectives
(parallel/tensor/ops.py). Eager runs go through the same ops.

An op takes tensors and plain values only, so the ring's CPState travels as its key
(`state_key`) and an all-to-all group as collective_ops' `op_group` key; the calls go through
comm.Comm, so every byte is still in the ledger and under the watchdog.
"""

from __future__ import annotations

from typing import Optional

import torch

from shardlm.parallel.tensor.ops import _COMMS

_STATES: dict = {}
RING: dict = {}
"""'forward' and 'backward' of the ring (parallel/context/attention.py ring_forward, ring_backward), set
by that module when it is imported: it imports this one, so the ops sit below the algorithm."""


def state_key(cp) -> str:
    """`cp`'s (a CPState's) key for ring_attention_op (registered on first use)."""
    key = f"cp@{id(cp):x}"
    _STATES[key] = cp
    return key


@torch.library.custom_op("shardlm::ring_attention", mutates_args=())
def ring_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: str, scale: float,
                      documents: Optional[torch.Tensor], window: int, softcap: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, log-sum-exp) of the ring (parallel/context/attention.py ring_forward)."""
    out, lse = RING["forward"](q, k, v, _STATES[state], scale, documents, window, softcap)
    return out.contiguous(), lse


@ring_attention_op.register_fake
def _(q, k, v, state, scale, documents, window, softcap):
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("shardlm::ring_attention_backward", mutates_args=())
def ring_attention_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               out: torch.Tensor, lse: torch.Tensor, state: str, scale: float,
                               documents: Optional[torch.Tensor], window: int, softcap: float
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return RING["backward"](dout.contiguous(), q, k, v, out, lse, _STATES[state], scale, documents, window,
                            softcap)


@ring_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, state, scale, documents, window, softcap):
    # contiguous, as ring_backward makes them (q, k, v are often transposed views)
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _setup_ring(ctx, inputs, output):
    q, k, v, state, scale, documents, window, softcap = inputs
    ctx.save_for_backward(q, k, v, *output, *([] if documents is None else [documents]))
    ctx.state, ctx.scale, ctx.window, ctx.softcap = state, scale, window, softcap


def _ring_backward(ctx, dout, dlse):
    q, k, v, out, lse, *documents = ctx.saved_tensors
    dq, dk, dv = ring_attention_backward_op(dout, q, k, v, out, lse, ctx.state, ctx.scale,
                                            documents[0] if documents else None, ctx.window, ctx.softcap)
    return dq, dk, dv, None, None, None, None, None


ring_attention_op.register_autograd(_ring_backward, setup_context=_setup_ring)


@torch.library.custom_op("shardlm::cp_all_to_all", mutates_args=())
def all_to_all_rows(x: torch.Tensor, group: str) -> torch.Tensor:
    """Row j of x (U, ...) to group rank j; row j of the result came from rank j (Ulysses'
    exchange: parallel/context/ulysses.py). Its own adjoint, so its backward is itself."""
    comm = _COMMS[group]
    x = x.contiguous()
    out = torch.empty_like(x)
    ones = [1] * comm.size
    comm.all_to_all(out, x, ones, ones).wait()
    return out


@all_to_all_rows.register_fake
def _(x, group):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup_a2a(ctx, inputs, output):
    ctx.group = inputs[1]


def _a2a_backward(ctx, grad):
    return all_to_all_rows(grad, ctx.group), None


all_to_all_rows.register_autograd(_a2a_backward, setup_context=_setup_a2a)
