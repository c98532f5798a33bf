"""The experts' grouped matmul as one torch custom op, so a compiled graph can hold it.

A MoE layer's rows arrive grouped by expert, `counts[e]` of them for expert e: expert e's rows
are multiplied by its own weight. How many rows each expert gets is data (the router's choice),
so a per-expert Python loop over `counts.tolist()` is data-dependent control flow that Dynamo
cannot trace without breaking the graph; `torch._grouped_mm` takes the counts as a tensor, but
its meta function accepts bf16 only (torch 2.13), so a float32 or fp16 graph cannot hold it.
`expert_linear` is that grouped matmul as an opaque node whose output shape Dynamo is told
((M, out) for (M, in) rows): the loop runs inside the op at run time. Its forward is exactly the
eager loop's (F.linear per expert) and its backward the products autograd takes for F.linear
(the input's gradient grad @ W, the weight's grad^T @ x, the bias's the rows' sum), so compiled
and eager experts agree bit for bit on their matmuls (tests/test_moe.py).

Mixed precision: an op is below autocast, so the caller casts the rows and weights to the
autocast dtype first (`expert_linear` here does it), as F.linear under autocast would.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _pieces(x: torch.Tensor, counts: torch.Tensor) -> list[torch.Tensor]:
    return list(x.split(counts.tolist()))


@torch.library.custom_op("shardlm::expert_linear", mutates_args=())
def _expert_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   counts: torch.Tensor) -> torch.Tensor:
    """x (M, in) grouped by expert, weight (E, out, in), bias (E, out) or None, counts (E,) ->
    (M, out): expert e's rows times weight[e]ᵀ (+ bias[e])."""
    outs = [F.linear(xe, weight[e], None if bias is None else bias[e]) for e, xe in enumerate(_pieces(x, counts))]
    return torch.cat(outs) if outs else x.new_empty((0, weight.shape[1]))


@_expert_linear.register_fake
def _(x, weight, bias, counts):
    return x.new_empty((x.shape[0], weight.shape[1]))


@torch.library.custom_op("shardlm::expert_linear_backward", mutates_args=())
def _expert_linear_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, with_bias: bool,
                            counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of x, weight and bias (zeros (E, out) without one): per expert, the
    products autograd's mm backward takes for F.linear (x @ Wᵀ: grad @ W, and grad^T @ x for
    the weight, W being the transposed, column-major operand)."""
    grad_x = torch.empty_like(x)
    grad_w = torch.zeros_like(weight)
    grad_b = weight.new_zeros(weight.shape[:2])
    at = 0
    for e, (ge, xe) in enumerate(zip(_pieces(grad, counts), _pieces(x, counts))):
        grad_x[at:at + xe.shape[0]] = ge.mm(weight[e])
        grad_w[e] = ge.t().mm(xe)
        if with_bias:
            grad_b[e] = ge.sum(0)
        at += xe.shape[0]
    return grad_x, grad_w, grad_b


@_expert_linear_backward.register_fake
def _(grad, x, weight, with_bias, counts):
    return torch.empty_like(x), torch.empty_like(weight), weight.new_empty(weight.shape[:2])


def _setup(ctx, inputs, output):
    x, weight, bias, counts = inputs
    ctx.save_for_backward(x, weight, counts)
    ctx.with_bias = bias is not None


def _backward(ctx, grad):
    x, weight, counts = ctx.saved_tensors
    grad_x, grad_w, grad_b = _expert_linear_backward(grad.contiguous(), x, weight, ctx.with_bias, counts)
    return grad_x, grad_w, grad_b if ctx.with_bias else None, None


_expert_linear.register_autograd(_backward, setup_context=_setup)


def expert_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  counts: torch.Tensor) -> torch.Tensor:
    """Each expert's rows through its linear: x (M, in) grouped by expert, `counts` (E,) rows
    each (a tensor: no data-dependent Python in a compiled graph), weight (E, out, in), bias
    (E, out) or None -> (M, out). Under autocast the operands are cast to its dtype first."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    return _expert_linear(x.contiguous(), weight, bias, counts)
