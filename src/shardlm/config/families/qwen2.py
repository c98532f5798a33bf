"""Qwen2 (Qwen2ForCausalLM): LLaMA with biases on q, k and v only, and sliding windows on the
blocks layer_types names (by default those from max_window_layers on)."""

from __future__ import annotations

from shardlm.config.families import Family, register


def qwen_window_keys(m, layer_types: list[str]) -> dict:
    """Qwen2's / Qwen3's sliding blocks (hf_families._qwen_windows reads them) as config keys."""
    if not m.sliding_window:
        return {"use_sliding_window": False}
    return {"use_sliding_window": True, "sliding_window": m.sliding_window, "layer_types": layer_types}


def export(m, llama_keys: dict, layer_types: list[str]) -> dict:
    """Qwen2Config's keys: no head_dim (hidden_size / heads), the windows as layer_types."""
    keys = {k: v for k, v in llama_keys.items() if k not in ("head_dim", "sliding_window", "hidden_act")}
    return dict(keys, **qwen_window_keys(m, layer_types))


def problems(m) -> list[str]:
    return ["model.bias = true (Qwen2's biases are on q/k/v only: model.qkv_bias)"] if m.bias else []


register(Family(name="qwen2", config_class="Qwen2Config", model_class="Qwen2ForCausalLM",
                shape={"qkv_bias": True}, attention_bias="qkv", windows="qwen", has_head_dim=False,
                implied=lambda m: m.qkv_bias and not m.bias,
                expresses=frozenset({"qkv_bias", "sliding_window", "global_every"}),
                problems=problems, export=export))
