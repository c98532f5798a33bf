"""Where a rank's piece of a parameter sits in the whole tensor: the one description that
initialisation, checkpoints and export share, whatever axis cut the tensor.

Tensor parallelism cuts a parameter along one dimension into pieces that may be several index
ranges concatenated (a fused q/k/v projection keeps this rank's query heads, then its key heads,
then its value heads). `Split(shape, dim, ranges)` says exactly that; a parameter without a
Split is whole on this rank (replicated across the tensor-parallel group).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def even_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """[lo, hi) of part `index` when n items are cut into `parts` contiguous parts whose sizes
    differ by at most one (the first n % parts parts get the extra item)."""
    base, extra = divmod(n, parts)
    lo = index * base + min(index, extra)
    return lo, lo + base + (1 if index < extra else 0)


@dataclass(frozen=True)
class Split:
    """This rank's piece of a tensor of `shape`: along `dim`, the concatenation of the index
    ranges `ranges` ([lo, hi) each); every other dimension whole."""

    shape: tuple[int, ...]
    dim: int
    ranges: tuple[tuple[int, int], ...]
    copies: tuple[int, ...] = ()
    """Indices of `ranges` every rank of the group holds the same values of (key/value heads
    replicated when tp > n_kv_heads): like a replicated parameter, tp rank 0 alone saves them and
    counts them in the gradient norm."""

    @property
    def local_shape(self) -> tuple[int, ...]:
        out = list(self.shape)
        out[self.dim] = sum(hi - lo for lo, hi in self.ranges)
        return tuple(out)

    def take(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the whole tensor (a new contiguous tensor)."""
        if tuple(whole.shape) != self.shape:
            raise ValueError(f"expected the whole tensor of shape {self.shape}, got {tuple(whole.shape)}")
        return torch.cat([whole.narrow(self.dim, lo, hi - lo) for lo, hi in self.ranges],
                         dim=self.dim).contiguous()

    def global_index(self, local_flat: torch.Tensor) -> torch.Tensor:
        """Flat indices into the whole tensor of the given flat indices into this piece
        (int64 in, int64 out): how a checkpoint maps a ZeRO shard of a piece to the whole."""
        local_shape = self.local_shape
        inner = math.prod(local_shape[self.dim + 1:])
        along = (local_flat // inner) % local_shape[self.dim]
        outer = local_flat // (inner * local_shape[self.dim])
        # Map the index along `dim` through the ranges.
        starts = torch.tensor([lo for lo, _ in self.ranges], dtype=torch.int64)
        sizes = torch.tensor([hi - lo for lo, hi in self.ranges], dtype=torch.int64)
        offsets = torch.cumsum(sizes, 0) - sizes  # where each range starts in the piece
        which = torch.searchsorted(offsets, along, right=True) - 1
        global_along = starts[which] + (along - offsets[which])
        rest = local_flat % inner
        return (outer * self.shape[self.dim] + global_along) * inner + rest

    def owned(self, tp_rank: int) -> list[tuple[int, int]]:
        """[start, end) spans of this piece, flattened, that this rank saves and counts: all of
        it on tp rank 0, else all but the copies (a cut along dim 0: each range is one span)."""
        if tp_rank == 0 or not self.copies:
            return [(0, math.prod(self.local_shape))]
        if self.dim != 0:
            raise ValueError("replicated ranges are supported along dim 0 only")
        inner, out, at = math.prod(self.shape[1:]), [], 0
        for i, (lo, hi) in enumerate(self.ranges):
            if i not in self.copies:
                out.append((at * inner, (at + hi - lo) * inner))
            at += hi - lo
        return out

    def runs(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """Elements [start, end) of this piece flattened, as runs contiguous in the whole
        tensor flattened: (whole_start, whole_end, piece_start) each. A cut along dim 0 gives
        one run per range touched; a cut along a later dim one per row touched."""
        if start >= end:
            return []
        index = self.global_index(torch.arange(start, end, dtype=torch.int64))
        jumps = index[1:] - index[:-1] != 1
        if self.copies:  # a copy never shares a run with what is owned, even where they touch
            inner, at = math.prod(self.shape[1:]), 0
            for lo, hi in self.ranges[:-1]:
                at += (hi - lo) * inner
                if start < at < end:
                    jumps[at - start - 1] = True
        breaks = (torch.nonzero(jumps).flatten() + 1).tolist()
        bounds = [0, *breaks, end - start]
        return [(int(index[a]), int(index[b - 1]) + 1, start + a) for a, b in zip(bounds, bounds[1:])]
