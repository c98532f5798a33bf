"""Gemma 3, text (Gemma3ForCausalLM): Gemma 2 without its soft-capping defaults, with q/k norms
per head, sliding blocks by sliding_window_pattern (6) and their own RoPE base."""

from __future__ import annotations

from shardlm.config.families import Family, register
from shardlm.config.families.gemma2 import read_sandwich, sandwich_keys, sandwich_problems


def prepare(hf: dict, shape: dict, rope: dict, problems: list[str]) -> dict:
    """Returns the global blocks' rope parameters (transformers 5 keeps one dict per layer type)."""
    read_sandwich(hf, shape, problems, (None, None), int(hf.get("sliding_window_pattern") or 6))
    shape["qk_norm"] = True
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers 5: one dict per layer type
        rope, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    else:  # transformers 4: rope_theta and rope_scaling global, rope_local_base_freq local
        rope = dict(hf.get("rope_scaling") or {}, rope_theta=hf.get("rope_theta", 1e6))
        local = {"rope_theta": hf.get("rope_local_base_freq", 10000.0)}
    local_type = local.get("rope_type", local.get("type", "default"))
    if local_type != "default":
        problems.append(f"rope scaling {local_type!r} on the sliding blocks (ours: plain RoPE there)")
    if shape.get("sliding_window"):
        shape["rope_local_theta"] = float(local.get("rope_theta", 10000.0))
    return rope


def export(m, llama_keys: dict, layer_types: list[str]) -> dict:
    """Gemma 3's two RoPE tables as its per-layer-type rope_parameters."""
    full = llama_keys["rope_parameters"]
    local = {"rope_type": "default", "rope_theta": m.rope_local_theta} if m.rope_local_theta else full
    return dict(sandwich_keys(m, llama_keys, layer_types),
                rope_parameters={"full_attention": full, "sliding_attention": local})


register(Family(name="gemma3_text", config_class="Gemma3TextConfig", model_class="Gemma3ForCausalLM",
                title="Gemma", attention_bias="refused", windows="none", silu=False, tied=True,
                prepare=prepare, implied=lambda m: m.norm_offset and m.qk_norm,
                checks=lambda m: sandwich_problems(m, "gemma3_text"), export=export))
