"""Qwen3 (Qwen3ForCausalLM): LLaMA with an RMSNorm on each query and key head, Qwen2's sliding
windows; its attention_bias (on q/k/v/o only) has no counterpart in our model.bias."""

from __future__ import annotations

from shardlm.config.families import Family, register
from shardlm.config.families.qwen2 import qwen_window_keys


def export(m, llama_keys: dict, layer_types: list[str]) -> dict:
    """Qwen3Config's keys: LLaMA's with head_dim, the windows as layer_types."""
    keys = {k: v for k, v in llama_keys.items() if k not in ("sliding_window", "hidden_act")}
    return dict(keys, attention_bias=False, **qwen_window_keys(m, layer_types))


register(Family(name="qwen3", config_class="Qwen3Config", model_class="Qwen3ForCausalLM",
                shape={"qk_norm": True}, attention_bias="refused", windows="qwen",
                implied=lambda m: m.qk_norm and m.qk_norm_width == "head",
                expresses=frozenset({"head_dim", "qk_norm", "sliding_window", "global_every"}),
                export=export))
