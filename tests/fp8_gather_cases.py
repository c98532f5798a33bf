"""Rank-side functions for tests/test_fp8_all_gather.py (importable by spawned ranks)."""

from __future__ import annotations

import torch

from shardlm.config.load import load_config
from shardlm.train.build import build_run
from shardlm.train.step import evaluate, train_step


def gather_case(overrides: dict, steps: int) -> dict:
    """Train `steps` steps; return each step's loss, gradient norm, fp8 JSONL figures and byte
    ledger, then an evaluation's figures, the units' layouts (name, padded elements, weights,
    gathered in fp8; the trained units, then the frozen) and the whole parameters in fp32."""
    run = build_run(load_config(overrides=overrides).validate())
    out = {"losses": [], "norms": [], "records": [], "ledgers": []}
    for step in range(steps):
        result = train_step(run, step)
        out["losses"].append(result.loss)
        out["norms"].append(result.grad_norm)
        out["records"].append(dict(result.state.fp8_record))
        out["ledgers"].append(dict(run.strategy.ledger.bytes))
        run.strategy.ledger.reset()
    out["eval"] = evaluate(run)  # forward only: gathered and freed by the hooks, without grad
    out["units"] = [(u.name, u.layout.padded, len(u.layout.numels), u.fp8_gather is not None)
                    for u in run.strategy.units + run.strategy.frozen]
    with run.strategy.full_parameters():
        out["params"] = {n: p.detach().float().cpu().clone() for n, p in run.model.named_parameters()}
    return out


def gather_cases(rank: int, world_size: int, cases: list[tuple[dict, int]]) -> list[dict]:
    torch.manual_seed(0)
    return [gather_case(overrides, steps) for overrides, steps in cases]
