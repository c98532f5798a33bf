"""Muon on the ZeRO engine's flat shards (train.optimizer = 'muon'), stages 0-3.

Muon orthogonalises whole matrices; a ZeRO rank holds a contiguous slice of each unit's flat
buffer. Per unit, each step:

    1. every rank updates the Nesterov momentum of its own slice (element-wise, as AdamW's
       moments are: the momentum is sharded like them and checkpointed as
       optim/momentum_buffer/<name>) and writes the direction g + mu buf into a shard buffer
    2. all_gather of that direction over the unit's shard group (stages 1-3; stage 0 already
       holds it whole): one call per unit, Ψ_unit elements
    3. each Muon matrix has ONE owning rank (assign_owners: balanced by Newton-Schulz work,
       largest first, within the unit and then across units): it runs
       Newton-Schulz on the whole matrix and writes 0.2 sqrt(max(A, B)) O into an otherwise
       zero update buffer. A matrix tensor parallelism cut is first gathered whole over the tp
       group (one all_gather per unit, `tp.muon` in the ledger) and each tp rank keeps its piece
       of the whole update (_orthogonalise)
    4. reduce_scatter of the update buffer (stage 0: all_reduce): each element has one
       non-zero addend, so the sum is exact and every rank receives its slice of every update
    5. the gradient of the Muon elements is zeroed before the tier's AdamW runs: with zero
       gradient and zero moments, AdamW moves them only by its decoupled weight decay
       W (1 - lr wd) — Muon's own decay — and after it the update is applied, W -= lr U

The collectives are recorded in the engine's CommLedger under the group's name + '.muon'
(e.g. all_gather/dp_shard.muon), so a step's record shows what Muon costs.

Known costs: the tier still holds AdamW moments (zeros) for the Muon elements; the units are
processed one after another, each collective waited on before the next (no overlap), which
bounds the transient memory to one unit's gathered directions and updates (2 Ψ_unit fp32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardlm.checkpoint.sharded import StateSlice
from shardlm.comm.collectives import Comm
from shardlm.config.schema import TrainConfig
from shardlm.models.placement import Split
from shardlm.parallel.data.zero.optim import fused_parts, orthogonalise


@dataclass
class _Matrix:
    name: str
    shape: tuple[int, int]
    """This rank's piece (the whole matrix unless tensor parallelism cut it)."""
    offset: int
    """In the unit's flat buffer."""
    owner: int
    """The rank of the unit's group that orthogonalises it."""
    cut: Split | None = None
    """Tensor parallelism's cut (placement.Split) of the whole matrix, or None."""
    pieces: tuple = ()
    """With a cut: each tp rank's ranges along cut.dim, in tp rank order."""

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def whole(self) -> tuple[int, int]:
        return self.cut.shape if self.cut is not None else self.shape


class _UnitMuon:
    def __init__(self, unit, matrices: list[_Matrix], comm: Comm, whole: bool):
        self.unit, self.matrices, self.comm, self.whole = unit, matrices, comm, whole
        # Each matrix's part of this rank's shard: (matrix, start, end) in shard coordinates.
        cuts = [(m, max(m.offset, unit.lo) - unit.lo, min(m.offset + m.numel, unit.hi) - unit.lo)
                for m in matrices]
        self.local = [(m, a, b) for m, a, b in cuts if a < b]
        self.momentum = torch.zeros(unit.hi - unit.lo, dtype=torch.float32,
                                    device=unit.flat_param.device)  # (shard,)
        self.update: torch.Tensor | None = None


def newton_schulz_cost(shape: tuple[int, int]) -> int:
    """Newton-Schulz's work on an A x B matrix, up to a constant: each iteration multiplies
    X Xᵀ (min² · max), its square (min³) and that by X (min² · max)."""
    small, large = sorted(shape)
    return small * small * large


def assign_owners(matrices: list[_Matrix], load: list[float]) -> None:
    """Each matrix of a unit to the rank with the least Newton-Schulz work in this unit, then in
    the units before it (`load`, updated): largest first (LPT), so a unit's slowest rank does as
    little as the sizes allow, and units take turns on the ranks (with more ranks than a unit
    has matrices, rank 4 of 8 orthogonalises some of the next unit's, not none)."""
    here = [0.0] * len(load)
    for m in sorted(matrices, key=lambda m: (-newton_schulz_cost(m.whole), m.offset)):
        rank = min(range(len(load)), key=lambda r: (here[r], load[r], r))
        m.owner = rank
        here[rank] += newton_schulz_cost(m.whole)
    for r, work in enumerate(here):
        load[r] += work


class ShardedMuon:
    """Muon's part of the engine's step (parallel/data/zero/engine.py calls before_step and after_step
    around the tier's AdamW)."""

    def __init__(self, engine, names: set[str], train: TrainConfig):
        self.engine, self.train = engine, train
        param_names = {id(p): n for n, p in engine.model.named_parameters()}
        whole = engine.opts.stage == 0  # stage 0: every rank's "shard" is the whole buffer
        self.parts = fused_parts(engine.model, train.muon_split_fused)  # whole matrices' rows
        # Tensor parallelism's cut matrices: gathered whole over the tp group before
        # Newton-Schulz (see _orthogonalise); every tp rank's ranges of each, learnt once.
        cuts = {n: engine.splits[n] for n in names if n in engine.splits}
        self.tp = (Comm(engine.mesh.tp_group, "tp.muon", engine.ledger, engine.watchdog)
                   if cuts and engine.tp_comm.size > 1 else None)
        pieces = self._tp_pieces(cuts) if self.tp is not None else {}
        self.units: list[_UnitMuon] = []
        load: dict[int, list[float]] = {}  # Newton-Schulz work given to each rank so far, by group size
        for unit in engine.units:
            matrices = [_Matrix(n, tuple(p.shape), off, 0, cuts.get(n) if pieces else None, pieces.get(n, ()))
                        for p, off in zip(unit.params, unit.layout.offsets)
                        if (n := param_names[id(p)]) in names]
            if not matrices:
                continue
            comm = Comm(unit.comm.group, unit.comm.name + ".muon", engine.ledger, engine.watchdog)
            assign_owners(matrices, load.setdefault(comm.size, [0.0] * comm.size))
            self.units.append(_UnitMuon(unit, matrices, comm, whole))

    def _tp_pieces(self, cuts: dict[str, Split]) -> dict[str, tuple]:
        """name -> each tp rank's ranges of that matrix along its cut dimension (setup only: one
        object gather over the tp group, outside the ledger)."""
        mine = {n: split.ranges for n, split in sorted(cuts.items())}
        every: list = [None] * self.tp.size
        torch.distributed.all_gather_object(every, mine, group=self.tp.group)
        return {n: tuple(ranks[n] for ranks in every) for n in mine}

    def before_step(self) -> None:
        """Steps 1-5 of the module docstring: every rank ends with its slice of each update."""
        t = self.train
        for u in self.units:
            grad = u.unit.grad_shard()  # (shard,) in the reduce dtype
            direction = torch.zeros_like(u.momentum)
            for _, a, b in u.local:
                g = grad[a:b].float()
                u.momentum[a:b].mul_(t.muon_momentum).add_(g)
                direction[a:b] = g.add(u.momentum[a:b], alpha=t.muon_momentum) if t.muon_nesterov else u.momentum[a:b]
                grad[a:b].zero_()  # AdamW now applies only the decoupled weight decay here
            padded = u.unit.layout.padded
            if u.whole:
                full = direction
            else:
                full = torch.empty(padded, dtype=torch.float32, device=direction.device)
                u.comm.all_gather(full, direction).wait()
            update = torch.zeros(padded, dtype=torch.float32, device=direction.device)
            self._orthogonalise([m for m in u.matrices if m.owner == u.comm.rank], full, update)
            if u.whole:
                u.comm.all_reduce(update).wait()
                u.update = update
            else:
                u.update = torch.empty_like(direction)
                u.comm.reduce_scatter(u.update, update, scratch_input=True).wait()

    def _orthogonalise(self, owned: list[_Matrix], full: torch.Tensor, update: torch.Tensor) -> None:
        """Newton-Schulz on each owned matrix's direction (in `full`, the unit's flat buffer),
        0.2 sqrt(max(A, B)) O written into `update`. A matrix tensor parallelism cut is first
        gathered whole over the tp group — its owner's tp peers are the owners of their pieces
        (owners follow whole shapes, the same on every tp rank), so the group gathers together,
        one call per unit — and each tp rank keeps its piece of the one whole result: exactly
        the one-process update, at tp times the Newton-Schulz work (each rank of the group
        orthogonalises the same whole matrix rather than wait on one that would)."""
        steps = self.train.muon_ns_steps
        cut = [m for m in owned if m.cut is not None]
        wholes = dict(zip((m.name for m in cut), self._gather_whole(cut, full))) if cut else {}
        for m in owned:
            direction = wholes.get(m.name)
            if direction is None:
                direction = full[m.offset:m.offset + m.numel].view(m.shape)
            o = orthogonalise(direction, steps, self.parts.get(m.name, ()))
            update[m.offset:m.offset + m.numel] = (m.cut.take(o) if m.cut is not None else o).view(-1)

    def _gather_whole(self, cut: list[_Matrix], full: torch.Tensor) -> list[torch.Tensor]:
        """The whole matrices of `cut` from every tp rank's pieces: one all_gather of this
        rank's pieces back to back (padded to the largest rank's total)."""
        def numel(m: _Matrix, ranges) -> int:
            return sum(hi - lo for lo, hi in ranges) * (m.whole[1 - m.cut.dim])

        sizes = [sum(numel(m, m.pieces[r]) for m in cut) for r in range(self.tp.size)]
        cap = max(sizes)
        mine = torch.zeros(cap, dtype=full.dtype, device=full.device)
        torch.cat([full[m.offset:m.offset + m.numel] for m in cut], out=mine[:sizes[self.tp.rank]])
        every = torch.empty(cap * self.tp.size, dtype=full.dtype, device=full.device)
        self.tp.all_gather(every, mine).wait()
        out = []
        starts = [r * cap for r in range(self.tp.size)]
        for m in cut:
            whole = torch.empty(m.whole, dtype=full.dtype, device=full.device)
            for r, ranges in enumerate(m.pieces):
                local = list(m.whole)
                local[m.cut.dim] = sum(hi - lo for lo, hi in ranges)
                piece = every[starts[r]:starts[r] + local[0] * local[1]].view(local)
                starts[r] += local[0] * local[1]
                at = 0
                for lo, hi in ranges:  # copies (kv heads every rank holds) are written alike
                    whole.narrow(m.cut.dim, lo, hi - lo).copy_(piece.narrow(m.cut.dim, at, hi - lo))
                    at += hi - lo
            out.append(whole)
        return out

    def after_step(self) -> None:
        """W -= lr U on this rank's masters (the tier already applied W (1 - lr wd)), then the
        compute-dtype parameters from them."""
        tier = self.engine.tier
        lr = tier.optimizer.param_groups[0]["lr"]
        starts = {}  # (unit id, segment's first element in shard coordinates) -> master index
        for i, (unit, local) in enumerate(self.engine.segments):
            starts.setdefault(id(unit), []).append((local.start, local.stop, i))
        for u in self.units:
            for _, a, b in u.local:  # a matrix lies in one segment: the decay one (it is 2-D)
                (lo, i), = [(lo, i) for lo, hi, i in starts[id(u.unit)] if lo <= a and b <= hi]
                tier.masters[i].data[a - lo:b - lo].add_(u.update[a:b], alpha=-lr)
            u.update = None
        tier.refresh_targets()

    def held_bytes(self) -> int:
        """The momentum this rank holds (fp32, its slice of each unit's Muon matrices)."""
        return sum(u.momentum.numel() * u.momentum.element_size() for u in self.units)

    @property
    def numel(self) -> int:
        """Elements the momentum spans before sharding: the whole (padded) flat buffer of each
        unit holding a Muon matrix — a block's norms ride along, a few hundred elements in
        ~10⁵ (tp / pp / ep: this rank's pieces)."""
        return sum(u.unit.layout.padded for u in self.units)

    def state_slices(self) -> list[StateSlice]:
        """The momentum this rank holds, as optim/momentum_buffer/<name> (the key the
        single-process optimizer checkpoints it under)."""
        out = []
        for u in self.units:
            for m, a, b in u.local:
                start = a + u.unit.lo - m.offset
                out.append(StateSlice(f"optim/momentum_buffer/{m.name}", m.shape, start,
                                      start + b - a, u.momentum[a:b]))
        return out
