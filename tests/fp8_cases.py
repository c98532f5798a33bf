"""Rank-side functions for the FP8 tests (importable by spawned ranks)."""

from __future__ import annotations

import torch

from shardlm.config import load_config
from shardlm.train.loop import build_run, train_step


def fp8_case(overrides: dict, steps: int) -> dict:
    """Train `steps` steps; return the losses, each step's fp8 JSONL figures (fp8_overflow,
    fp8_underflow, ...) and the whole parameters in fp32."""
    run = build_run(load_config(overrides=overrides).validate())
    out = {"losses": [], "records": []}
    for step in range(steps):
        out["losses"].append(train_step(run, step).loss)
        out["records"].append(dict(run.fp8_record))
    with run.strategy.full_parameters():
        out["params"] = {n: p.detach().float().cpu().clone() for n, p in run.model.named_parameters()}
    return out


def fp8_cases(rank: int, world_size: int, cases: list[tuple[dict, int]]) -> list[dict]:
    torch.manual_seed(0)
    return [fp8_case(overrides, steps) for overrides, steps in cases]
