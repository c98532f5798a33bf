"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention (an RMSNorm on each query and key head)
with mixtures of SwiGLU experts (moe_intermediate_size wide), dense blocks between each
decoder_sparse_step-th (model.moe_every), a window on every block where use_sliding_window."""

from __future__ import annotations

from shardlm.config.families import Experts, Family, register
from shardlm.config.families.mixtral import expert_width, moe_keys


def read_experts(hf: dict, shape: dict, problems: list[str]) -> None:
    """decoder_sparse_step as model.moe_every; mlp_only_layers (dense blocks anywhere) refused."""
    shape["moe_every"] = int(hf.get("decoder_sparse_step", 1) or 1)
    if hf.get("mlp_only_layers"):
        problems.append(f"mlp_only_layers = {hf['mlp_only_layers']} (ours: dense blocks only "
                        f"between every decoder_sparse_step-th, model.moe_every)")


def export(m, llama_keys: dict, layer_types: list[str]) -> dict:
    """Qwen3MoeConfig's keys: the dense blocks' width and the experts', model.moe_every as
    decoder_sparse_step, the window on every block."""
    return dict(moe_keys(m, llama_keys), intermediate_size=llama_keys["intermediate_size"],
                moe_intermediate_size=expert_width(m, llama_keys), head_dim=llama_keys["head_dim"],
                num_experts=m.experts, decoder_sparse_step=m.moe_every, mlp_only_layers=[],
                norm_topk_prob=m.router_topk_norm, attention_bias=False,
                use_sliding_window=bool(m.sliding_window), sliding_window=m.sliding_window or None)


register(Family(name="qwen3_moe", config_class="Qwen3MoeConfig", model_class="Qwen3MoeForCausalLM",
                title="Qwen3-MoE", shape={"qk_norm": True}, attention_bias="refused", windows="flagged",
                experts=Experts(count_key="num_experts", width_key="moe_intermediate_size",
                                dense_blocks=True, read=read_experts),
                implied=lambda m: m.qk_norm and m.qk_norm_width == "head",
                expresses=frozenset({"head_dim", "qk_norm", "sliding_window"}), export=export))
