"""Rank-side functions for tests/test_eval_data.py (importable by spawned ranks)."""

from __future__ import annotations

from shardlm.config.load import load_config
from shardlm.data.sft import IGNORE
from shardlm.train.build import build_run
from shardlm.train.step import evaluate, train_step


def eval_case(overrides: dict, steps: int = 0) -> dict:
    """The validation metrics after `steps` training steps (so that the argmax predicts some
    targets), and how many loss-carrying targets this rank's share of them holds."""
    run = build_run(load_config(overrides=overrides).validate())
    for step in range(steps):
        train_step(run, step)
    metrics = evaluate(run)
    share = run.val_loader.eval_batches(run.cfg.train.eval_batches)
    return {**metrics, "rank_targets": sum(int((y != IGNORE).sum()) for _, y in share)}


def eval_cases(rank: int, world_size: int, cases: list[dict], steps: int) -> list[dict]:
    return [eval_case(overrides, steps) for overrides in cases]
