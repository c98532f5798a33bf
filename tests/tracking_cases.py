"""Rank-side function for the tracking tests (importable by spawned ranks)."""

from __future__ import annotations

from ckpt_cases import train_run


def train_runs(rank: int, world_size: int, runs: list[dict]) -> list[dict]:
    """A whole `train` per overrides, one after the other on the same ranks."""
    return [train_run(overrides) for overrides in runs]
