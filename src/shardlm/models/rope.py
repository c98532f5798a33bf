"""Rotary position embeddings (Su et al. 2021) as transformers computes them: the frequency
tables of every RoPE scaling our decoder maps (model.rope_type: transformers'
ROPE_INIT_FUNCTIONS, step for step), partial rotary (model.rope_fraction) and the rotation
itself in the rotate-half convention. models/decoder.py builds the tables once per model and
indexes them by position in each forward."""

from __future__ import annotations

import math

import torch

from shardlm.config.model import ModelConfig
from shardlm.models.flops import head_dim


def _plain_inv_freq(dim: int, theta: float) -> torch.Tensor:
    """theta^(-2i/dim) for i < dim/2: RoPE's frequencies (Su et al. 2021), float32."""
    return 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)


def rope_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inverse frequencies (head_dim/2,), attention factor) for model.rope_type: the arithmetic
    of transformers' ROPE_INIT_FUNCTIONS (modeling_rope_utils.py), step for step, so a scaled
    checkpoint (Llama 3.1-3.3's 'llama3', YaRN, ...) gives its own logits. The factor multiplies
    cos and sin (YaRN's; 1 for the others)."""
    dim, theta, factor = rotary_dim(cfg), cfg.rope_theta, cfg.rope_factor
    original = cfg.rope_original_max_seq_len or cfg.max_seq_len
    if cfg.rope_type == "linear":
        return _plain_inv_freq(dim, theta) / factor, 1.0
    if cfg.rope_type == "dynamic":
        # NTK-aware base at the longest sequence seen; transformers starts at (and never goes
        # below) max_position_embeddings, and ours never exceeds max_seq_len: this one base.
        seq_len = cfg.max_seq_len
        base = theta * ((factor * seq_len / cfg.max_seq_len) - (factor - 1)) ** (dim / (dim - 2))
        return _plain_inv_freq(dim, base), 1.0
    if cfg.rope_type == "llama3":
        inv_freq = _plain_inv_freq(dim, theta)
        low_wavelen = original / cfg.rope_low_freq_factor
        high_wavelen = original / cfg.rope_high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths (low frequencies) divided by factor, short ones kept, smooth between
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - cfg.rope_low_freq_factor) / (
            cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if cfg.rope_type == "yarn":
        return _yarn_frequencies(cfg, dim, original)
    return _plain_inv_freq(dim, theta), 1.0


def _yarn_frequencies(cfg: ModelConfig, dim: int, original: int) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023): frequencies rotating fewer than beta_slow times over the original
    context are interpolated (/factor), more than beta_fast times kept, a linear ramp between;
    the attention factor 0.1·ln(factor) + 1 unless given."""
    theta, factor = cfg.rope_theta, cfg.rope_factor
    attention_factor = cfg.rope_attention_factor or (
        1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(cfg.rope_beta_fast), correction_dim(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    kept = 1 - ramp  # the share of each frequency extrapolated
    return interpolation * (1 - kept) + extrapolation * kept, float(attention_factor)


def rope_tables(head_dim: int, max_seq_len: int, theta: float, inv_freq: torch.Tensor | None = None,
                attention_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position * frequency, each (max_seq_len, head_dim // 2), float32 on CPU;
    `inv_freq` (rope_frequencies) in place of plain RoPE's, cos and sin times `attention_factor`.

    Computed exactly as Hugging Face's LlamaRotaryEmbedding (int64 arange cast to float32), so an
    exported checkpoint reproduces our logits.
    """
    if inv_freq is None:
        inv_freq = _plain_inv_freq(head_dim, theta)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.int64).float(), inv_freq)  # (T, hs/2)
    if attention_factor == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * attention_factor, angles.sin() * attention_factor


def rotary_dim(cfg: ModelConfig) -> int:
    """The features of each head RoPE rotates: int(head_dim · rope_fraction), as transformers'
    partial_rotary_factor (GPT-NeoX's rotary_pct)."""
    return int(head_dim(cfg) * cfg.rope_fraction)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, nh, T, hs) by position, in the "rotate-half" convention of HF's LlamaModel.

    Feature i is paired with feature i + hs/2 (not with its neighbour 2i+1 as in Meta's
    complex-number code): x*cat(cos, cos) + rotate_half(x)*cat(sin, sin), written on the halves.
    HF's conversion script permutes Meta's q/k weights into this layout, so our q/k weights
    export to `q_proj`/`k_proj` unchanged.
    """
    rotated = 2 * cos.shape[-1]
    if rotated < x.shape[-1]:  # partial rotary (model.rope_fraction): the rest pass as they are
        return torch.cat((apply_rope(x[..., :rotated], cos, sin), x[..., rotated:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)  # (B, nh, T, hs/2) each
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # (T, hs/2) or (B, 1, T, hs/2): broadcast
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
