"""Weight gradients set aside and computed later: the split backward of the zero-bubble
schedules (zb, zbv, dualpipev: shardlm/parallel/pipeline/tables.py; Qi et al. 2023). "I" computes only
the gradient a stage sends back; the linear layers' dW = gᵀx and db = Σg wait in `WeightGrads`
until "W".
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


class WeightGrads:
    """Weight gradients set aside during a split backward ("I") and computed later ("W"):
    the Decoder's linear layers (`DeferrableLinear`) put (weight, bias, input, output
    gradient) here instead of computing dW = gᵀx and db = Σg while deferring is on."""

    def __init__(self):
        self.collecting: tuple | None = None
        self.waiting: dict[tuple, list] = {}

    @contextlib.contextmanager
    def deferred(self, key: tuple | None):
        self.collecting = key
        try:
            yield
        finally:
            self.collecting = None

    def put(self, item: tuple) -> None:
        self.waiting.setdefault(self.collecting, []).append(item)

    @torch.no_grad()
    def apply(self, key: tuple) -> None:
        for weight, bias, x, g in self.waiting.pop(key, []):
            _accumulate(weight, (g.flatten(0, -2).t() @ x.flatten(0, -2)).to(weight.dtype))
            if bias is not None:
                _accumulate(bias, g.flatten(0, -2).sum(0).to(bias.dtype))


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    param.grad = grad if param.grad is None else param.grad.add_(grad)


class _DeferrableLinearFunction(torch.autograd.Function):
    """y = x Wᵀ + b, whose backward leaves dW and db to `stash` while it is collecting."""

    @staticmethod
    def forward(ctx, x, weight, bias, stash: WeightGrads):
        ctx.stash, ctx.weight, ctx.bias, ctx.x_dtype = stash, weight, bias, x.dtype
        if torch.is_autocast_enabled(x.device.type):  # autocast's cast, made here, saved as used
            dtype = torch.get_autocast_dtype(x.device.type)
            x, weight = x.to(dtype), weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
        ctx.save_for_backward(x, weight)
        with torch.autocast(x.device.type, enabled=False):
            return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        dx = (g @ weight).to(ctx.x_dtype)
        if ctx.stash.collecting is not None:
            ctx.stash.put((ctx.weight, ctx.bias, x, g))
            return dx, None, None, None
        dw = (g.flatten(0, -2).t() @ x.flatten(0, -2)).to(ctx.weight.dtype)
        db = g.flatten(0, -2).sum(0).to(ctx.bias.dtype) if ctx.bias is not None else None
        return dx, dw, db, None


class DeferrableLinear(nn.Linear):
    """nn.Linear whose weight gradients a split backward can defer (WeightGrads): what the
    zero-bubble schedule turns a stage's linear layers into (same parameters, same names)."""

    stash: WeightGrads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _DeferrableLinearFunction.apply(x, self.weight, self.bias, self.stash)


def make_deferrable(model: nn.Module, stash: WeightGrads) -> int:
    """Turn the model's nn.Linear layers into DeferrableLinear in place (the same objects and
    parameters, a subclass that only changes forward); returns how many."""
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = DeferrableLinear
            module.stash = stash
            count += 1
    return count
