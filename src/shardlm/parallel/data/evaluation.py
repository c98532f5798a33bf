"""Evaluation metrics as sums, so that they add up across micro-batches and ranks.

A micro-batch contributes three numbers over its targets that carry loss (target != -100):
the summed cross-entropy, how many the argmax of the logits predicts, and how many there are.
Ranks and batches add these sums (an all-reduce of three numbers) and the metrics come from the
totals: loss = sum / count, perplexity = exp(loss), token accuracy = correct / count. A mean of
per-batch (or per-rank) means would weight a batch with few loss tokens (SFT rows, a rank's
short share) as much as a full one; the sums weight every target once.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from shardlm.comm.watchdog import watched
from shardlm.data.packed import counted_targets
from shardlm.data.sft import IGNORE


def token_sums(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(…, V) logits and (…) targets -> float64 [summed cross-entropy, correct, targets], over
    the targets != -100. The softmax in fp32 (as the training loss); argmax ties go to the
    lowest id (torch.argmax). Logits of the counted positions only (PackedTokens.counted) take
    those targets."""
    targets = counted_targets(logits, targets, IGNORE)
    logits = logits.float().flatten(0, -2)  # (N, V)
    targets = targets.flatten()  # (N,)
    keep = targets != IGNORE
    loss = F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum")
    correct = ((logits.argmax(dim=-1) == targets) & keep).sum()
    return torch.stack([loss.double(), correct.double(), keep.sum().double()])


def metrics_of(sums: torch.Tensor | list[float]) -> dict[str, float]:
    """The JSONL's val_loss, val_perplexity and val_token_accuracy from summed token_sums."""
    loss_sum, correct, count = (float(v) for v in sums)
    if count <= 0:
        raise ValueError("no validation target carries loss: nothing to evaluate")
    loss = loss_sum / count
    # exp overflows past ~709 (a diverged model): report inf rather than raise.
    perplexity = math.exp(loss) if loss < 709.0 else math.inf
    return {"val_loss": loss, "val_perplexity": perplexity, "val_token_accuracy": correct / count}


def global_target_counts(targets: list[torch.Tensor], group, copies: int, device: torch.device,
                         watchdog=None) -> tuple[float, float]:
    """(targets that carry loss, all targets) of the global batch: this rank's micro-batches'
    `targets` summed over `group`, the ranks whose gradients are summed (the data- and context-
    parallel ranks of a stage and tensor-parallel position; under local SGD, of one replica).
    Each of the `copies` context-parallel ranks holds its micro-batches' whole targets, so the
    sum counts them that many times. One all-reduce of two numbers, before the step's forwards
    (train/step.py train_step: the global-batch loss)."""
    counts = torch.tensor([float(sum(int((y != IGNORE).sum()) for y in targets)),
                           float(sum(y.numel() for y in targets))], dtype=torch.float64, device=device)
    if group is not None:  # not model communication: not in the ledger
        with watched(watchdog, "all_reduce(target counts)", "dp", counts.numel() * 8):
            torch.distributed.all_reduce(counts, group=group)
    kept, total = (float(v) / copies for v in counts.tolist())
    return kept, total
