"""OLMo-2 (Olmo2ForCausalLM): LLaMA with its norms after attention and the MLP
(post_attention_layernorm, post_feedforward_layernorm) and q/k RMSNorms over the whole
projections; its attention_bias (on q/k/v/o only) has no counterpart in our model.bias."""

from __future__ import annotations

from shardlm.config.families import Family, register


def export(m, llama_keys: dict, layer_types: list[str]) -> dict:
    """Olmo2Config's keys: no head_dim, no window."""
    keys = {k: v for k, v in llama_keys.items() if k not in ("head_dim", "sliding_window")}
    return dict(keys, attention_bias=False, pad_token_id=None)


SHAPE = {"qk_norm": True, "qk_norm_width": "all", "norm_placement": "post"}

register(Family(name="olmo2", config_class="Olmo2Config", model_class="Olmo2ForCausalLM",
                shape=SHAPE, attention_bias="refused", has_head_dim=False,
                implied=lambda m: m.qk_norm and m.qk_norm_width == "all",
                expresses=frozenset({"qk_norm", "qk_norm_width", "norm_placement"}), export=export))
