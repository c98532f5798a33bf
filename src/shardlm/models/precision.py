"""Precision policy: the compute dtype (autocast) and, for fp16, a dynamic loss scaler.

The variant is chosen once when the run is built (`build_precision`); the step calls the same
methods whatever the precision. Master weights and optimizer states stay fp32.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch

from shardlm.config import PrecisionConfig

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


@dataclass
class Precision:
    name: str
    """'fp32', 'bf16', 'fp16' or 'fp8' (resolved; never 'auto')."""
    autocast: Callable[[], ContextManager]
    scaler: NoLossScaler | DynamicLossScaler

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
    if carrier(name) not in DTYPES:  # 'auto' is decided once per run, on one rank: resolve.resolve_config
        raise ValueError(f"precision.compute = {name!r} must be resolved (resolve.resolve_config) "
                         f"before the precision is built")
    if name == "fp32":
        autocast: Callable[[], ContextManager] = contextlib.nullcontext
    else:
        dtype = DTYPES[carrier(name)]
        autocast = lambda: torch.autocast(device.type, dtype=dtype)  # noqa: E731
    if name == "fp16":
        scaler: NoLossScaler | DynamicLossScaler = DynamicLossScaler(
            cfg.loss_scale_init, cfg.loss_scale_growth_interval, cfg.loss_scale_backoff)
    else:
        scaler = NoLossScaler(stop_on_nonfinite)
    return Precision(name, autocast, scaler)


def is_finite(value: torch.Tensor | float) -> bool:
    return math.isfinite(float(value))
