"""StableLM (StableLmForCausalLM): LLaMA's attention and SwiGLU MLP under LayerNorms with biases,
biases on q/k/v (use_qkv_bias), partial rotary."""

from __future__ import annotations

from shardlm.config.families import Family, register
from shardlm.config.hf_families import rope_shape


def reader(hf: dict, shape: dict, rope: dict, key, problems: list[str]) -> None:
    rope = dict(rope)
    rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    rope.setdefault("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    shape.update(n_kv_heads=int(hf.get("num_key_value_heads") or shape["n_heads"]),
                 d_ff=int(hf["intermediate_size"]), norm="layernorm", position="rope", mlp="swiglu",
                 bias=False, norm_bias=True, qkv_bias=bool(hf.get("use_qkv_bias", False)),
                 tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                 norm_eps=float(hf.get("layer_norm_eps", 1e-5)), rope_theta=float(rope["rope_theta"]))
    for flag in ("qk_layernorm", "use_parallel_residual"):
        if hf.get(flag):  # per-head LayerNorms of their own; one norm shared by attention and MLP
            problems.append(f"{flag} = True (not mapped onto our decoder yet)")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act = {hf['hidden_act']!r} (ours is 'silu')")
    shape.update(rope_shape(hf, rope, shape["max_seq_len"], problems, partial_ok=True))


def export(m, llama_keys: dict, layer_types: list[str]) -> dict:
    """StableLmConfig's keys: LayerNorms with biases, q/k/v biases, partial rotary, no dropout."""
    keys = {k: v for k, v in llama_keys.items() if k not in ("head_dim", "rms_norm_eps", "sliding_window")}
    return dict(use_qkv_bias=m.qkv_bias, qk_layernorm=False, use_parallel_residual=False,
                layer_norm_eps=m.norm_eps, hidden_dropout=0.0, attention_dropout=0.0,
                pad_token_id=None, **keys)


register(Family(name="stablelm", config_class="StableLmConfig", model_class="StableLmForCausalLM",
                style=("layernorm", "rope", "swiglu"), reader=reader, sizable=False,
                shape={"norm_bias": True}, expresses=frozenset({"qkv_bias", "rope_fraction"}),
                export=export))
