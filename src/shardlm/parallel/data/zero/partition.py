"""Pure shard arithmetic: where each parameter sits in its unit's flat buffer, which slice each
rank owns, and the ZeRO paper's per-rank memory and communication predictions. No tensors.

A unit's flat buffer holds its parameters back to back — those that take weight decay first,
then those that do not — padded so it splits into `shard_world` equal shards. Decay-first means
any rank's shard meets at most two optimizer groups: one contiguous decay segment and one
no-decay segment.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Segment:
    start: int
    """Offset in the unit's flat buffer."""
    end: int
    decay: bool

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class UnitLayout:
    numels: tuple[int, ...]
    """Elements of each parameter, in flat-buffer order (decay ones first)."""
    decay: tuple[bool, ...]
    shard_world: int

    @property
    def offsets(self) -> tuple[int, ...]:
        out, at = [], 0
        for n in self.numels:
            out.append(at)
            at += n
        return tuple(out)

    @property
    def total(self) -> int:
        return sum(self.numels)

    @property
    def padded(self) -> int:
        """Smallest multiple of shard_world >= total: every shard the same size, so one
        all-gather / reduce-scatter call moves the whole unit."""
        return -(-self.total // self.shard_world) * self.shard_world

    @property
    def shard_size(self) -> int:
        return self.padded // self.shard_world

    @property
    def decay_end(self) -> int:
        return sum(n for n, d in zip(self.numels, self.decay) if d)

    def shard_range(self, shard_rank: int) -> tuple[int, int]:
        start = shard_rank * self.shard_size
        return start, start + self.shard_size

    def segments(self, shard_rank: int) -> list[Segment]:
        """The non-empty parts of this rank's shard that hold parameters (padding excluded),
        split at the decay / no-decay boundary."""
        lo, hi = self.shard_range(shard_rank)
        parts = [Segment(max(lo, 0), min(hi, self.decay_end), True),
                 Segment(max(lo, self.decay_end), min(hi, self.total), False)]
        return [s for s in parts if s.numel > 0]


def layout_for(numels: list[int], decay: list[bool], shard_world: int) -> tuple[UnitLayout, list[int]]:
    """The layout and the order (indices into the inputs) parameters take in the flat buffer."""
    order = [i for i, d in enumerate(decay) if d] + [i for i, d in enumerate(decay) if not d]
    layout = UnitLayout(tuple(numels[i] for i in order), tuple(decay[i] for i in order), shard_world)
    return layout, order


def model_state_bytes(psi: int, shard_world: int, stage: int, param_bytes: int, grad_bytes: int,
                      optim_bytes: int) -> dict[str, float]:
    """Per-rank model-state bytes by category (ZeRO paper, section 5). With bf16 parameters and
    gradients and fp32 master + Adam moments (2, 2, 12) this is the paper's table:
    16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N."""
    n = shard_world
    return {"params": param_bytes * psi / (n if stage >= 3 else 1),
            "grads": grad_bytes * psi / (n if stage >= 2 else 1),
            "optimizer": optim_bytes * psi / (n if stage >= 1 else 1)}


def comm_bytes_per_step(psi: int, stage: int, param_bytes: int, grad_bytes: int,
                        reshard_after_forward: bool = True, micro_steps: int = 1,
                        shard_world: int = 1, dp_replicate: int = 1, pipeline: bool = False) -> float:
    """Data volume per rank per step, counted as the ZeRO paper does: an all-reduce of Ψ
    elements moves 2Ψ (a reduce-scatter plus an all-gather), each of those Ψ.
    Stage 0: all-reduce gradients (2Ψ). Stages 1-2: reduce-scatter gradients, all-gather updated
    parameters (2Ψ). Stage 3: all-gather parameters for forward and again for backward, reduce-
    scatter gradients (3Ψ; 2Ψ without reshard after forward) — and the gathers repeat for every
    micro-step of gradient accumulation; on a `pipeline` stage (Ψ: the stage's) each unit is
    gathered once per step and held to the last micro-batch's backward (2Ψ, parallel/data/zero/params.py).
    Hybrid sharding adds an all-reduce of each rank's gradient shard across replicas (2Ψ/N)."""
    if stage == 0:
        return 2.0 * psi * grad_bytes
    replicas = 2.0 * psi / shard_world * grad_bytes if dp_replicate > 1 else 0.0
    if stage in (1, 2):
        return psi * (grad_bytes + param_bytes) + replicas
    gathers = 1 if pipeline else (2 if reshard_after_forward else 1) * micro_steps
    return psi * (gathers * param_bytes + grad_bytes) + replicas
