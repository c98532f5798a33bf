"""ZeRO-3's fp8 all-gather (precision.fp8_all_gather): a block's FP8 linear weights travel in E4M3.

Followed: torchao's float8 training under FSDP2 — `Float8LinearConfig(enable_fsdp_float8_all_gather
=True)` with `precompute_float8_dynamic_scale_for_fsdp` (torchao/float8/fsdp_utils.py): one
all-reduce(max) of the weights' amaxes, then each rank casts its shard at the global scale and
the all-gather moves 1 byte per element instead of bf16's 2. Our code, our engine's units.

The FP8 linears' weights of a unit form a unit of their own (parallel/data/zero/units.py collect_units,
"<name>[fp8]"; LoRA's frozen base "<name>[fp8 frozen]", gathered the same way, no gradient
flowing to it): its flat buffer holds nothing else, so every rank's shard is rounded whole and
each rank sends the same bytes. The shard stays bf16 (the optimizer's target, as before). A
gather, in the shard group (unit.comm):

  1. each rank: max |w| over its piece of each weight, from the bf16 shard (fp32, one per weight)
  2. all_reduce(max) of those, one call for the unit: each weight's whole amax on every rank,
     so its tensorwise scale, E4M3.max / amax — the scale one process computes from the whole
     weight. Under tensor parallelism a weight is itself a piece of one process's (its rows or
     columns: parallel/tensor/decoder.py), so a second all_reduce(max) of the unit's amaxes, over the
     tp group, gives the whole weight's — what the tp layer's own quantiser reduces when it
     rounds the weight itself (Fp8Quantiser.share_amax); a weight the tp ranks hold whole (a
     replicated one) has the same amax on each of them, which the max keeps. Forward
     gathers only: backward's gather re-rounds at the forward's scales (the
     weights have not changed in between), as torchao's precomputed scale serves both
  3. each rank rounds its shard at its weights' scales (models/fp8.py round_to_fp8): element by
     element the arithmetic of rounding the whole weight, hence the same bits
  4. all_gather of the E4M3 bytes (uint8): 1 byte per element, `padded` bytes per gather

The layers' quantisers see the gathered bytes and scales through GatheredWeight views of this
unit's buffers (bound once; the buffers are freed and refilled like the flat parameters), and
multiply by them directly, not rounding again (models/fp8.py _Fp8Matmul). The bf16 flat buffer
of this unit is gathered only where whole parameters are asked for (ZeroEngine.full_parameters:
evaluation at the end, generation, export), where the layers then round it themselves.

Overflow / underflow counts (Fp8Stats): each rank counts its piece of each weight at step 3,
times the shard group's size: summed over the ranks (as the trainer sums them) that is each
rank counting every weight whole, what a run without fp8_all_gather reports.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardlm.comm.collectives import Comm
from shardlm.models.fp8 import E4M3, EPS, GatheredWeight, round_to_fp8


class _Fp8Handle:
    """The all-gather's handle: waiting makes the gathered bytes the layers' weights (live)."""

    def __init__(self, work, gather: "Fp8Gather", send: torch.Tensor):
        self.work, self.gather, self.send = work, gather, send

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
            self.gather.set_live(True)
            self.work = self.send = None  # the send buffer lives until the gather is complete
        return True


class Fp8Gather:
    """One [fp8] unit's E4M3 buffers and the pieces of its weights this rank's shard holds."""

    def __init__(self, unit) -> None:
        """`unit`: a parallel.data.zero.units.Unit whose parameters are all FP8 linear weights (its `refs`
        bound to modules holding an Fp8Quantiser `fp8`), its shard [unit.lo, unit.hi)."""
        layout, device = unit.layout, unit.flat_param.device
        self.shard_size = layout.shard_size
        # (weight index, start, end) in shard coordinates: the part of each weight held here
        self.pieces = [(i, max(off, unit.lo) - unit.lo, min(off + n, unit.hi) - unit.lo)
                       for i, (off, n) in enumerate(zip(layout.offsets, layout.numels))
                       if max(off, unit.lo) < min(off + n, unit.hi)]
        self.flat = torch.empty(layout.padded, dtype=torch.uint8, device=device)  # (padded,) E4M3 bytes
        self.scales = torch.ones(len(layout.numels), dtype=torch.float32, device=device)
        self.counts = torch.zeros(len(layout.numels), 3, dtype=torch.float32, device=device)
        self.weights: list[GatheredWeight] = []
        # tensor parallelism's max over the tp group (one reducer serves every weight: step 2)
        reducers = [m.fp8.amax_reducers.get("weight") for ref in unit.refs for m, _ in ref.places]
        self.tp_reduce = next((r for r in reducers if r is not None), None)
        for i, (ref, off) in enumerate(zip(unit.refs, layout.offsets)):
            data = self.flat[off:off + ref.param.numel()].view(E4M3.dtype).view(ref.param.shape)
            weight = GatheredWeight(data, self.scales[i], self.counts[i])
            for module, _ in ref.places:
                module.fp8.gathered = weight
            self.weights.append(weight)
        self.free()

    def set_live(self, live: bool) -> None:
        for weight in self.weights:
            weight.live = live

    def free(self) -> None:
        self.set_live(False)
        self.flat.untyped_storage().resize_(0)

    def start(self, comm: Comm, shard: torch.Tensor, rescale: bool) -> _Fp8Handle:
        """Round `shard` (shard_size,) bf16 to E4M3 and launch the all-gather of the bytes over
        `comm`; `rescale`: first the weights' scales from their amaxes now (a forward's gather),
        else the last ones (backward's)."""
        self.flat.untyped_storage().resize_(self.flat.numel())
        if rescale:
            amaxes = torch.zeros_like(self.scales)  # a weight this rank holds none of: 0
            for i, lo, hi in self.pieces:
                amaxes[i] = shard[lo:hi].abs().amax().float()
            # a NaN piece as +inf: a max over ranks need not carry NaN, and a non-finite weight
            # must stay visible (its scale becomes 0, its non-finite elements NaN)
            comm.all_reduce(amaxes.nan_to_num_(nan=float("inf")), op=dist.ReduceOp.MAX).wait()
            if self.tp_reduce is not None:  # each weight a tp piece: the max over the tp group too
                amaxes = self.tp_reduce(amaxes)
            # the whole weight's scale, as Fp8Quantiser.scale computes it from its amax
            self.scales.copy_(E4M3.max / amaxes.clamp_min(EPS))
        send = torch.zeros(self.shard_size, dtype=torch.uint8, device=shard.device)  # padding: 0
        counts = torch.zeros_like(self.counts)  # counted in forward; backward's are the same
        for i, lo, hi in self.pieces:
            q, clamped_and_lost = round_to_fp8(shard[lo:hi], E4M3, self.scales[i], count=rescale)
            send[lo:hi] = q.view(torch.uint8)
            if rescale:
                counts[i, :2], counts[i, 2] = clamped_and_lost.float(), hi - lo  # overflow, underflow, elements
        if rescale:
            self.counts.copy_(counts * comm.size)
        return _Fp8Handle(comm.all_gather(self.flat, send), self, send)
