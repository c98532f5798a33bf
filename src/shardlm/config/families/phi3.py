"""Phi-3 (Phi3ForCausalLM): LLaMA with q/k/v fused in qkv_proj (rows q, k, v, as ours) and gate
and up in gate_up_proj (rows gate, then up), partial rotary, a window on every block."""

from __future__ import annotations

from shardlm.config.families import Family, register


def export(m, llama_keys: dict, layer_types: list[str]) -> dict:
    """Phi3Config's keys: no head_dim (hidden_size / heads), no dropout, no pad token in our
    vocabulary."""
    keys = {k: v for k, v in llama_keys.items() if k != "head_dim"}
    return dict(keys, pad_token_id=None, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)


register(Family(name="phi3", config_class="Phi3Config", model_class="Phi3ForCausalLM",
                windows="every", has_head_dim=False, partial_rotary=True,
                names={"attn.qkv": ("self_attn.qkv_proj",), "mlp.gate_up": ("mlp.gate_up_proj",)},
                expresses=frozenset({"sliding_window", "rope_fraction"}), export=export))
