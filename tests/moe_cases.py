"""Rank-side functions for the mixture-of-experts tests (importable by spawned ranks)."""

from __future__ import annotations


from shardlm.config.load import load_config
from shardlm.models.moe import MoE
from shardlm.train.build import build_run
from shardlm.train.step import train_step


def ledger_case(rank: int, world_size: int, overrides: dict) -> dict:
    """One step under expert parallelism, recording every MoE call's routing (the choices kept
    per expert, as models.moe.route decided them) beside the ledger's all-to-all bytes."""
    import torch.distributed as dist

    run = build_run(load_config(overrides=overrides).validate())
    routed: list[list[int]] = []

    class Recording:  # the dispatcher, noting each call's routing first
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def __call__(self, x, routing, experts):
            routed.append(routing.counts.tolist())
            return self.inner(x, routing, experts)
    for module in run.model.modules():
        if isinstance(module, MoE):
            module.dispatcher = Recording(module.dispatcher)
    run.strategy.ledger.reset()
    train_step(run, 0)
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, routed)
    return {"bytes": dict(run.strategy.ledger.bytes), "routed": everyone,
            "d_model": run.cfg.model.d_model, "experts": run.cfg.model.experts}


def rebalance_case(rank: int, world_size: int, overrides: dict, steps: int) -> dict:
    """train_case's figures, plus how many MoE blocks each step re-placed and the placements."""
    from zero_cases import train_case

    moved: list[int] = []
    original = train_step

    def counting(run, step, *args, **kwargs):
        out = original(run, step, *args, **kwargs)
        moved.append(out.state.moe_placement.get("moe_replaced_blocks", 0))
        return out
    import zero_cases
    zero_cases.train_step = counting
    try:
        out = train_case(overrides, steps)
    finally:
        zero_cases.train_step = original
    out["moved"] = moved
    return out
