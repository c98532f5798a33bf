"""Models: the GPT-2 / LLaMA decoder family, named presets, parameter and FLOP counts.

The names below are imported on first use (PEP 562), so importing a light submodule
(`shardlm.config.presets`, `shardlm.models.flops`: config and the planner) does not import the
decoder and with it torch (~2 s). Also here: fp8.py and precision.py (the compute dtype's
autocast and loss scaler), quant.py (QLoRA's base), placement.py (where a rank's piece of a
parameter sits in the whole). Imports config, launch, hardware, comm, data.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Decoder": "decoder", "build_model": "decoder", "generate": "decoder",
    "count_params": "flops", "flops_per_token": "flops",
    "CausalLMAdapter": "hf", "Seq2SeqAdapter": "hf",
}
"""Public name -> the submodule that defines it."""

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
