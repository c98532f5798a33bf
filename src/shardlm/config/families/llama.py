"""Llama 1 to 3.3 (LlamaForCausalLM): RMSNorm, RoPE (any model.rope_type), SwiGLU, grouped-query
attention, head_dim of its own; model.bias is its attention_bias and mlp_bias together."""

from __future__ import annotations

from shardlm.config.families import Family, register


def export(m, llama_keys: dict, layer_types: list[str]) -> dict:
    """LlamaConfig's keys: our RMSNorm has no bias, so model.bias means biases on the linears
    only: exactly HF's attention_bias (q/k/v/o) and mlp_bias (gate/up/down)."""
    keys = {k: v for k, v in llama_keys.items() if k not in ("sliding_window", "hidden_act")}
    return dict(keys, attention_bias=m.bias, mlp_bias=m.bias)


register(Family(name="llama", config_class="LlamaConfig", model_class="LlamaForCausalLM",
                expresses=frozenset({"head_dim"}), biased=True, export=export))
