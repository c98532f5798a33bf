"""Mixtral (MixtralForCausalLM): LLaMA whose every block's MLP is a mixture of SwiGLU experts
(block_sparse_moe: a softmax router, `gate`, always renormalised over the top k; each expert's w1
(gate), w3 (up) and w2 (down)), a sliding window on every block."""

from __future__ import annotations

from shardlm.config.families import Experts, Family, register


def moe_keys(m, llama_keys: dict) -> dict:
    """The keys the mixtures' config classes share: LLaMA's but the widths and window, the top
    k, the balancing loss's coefficient (recorded for a fine-tune of the export). No router
    logits by default (they are for that loss, output_router_logits=True)."""
    keys = {k: v for k, v in llama_keys.items()
            if k not in ("intermediate_size", "head_dim", "sliding_window")}
    return dict(keys, num_experts_per_tok=m.top_k, output_router_logits=False,
                router_aux_loss_coef=m.aux_loss_coef if m.balance == "aux" else 0.0)


def expert_width(m, llama_keys: dict) -> int:
    """One expert's hidden width: model.expert_d_ff, else the dense MLP's."""
    return m.expert_d_ff or llama_keys["intermediate_size"]


def export(m, llama_keys: dict, layer_types: list[str]) -> dict:
    """MixtralConfig's keys: every block sparse (its check), the experts' width; no router
    jitter (ours routes deterministically)."""
    return dict(moe_keys(m, llama_keys), intermediate_size=expert_width(m, llama_keys),
                head_dim=llama_keys["head_dim"], sliding_window=m.sliding_window or None,
                num_local_experts=m.experts, router_jitter_noise=0.0)


register(Family(name="mixtral", config_class="MixtralConfig", model_class="MixtralForCausalLM",
                title="Mixtral", windows="every",
                experts=Experts(count_key="num_local_experts", renormalised=True,
                                module="block_sparse_moe", weights=("w1", "w3", "w2")),
                expresses=frozenset({"head_dim", "sliding_window"}), export=export))
