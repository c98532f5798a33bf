"""Rank-side functions for the QLoRA tests (importable by spawned ranks)."""

from __future__ import annotations

import torch

from lora_cases import lora_case


def qlora_cases(rank: int, world_size: int, cases: list[tuple[dict, int]]) -> list[dict]:
    """lora_case per case, plus what the engine holds of the quantised base: its byte units
    (name, dtype, this rank's shard elements, whole elements) and the state-bytes ledger. A case
    with tensor or expert parallelism: layout_case instead."""
    from shardlm.config.load import load_config
    from shardlm.train.build import build_run

    torch.manual_seed(0)
    out = []
    for overrides, steps in cases:
        if "parallel.tp" in overrides or "parallel.ep" in overrides:
            out.append(layout_case(overrides, steps))
            continue
        result = lora_case(overrides, steps)
        engine = build_run(load_config(overrides={**overrides, "run.name": "ledger"}).validate()).strategy
        result["byte_units"] = [(u.name, str(u.flat_param.dtype), u.shard_param.numel(), u.layout.total)
                                for u in getattr(engine, "frozen", []) if u.flat_param.dtype == torch.uint8]
        result["state_bytes"] = engine.model_state_bytes()
        result["predicted"] = engine.predicted_state_bytes()
        out.append(result)
    return out


def layout_case(overrides: dict, steps: int) -> dict:
    """Train `steps` steps; the losses, this rank's parameters after (fp32; the quantised tables'
    bytes as their values) and the Splits that place its pieces in the whole (tensor and expert parallel)."""
    from shardlm.config.load import load_config
    from shardlm.train.build import build_run
    from shardlm.train.step import train_step

    run = build_run(load_config(overrides=overrides).validate())
    losses = [train_step(run, step)[0] for step in range(steps)]
    with run.strategy.full_parameters():
        params = {n: p.detach().float().cpu().clone() for n, p in run.model.named_parameters()}
    splits = {}
    for axis in ("tp", "ep"):
        state = getattr(run.model, axis, None)
        splits.update(state.splits if state is not None else {})
    return {"losses": losses, "params": params, "splits": splits}
