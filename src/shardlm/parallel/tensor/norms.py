"""OLMo-2's (and OLMoE's) query/key RMSNorm over the whole projection (model.qk_norm_width =
'all') under tensor parallelism.

The norm of q (B, T, nh·hs) divides by sqrt(mean over all nh·hs features of q² + eps), but a
tensor-parallel rank holds only its heads' nh/T·hs features (parallel/tensor/decoder.py: q/k/v is
column-parallel). So each rank sums the squares of its own features, the sums are all-reduced
over the tensor-parallel group, and the mean is that sum over the whole width; each rank then
scales its own features by its slice of the norm's weight (cut with the heads: tp.splits).

    s_r = Σ_local q²  ->  S = Σ_r s_r (all-reduce)  ->  q_r · rsqrt(S / width + eps) · w_r

Backward: every rank's loss reaches S through its own heads only, so the gradient of S is the
group's sum of the ranks' gradients: an all-reduce forward and an all-reduce backward. The
weight's slice is this rank's alone (no gradient to sum). Sequence parallelism changes nothing
here: attention runs on the whole sequence (the activations are gathered before q/k/v).
"""

from __future__ import annotations

import torch
from torch import nn

from shardlm.parallel.tensor.ops import all_reduce


class _SumOverGroup(torch.autograd.Function):
    """The group's sum forward and the group's sum of the gradient backward: a value every
    rank uses (each through its own part of the model) that every rank contributes to."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class SplitWidthNorm(nn.Module):
    """An RMSNorm (or Gemma-style (1 + w) one) over a width that tensor parallelism splits:
    this rank's `local` features of `width`, the mean of squares summed over `group` (a
    collective_ops group key); `norm`'s weight already this rank's slice (on the meta device)."""

    def __init__(self, norm: nn.Module, width: int, group: str, offset: bool = False) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps, self.width, self.group, self.offset = norm.eps, width, group, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()  # (B, T, local): fp32 sums, as nn.RMSNorm's and transformers' fp32 math
        squares = _SumOverGroup.apply(x32.pow(2).sum(-1, keepdim=True), self.group)  # (B, T, 1)
        normed = x32 * torch.rsqrt(squares / self.width + self.eps)
        w = 1.0 + self.weight.float() if self.offset else self.weight.float()
        return (normed * w).type_as(x)

    def extra_repr(self) -> str:
        return f"width={self.width} (this rank's {self.weight.shape[0]}), eps={self.eps}"


def split_qk_norms(attn: nn.Module, pre: str, qkv_ranges: list[tuple[int, int]], tp) -> None:
    """Replace `attn`'s whole-width q_norm and k_norm (named `pre`.attn.*) by SplitWidthNorms
    over this rank's heads, recording each weight's Split in tp.splits (a parallel.tensor
    TPState). `qkv_ranges`: this rank's rows of the fused q/k/v (q's, then k's, then v's)."""
    from shardlm.models.decoder import OffsetRMSNorm
    from shardlm.models.placement import Split

    (q_lo, q_hi), (k_lo, k_hi) = qkv_ranges[0], qkv_ranges[1]
    nq = attn.q_norm.weight.shape[0]  # the whole widths, on the meta device
    nkv = attn.k_norm.weight.shape[0]
    k_lo, k_hi = k_lo - nq, k_hi - nq  # k's rows follow q's in the fused projection
    for name, width, lo, hi in (("q_norm", nq, q_lo, q_hi), ("k_norm", nkv, k_lo, k_hi)):
        norm = getattr(attn, name)
        offset = isinstance(norm, OffsetRMSNorm)
        norm.weight = nn.Parameter(torch.empty(hi - lo, device="meta"),
                                   requires_grad=norm.weight.requires_grad)
        setattr(attn, name, SplitWidthNorm(norm, width, tp.group, offset))
        tp.splits[f"{pre}.attn.{name}.weight"] = Split((width,), 0, ((lo, hi),))
