"""Async tensor parallelism under FP8 (parallel.async_tp with precision.compute = 'fp8', emulated):
the decomposed linears of parallel/tensor/async_tp.py multiplying the operands the blocking FP8
matmul (models/fp8.py _Fp8Matmul) multiplies, bit for bit the same rounding.

The blocking matmul rounds the whole tensor at the scale of its whole amax. A decomposed linear
holds only a piece of one tensor when it must round it: the column-parallel forward's input is
this rank's sequence chunk (the all-gather has not happened yet), and the row-parallel backward's
output gradient too (its all-gather overlaps grad_x's matmuls). So each piece's amax is first
max-reduced over the tensor-parallel group (ops.all_reduce_max: one scalar, in the ledger) — the
whole tensor's amax — and rounding element by element at that scale gives the bits the whole
tensor would have; the pieces then travel already rounded (bf16 values held in the operand's
dtype). The weight and the column's output gradient / the row's input are rounded as the
blocking layer rounds them (the amaxes it already shares over the group: fp8.take_over).

    column: y = all_gather_matmul(round_E4M3(x_chunk), round_E4M3(W)) + b, its output gradient
            rounded to E5M2 before the op's backward (grad_x = gq W_q reduce-scattered piece by
            piece, grad_W = gqᵀ x_q over the gathered rounded input, as _Fp8Matmul computes them)
    row:    y_chunk = matmul_reduce_scatter(round_E4M3(x), round_E4M3(W)), the chunk's gradient
            rounded to E5M2 at the whole gradient's amax before the op gathers it

The matmuls run as the blocking one's: bf16 products of the dequantised values (autocast bf16
inside the op), the input gradient reduce-scattered in the input's dtype. The rounding is
straight-through for x and W (the blocking backward's gq W_q and gqᵀ x_q are what the op computes
from the rounded operands). Overflow / underflow counts reach Fp8Stats through its sink, counted
per piece (the fractions are the whole tensor's; the element counts are this rank's).

Costs: the rounded weight is a tensor of its own, kept for the op's backward (the blocking
matmul re-rounds the parameter there instead); under ZeRO-3 that holds each layer's whole weight
from forward to backward. LoRA on an FP8 base with async TP is refused (config.layout_rules): its
adapter reads the unrounded gathered input, which the pieces no longer carry.
"""

from __future__ import annotations

import torch

from shardlm.models.fp8 import Fp8Quantiser, dequantise
from shardlm.parallel.tensor.async_tp import _all_gather_matmul, _matmul_reduce_scatter
from shardlm.parallel.tensor.ops import all_reduce_max

_BF16 = torch.bfloat16  # the blocking FP8 matmul's product dtype (models/fp8.py _Fp8Matmul)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _RoundOperands(torch.autograd.Function):
    """(x, W) -> (x rounded through E4M3 at the whole input's scale, W as the blocking matmul
    rounds it), dequantised values in each operand's dtype; straight through in backward. The
    counts leave as the gradient of `sink` (Fp8Stats' input and weight rows)."""

    @staticmethod
    def forward(ctx, x, weight, sink, q: Fp8Quantiser, group, record: bool):
        reduce = (lambda a: all_reduce_max(a, group)) if group else None
        with torch.autocast(x.device.type, enabled=False):
            x2 = _rows(x)
            xq, x_counts = q.cast(x2, "input", record, q.scale(x2, "input", record, reduce))
            gathered = q.gathered if q.gathered is not None and q.gathered.live else None
            if gathered is None:
                wq, w_counts = q.cast(weight, "weight", record)
            else:  # ZeRO-3 gathered it in E4M3 (parallel/data/zero/fp8_gather.py): its bits as they are
                wq, w_counts = dequantise(gathered.data, gathered.scale.clone()), gathered.counts.clone()
        ctx.counts = torch.stack([x_counts, w_counts.to(x_counts.device), torch.zeros_like(x_counts)])
        return xq.view(x.shape).to(x.dtype), wq.to(weight.dtype)

    @staticmethod
    def backward(ctx, grad_x, grad_w):
        return grad_x, grad_w, ctx.counts if ctx.needs_input_grad[2] else None, None, None, None


class _RoundGradient(torch.autograd.Function):
    """y (+ b): its backward rounds the output's gradient through E5M2 at the whole gradient's
    scale (the role's shared amax, max-reduced over `group` too where this rank holds a sequence
    piece of it), as _Fp8Matmul's backward rounds it, and sums the unrounded one in fp32 for the
    bias, as it does. Counts: Fp8Stats' third row."""

    @staticmethod
    def forward(ctx, y, bias, sink, q: Fp8Quantiser, group):
        ctx.q, ctx.group, ctx.bias_dtype = q, group, None if bias is None else bias.dtype
        return y.view_as(y) if bias is None else y + bias.to(y.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, group = ctx.q, ctx.group
        reduce = (lambda a: all_reduce_max(a, group)) if group else None
        with torch.autocast(grad.device.type, enabled=False):
            g2 = _rows(grad)
            gq, counts = q.cast(g2, "grad_output", True, q.scale(g2, "grad_output", True, reduce))
            grad_b = g2.float().sum(0).to(ctx.bias_dtype) if ctx.bias_dtype and ctx.needs_input_grad[1] else None
        sink = torch.zeros(3, counts.numel(), device=counts.device, dtype=counts.dtype)
        sink[2] = counts
        return gq.view(grad.shape).to(grad.dtype), grad_b, sink if ctx.needs_input_grad[2] else None, None, None


def fp8_all_gather_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, q: Fp8Quantiser,
                          group: str, pieces: int) -> tuple[torch.Tensor, torch.Tensor]:
    """async_tp.all_gather_matmul in FP8: (gather(x_q) W_qᵀ + b, gather(x_q)) for this rank's
    sequence chunk x (B, t, C); the input's amax is the max over the group's chunks."""
    record = torch.is_grad_enabled()
    xq, wq = _RoundOperands.apply(x, weight, q.stats.sink, q, group, record)
    y, whole = _all_gather_matmul(xq, wq, None, group, pieces, _BF16)
    return _RoundGradient.apply(y, bias, q.stats.sink, q, None), whole  # output features cut: the shared amax


def fp8_matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, q: Fp8Quantiser, group: str,
                              pieces: int) -> torch.Tensor:
    """async_tp.matmul_reduce_scatter in FP8: this rank's (B, t, out) chunk of Σ x_q W_qᵀ; the
    chunk's gradient rounded at the amax of the whole gathered gradient (max over the group)."""
    xq, wq = _RoundOperands.apply(x, weight, q.stats.sink, q, None, torch.is_grad_enabled())
    mine = _matmul_reduce_scatter(xq, wq, None, group, pieces, _BF16)
    return _RoundGradient.apply(mine, None, q.stats.sink, q, group)
