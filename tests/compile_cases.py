"""Rank-side functions for the compile tests (importable by spawned ranks)."""

from __future__ import annotations

import json

import torch

from shardlm.config.load import load_config
from shardlm.train.build import build_run
from shardlm.train.loop import train
from zero_cases import train_case


def first_record_then_cases(rank: int, world_size: int, overrides: dict, cases: list[dict],
                            steps: int) -> dict:
    """A short `train` run first (its compile is this process's first, so compile_s is the
    cold cost), then each case's losses and parameters after `steps` steps."""
    torch.manual_seed(0)
    result = train(build_run(load_config(overrides=overrides).validate()))
    records = []
    if rank == 0:  # the main rank writes the log
        with open(result.run_dir / "metrics.jsonl") as f:
            records = [json.loads(line) for line in f]
    return {"records": records, "cases": [train_case(case, steps) for case in cases]}
