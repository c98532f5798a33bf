"""Model shapes from the command line: a named preset, a transformers config.json, or a
parameter count sized in a named family (`--params N --family gpt2|llama|moe`). Pure: no torch.
"""

from __future__ import annotations

from shardlm.config.model import ModelConfig
from shardlm.errors import ConfigError
from shardlm.config.presets import ALIASES, get_preset
from shardlm.config.hf_shapes import hf_shape



def preset_model(name: str) -> ModelConfig:
    """A named preset as a ModelConfig, without importing torch (ConfigError lists the names)."""
    return ModelConfig(preset=ALIASES.get(name, name), **get_preset(name))


def model_from_hf_config(path: str) -> ModelConfig:
    """A transformers config.json as a ModelConfig (hf_shapes.hf_shape: GPT-2's and LLaMA-family
    key names), for `--model path/config.json`."""
    from pathlib import Path

    return ModelConfig(preset=f"{Path(path).name} (a transformers config, its shape)", **hf_shape(path))


FAMILIES = {
    "gpt2": dict(norm="layernorm", position="learned", mlp="gelu", bias=True, tie_embeddings=True),
    "llama": dict(norm="rmsnorm", position="rope", mlp="swiglu", bias=False, tie_embeddings=False),
    "moe": dict(norm="rmsnorm", position="rope", mlp="swiglu", bias=False, tie_embeddings=False),
}
"""The shape families `--params N` sizes a model in (`--family`): GPT-2 (LayerNorm, learned
positions, GELU MLP of 4h, biases, tied head), LLaMA (RMSNorm, RoPE, SwiGLU MLP of 8h/3 rounded
up to 256, no biases, untied head, GQA with `kv_heads`), and a LLaMA-block mixture of experts
(`experts` routed experts of the MLP's width, top_k per token; Mixtral's 8 and 2 unless given)."""

FAMILY_NAMES = {"gpt2": "GPT-2-family shape", "llama": "LLaMA-family shape",
                "moe": "LLaMA-block mixture-of-experts shape"}


def model_from_params(params: float, layers: int | None = None, hidden: int | None = None,
                      heads: int | None = None, vocab: int = 50257, max_seq_len: int = 2048,
                      family: str = "gpt2", kv_heads: int | None = None, ffn: int | None = None,
                      experts: int | None = None, top_k: int | None = None) -> ModelConfig:
    """A `family` shape (FAMILIES) with about `params` parameters, for `--params`.

    Every dimension given is kept. Unless given, the width is about 128 x the depth (GPT-3
    6.7B-175B and LLaMA 7B have h/L = 128; Kaplan et al. 2020 find the loss flat over a wide range
    of aspect ratios), rounded so that heads of 128 split evenly for tensor parallelism (GPT-2
    family: 1.3e9 gives GPT-3 XL's 24 x 2048, 175e9 GPT-3's 96 x 12288), and the depth is then
    refitted to the count unless given; parameters are counted by models.flops.count_params, the
    runtime's own count. With every dimension given the shape is exact (Llama 3.1 405B:
    --family llama --layers 126 --hidden 16384 --heads 128 --kv-heads 8 --ffn 53248
    --vocab 128256). The model states use `params` exactly (Workload.params); the shape sizes
    activations and FLOPs.
    """
    from shardlm.models.flops import count_params

    if family not in FAMILIES:
        raise ConfigError(f"--family {family!r}: choose one of {', '.join(FAMILIES)}")
    if params <= 0:
        raise ConfigError(f"--params {params:g} must be > 0")
    if family != "moe" and (experts or top_k):
        raise ConfigError(f"--experts/--top-k describe a mixture of experts: add --family moe "
                          f"(--family {family} is dense)")
    moe = dict(experts=experts or 8, top_k=top_k or 2) if family == "moe" else {}

    def shape(h: int, l: int) -> ModelConfig:
        a = heads or max(1, h // 128 if h % 128 == 0 else h // 64)
        kv = kv_heads if kv_heads and family != "gpt2" else 0
        return ModelConfig(preset=f"--params {params:.3g} ({FAMILY_NAMES[family]})", vocab_size=vocab,
                           n_layers=l, n_heads=a, n_kv_heads=kv, d_model=h, d_ff=ffn or 0,
                           max_seq_len=max_seq_len, **FAMILIES[family], **moe)

    def fit_layers(h: int) -> int:
        root = count_params(shape(h, 1)) - (count_params(shape(h, 2)) - count_params(shape(h, 1)))
        block = count_params(shape(h, 2)) - count_params(shape(h, 1))
        return max(1, round((params - root) / block))

    if hidden is None:  # solve c·L·h² + root·h = params for h, c and root from the family's count
        # the depth at which h = 128·L holds, with the family's parameters per block per h²
        # (12 for GPT-2; ~12 for LLaMA; ~4 + 8·experts for the mixture of experts)
        per_h2 = (count_params(shape(4096, 2)) - count_params(shape(4096, 1))) / 4096**2
        guess = layers or max(1, round((params / (per_h2 * 128**2)) ** (1 / 3)))
        h0 = 128 * guess
        block = count_params(shape(h0, 2)) - count_params(shape(h0, 1))
        root = count_params(shape(h0, 1)) - block
        a, b = block / h0**2 * guess, root / h0
        exact = (-b + (b * b + 4 * a * params) ** 0.5) / (2 * a)
        step = 1024 if exact >= 8192 else 512 if exact >= 2048 else 128  # heads of 128 split by 4-8
        step = max(step, 128 * (kv_heads or 1)) if family != "gpt2" and not heads else step
        hidden = max(step if family != "gpt2" else 128, step * round(exact / step))
    if layers is None:
        layers = fit_layers(hidden)
    model = shape(hidden, layers)
    errors = []
    if hidden % model.n_heads:
        errors.append(f"--hidden {hidden} is not divisible by --heads {model.n_heads}")
    if model.n_kv_heads and model.n_heads % model.n_kv_heads:
        errors.append(f"--kv-heads {model.n_kv_heads} must divide --heads {model.n_heads}")
    if kv_heads and family == "gpt2":
        errors.append("--kv-heads: GPT-2 has no grouped-query attention; use --family llama")
    if errors:
        raise ConfigError("; ".join(errors))
    return model
