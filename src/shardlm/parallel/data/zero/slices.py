"""A ZeRO engine's checkpoint slices: every parameter's values and Adam moments this rank holds,
in the whole tensors' coordinates (checkpoint/sharded.py StateSlice), so a checkpoint is the same
at any layout — ZeRO shards, tensor- and expert-parallel pieces (placement.Split), frozen units.
Kept apart from parallel/data/zero/engine.py, which owns the buffers these slices view."""

from __future__ import annotations

import dataclasses
import functools

import torch

from shardlm.checkpoint.sharded import StateSlice, param_state


def engine_state_slices(engine, saving: bool = False) -> list[StateSlice]:
    """Per master segment, the parameters it overlaps, cut to the overlap, in the whole
    tensors' coordinates: a tensor-parallel piece's elements as the runs they make in the
    whole tensor (placement.Split.runs), so a checkpoint is the same at any layout.
    `saving`: leave out what another tensor-parallel rank writes (replicated parameters are
    written by tp rank 0 only)."""
    names = {id(p): n for n, p in engine.model.named_parameters()}
    out: list[StateSlice] = []
    for i, (unit, local) in enumerate(engine.segments):
        master, exp_avg, exp_avg_sq = engine.tier.segment_state(i)
        states = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        lo, hi = unit.lo + local.start, unit.lo + local.stop  # in the unit's flat buffer
        out += _unit_slices(engine, unit, lo, hi, master, states, names, saving)
    # Frozen parameters are saved too (a checkpoint is self-contained: it loads without the
    # model it was fine-tuned from), as the values in use, with no optimizer state.
    for unit in engine.frozen:
        if engine.opts.stage == 3:
            out += _unit_slices(engine, unit, unit.lo, unit.hi, unit.shard_param, {}, names, saving)
        elif not (saving and (engine.mesh.ep_shard_rank if unit.expert else engine.mesh.shard_rank)):
            # whole on every rank: the first shard rank writes it
            out += _unit_slices(engine, unit, 0, unit.layout.total, unit.flat_param, {}, names, saving,
                                whole=True)
    snapshot = engine.tier.snapshot() if saving else None
    if snapshot is not None:  # state in files: an asynchronous save copies it on its disk
        out = [dataclasses.replace(s, snapshot=functools.partial(snapshot.view_of, s.tensor))
               if snapshot.holds(s.tensor) else s for s in out]
    return out


def _unit_slices(engine, unit, lo: int, hi: int, master: torch.Tensor, states: dict,
                 names: dict[int, str], saving: bool, whole: bool = False) -> list[StateSlice]:
    """The state slices of `unit`'s parameters within [lo, hi) of its flat buffer, whose
    values `master` (and the moments in `states`) hold from lo on. `whole`: every rank of
    the shard group holds these values (a frozen unit below stage 3)."""
    out = []
    for param, offset, numel in zip(unit.params, unit.layout.offsets, unit.layout.numels):
        start, end = max(offset, lo), min(offset + numel, hi)
        if start >= end:
            continue
        name = names[id(param)]
        if saving and name in engine.copies:
            continue
        if saving and not whole and engine.opts.stage == 0 and engine.expert_splits and (
                engine.mesh.ep_shard_rank if unit.expert else engine.mesh.shard_rank):
            continue  # stage 0: another rank holding the same values writes them
        split = engine.splits.get(name) or engine.expert_splits.get(name)
        if split is None:
            if not (saving and engine.mesh.tp_rank != 0):
                out += param_state(name, tuple(param.shape), start - offset, end - offset,
                                   master, states, slice(start - lo, end - lo))
            continue
        for whole_start, whole_end, piece_start in split.runs(start - offset, end - offset):
            if saving and not any(a <= piece_start < b for a, b in split.owned(engine.mesh.tp_rank)):
                continue  # a copy another tensor-parallel rank writes
            at = offset + piece_start - lo  # in this segment
            out += param_state(name, split.shape, whole_start, whole_end, master, states,
                               slice(at, at + whole_end - whole_start))
    return out
