"""OLMoE (OlmoeForCausalLM): OLMo's attention (q/k RMSNorms over the whole projections, no
head_dim key) with a mixture of SwiGLU experts in every block; clip_qkv refused."""

from __future__ import annotations

from shardlm.config.families import Experts, Family, register
from shardlm.config.families.mixtral import expert_width, moe_keys


def read_experts(hf: dict, shape: dict, problems: list[str]) -> None:
    if hf.get("clip_qkv") is not None:
        problems.append(f"clip_qkv = {hf['clip_qkv']} (our attention does not clamp q/k/v)")


def export(m, llama_keys: dict, layer_types: list[str]) -> dict:
    """OlmoeConfig's keys: the experts' width, no head_dim, no clipping."""
    return dict(moe_keys(m, llama_keys), intermediate_size=expert_width(m, llama_keys),
                num_experts=m.experts, norm_topk_prob=m.router_topk_norm, attention_bias=False,
                clip_qkv=None, pad_token_id=None)


register(Family(name="olmoe", config_class="OlmoeConfig", model_class="OlmoeForCausalLM",
                title="OLMoE", shape={"qk_norm": True, "qk_norm_width": "all"},
                attention_bias="refused", has_head_dim=False,
                experts=Experts(count_key="num_experts", read=read_experts),
                implied=lambda m: m.qk_norm and m.qk_norm_width == "all",
                expresses=frozenset({"qk_norm", "qk_norm_width"}), export=export))
