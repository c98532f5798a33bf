"""Named model shapes (plain data: the config layer fills [model] from them, the planner
reads them without torch). Published ones carry their real shapes (and the parameter count the source
reports, checked by tests/test_models.py); tiny ones exist for tests and the default run."""

from __future__ import annotations

from typing import Any

from shardlm.errors import ConfigError


def _gpt2(n_layers: int, n_heads: int, d_model: int, vocab_size: int = 50257,
          max_seq_len: int = 1024) -> dict[str, Any]:
    # GPT-2 (Radford et al. 2019): pre-LayerNorm, learned positions, GELU MLP of 4*d, biases,
    # the output head tied to the token embedding.
    return dict(vocab_size=vocab_size, n_layers=n_layers, n_heads=n_heads, n_kv_heads=0,
                d_model=d_model, d_ff=0, max_seq_len=max_seq_len, norm="layernorm",
                position="learned", mlp="gelu", bias=True, tie_embeddings=True, norm_eps=1e-5)


def _llama(n_layers: int, n_heads: int, n_kv_heads: int, d_model: int, d_ff: int, vocab_size: int,
           max_seq_len: int, rope_theta: float = 10000.0, tie_embeddings: bool = False,
           norm_eps: float = 1e-5, ffn_multiple_of: int = 256) -> dict[str, Any]:
    # LLaMA (Touvron et al. 2023): RMSNorm, RoPE, SwiGLU, no biases, grouped-query attention
    # from LLaMA 2 70B / LLaMA 3 on.
    return dict(vocab_size=vocab_size, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                d_model=d_model, d_ff=d_ff, max_seq_len=max_seq_len, norm="rmsnorm",
                position="rope", mlp="swiglu", bias=False, tie_embeddings=tie_embeddings,
                rope_theta=rope_theta, norm_eps=norm_eps, ffn_multiple_of=ffn_multiple_of)


def _moe(base: dict[str, Any], experts: int, top_k: int, expert_d_ff: int, shared: int = 0,
         router: str = "softmax") -> dict[str, Any]:
    # A mixture of experts on a dense shape: every block's MLP routed (models/moe.py).
    return dict(base, experts=experts, top_k=top_k, expert_d_ff=expert_d_ff, shared_experts=shared,
                router=router)


PRESETS: dict[str, dict[str, Any]] = {
    # Tiny shapes for tests: seconds on a CPU.
    "gpt-tiny": _gpt2(n_layers=2, n_heads=2, d_model=64, vocab_size=512, max_seq_len=64),
    "llama-tiny": _llama(n_layers=2, n_heads=4, n_kv_heads=2, d_model=64, d_ff=0, vocab_size=512,
                         max_seq_len=64, ffn_multiple_of=32),
    # max_seq_len 256: `shardlm train --model.preset=moe-tiny` runs with the default seq_len.
    "moe-tiny": _moe(_llama(n_layers=2, n_heads=4, n_kv_heads=2, d_model=64, d_ff=0, vocab_size=512,
                            max_seq_len=256, ffn_multiple_of=32), experts=4, top_k=2, expert_d_ff=96),
    # The default run: a small GPT that learns visibly on the stdlib corpus in a few CPU minutes.
    "gpt-mini": _gpt2(n_layers=4, n_heads=4, d_model=256, vocab_size=8192, max_seq_len=256),
    # gpt-mini's size as a mixture of experts (8 experts of width 512, 2 per token): expert
    # parallelism measured on a CPU (bench/bench_planner.py --preset moe-mini).
    "moe-mini": _moe(_llama(n_layers=4, n_heads=4, n_kv_heads=4, d_model=256, d_ff=0, vocab_size=8192,
                            max_seq_len=256), experts=8, top_k=2, expert_d_ff=512),
    # GPT-2 family (124M, 355M, 774M, 1.558B parameters as published with 50257 tokens).
    "gpt2-124m": _gpt2(n_layers=12, n_heads=12, d_model=768),
    "gpt2-350m": _gpt2(n_layers=24, n_heads=16, d_model=1024),
    "gpt2-774m": _gpt2(n_layers=36, n_heads=20, d_model=1280),
    "gpt2-1.5b": _gpt2(n_layers=48, n_heads=25, d_model=1600),
    # GPT-2 architecture at GPT-3 2.7B's shape (Brown et al. 2020, table 2.1: 32 layers, d=2560,
    # 32 heads, 2048 context).
    "gpt2-2.7b": _gpt2(n_layers=32, n_heads=32, d_model=2560, max_seq_len=2048),
    # LLaMA family: Llama 3.2 1B (tied embeddings, 128256 tokens, GQA 32/8), LLaMA 2 7B and 13B.
    "llama-1b": _llama(n_layers=16, n_heads=32, n_kv_heads=8, d_model=2048, d_ff=8192,
                       vocab_size=128256, max_seq_len=131072, rope_theta=500000.0,
                       tie_embeddings=True),
    "llama-7b": _llama(n_layers=32, n_heads=32, n_kv_heads=32, d_model=4096, d_ff=11008,
                       vocab_size=32000, max_seq_len=4096),
    "llama-13b": _llama(n_layers=40, n_heads=40, n_kv_heads=40, d_model=5120, d_ff=13824,
                        vocab_size=32000, max_seq_len=4096),
    # Mixtures of experts at published shapes (for the planner; trainable where they fit).
    # Mixtral 8x7B (Jiang et al. 2024): Mistral 7B's attention, 8 SwiGLU experts of 14336, top 2.
    "mixtral-8x7b": _moe(_llama(n_layers=32, n_heads=32, n_kv_heads=8, d_model=4096, d_ff=14336,
                                vocab_size=32000, max_seq_len=32768, rope_theta=1e6),
                         experts=8, top_k=2, expert_d_ff=14336),
    # OLMoE-1B-7B-like (Muennighoff et al. 2024): 64 experts of 1024, top 8 (without its q/k norm).
    "olmoe-like": _moe(_llama(n_layers=16, n_heads=16, n_kv_heads=16, d_model=2048, d_ff=1024,
                              vocab_size=50304, max_seq_len=4096), experts=64, top_k=8, expert_d_ff=1024),
    # DeepSeek-V2-Lite-like (DeepSeek-AI 2024): 64 routed experts of 1408, top 6, 2 shared; with
    # grouped-query attention in place of its multi-head latent attention, and every block MoE
    # (the original's first is dense).
    "deepseek-v2-lite-like": _moe(_llama(n_layers=27, n_heads=16, n_kv_heads=16, d_model=2048, d_ff=1408,
                                         vocab_size=102400, max_seq_len=4096),
                                  experts=64, top_k=6, expert_d_ff=1408, shared=2),
}

ALIASES = {"gpt2": "gpt2-124m", "gpt2-medium": "gpt2-350m", "gpt2-large": "gpt2-774m",
           "gpt2-xl": "gpt2-1.5b"}

# Parameter counts reported by the sources (Hugging Face model cards / papers), for the tests.
PUBLISHED_PARAMS = {
    "gpt2-124m": 124_439_808,
    "gpt2-350m": 354_823_168,
    "gpt2-774m": 774_030_080,
    "gpt2-1.5b": 1_557_611_200,
    "llama-1b": 1_235_814_400,
    "llama-7b": 6_738_415_616,
    "llama-13b": 13_015_864_320,
    "mixtral-8x7b": 46_702_792_704,
}


def get_preset(name: str) -> dict[str, Any]:
    """The [model] field values of a named preset (a copy)."""
    key = ALIASES.get(name, name)
    if key not in PRESETS:
        names = ", ".join(list(PRESETS) + list(ALIASES))
        raise ConfigError(f"unknown model preset {name!r}; choose one of: {names}")
    return dict(PRESETS[key])
