"""Rank-side functions for the tensor-parallel transformers tests (importable by spawned
ranks): the tiny models of hf_cases, built on the meta device so that parallelize can cut them."""

from __future__ import annotations

from hf_cases import hf_model
from zero_cases import train_case


def hf_tp_cases(rank: int, world_size: int, cases: list[tuple[str, dict, int]]) -> list[dict]:
    """Each (model name, overrides, steps) trained from a meta-device build: losses, full
    parameters (this rank's pieces), their Splits and the ledger (zero_cases.train_case)."""
    return [train_case(overrides, steps, model=hf_model(name, "meta")) for name, overrides, steps in cases]
