"""Rank-side functions for the ZeRO tests (importable by spawned ranks)."""

from __future__ import annotations

import torch

from shardlm.config.load import load_config
from shardlm.train.build import build_run
from shardlm.train.step import train_step


def train_case(overrides: dict, steps: int, poison_rank: int = -1, model=None) -> dict:
    """Train `steps` steps (`model`: a user model instead of the config's); return losses,
    full fp32 parameters, and the ledgers."""
    run = build_run(load_config(overrides=overrides).validate(), model=model)
    rank = run.runtime.rank
    if rank == poison_rank:  # an fp16 overflow on this rank only, in the first step
        param = run.model.blocks[0].attn.qkv.weight
        handle = param.register_hook(lambda g: g * float("inf"))
    out = {"losses": [], "stepped": [], "scale": [], "comm": [], "comm_by_op": [], "comm_ops": [], "state": None}
    for step in range(steps):
        loss, _, stepped, _, _ = train_step(run, step)
        if step == 0 and rank == poison_rank:
            handle.remove()
        out["losses"].append(loss)
        out["stepped"].append(stepped)
        out["scale"].append(run.precision.scaler.scale)
        out["comm"].append(run.strategy.ledger.total())
        by_group: dict[str, int] = {}  # "op/group" -> bytes, summed per group
        for key, nbytes in run.strategy.ledger.bytes.items():
            group = key.split("/", 1)[1]
            by_group[group] = by_group.get(group, 0) + nbytes
        out["comm_by_op"].append(by_group)
        out["comm_ops"].append(dict(run.strategy.ledger.bytes))  # "op/group" -> bytes
        run.strategy.ledger.reset()
    out["state"] = run.strategy.model_state_bytes()
    out["predicted_state"] = run.strategy.predicted_state_bytes()  # the formula's, by category
    out["numel"] = getattr(run.strategy, "numel", None)
    out["padded"] = sum(u.layout.padded for u in getattr(run.strategy, "units", []))
    with run.strategy.full_parameters():
        out["params"] = {n: p.detach().float().cpu().clone() for n, p in run.model.named_parameters()}
    # tensor / expert parallel: where each piece sits in the whole
    out["splits"] = {name: split for state in (getattr(run.model, "tp", None), getattr(run.model, "ep", None))
                     if state is not None for name, split in state.splits.items()}
    return out


def reference_case(overrides: dict, world: int, steps: int, model=None) -> dict:
    """The single-process run a `world`-rank run must match: the same global batch (the ranks'
    micro-batches become accumulation steps) and one rank's thread count. The threads are set
    through LOCAL_WORLD_SIZE, which init_runtime reads (a set_num_threads here would be undone):
    CPU kernels such as LayerNorm's backward sum per thread, so the count changes the rounding."""
    import os

    accum = int(overrides.get("train.grad_accum", 1)) * world
    saved = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    try:
        return train_case({**overrides, "train.grad_accum": accum}, steps, model=model)
    finally:
        if saved is None:
            os.environ.pop("LOCAL_WORLD_SIZE")
        else:
            os.environ["LOCAL_WORLD_SIZE"] = saved


def train_cases(rank: int, world_size: int, cases: list[tuple[dict, int, int]]) -> list[dict]:
    torch.manual_seed(0)
    return [train_case(overrides, steps, poison) for overrides, steps, poison in cases]
