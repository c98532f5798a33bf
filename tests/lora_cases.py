"""Rank-side functions for the LoRA tests (importable by spawned ranks)."""

from __future__ import annotations

import torch

from shardlm.config.load import load_config
from shardlm.models.lora import is_adapter
from shardlm.train.build import build_run
from shardlm.train.step import train_step


def lora_case(overrides: dict, steps: int) -> dict:
    """Train `steps` steps; the losses, whole fp32 parameters before and after, and the elements
    the optimizer holds state for (this rank's) next to the adapters' count."""
    run = build_run(load_config(overrides=overrides).validate())
    with run.strategy.full_parameters():
        before = {n: p.detach().float().cpu().clone() for n, p in run.model.named_parameters()}
    losses = [train_step(run, step)[0] for step in range(steps)]
    with run.strategy.full_parameters():
        after = {n: p.detach().float().cpu().clone() for n, p in run.model.named_parameters()}
    state = [t for s in run.strategy.optimizer.state.values() for k, t in s.items()
             if k == "exp_avg" and torch.is_tensor(t)]
    return {"losses": losses, "before": before, "params": after,
            "optim_elements": sum(t.numel() for t in state),
            "adapter_elements": sum(v.numel() for n, v in after.items() if is_adapter(n)),
            "trainable": run.model.lora.trainable,
            "requires_grad": {n for n, p in run.model.named_parameters() if p.requires_grad}}


def lora_cases(rank: int, world_size: int, cases: list[tuple[dict, int]]) -> list[dict]:
    torch.manual_seed(0)
    return [lora_case(overrides, steps) for overrides, steps in cases]
