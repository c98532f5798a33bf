"""Gemma 2 (Gemma2ForCausalLM): Gemma 1 with sandwich norms, query_pre_attn_scalar, soft-capped
attention and final logits, and sliding-window blocks (every other one, layer_types)."""

from __future__ import annotations

from shardlm.config.families import Family, global_every, register
from shardlm.config.families.gemma import common_keys, gemma_problems, read_gelu


def read_sandwich(hf: dict, shape: dict, problems: list[str], capping: tuple, every: int) -> None:
    """Gemma 2's and 3's keys: GeGLU (hidden_activation), sandwich norms, query_pre_attn_scalar,
    soft-capping (`capping`: the config's defaults) and the sliding blocks of layer_types (by
    default all but each `every`-th)."""
    read_gelu(hf, shape, problems, "hidden_activation", ("gelu_pytorch_tanh",))
    if hf.get("use_bidirectional_attention"):
        problems.append("use_bidirectional_attention = True (ours is causal)")
    shape.update(norm_placement="sandwich",
                 attention_scale=float(hf.get("query_pre_attn_scalar", 256) ** -0.5))
    shape["attn_softcap"] = float(hf.get("attn_logit_softcapping", capping[0]) or 0.0)
    shape["logit_softcap"] = float(hf.get("final_logit_softcapping", capping[1]) or 0.0)
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % every else "full_attention"
                                      for i in range(shape["n_layers"])]
    sliding = [t == "sliding_attention" for t in types]
    unknown = sorted({t for t in types} - {"sliding_attention", "full_attention"})
    n = global_every(sliding)
    if unknown or n is None:
        problems.append(f"layer_types = {types} (ours: every block slides, or all but each "
                        f"n-th: model.global_every)")
    elif any(sliding) and hf.get("sliding_window"):
        shape.update(sliding_window=int(hf["sliding_window"]), global_every=n)


def prepare(hf: dict, shape: dict, rope: dict, problems: list[str]) -> dict:
    read_sandwich(hf, shape, problems, (50.0, 30.0), 2)
    return rope


def query_pre_attn_scalar(m) -> int | None:
    """Gemma's query_pre_attn_scalar q with q^-1/2 exactly model.attention_scale (head_dim when
    that is 0), or None where no whole number gives it."""
    if not m.attention_scale:
        return m.head_dim or m.d_model // m.n_heads
    q = round(m.attention_scale ** -2)
    return q if q > 0 and q ** -0.5 == m.attention_scale else None


def sandwich_problems(m, family: str) -> list[str]:
    """What Gemma 2's or 3's class cannot express of our model."""
    scale = [] if query_pre_attn_scalar(m) is not None else [
        f"model.attention_scale = {m.attention_scale!r} (Gemma's is query_pre_attn_scalar^-1/2 for "
        f"a whole number)"]
    return gemma_problems(m, family, scale)


def sandwich_keys(m, llama_keys: dict, layer_types: list[str]) -> dict:
    """Gemma 2's and 3's config keys but the RoPE's."""
    return dict(common_keys(llama_keys), hidden_activation="gelu_pytorch_tanh",
                query_pre_attn_scalar=query_pre_attn_scalar(m), sliding_window=m.sliding_window or None,
                layer_types=layer_types, attn_logit_softcapping=m.attn_softcap or None,
                final_logit_softcapping=m.logit_softcap or None)


def export(m, llama_keys: dict, layer_types: list[str]) -> dict:
    return dict(sandwich_keys(m, llama_keys, layer_types), rope_parameters=llama_keys["rope_parameters"])


register(Family(name="gemma2", config_class="Gemma2Config", model_class="Gemma2ForCausalLM",
                title="Gemma", attention_bias="refused", windows="none", silu=False, tied=True,
                prepare=prepare, implied=lambda m: m.norm_offset and m.norm_placement == "sandwich",
                checks=lambda m: sandwich_problems(m, "gemma2"), export=export))
