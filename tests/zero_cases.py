"""Rank-side functions for the ZeRO tests (importable by spawned ranks)."""

from __future__ import annotations

import torch

from shardlm.config import load_config
from shardlm.trainer import build_run, train_step


def train_case(overrides: dict, steps: int, poison_rank: int = -1) -> dict:
    """Train `steps` steps; return losses, full fp32 parameters, and the ledgers."""
    run = build_run(load_config(overrides=overrides).validate())
    rank = run.runtime.rank
    if rank == poison_rank:  # an fp16 overflow on this rank only, in the first step
        param = run.model.blocks[0].attn.qkv.weight
        handle = param.register_hook(lambda g: g * float("inf"))
    out = {"losses": [], "stepped": [], "scale": [], "comm": [], "state": None}
    for step in range(steps):
        loss, _, stepped = train_step(run, step)
        if step == 0 and rank == poison_rank:
            handle.remove()
        out["losses"].append(loss)
        out["stepped"].append(stepped)
        out["scale"].append(run.precision.scaler.scale)
        out["comm"].append(run.strategy.ledger.total())
        run.strategy.ledger.reset()
    out["state"] = run.strategy.model_state_bytes()
    out["numel"] = getattr(run.strategy, "numel", None)
    out["padded"] = sum(u.layout.padded for u in getattr(run.strategy, "units", []))
    with run.strategy.full_parameters():
        out["params"] = {n: p.detach().float().cpu().clone() for n, p in run.model.named_parameters()}
    return out


def train_cases(rank: int, world_size: int, cases: list[tuple[dict, int, int]]) -> list[dict]:
    torch.manual_seed(0)
    return [train_case(overrides, steps, poison) for overrides, steps, poison in cases]
