"""Rank-side functions for the QLoRA tests (importable by spawned ranks)."""

from __future__ import annotations

import torch

from lora_cases import lora_case


def qlora_cases(rank: int, world_size: int, cases: list[tuple[dict, int]]) -> list[dict]:
    """lora_case per case, plus what the engine holds of the quantised base: its byte units
    (name, dtype, this rank's shard elements, whole elements) and the state-bytes ledger."""
    from shardlm.config import load_config
    from shardlm.train.loop import build_run

    torch.manual_seed(0)
    out = []
    for overrides, steps in cases:
        result = lora_case(overrides, steps)
        engine = build_run(load_config(overrides={**overrides, "run.name": "ledger"}).validate()).strategy
        result["byte_units"] = [(u.name, str(u.flat_param.dtype), u.shard_param.numel(), u.layout.total)
                                for u in getattr(engine, "frozen", []) if u.flat_param.dtype == torch.uint8]
        result["state_bytes"] = engine.model_state_bytes()
        result["predicted"] = engine.predicted_state_bytes()
        out.append(result)
    return out
