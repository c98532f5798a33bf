"""Rank-side helpers for the transformers mixture-of-experts parity tests (importable by spawned
ranks): tiny Mixtral, Qwen2-MoE and OLMoE models built from configs (nothing is downloaded),
identically on every rank, as tests/hf_cases.py builds GPT-2, LLaMA and T5.

Each is 2 layers of width 64 with 4 experts, top 2, over gpt-tiny's 512-token vocabulary, and
keeps what sets its family apart: Mixtral renormalises the top-k gates; Qwen2-MoE adds a shared
expert behind a sigmoid gate, q/k/v biases and un-normalised top-k gates; OLMoE normalises q and
k. The experts kernel is chosen like the attention one, the same in every process: 'eager'
(a loop over the experts) unless a case names another; None leaves it to the library
(transformers >= 5 picks `grouped_mm` when torch has it).
"""

from __future__ import annotations

import torch

from hf_cases import ATTN, VOCAB
from shardlm.models.hf import CausalLMAdapter
from zero_cases import train_case

EXPERTS = "eager"  # one expert at a time: the reference implementation, in every version
MOE_MODELS = ("mixtral", "qwen2_moe", "olmoe")


def moe_hf_model(name: str, device: str = "cpu", experts: str | None = EXPERTS,
                 stacked: bool = False) -> torch.nn.Module:
    """The adapted model, built under a fixed seed (on the CPU) or on the meta device, its
    experts run by the `experts` implementation (None: the library's choice), or with `stacked`
    by parallel.expert.dispatch.StackedExperts holding every expert (what expert parallelism runs, on one
    rank). No router jitter and no dropout: each process would draw its own noise."""
    with torch.device(device):
        model = _moe_hf_model(name, experts)
    if stacked:
        from shardlm.models.moe import LocalDispatcher
        from shardlm.parallel.expert.dispatch import StackedExperts

        for layer in model.model.model.layers:
            layer.mlp.experts = StackedExperts(layer.mlp.experts, 0, layer.mlp.experts.num_experts,
                                               LocalDispatcher())
    return model


def _moe_hf_model(name: str, experts: str | None) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    shape = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, num_experts_per_tok=2,
                 bos_token_id=0, eos_token_id=0, pad_token_id=0, attention_dropout=0.0,
                 attn_implementation=ATTN)
    if experts is not None:
        shape["experts_implementation"] = experts
    if name == "mixtral":
        config = tf.MixtralConfig(**shape, intermediate_size=96, num_local_experts=4,
                                  router_jitter_noise=0.0)
        return CausalLMAdapter(tf.MixtralForCausalLM(config), VOCAB)
    if name == "qwen2_moe":  # every block sparse (decoder_sparse_step 1, no mlp_only_layers)
        config = tf.Qwen2MoeConfig(**shape, intermediate_size=128, moe_intermediate_size=96,
                                   shared_expert_intermediate_size=128, num_experts=4,
                                   use_sliding_window=False)
        return CausalLMAdapter(tf.Qwen2MoeForCausalLM(config), VOCAB)
    if name == "olmoe":
        config = tf.OlmoeConfig(**shape, intermediate_size=96, num_experts=4)
        return CausalLMAdapter(tf.OlmoeForCausalLM(config), VOCAB)
    raise ValueError(name)


def moe_hf_train_cases(rank: int, world_size: int,
                       cases: list[tuple[str, str | None, dict, int]]) -> list[dict]:
    """(model, experts implementation, overrides, steps) -> train_case's results."""
    return [train_case(overrides, steps, model=moe_hf_model(name, experts=experts))
            for name, experts, overrides, steps in cases]


def moe_hf_built(rank: int, world_size: int, cases: list[tuple[str, dict]]) -> list[dict]:
    """Each model built on the meta device and parallelized (the sharded build: this rank
    materialises its units only); its full parameters and buffers."""
    from shardlm.config.load import load_config
    from shardlm.train.build import build_run

    out = []
    for name, overrides in cases:
        run = build_run(load_config(overrides=overrides).validate(), model=moe_hf_model(name, "meta"))
        with run.strategy.full_parameters():
            out.append({n: t.detach().float().clone() for n, t in
                        [*run.model.named_parameters(), *run.model.named_buffers()]})
    return out


def moe_hf_ep_cases(rank: int, world_size: int, cases: list[tuple[str, str, dict, int]]) -> list[dict]:
    """(model, device it is built on, overrides, steps) -> train_case's results (with `splits`:
    where this rank's expert rows sit in the stacked whole, from model.ep)."""
    return [train_case(overrides, steps, model=moe_hf_model(name, device))
            for name, device, overrides, steps in cases]
