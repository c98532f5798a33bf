"""Precision policy: the compute dtype (autocast) and, for fp16, a dynamic loss scaler.

The variant is chosen once when the run is built (`build_precision`); the step calls the same
methods whatever the precision. Master weights and optimizer states stay fp32.

bf16 on a CPU without bf16 matmul hardware (no AVX-512-BF16, no AMX: AVX2 Intel and AMD up to
Zen 3) gets torch's portable bf16 GEMM, 5-30x slower than the same product in fp32 (measured on a
Zen 3: a 512 x 576 x 3072 product 116 ms against 21.5 ms, the transposed products of backward
worse). There `precision.cpu_bf16_gemm = 'fp32'` (what 'auto' resolves to by the measured
peaks) multiplies the bf16 values in fp32 GEMMs and rounds the result to bf16: a product of two
bf16 numbers is exact in fp32 and the sum accumulates in fp32, as a bf16 kernel accumulates, so
the result differs from the bf16 kernel's only by the order of that fp32 sum. Inputs, outputs,
what autograd saves and the gradients stay bf16 (`fp32_gemm`).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterator

import torch
import torch.nn.functional as F

from shardlm.config.schema import PrecisionConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def carrier(compute: str) -> str:
    """The dtype (a DTYPES key) a resolved precision.compute runs everything but its FP8 matmuls
    in, and keeps its compute-dtype parameters and gradients in: 'fp8' is bf16 there (as torchao
    does; models/fp8.py swaps the blocks' linears), any other value is itself."""
    return "bf16" if compute == "fp8" else compute


class NoLossScaler:
    """fp32 and bf16: bf16 has fp32's exponent range, so gradients need no scaling."""

    scale = 1.0

    def __init__(self, stop_on_nonfinite: bool = True):
        self.stop_on_nonfinite = stop_on_nonfinite
        self.skipped_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def unscale_(self, grads: list[torch.Tensor]) -> None:
        pass

    def update(self, grads_finite: bool) -> bool:
        """Returns whether the optimizer may step. Outside fp16 a non-finite gradient is not an
        expected event to skip silently but a diverged run."""
        if grads_finite:
            return True
        if self.stop_on_nonfinite:
            raise FloatingPointError(
                "the gradient norm is not finite (NaN/inf): the run diverged. Lower train.lr, keep "
                "train.grad_clip > 0, or set train.on_nonfinite = 'skip' to skip such steps")
        self.skipped_steps += 1
        return False

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class DynamicLossScaler:
    """fp16 loss scaling (Micikevicius et al. 2018): multiply the loss by `scale` so small
    gradients survive fp16's narrow range; on overflow skip the step and back off; after
    `growth_interval` clean steps grow the scale again."""

    def __init__(self, init_scale: float, growth_interval: int, backoff: float, growth: float = 2.0):
        self.scale = float(init_scale)
        self.growth_interval = growth_interval
        self.backoff = backoff
        self.growth = growth
        self.clean_steps = 0
        self.skipped_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_(self, grads: list[torch.Tensor]) -> None:
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)

    def update(self, grads_finite: bool) -> bool:
        if not grads_finite:
            self.scale *= self.backoff
            self.clean_steps = 0
            self.skipped_steps += 1
            return False
        self.clean_steps += 1
        if self.clean_steps % self.growth_interval == 0:
            self.scale *= self.growth
        return True

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state["skipped_steps"])


FP32_COPY_BYTES = 32 * 2**20
"""The largest fp32 copy of a weight a product makes at once: a larger weight (an LM head: 49,152
x 576 is 113 MB in fp32) is multiplied a block of its rows at a time."""


def _row_blocks(weight: torch.Tensor) -> list[slice]:
    step = max(1, FP32_COPY_BYTES // (4 * weight.shape[1]))
    return [slice(i, i + step) for i in range(0, weight.shape[0], step)]


class _Fp32GemmLinear(torch.autograd.Function):
    """F.linear of bf16 operands through fp32 GEMMs, each result rounded to bf16: forward
    x W^T + b, backward grad W (the input's) and grad^T x (the weight's), a block of W's rows at
    a time (FP32_COPY_BYTES; the input's gradient summed over the blocks in fp32, rounded once).
    Saves the bf16 x and W, as the bf16 kernel's autograd does."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        x32 = x.float()
        out = x.new_empty((*x.shape[:-1], weight.shape[0]))
        for rows in _row_blocks(weight):
            out[..., rows] = F.linear(x32, weight[rows].float(), None if bias is None else bias[rows].float())
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = grad.float()
        blocks = _row_blocks(weight)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            acc = sum(g[..., rows] @ weight[rows].float() for rows in blocks)  # (…, in), fp32
            grad_x = acc.to(x.dtype)
        flat = g.reshape(-1, g.shape[-1])  # (N, out)
        if ctx.needs_input_grad[1]:
            x32 = x.reshape(-1, x.shape[-1]).float()
            grad_w = weight.new_empty(weight.shape)
            for rows in blocks:
                grad_w[rows] = flat[:, rows].t() @ x32
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = flat.sum(0).to(weight.dtype)
        return grad_x, grad_w, grad_b


_NO_AUTOCAST = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


def _bf16(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(torch.bfloat16)  # autocast's own cast (a no-op on bf16)


def _linear(x, weight, bias=None):
    with torch._C._ExcludeDispatchKeyGuard(_NO_AUTOCAST):
        return _Fp32GemmLinear.apply(_bf16(x), _bf16(weight), _bf16(bias))


def _product(op: Callable) -> Callable:
    """`op` (matmul, mm, bmm) of bf16-cast operands in fp32, the result rounded to bf16; autograd
    records the casts, so the gradients are bf16 too (their products in fp32, saved in fp32)."""
    def kernel(a, b):
        with torch._C._ExcludeDispatchKeyGuard(_NO_AUTOCAST):
            return op(_bf16(a).float(), _bf16(b).float()).to(torch.bfloat16)
    return kernel


def _attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    """scaled_dot_product_attention of bf16-cast q, k, v in fp32 (its products are GEMMs: torch's
    CPU flash kernel runs them in bf16 through the same portable GEMM), the output rounded to
    bf16; a float mask in fp32."""
    with torch._C._ExcludeDispatchKeyGuard(_NO_AUTOCAST):
        mask = attn_mask.float() if attn_mask is not None and attn_mask.is_floating_point() else attn_mask
        return F.scaled_dot_product_attention(
            _bf16(query).float(), _bf16(key).float(), _bf16(value).float(), mask, dropout_p, is_causal,
            scale=scale, enable_gqa=enable_gqa).to(torch.bfloat16)


def _addmm(input, mat1, mat2, *, beta=1, alpha=1):
    """addmm (LoRA's base + scaling · B h, models/lora.py) of bf16-cast operands in fp32, rounded
    once to bf16."""
    with torch._C._ExcludeDispatchKeyGuard(_NO_AUTOCAST):
        return torch.addmm(_bf16(input).float(), _bf16(mat1).float(), _bf16(mat2).float(),
                           beta=beta, alpha=alpha).to(torch.bfloat16)


_FP32_GEMM_KERNELS = {"linear": _linear, "matmul": _product(torch.matmul), "mm": _product(torch.mm),
                      "bmm": _product(torch.bmm), "addmm": _addmm, "scaled_dot_product_attention": _attention}
_fp32_gemm_depth = 0
_fp32_gemm_library: torch.library.Library | None = None


def fp32_gemm_active() -> bool:
    """Whether bf16 matmuls on the CPU run through fp32 GEMMs now (inside `fp32_gemm`)."""
    return _fp32_gemm_depth > 0


@contextlib.contextmanager
def fp32_gemm() -> Iterator[None]:
    """Within: CPU autocast to bf16 runs linear, matmul, mm, bmm, addmm and
    scaled_dot_product_attention as fp32 GEMMs of the bf16 operands, the results rounded to bf16 (torch.library kernels for the AutocastCPU dispatch
    key, registered on the outermost entry, removed on its exit: torch's own autocast kernels
    return). Custom autograd Functions whose backward multiplies bf16 tensors outside autocast
    ask `fp32_gemm_active` at forward and multiply with `gemm`."""
    global _fp32_gemm_depth, _fp32_gemm_library
    if _fp32_gemm_depth == 0:
        library = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():  # "Overriding a previously registered kernel": meant
            warnings.simplefilter("ignore", UserWarning)
            for op, kernel in _FP32_GEMM_KERNELS.items():
                library.impl(op, kernel, "AutocastCPU")
        _fp32_gemm_library = library
    _fp32_gemm_depth += 1
    try:
        yield
    finally:
        _fp32_gemm_depth -= 1
        if _fp32_gemm_depth == 0 and _fp32_gemm_library is not None:
            _fp32_gemm_library._destroy()
            _fp32_gemm_library = None


def gemm(a: torch.Tensor, b: torch.Tensor, fp32: bool) -> torch.Tensor:
    """a @ b; with `fp32` (fp32_gemm_active() when the forward ran) and bf16 CPU operands, as an
    fp32 GEMM rounded to bf16."""
    if fp32 and a.dtype == b.dtype == torch.bfloat16 and a.device.type == "cpu":
        return (a.float() @ b.float()).to(torch.bfloat16)
    return a @ b


@dataclass
class Precision:
    name: str
    """'fp32', 'bf16', 'fp16' or 'fp8' (resolved; never 'auto')."""
    autocast: Callable[[], ContextManager]
    scaler: NoLossScaler | DynamicLossScaler
    cpu_bf16_gemm: str = "native"
    """precision.cpu_bf16_gemm, resolved: 'fp32' when this run's bf16 matmuls on the CPU go
    through fp32 GEMMs (`fp32_gemm`, entered with autocast and around a whole step: `kernels`)."""

    def kernels(self) -> ContextManager:
        """Around a whole training step: the fp32 GEMM kernels where this run uses them, so that
        activation checkpointing's recomputation in backward (under autocast again, outside the
        forward's context) multiplies as the forward did."""
        return fp32_gemm() if self.cpu_bf16_gemm == "fp32" else contextlib.nullcontext()

    @property
    def gemm(self) -> str:
        """The DTYPES key the matmuls run at: the peak MFU is measured against."""
        return "fp32" if self.cpu_bf16_gemm == "fp32" else self.carrier

    @property
    def carrier(self) -> str:
        """The DTYPES key autocast runs in (bf16 for fp8): also the peak MFU is measured against."""
        return carrier(self.name)

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.carrier]


def build_precision(cfg: PrecisionConfig, device: torch.device,
                    stop_on_nonfinite: bool = True) -> Precision:
    name = cfg.compute
    widen = cfg.cpu_bf16_gemm == "fp32" and device.type == "cpu" and carrier(name) == "bf16"
    if carrier(name) not in DTYPES:  # 'auto' is decided once per run, on one rank: resolve.resolve_config
        raise ValueError(f"precision.compute = {name!r} must be resolved (resolve.resolve_config) "
                         f"before the precision is built")
    if name == "fp32":
        autocast: Callable[[], ContextManager] = contextlib.nullcontext
    else:
        dtype = DTYPES[carrier(name)]
        if widen:
            @contextlib.contextmanager
            def autocast() -> Iterator[None]:
                with torch.autocast(device.type, dtype=dtype), fp32_gemm():
                    yield
        else:
            autocast = lambda: torch.autocast(device.type, dtype=dtype)  # noqa: E731
    if name == "fp16":
        scaler: NoLossScaler | DynamicLossScaler = DynamicLossScaler(
            cfg.loss_scale_init, cfg.loss_scale_growth_interval, cfg.loss_scale_backoff)
    else:
        scaler = NoLossScaler(stop_on_nonfinite)
    return Precision(name, autocast, scaler, "fp32" if widen else "native")


def is_finite(value: torch.Tensor | float) -> bool:
    return math.isfinite(float(value))
