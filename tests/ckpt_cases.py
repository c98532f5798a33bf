"""Rank-side functions for the checkpoint tests (importable by spawned ranks)."""

from __future__ import annotations

from pathlib import Path

import torch

from shardlm.checkpoint.sharded import CHECKPOINTS, step_dir_name
from shardlm.config import load_config
from shardlm.trainer import build_run, train


def train_run(overrides: dict) -> dict:
    """A whole `train` (with its checkpoints); the losses of the steps it ran, where it
    started, and the final parameters as fp32."""
    run = build_run(load_config(overrides=overrides).validate())
    result = train(run)
    with run.strategy.full_parameters():
        params = {n: p.detach().float().cpu().clone() for n, p in run.model.named_parameters()}
    return {"losses": result.losses, "start": run.start_step, "params": params,
            "run_dir": str(run.run_dir), "stall": [s.stall_s for s in result.saves]}


def checkpoint_of(run_dir: str, step: int) -> str:
    return str(Path(run_dir) / CHECKPOINTS / step_dir_name(step))


def straight_and_resumed(rank: int, world_size: int, cases: list[tuple[str, dict, int]]) -> list:
    """Per case: 2n steps saving at n, then a second run resuming from that checkpoint."""
    torch.manual_seed(0)
    out = []
    for name, overrides, n in cases:
        base = {**overrides, "train.steps": 2 * n}
        straight = train_run({**base, "checkpoint.every": n, "run.name": f"{name}-straight"})
        resumed = train_run({**base, "run.name": f"{name}-resumed",
                             "checkpoint.resume": checkpoint_of(straight["run_dir"], n)})
        out.append((straight, resumed))
    return out


def train_ranks(rank: int, world_size: int, overrides: dict) -> dict:
    return train_run(overrides)
