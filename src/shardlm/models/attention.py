"""The attention kernels (model.attention) and document masking for packed sequences.

softmax(q kᵀ/√d + mask) v, causal, and — when the batch comes with per-token positions that
restart at 0 at each document (data.document_mask) — blocked between documents, so a packed row
computes what each of its documents would alone (docs/finetuning.md, docs/computation.md).

Backends (model.attention):
  'sdpa'          F.scaled_dot_product_attention: torch picks the fused kernel the device has
                  (flash / memory-efficient / cuDNN on CUDA, the fused flash kernel on CPU).
                  Documents: an additive float mask (B, 1, T, T) built once per forward and
                  shared by every layer (a boolean mask would be converted to a float copy in
                  each layer, and kept for backward: b·s²·4 bytes per layer, measured).
  'per_document'  SDPA on each document of each row on its own (is_causal): no mask, and no
                  work across documents (Σ len² instead of s²: measured 3-6x faster than the
                  masked kernel on this CPU at 2048 tokens); its lengths are data-dependent,
                  so it cannot be compiled.
  'flex'          FlexAttention (torch.nn.attention.flex_attention) with a block mask, compiled:
                  fully masked blocks are skipped. torch 2.13 has no FlexAttention backward on
                  CPU, so on CPU it serves inference only.
  'math'          plain matmul-softmax-matmul: the reference the others are tested against; it
                  keeps the s x s probabilities for backward (the planner charges them).
  'auto'          CUDA: 'flex' with documents, else 'sdpa'. CPU: 'per_document' with documents
                  ('sdpa' when train.compile), else 'sdpa' — the fastest measured
                  (bench/bench_attention.py). A model with attention soft-capping (Gemma 2)
                  runs 'math', the one that writes the scores out; one with sliding-window
                  blocks runs 'sdpa' where it would run 'flex' or 'per_document'.

Sliding windows (model.sliding_window: Mistral, Gemma 2 and 3) are part of the mask: query i
sees key j when i - window < j <= i, built once per forward for the blocks that slide (sdpa,
math; flex and per_document refuse them, config_rules), and nothing at all when the sequence
is no longer than the window. A scale other than 1/√d (model.attention_scale) reaches every
kernel; soft-capping (model.attn_softcap: c·tanh(s/c) on the scores, before the mask) only math.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardlm.config.fields import ATTENTION_BACKENDS
from shardlm.errors import ConfigError
from shardlm.models.flops import CPU_HALF_IN_FP32_MAX_LEN

BACKENDS = ATTENTION_BACKENDS


def choose_backend(name: str, device_type: str, documents: bool, compiled: bool,
                   softcap: bool = False, window: bool = False) -> str:
    """The backend model.attention = `name` runs: itself, or what 'auto' picks for the device,
    whether batches carry documents, whether the blocks are compiled, whether the scores are
    soft-capped (only 'math' writes them out) and whether some blocks slide (a mask)."""
    if name != "auto":
        return name
    if softcap:
        return "math"
    if not documents:
        return "sdpa"
    if device_type == "cuda" and not window:
        return "flex"
    return "sdpa" if compiled or window else "per_document"


def configure(model: nn.Module, attention: str, device: torch.device, documents: bool,
              compiled: bool) -> str:
    """Fix the backend a training run's model runs and say which, for the log. Our Decoder has
    `attention_backend`; a model we did not build runs its own attention and cannot take
    document positions."""
    if not hasattr(model, "attention_backend"):
        if documents or attention != "auto":
            raise ConfigError(f"{type(model).__name__} is not shardlm's Decoder: it runs its own "
                              f"attention and takes no per-document positions; set "
                              f"model.attention = 'auto' and data.document_mask = 'off'")
        return f"attention: {type(model).__name__}'s own"
    cfg = model.cfg
    backend = choose_backend(attention, device.type, documents, compiled, cfg.attn_softcap > 0,
                             cfg.sliding_window > 0)
    if backend == "flex" and device.type == "cpu":
        raise ConfigError("model.attention = 'flex' on CPU: torch 2.13's FlexAttention has no CPU "
                          "backward, so it cannot train here; use 'auto' (per_document / sdpa) or "
                          "'sdpa', and keep 'flex' for CUDA")
    model.attention_backend = backend
    return (f"attention: model.attention = {attention!r} -> {backend!r} on {device.type}, document "
            f"masks {'on' if documents else 'off'}" + (", blocks compiled" if compiled else ""))


@dataclass(frozen=True)
class AttentionMask:
    """What every layer's attention needs for one forward, built once (Decoder.forward)."""

    backend: str
    """A concrete backend (never 'auto')."""
    data: Any = None
    """sdpa: the additive float mask (B, 1, T, T); math: the boolean mask of blocked pairs
    (B or 1, 1, T, T), negated once here, not in every layer; per_document: each row's document lengths (a tuple of tuples of ints);
    flex: the BlockMask."""


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """(B, T) document index of each token: a document starts where its position is 0."""
    return (positions == 0).cumsum(dim=-1)


def _allowed(positions: torch.Tensor | None, T: int, device: torch.device, window: int = 0) -> torch.Tensor:
    """Boolean (B or 1, 1, T, T): query i may see key j (causal, within the last `window` tokens
    when window > 0, and the same document)."""
    ones = torch.ones(T, T, dtype=torch.bool, device=device)
    causal = ones.tril()
    if window:  # i - window < j: drop the diagonals at and below -window
        causal &= ~ones.tril(-window)
    if positions is None:
        return causal[None, None]
    docs = document_ids(positions)  # (B, T)
    return (docs[:, None, :, None] == docs[:, None, None, :]) & causal  # (B, 1, T, T)


def _block_mask(positions: torch.Tensor | None, B: int, T: int, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask

    if positions is None:
        def causal(b, h, q, kv):
            return q >= kv
        return create_block_mask(causal, None, None, T, T, device=device)
    docs = document_ids(positions)

    def same_document(b, h, q, kv):
        return (q >= kv) & (docs[b, q] == docs[b, kv])
    return create_block_mask(same_document, B, None, T, T, device=device)


def prepare(backend: str, positions: torch.Tensor | None, T: int, device: torch.device,
            dtype: torch.dtype, window: int = 0) -> AttentionMask | None:
    """The per-forward mask for `backend` (concrete); None = plain causal SDPA. `positions`
    (B, T): each token's position in its document, or None (one document per row). `dtype`:
    the dtype q will have (the compute dtype), for sdpa's additive mask. `window`: a sliding
    window's mask (0, or one no shorter than T: none)."""
    window = window if 0 < window < T else 0
    if window and backend in ("per_document", "flex"):
        raise ValueError(f"model.attention = {backend!r} has no sliding-window mask; use 'sdpa' or 'math'")
    if backend in ("sdpa", "per_document") and positions is None and not window:
        return None
    if backend == "sdpa":
        blocked = ~_allowed(positions, T, device, window)
        return AttentionMask(backend, torch.zeros(blocked.shape, dtype=dtype, device=device)
                             .masked_fill_(blocked, float("-inf")))
    if backend == "per_document":
        starts = positions == 0
        starts[:, 0] = True
        begins: list[list[int]] = [[] for _ in range(positions.shape[0])]
        for row, col in starts.nonzero().tolist():  # one host sync per forward
            begins[row].append(col)
        return AttentionMask(backend, tuple(tuple(b - a for a, b in zip(row, row[1:] + [T]))
                                            for row in begins))
    if backend == "math":
        return AttentionMask(backend, ~_allowed(positions, T, device, window))
    if backend == "flex":
        B = 1 if positions is None else positions.shape[0]
        return AttentionMask(backend, _block_mask(positions, B, T, device))
    raise ValueError(f"model.attention = {backend!r}; choose one of {', '.join(BACKENDS)}")


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask | None = None,
           scale: float | None = None, softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of q (B, nh, T, hs) over k, v (B, nkv, T, hs) -> (B, nh, T, hs), masked
    as `mask` says (None: plain causal SDPA). `scale`: of q·k (None = 1/√hs); `softcap` > 0:
    scores -> softcap·tanh(scores/softcap), which only the math backend computes."""
    gqa = q.shape[1] != k.shape[1]
    if softcap and (mask is None or mask.backend != "math"):
        raise ValueError(f"attention soft-capping needs model.attention = 'math' (got "
                         f"{'sdpa' if mask is None else mask.backend!r})")
    if mask is None:
        return sdpa(q, k, v, gqa, is_causal=True, scale=scale)
    if mask.backend == "sdpa":
        return sdpa(q, k, v, gqa, attn_mask=mask.data, scale=scale)
    if mask.backend == "per_document":
        return _per_document(q, k, v, mask.data, gqa, scale)
    if mask.backend == "flex":
        return _flex()(q, k, v, block_mask=mask.data, enable_gqa=gqa, scale=scale)
    return _math(q, k, v, mask.data, scale, softcap)


def kernel_takes_grouped_kv(device_type: str, dtype: torch.dtype, masked: bool) -> bool:
    """Whether SDPA's fused kernel broadcasts grouped kv heads itself (enable_gqa) for this call.
    On CUDA only flash attention does, and it takes neither fp32 nor a mask: the memory-efficient
    and cuDNN kernels need as many kv heads as query heads, so SDPA fell back to its math kernel
    and kept the (T, T) probabilities (torch 2.11 on an H200: 77 MiB against 1 MiB with the kv
    heads repeated, fp32, 8 x 4 heads x 512 tokens; docs/gpu/h200-2026-11-29-run4-gqa.log). On
    the CPU enable_gqa was measured 10-20% faster than repeating the heads (torch 2.13,
    forward + backward), with identical outputs."""
    return device_type != "cuda" or (dtype in (torch.bfloat16, torch.float16) and not masked)


def sdpa(q, k, v, gqa: bool, **kwargs) -> torch.Tensor:
    """F.scaled_dot_product_attention with grouped kv heads broadcast by the kernel where it
    can, else repeated to the query heads first (kernel_takes_grouped_kv); short half-precision
    sequences on the CPU in fp32 (CPU_HALF_IN_FP32_MAX_LEN)."""
    if (q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16)
            and max(q.shape[-2], k.shape[-2]) <= CPU_HALF_IN_FP32_MAX_LEN
            and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
        mask = kwargs.get("attn_mask")
        if mask is not None and mask.is_floating_point():
            kwargs["attn_mask"] = mask.float()
        with torch.autocast("cpu", enabled=False):  # autocast would cast them back to half
            return sdpa(q.float(), k.float(), v.float(), gqa, **kwargs).to(q.dtype)
    if gqa and not kernel_takes_grouped_kv(q.device.type, q.dtype, kwargs.get("attn_mask") is not None):
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        gqa = False
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, **kwargs)


def _per_document(q, k, v, lengths: tuple[tuple[int, ...], ...], gqa: bool,
                  scale: float | None = None) -> torch.Tensor:
    if all(len(row) == 1 for row in lengths):  # one document per row: one call
        return sdpa(q, k, v, gqa, is_causal=True, scale=scale)
    rows = []
    # split, not t[b:b + 1]: split's backward is one cat of the pieces' gradients, a slice's a
    # zero tensor of the whole input per piece, then summed (B·docs fills of q, k and v)
    by_row = [t.split(1, dim=0) for t in (q, k, v)]
    for b, row in enumerate(lengths):
        pieces = zip(*(t[b].split(row, dim=2) for t in by_row))  # (1, h, len, hs) each
        rows.append(torch.cat([sdpa(qd, kd, vd, gqa, is_causal=True, scale=scale)
                               for qd, kd, vd in pieces], dim=2))
    return torch.cat(rows, dim=0)  # (B, nh, T, hs)


def _math(q, k, v, blocked: torch.Tensor, scale: float | None = None, softcap: float = 0.0) -> torch.Tensor:
    """softmax(q kᵀ/√d, masked) v written out: autograd keeps q, k, v and the (B, nh, T, T)
    probabilities (the s² term of Korthikanti et al.'s activation formula). Soft-capped as
    Gemma 2: c·tanh(scores/c) before the mask."""
    if q.shape[1] != k.shape[1]:  # GQA: each key/value head serves n_heads / n_kv_heads queries
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)  # (B, nh, T, T)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    return scores.masked_fill(blocked, float("-inf")).softmax(dim=-1) @ v


_compiled_flex = None


def _flex():
    """flex_attention, compiled once per process (uncompiled it runs an unfused reference);
    inside a compiled block Dynamo traces it directly."""
    from torch.nn.attention.flex_attention import flex_attention

    if torch.compiler.is_compiling():
        return flex_attention
    global _compiled_flex
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex
