"""Attention over one key/value block of the ring (parallel/context/attention.py): the block's output and
the log-sum-exp of each query's scores, and the block's share of the gradients given the
*whole* attention's output and log-sum-exp. That is all flash attention's backward needs
(Dao et al. 2022): with the global output O and log-sum-exp L, a block's probabilities are
exp(s - L) and its dq, dk, dv are exactly its contribution to the whole gradient — so the fused
kernel's backward, fed one block's q, k, v with the global O and L, is the ring's hop backward
(Liu et al. 2023; the same trick as zhuzilin/ring-flash-attention).

Three kernels, chosen per hop (`_kernel`):
- fused (CPU): torch's flash attention for CPU, `aten._scaled_dot_product_flash_attention_for_cpu`
  and its `_backward` (fp32, bf16, fp16; log-sum-exp (B, h, t) fp32). Blocked over (query, key)
  tiles, it never holds a hop's score block: beyond its inputs and outputs it needs a few
  (query split x key split) buffers per thread. Masks beyond the causal one (documents, sliding
  windows) go in as its additive `attn_mask`, in q's dtype (the kernel takes no boolean one),
  one tile of query rows at a time (`tile_rows`: at most MASK_ELEMENTS mask elements per call,
  whatever the block's length), each tile's keys cut to the span its rows may see; a tile that
  sees no key is skipped, one that sees every key of its span runs unmasked.
- fused (CUDA): without a mask in bf16 / fp16, flash attention
  (`aten._scaled_dot_product_flash_attention` and its `_backward`; log-sum-exp (B, h, t) fp32);
  with a mask, or in fp32, memory-efficient attention (`aten._scaled_dot_product_efficient_attention`
  with compute_log_sumexp and its `_backward`), the mask as its additive `attn_bias` over the
  same tiles as the CPU's (CUDA_MASK_ELEMENTS per call), the bias's rows padded to 16 elements
  (the kernel's alignment) and expanded over the heads; its log-sum-exp comes padded to a
  multiple of 32 query rows (cut off here, padded again for the backward). Rows that see no key
  of a tile get output 0 here (the kernel's value for them is not relied on). A masked bf16 /
  fp16 hop's backward runs in fp32 (_fused_backward: the bf16 one was wrong).
- math (portable): the scores in fp32, a tile of query rows at a time (`_math_tiles`: at most
  the device's mask elements of scores per tile over batch and heads, so linear in T/C like the
  fused paths; the backward recomputes each tile's scores and probabilities). Soft-capped
  scores (Gemma 2) run it on every device: no kernel here takes a cap (flex attention's
  `score_mod` would, but has no backward on a CPU in torch 2.13 and takes no whole-attention
  output and log-sum-exp in its autograd; see docs/gpu.md), and so does any other device, dtype
  or head width (> 256, not a multiple of 8 on CUDA). The math path is the fused ones'
  reference in tests/test_ring_blocks.py and tests/test_cuda_kernels.py.
The log-sum-exp merge across hops (parallel/context/attention.py) is fp32 on every path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

MASK_ELEMENTS = 1 << 20
"""The most mask elements one fused call of a masked hop takes (4 MiB of fp32): a hop's query
rows are cut into tiles of at least MIN_TILE_ROWS rows under it."""
MIN_TILE_ROWS = 128
"""Fewer rows per call would leave the kernel's own query split (up to 256 rows) half empty."""
CUDA_MASK_ELEMENTS = 1 << 24
"""MASK_ELEMENTS on CUDA (32 MiB of bf16): at 32k keys a call takes 512 query rows, enough to
fill the GPU's multiprocessors; the (T/C)² block it avoids is 2 GiB of bf16 there."""
BIAS_ALIGN = 16
"""Memory-efficient attention wants its bias's row stride a multiple of 16 elements (what SDPA's
own mask preprocessing pads to)."""
LSE_ROWS = 32
"""Memory-efficient attention's log-sum-exp is padded to a multiple of 32 query rows on CUDA."""


def _has_cpu_flash(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def _has_cuda_fused(q: torch.Tensor) -> bool:
    """CUDA's kernels that return a log-sum-exp take this q: fp32 / bf16 / fp16, a head width
    that is a multiple of 8 and at most 256 (flash attention's limit). Not ROCm: its
    memory-efficient attention does not pad the log-sum-exp (unchecked there: the math path)."""
    d = q.shape[-1]
    return (q.is_cuda and torch.version.hip is None and q.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and d % 8 == 0 and d <= 256)


def _kernel(q: torch.Tensor, softcap: float) -> str:
    """"cpu" / "cuda" (fused) or "math" for this hop."""
    if softcap:
        return "math"
    if _has_cpu_flash(q):
        return "cpu"
    return "cuda" if _has_cuda_fused(q) else "math"


def expand_kv(kv: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, h_kv, t, d) -> (B, h_kv·groups, t, d): each key/value head for its query heads."""
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)


def fold_kv(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of an expanded key/value head back onto the shared head."""
    if groups == 1:
        return grad
    b, h, t, d = grad.shape
    return grad.view(b, h // groups, groups, t, d).sum(2)


@dataclass(frozen=True)
class BlockMask:
    """Which of a hop's queries may see which of its keys, from their global positions: causal
    (query >= key), within `window` (> 0: query - key < window) and, with `docs` ((B, T) the
    whole sequence's document ids), in the same document. Built a tile of query rows at a time:
    the fused path never holds it whole."""

    qpos: torch.Tensor
    """(tq,) the hop's query positions in the whole sequence."""
    kpos: torch.Tensor
    """(tk,) its key positions."""
    window: int = 0
    docs: torch.Tensor | None = None

    def allowed(self, rows: slice = slice(None)) -> torch.Tensor:
        """(B or 1, 1, r, tk) bool for the query rows `rows` (comparisons only: no (r, tk)
        position differences, which would be int64)."""
        qpos, kpos = self.qpos[rows], self.kpos
        ok = qpos[:, None] >= kpos[None, :]
        if self.window:
            ok &= qpos[:, None] < (kpos + self.window)[None, :]
        if self.docs is None:
            return ok[None, None]
        same = self.docs[:, qpos][:, :, None] == self.docs[:, kpos][:, None, :]  # (B, r, tk)
        return (same & ok).unsqueeze(1)


def block_forward(q, k, v, causal: bool, scale: float, mask: BlockMask | None = None,
                  softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q kᵀ·scale) v and the log-sum-exp of each query's scores (fp32). Causal: the
    diagonal block (queries and keys the same positions). `mask`: which query-key pairs may
    attend (documents, a window), instead of `causal`; a query with none gets output 0 and
    log-sum-exp -inf (nothing to merge). `softcap` > 0: scores c·tanh(s/c) before the mask
    (Gemma 2). Keys/values already expanded to the query heads."""
    kernel = _kernel(q, softcap)
    if kernel != "math":
        if mask is None:
            return _fused_forward(kernel, q, k, v, causal, scale, None)
        return _fused_masked_forward(kernel, q, k, v, scale, mask)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    for rows, allowed in _math_tiles(q, k, causal, mask):
        scores, _ = _scores(q[:, :, rows], k, scale, allowed, softcap)  # (B, h, r, tk): any device
        tile_lse = scores.logsumexp(-1)
        finite = tile_lse.masked_fill(tile_lse == float("-inf"), 0.0)  # an empty row: exp(-inf) = 0, not nan
        out[:, :, rows] = ((scores - finite.unsqueeze(-1)).exp() @ v.float()).to(q.dtype)
        lse[:, :, rows] = tile_lse
    return out, lse


def block_backward(dout, q, k, v, out, lse, causal: bool, scale: float, mask: BlockMask | None = None,
                   softcap: float = 0.0):
    """dq, dk, dv of one block's share of the attention whose final output and log-sum-exp
    are `out` and `lse` (finite: every query sees itself)."""
    kernel = _kernel(q, softcap)
    if kernel != "math":
        if mask is None:
            return _fused_backward(kernel, dout, q, k, v, out, lse.to(torch.float32), causal, scale, None)
        return _fused_masked_backward(kernel, dout, q, k, v, out, lse, scale, mask)
    kf, vf = k.float(), v.float()
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for rows, allowed in _math_tiles(q, k, causal, mask):
        qf, df = q[:, :, rows].float(), dout[:, :, rows].float()
        scores, slope = _scores(q[:, :, rows], k, scale, allowed, softcap)
        p = (scores - lse[:, :, rows].unsqueeze(-1)).exp()  # this block's probabilities under the whole softmax
        delta = (df * out[:, :, rows].float()).sum(-1, keepdim=True)
        ds = p * (df @ vf.transpose(-1, -2) - delta) * scale
        if slope is not None:  # through the cap: c·tanh(s/c)' = 1 - tanh²(s/c)
            ds = ds * slope
        dq[:, :, rows] = (ds @ kf).to(q.dtype)
        dk += ds.transpose(-1, -2) @ qf
        dv += p.transpose(-1, -2) @ df
    return dq, dk.to(k.dtype), dv.to(v.dtype)


def _math_tiles(q, k, causal: bool, mask: BlockMask | None) -> Iterator[tuple[slice, torch.Tensor | None]]:
    """The math hop's tiles of query rows, each with which of the block's keys its rows may see
    (None: all): at most the device's mask elements (_mask_elements) of fp32 scores per tile over
    the batch and heads, so no (T/C)² block is ever held (soft-capped hops, which no fused kernel
    here takes, are linear in T/C too). Causal: the diagonal block, queries and keys the same
    positions."""
    B, h, tq, _ = q.shape
    tk = k.shape[2]
    step = max(1, _mask_elements("cuda" if q.is_cuda else "cpu") // max(1, B * h * tk))
    keys = torch.arange(tk, device=q.device) if causal and mask is None else None
    for start in range(0, tq, step):
        rows = slice(start, min(start + step, tq))
        if mask is not None:
            yield rows, mask.allowed(rows)
        elif keys is not None:
            yield rows, (torch.arange(rows.start, rows.stop, device=q.device)[:, None] >= keys[None, :])[None, None]
        else:
            yield rows, None


def _scores(q, k, scale: float, allowed: torch.Tensor | None, softcap: float = 0.0):
    """The masked (and soft-capped) scores, fp32, and d(capped)/d(uncapped) = 1 - tanh² (None
    without a cap)."""
    scores, slope = (q.float() @ k.float().transpose(-1, -2)) * scale, None
    if softcap:
        capped = torch.tanh(scores / softcap)
        scores, slope = capped * softcap, 1 - capped * capped
    if allowed is not None:
        return scores.masked_fill(~allowed, float("-inf")), slope
    return scores, slope


# ---------------------------------------------------------------------------------------------
# The fused kernel under a mask, a tile of query rows at a time


@dataclass
class _Tile:
    rows: slice
    keys: slice
    bias: torch.Tensor | None
    """(B or 1, 1, r, keys) additive mask in q's dtype (0 or -inf), or None: every key seen."""
    blind: torch.Tensor | None
    """(B or 1, 1, r) rows that see no key (the kernel gives them log-sum-exp 0), or None."""


def tile_rows(mask_batch: int, keys: int, elements: int | None = None) -> int:
    """Query rows per fused call of a masked hop: `elements` (MASK_ELEMENTS) over the mask's
    row, at least MIN_TILE_ROWS."""
    return max(MIN_TILE_ROWS, (elements or MASK_ELEMENTS) // max(1, mask_batch * keys))


def _tiles(mask: BlockMask, dtype: torch.dtype, elements: int | None = None) -> Iterator[_Tile]:
    """The tiles of a masked hop that see some key, each with its keys cut to the span its rows
    may see (a window's or a document's tile touches few of the block's keys)."""
    tq, tk = len(mask.qpos), len(mask.kpos)
    step = tile_rows(1 if mask.docs is None else mask.docs.shape[0], tk, elements)
    for start in range(0, tq, step):
        rows = slice(start, min(start + step, tq))
        ok = mask.allowed(rows)  # (B or 1, 1, r, tk) bool: a quarter of the bias below
        seen = ok.any(-1)  # (B or 1, 1, r)
        cols = ok.any(-2).flatten(0, -2).any(0).nonzero()  # the keys any row sees
        if len(cols) == 0:
            continue
        keys = slice(int(cols[0]), int(cols[-1]) + 1)
        ok = ok[..., keys]
        if bool(ok.all()):
            yield _Tile(rows, keys, None, None)
            continue
        bias = torch.zeros(ok.shape, dtype=dtype, device=ok.device).masked_fill_(~ok, float("-inf"))
        yield _Tile(rows, keys, bias, None if bool(seen.all()) else ~seen)


def _fused_forward(kernel: str, q, k, v, causal: bool, scale: float, bias):
    """One fused call: the output (q's dtype) and the log-sum-exp (B, h, tq) fp32."""
    if kernel == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
        return out, lse.float()
    if _flash(q, bias):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
        return out, lse.float()
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, _cuda_bias(bias, q), True, 0.0, causal, scale=scale)[:2]
    return out, lse[..., :q.shape[2]].float()


def _fused_backward(kernel: str, dout, q, k, v, out, lse, causal: bool, scale: float, bias):
    """dq, dk, dv of one fused call given the whole attention's `out` and `lse` (fp32)."""
    if kernel == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale)
    tq, tk, device = q.shape[2], k.shape[2], q.device
    if _flash(q, bias):
        # no dropout: the kernel reads neither the random state (shaped as its forward returns
        # it) nor cumulative lengths (None: the dense, not the variable-length, kernel)
        seed = torch.zeros(2, dtype=torch.uint64, device=device)
        offset = torch.zeros((), dtype=torch.uint64, device=device)
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.contiguous(), None, None, tq, tk, 0.0, causal, seed, offset, scale=scale)
    if bias is not None and q.dtype != torch.float32:
        # bf16 / fp16 under a mask: memory-efficient attention's backward on fp32 copies of the
        # tile (linear in its rows and keys). Its bf16 backward with a bias gave dq 0.28 away
        # from the math hop on an H200 (torch 2.11, 2026-11-29), where its forward and its fp32
        # backward agreed to their tolerances (docs/gpu/h200-2026-11-29-run3-masked-hop.log).
        low = q.dtype
        grads = _fused_backward(kernel, *(t.float() for t in (dout, q, k, v, out)), lse, causal, scale, bias.float())
        return tuple(g.to(low) for g in grads)
    padded = torch.zeros((*lse.shape[:2], -(-tq // LSE_ROWS) * LSE_ROWS), dtype=torch.float32, device=device)
    padded[..., :tq] = lse
    seed = torch.zeros((), dtype=torch.int64, device=device)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, _cuda_bias(bias, q), out, padded, seed, seed, 0.0, [True, True, True, False], causal,
        scale=scale)
    return dq, dk, dv


def _flash(q: torch.Tensor, bias) -> bool:
    """CUDA's flash kernel takes this hop: no mask, bf16 / fp16, an Ampere or later GPU."""
    return bias is None and q.dtype != torch.float32 and torch.cuda.get_device_capability(q.device) >= (8, 0)


def _cuda_bias(bias: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """A tile's additive mask as memory-efficient attention takes it: rows padded to BIAS_ALIGN
    elements (a view of the first `keys`), expanded to (B, h, rows, keys) without a copy."""
    if bias is None:
        return None
    keys = bias.shape[-1]
    width = -(-keys // BIAS_ALIGN) * BIAS_ALIGN
    if width != keys:
        padded = torch.zeros((*bias.shape[:-1], width), dtype=bias.dtype, device=bias.device)
        padded[..., :keys] = bias
        bias = padded[..., :keys]
    return bias.expand(q.shape[0], q.shape[1], q.shape[2], keys)


def _fused_masked_forward(kernel: str, q, k, v, scale: float, mask: BlockMask):
    """block_forward's fused path under a mask: tiles of query rows (_tiles); rows of skipped
    tiles keep output 0 and log-sum-exp -inf, as rows the kernel found blind (on CUDA their
    output set to 0 too)."""
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    for tile in _tiles(mask, q.dtype, _mask_elements(kernel)):
        rows, keys = tile.rows, tile.keys
        o, l = _fused_forward(kernel, q[:, :, rows], k[:, :, keys], v[:, :, keys], False, scale, tile.bias)
        if tile.blind is not None and kernel == "cuda":
            o = o.masked_fill(tile.blind.unsqueeze(-1), 0.0)
        out[:, :, rows] = o
        lse[:, :, rows] = l if tile.blind is None else l.masked_fill(tile.blind, float("-inf"))
    return out, lse


def _fused_masked_backward(kernel: str, dout, q, k, v, out, lse, scale: float, mask: BlockMask):
    """block_backward's fused path under a mask, over the forward's tiles: each tile's dq rows
    are its own; its dk, dv (its key span) summed over the tiles in fp32."""
    dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    lse = lse.to(torch.float32)
    for tile in _tiles(mask, q.dtype, _mask_elements(kernel)):
        rows, keys = tile.rows, tile.keys
        gq, gk, gv = _fused_backward(kernel, dout[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys],
                                     out[:, :, rows], lse[:, :, rows], False, scale, tile.bias)
        dq[:, :, rows] = gq
        dk[:, :, keys] += gk
        dv[:, :, keys] += gv
    return dq, dk.to(k.dtype), dv.to(v.dtype)


def _mask_elements(kernel: str) -> int:
    return CUDA_MASK_ELEMENTS if kernel == "cuda" else MASK_ELEMENTS
