"""Granite (GraniteForCausalLM): LLaMA with four multipliers: the embeddings', the residual
branches', the attention's scale and the logits' divisor."""

from __future__ import annotations

from shardlm.config.families import Family, register


def read(hf: dict, shape: dict, problems: list[str]) -> None:
    """Its multipliers as model.embedding_multiplier, residual_multiplier, attention_scale and
    logits_divisor."""
    shape.update(embedding_multiplier=float(hf.get("embedding_multiplier", 1.0)),
                 residual_multiplier=float(hf.get("residual_multiplier", 1.0)),
                 attention_scale=float(hf.get("attention_multiplier", 1.0)),
                 logits_divisor=float(hf.get("logits_scaling", 1.0)))


def export(m, llama_keys: dict, layer_types: list[str]) -> dict:
    """GraniteConfig's keys: no head_dim, the multipliers (the attention's: 1/sqrt(head_dim)
    where ours is the default)."""
    keys = {k: v for k, v in llama_keys.items() if k not in ("head_dim", "sliding_window")}
    return dict(keys, attention_bias=m.bias, mlp_bias=m.bias, embedding_multiplier=m.embedding_multiplier,
                residual_multiplier=m.residual_multiplier,
                attention_multiplier=m.attention_scale or llama_keys["head_dim"] ** -0.5,
                logits_scaling=m.logits_divisor, pad_token_id=None)


def implied(m) -> bool:
    """A model of ours with any of Granite's multipliers."""
    return (m.embedding_multiplier, m.attention_scale, m.residual_multiplier, m.logits_divisor) != \
        (1.0, 0.0, 1.0, 1.0)


register(Family(name="granite", config_class="GraniteConfig", model_class="GraniteForCausalLM",
                has_head_dim=False, read=read, biased=True, implied=implied, export=export,
                expresses=frozenset({"embedding_multiplier", "attention_scale", "residual_multiplier",
                                     "logits_divisor"})))
