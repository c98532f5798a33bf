"""Token ids of rows that pack several documents, with each token's position in its document.

The data loader makes them (data.document_mask: shardlm.data.loader), our Decoder takes them as
its input ids (models/decoder.py): positions restart at 0 at each document's first token, and
attention stays inside each document (models/attention.py). One object travels where token ids
travel — through the training step, evaluation and every pipeline stage — as torch's
PackedSequence does for RNNs. Below both data and models in the import contract.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedTokens:
    ids: torch.Tensor
    """(B, T) int64 token ids."""
    positions: torch.Tensor
    """(B, T) int64: each token's position in its document, 0 where a document starts (the
    first token of every row counts as a start)."""
    counted: torch.Tensor | None = None
    """(B, T) bool, rows with a loss mask (chat / prompt-completion SFT): True where the token's
    target carries loss. Our Decoder then runs its head on those positions only, and returns
    their logits as (1, N, vocab) in row order (the targets' `y[y != -100]`): no other
    position's logits reach the loss (Parallelized.loss realigns the targets)."""

    def __post_init__(self) -> None:
        if self.ids.shape != self.positions.shape or self.ids.dim() != 2:
            raise ValueError(f"PackedTokens: ids {tuple(self.ids.shape)} and positions "
                             f"{tuple(self.positions.shape)} must both be (batch, seq_len)")
        if self.counted is not None and self.counted.shape != self.ids.shape:
            raise ValueError(f"PackedTokens: counted {tuple(self.counted.shape)} must be ids' shape "
                             f"{tuple(self.ids.shape)}")

    @property
    def shape(self) -> torch.Size:
        return self.ids.shape

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "PackedTokens":
        return PackedTokens(self.ids.to(device, non_blocking=non_blocking),
                            self.positions.to(device, non_blocking=non_blocking),
                            None if self.counted is None else self.counted.to(device, non_blocking=non_blocking))


def counted_targets(logits: torch.Tensor, targets: torch.Tensor, ignore: int) -> torch.Tensor:
    """`targets` (B, T) aligned with `logits`: as they are, or, where the head ran on the
    counted positions only ((1, N, vocab): PackedTokens.counted), the N counted targets in row
    order as (1, N)."""
    if logits.shape[:-1] == targets.shape:
        return targets
    kept = targets[targets != ignore].unsqueeze(0)  # (1, N)
    if kept.shape != logits.shape[:-1]:
        raise ValueError(f"logits {tuple(logits.shape)} match neither the targets {tuple(targets.shape)} "
                         f"nor their {kept.shape[1]} counted positions")
    return kept


def positions_from_starts(starts: torch.Tensor) -> torch.Tensor:
    """(B, T) position of each token in its document, from a boolean (B, T) that is True at each
    document's first token (column 0 always counts as one)."""
    starts = starts.clone()
    starts[:, 0] = True
    index = torch.arange(starts.shape[1], device=starts.device).expand_as(starts)
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - first
