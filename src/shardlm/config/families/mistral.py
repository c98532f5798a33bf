"""Mistral (MistralForCausalLM): LLaMA with a sliding window on every block (a mask, or the
context capped at it)."""

from __future__ import annotations

from shardlm.config.families import Family, register


def export(m, llama_keys: dict, layer_types: list[str]) -> dict:
    """MistralConfig's keys: LLaMA's, the window included."""
    return dict(llama_keys)


register(Family(name="mistral", config_class="MistralConfig", model_class="MistralForCausalLM",
                windows="every", implied=lambda m: bool(m.sliding_window),
                expresses=frozenset({"head_dim", "sliding_window"}), export=export))
