"""Context parallelism: one sequence split over the C ranks of a context-parallel group, with
attention by ring (ring attention: Liu et al. 2023; the load-balanced layout of Megatron-LM's
and torchtitan's context parallelism).

Everything in a block but attention works token by token, so each rank runs it on its own
tokens only: activations are 1/C per rank. Attention needs every earlier key and value: the
ranks pass their key/value blocks around the ring, C - 1 hops, each rank merging the partial
attention of its queries over each block it receives (the log-sum-exp merge of flash
attention), while the next block is already in flight.

Load balance. With the causal mask, a rank holding the sequence's last chunk does C times the
attention work of the one holding the first. So the sequence is cut into 2C chunks and rank r
holds chunks r and 2C-1-r, one from the front and one from the back: at every hop but the
first, each rank computes exactly half a block, the same work on every rank: from an earlier
rank, all its queries against that rank's front chunk (its back chunk comes after both of
ours); from a later one, only our back chunk's queries, against both its chunks (our front
chunk comes before both).

Three ways to attend (parallel.cp_mode; docs/architecture.md compares them): the ring here,
for any head count, hiding its hops behind the block computations; Ulysses (parallel/
context/ulysses.py: an all-to-all trades the sequence split for a head split, and UlyssesAttention
below runs the one-process kernel on the whole sequence), when the heads divide by C; or the
hybrid, an all-to-all inside groups and this ring across them.

Masks. Beyond the causal one — packed documents, sliding windows — each hop's mask is built
from the two ranks' global positions and the whole sequence's document positions, which every
rank holds (nothing extra travels), a tile of query rows at a time.

The backward passes the key/value blocks around the ring again, recomputing each block's
partial gradients from the saved (whole) output and log-sum-exp, and the blocks' key/value
gradients travel with them (fp32, so C partial sums do not round at each hop), arriving home
after C hops. The per-hop kernels, fused (CPU flash attention, masks included) or portable
(soft-capped scores, CUDA), are parallel/context/ring_blocks.py's.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from shardlm.comm.collectives import Comm
from shardlm.errors import ConfigError
from shardlm.models.attention import AttentionMask, attend, document_ids
from shardlm.parallel.context import ops as context_ops
from shardlm.parallel.tensor.ops import op_group
from shardlm.parallel.context.ring_blocks import BlockMask, block_backward, block_forward, expand_kv, fold_kv
from shardlm.parallel.context.ulysses import heads_to_sequence, hybrid_groups, replicate_kv, sequence_to_heads

log = logging.getLogger("shardlm")


@dataclass
class CPState:
    """The context-parallel group of one model. A forward splits the sequence when its length
    divides into 2C chunks and splitting is on (generation turns it off: every rank then
    computes the whole, short, sequence)."""

    comm: Comm
    enabled: bool = True
    sharded: bool = False
    """True while this forward runs on this rank's chunks."""
    a2a: int = 1
    """The all-to-all degree (parallel/context/ulysses.py): 1 for the ring, C for Ulysses, between for
    the hybrid; the ring then runs over C / a2a groups."""
    documents: torch.Tensor | None = None
    """(B, T) each token's position in its document, for the whole sequence, while a forward of
    packed documents runs split (data.document_mask); None otherwise."""

    def __post_init__(self) -> None:
        self.key = context_ops.state_key(self)
        """Its key for the ring's custom op (parallel/context/ops.py), registered here, once,
        not inside a compiled forward."""

    @property
    def size(self) -> int:
        return self.comm.size

    def positions(self, length: int, device: torch.device | None = None, rank: int | None = None) -> torch.Tensor:
        """This rank's token positions in a sequence of `length`. The ring (a2a = 1): chunks r
        and 2C-1-r of 2C. With an all-to-all degree U (parallel/context/ulysses.py), the R = C/U ring
        groups hold chunks j and 2R-1-j of 2R, and rank j·U + u piece u of U of each. `rank`:
        another rank's (default this one's)."""
        ring = self.size // self.a2a
        j, u = divmod(self.comm.rank if rank is None else rank, self.a2a)
        chunk = length // (2 * ring)
        piece = chunk // self.a2a
        front, back = j * chunk + u * piece, (2 * ring - 1 - j) * chunk + u * piece
        return torch.cat([torch.arange(front, front + piece, device=device),
                          torch.arange(back, back + piece, device=device)])

    def split(self, idx: torch.Tensor, documents: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, T) token ids -> this rank's (B, T/C) and their positions (with `documents`, the
        (B, T) positions within each document: this rank's of those); or, when this forward
        does not split, the ids unchanged and None."""
        length = idx.shape[1]
        self.sharded = self.enabled and length % (2 * self.size) == 0
        self.documents = documents if self.sharded else None
        if not self.sharded:
            return idx, None
        positions = self.positions(length, idx.device)
        return idx[:, positions], positions if documents is None else documents[:, positions]

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """The same cut of another (B, T, ...) tensor of this forward (the targets)."""
        return x[:, self.positions(x.shape[1], x.device)] if self.sharded else x

    @contextlib.contextmanager
    def whole_sequences(self) -> Iterator[None]:
        """Forwards inside compute the whole sequence on every rank (generation)."""
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True


# ---------------------------------------------------------------------------------------------
# Merging a block's partial attention (the block kernels: parallel/context/ring_blocks.py)


def _merge(out, lse, block_out, block_lse, rows: slice):
    """Fold a block's partial attention into the running output (fp32) for query rows `rows`."""
    o, l = out[:, :, rows], lse[:, :, rows]
    new = torch.logaddexp(l, block_lse)
    o.mul_((l - new).exp().unsqueeze(-1)).add_(block_out.float() * (block_lse - new).exp().unsqueeze(-1))
    l.copy_(new)


# ---------------------------------------------------------------------------------------------
# The ring


def _ring(kv: torch.Tensor, cp: CPState):
    """(kind, source rank, block) for each hop of the ring: this rank's key/value block first, then each
    one received, the next already in flight while the caller computes on the one in hand.
    kind: 'diagonal' (own block, causal), 'front' (a block from an earlier rank: every query
    against its front chunk) or 'back' (from a later rank: our back chunk's queries against
    both its chunks)."""
    for step in range(cp.size):
        if step < cp.size - 1:
            incoming = torch.empty_like(kv)
            pending = cp.comm.shift(kv, incoming)
        src = (cp.comm.rank - step) % cp.size
        yield ("diagonal" if step == 0 else "front" if src < cp.comm.rank else "back"), src, kv
        if step < cp.size - 1:
            pending.wait()
            kv = incoming


def _parts(kind: str, half: int) -> tuple[slice, slice]:
    """(query rows, key rows) a hop computes."""
    return {"diagonal": (slice(None), slice(None)), "front": (slice(None), slice(None, half)),
            "back": (slice(half, None), slice(None))}[kind]


def _rows(t: torch.Tensor, rows: slice) -> torch.Tensor:
    return t[:, :, rows].contiguous()  # the whole tensor itself when rows is everything


class _Masks:
    """Per-hop masks of a ring whose attention is more than causal: which of our queries may see
    which of the source rank's keys — same document (every rank holds the whole sequence's
    document positions, so nothing travels for them) and, with a sliding window, within it.
    None of this exists for the plain causal ring (masks() then gives None)."""

    def __init__(self, cp: CPState, length: int, documents: torch.Tensor | None, window: int):
        self.cp, self.length, self.window = cp, length, window
        self.docs = None if documents is None else document_ids(documents)  # (B, T)

    def hop(self, src: int, rows: slice, keys: slice, device) -> BlockMask:
        """The mask of our queries `rows` against source rank `src`'s keys `keys` (built by the
        block kernel a tile at a time: parallel/context/ring_blocks.py)."""
        qpos = self.cp.positions(self.length, device)[rows]
        kpos = self.cp.positions(self.length, device, rank=src)[keys]
        return BlockMask(qpos, kpos, self.window, self.docs)


def _masks(cp: CPState, q: torch.Tensor, documents, window: int) -> _Masks | None:
    length = q.shape[2] * cp.size
    window = window if 0 < window < length else 0
    return _Masks(cp, length, documents, window) if documents is not None or window else None


def ring_forward(q, k, v, cp: CPState, scale: float, documents, window: int, softcap: float = 0.0):
    """The ring's forward: this rank's output (q's dtype) and its queries' log-sum-exp (fp32)."""
    groups, half = q.shape[1] // k.shape[1], q.shape[2] // 2
    masks = _masks(cp, q, documents, window)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    for kind, src, block in _ring(torch.stack([k, v]), cp):  # one buffer per hop
        rows, keys = _parts(kind, half)
        mask = masks.hop(src, rows, keys, q.device) if masks else None
        o, block_lse = block_forward(_rows(q, rows), expand_kv(_rows(block[0], keys), groups),
                                     expand_kv(_rows(block[1], keys), groups), kind == "diagonal", scale,
                                     mask, softcap)
        _merge(out, lse, o, block_lse, rows)
    return out.to(q.dtype), lse


def ring_backward(dout, q, k, v, out, lse, cp: CPState, scale: float, documents, window: int,
                  softcap: float = 0.0):
    """dq, dk, dv of this rank's chunks: the blocks pass around the ring again, their key/value
    gradients (fp32) travelling with them."""
    groups, half = q.shape[1] // k.shape[1], q.shape[2] // 2
    masks = _masks(cp, q, documents, window)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=q.device)  # travels with its block
    for kind, src, block in _ring(torch.stack([k, v]), cp):
        rows, keys = _parts(kind, half)
        mask = masks.hop(src, rows, keys, q.device) if masks else None
        gq, gk, gv = block_backward(_rows(dout, rows), _rows(q, rows), expand_kv(_rows(block[0], keys), groups),
                                    expand_kv(_rows(block[1], keys), groups), _rows(out, rows),
                                    _rows(lse, rows), kind == "diagonal", scale, mask, softcap)
        dq[:, :, rows] += gq
        dkv[0, :, :, keys] += fold_kv(gk, groups)
        dkv[1, :, :, keys] += fold_kv(gv, groups)
        # The block's gradient moves on with it; after the last hop it reaches its owner.
        arriving = torch.empty_like(dkv)
        cp.comm.shift(dkv, arriving).wait()
        dkv = arriving
    return dq.to(q.dtype), dkv[0].to(k.dtype, copy=True), dkv[1].to(v.dtype, copy=True)  # not views of one buffer


context_ops.RING.update(forward=ring_forward, backward=ring_backward)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: CPState,
                   scale: float | None = None, documents: torch.Tensor | None = None,
                   window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of this rank's queries (B, h, T/C, d) over the whole sequence, whose
    keys/values (B, h_kv, T/C, d) are spread over the group in the load-balanced layout;
    `scale` of q·k, None = 1/√d. `documents` (B, T): the whole sequence's positions within
    their documents (attention kept inside each); `window` > 0: query i sees keys j > i - window;
    `softcap` > 0: scores soft-capped, c·tanh(s/c) (Gemma 2).
    One custom op (parallel/context/ops.py), so a compiled block holds the ring as one node."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return context_ops.ring_attention_op(q, k, v, cp.key, scale, documents, window, softcap)[0]


class RingAttention(nn.Module):
    """Replaces a Decoder block's core attention (models/decoder.py CausalAttention): the ring
    when this forward is split, the plain kernel otherwise."""

    def __init__(self, cp: CPState, scale: float | None = None, window: int = 0, softcap: float = 0.0):
        super().__init__()
        self.cp = cp
        self.scale = scale
        """Of q·k (model.attention_scale); None = 1/√d."""
        self.window = window
        """This block's sliding window (model.sliding_window on the blocks that slide), or 0."""
        self.softcap = softcap
        """model.attn_softcap (Gemma 2), or 0."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: AttentionMask | None = None) -> torch.Tensor:
        """`mask`: the whole sequence's (models/attention.py), for the unsplit forwards; split,
        the ring builds its own per hop from the document positions and the window."""
        if self.cp.sharded:
            return ring_attention(q, k, v, self.cp, self.scale, self.cp.documents, self.window, self.softcap)
        return attend(q, k, v, mask, self.scale, self.softcap)


class UlyssesAttention(nn.Module):
    """Replaces a Decoder block's core attention (models/decoder.py CausalAttention) when
    parallel.cp_mode is 'ulysses' or 'hybrid': heads exchanged for the sequence, then the
    one-process kernel (Ulysses) or the ring over the all-to-all groups (hybrid), and back."""

    def __init__(self, cp, a2a: Comm, ring=None, scale: float | None = None, softcap: float = 0.0,
                 window: int = 0):
        super().__init__()
        self.cp, self.a2a, self.ring = cp, a2a, ring
        """cp: the whole group's CPState (is this forward split?); a2a: the all-to-all group;
        ring: the ring's CPState (hybrid) or None."""
        self.a2a_key = op_group(a2a)  # registered here, not inside a compiled forward
        self.scale, self.softcap, self.window = scale, softcap, window
        """window: this block's sliding window for the hybrid's ring (Ulysses alone takes the
        Decoder's whole-sequence mask)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: AttentionMask | None = None) -> torch.Tensor:
        """q (B, h, t, d), k, v (B, h_kv, t, d): this rank's tokens; `mask` the whole sequence's
        (the Decoder builds it for all T tokens)."""
        if not self.cp.sharded:
            return attend(q, k, v, mask, self.scale, self.softcap)
        U = self.a2a.size
        q, k, v = heads_to_sequence([q, replicate_kv(k, U), replicate_kv(v, U)], self.a2a, self.a2a_key)
        if self.ring is None:  # the whole sequence for h/U heads: the one-process kernel and mask
            y = attend(q, k, v, mask, self.scale, self.softcap)
        else:
            y = ring_attention(q, k, v, self.ring, self.scale, self.cp.documents, self.window, self.softcap)
        return sequence_to_heads(y, self.a2a, self.a2a_key)  # (B, h, t, d)


def apply_cp(model: nn.Module, comm: Comm, mode: str = "ring", ulysses: int = 0) -> CPState | None:
    """Give a meta-device Decoder its context-parallel group: the forward splits the sequence
    (Decoder.forward asks `model.context`), and every block's attention runs the ring
    (parallel.cp_mode = 'ring'), the all-to-all over heads ('ulysses') or both ('hybrid', an
    all-to-all degree of `ulysses`: parallel/context/ulysses.py)."""
    from shardlm.config.layout_rules import cp_degrees
    from shardlm.models.decoder import Decoder

    if comm.size == 1:
        return None
    if not isinstance(model, Decoder):
        raise ConfigError(f"parallel.cp > 1 needs shardlm's Decoder (got {type(model).__name__}): "
                          f"context parallelism of transformers models is not supported yet; use cp = 1")
    if mode not in ("ring", "ulysses", "hybrid"):
        raise ConfigError(f"parallel.cp_mode = {mode!r} reached apply_cp: 'auto' is decided before "
                          f"the run is built (resolve.decide); choose 'ring', 'ulysses' or 'hybrid'")
    a2a, ring = cp_degrees(comm.size, mode, ulysses)
    cp = CPState(comm, a2a=a2a)
    a2a_comm, ring_comm = (comm, None) if ring == 1 else (None, comm) if a2a == 1 else hybrid_groups(comm, a2a)
    window = model.cfg.sliding_window
    for block in model.blocks:
        core = block.attn.core
        slide = window if getattr(block, "sliding", False) else 0
        ring_state = None if ring_comm is None else cp if a2a == 1 else CPState(ring_comm)
        block.attn.core = (RingAttention(cp, core.scale, slide, core.softcap) if a2a == 1 else
                           UlyssesAttention(cp, a2a_comm, ring_state, core.scale, core.softcap, slide))
    model.context = cp
    log.info("context parallel: %d ranks, %s, sequence in %d load-balanced chunks", comm.size,
             {"ring": "ring attention", "ulysses": "all-to-all over heads (Ulysses)",
              "hybrid": f"all-to-all over {a2a} ranks, ring over {ring} (hybrid)"}[mode], 2 * comm.size)
    return cp
