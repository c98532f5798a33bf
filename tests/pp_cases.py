"""Rank-side functions for the pipeline tests (importable by spawned ranks)."""

from __future__ import annotations

from shardlm.config import load_config
from shardlm.trainer import build_run, sample_text, train_step


def sample_case(rank: int, world_size: int, overrides: dict, steps: int) -> str:
    """Train `steps` steps, then sample 20 tokens (every rank takes part)."""
    run = build_run(load_config(overrides=overrides).validate())
    for step in range(steps):
        train_step(run, step)
    return sample_text(run, "def ", 20)


def cases_then_sample(rank: int, world_size: int, cases: list, sample: tuple[dict, int]) -> list:
    """zero_cases.train_cases's results of `cases`, then sample_case's text of `sample`
    (overrides, steps): one spawn for both."""
    from zero_cases import train_cases

    return [*train_cases(rank, world_size, cases), sample_case(rank, world_size, *sample)]
