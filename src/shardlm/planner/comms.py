"""The collectives of a predicted step and what of them the compute beside them hides: the
data types (CommTime, its CommTerm parts, the compute Windows), one collective over a group's
link at the device's measured factor, and the ZeRO engine's data-parallel collectives unit by
unit (dp_comms). timing.py adds the model-parallel axes' and assembles the step.

Pure functions; no torch. docs/planner.md section 5.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

from shardlm.hardware.catalog import Cluster
from shardlm.planner.muon import collectives as muon_collectives
from shardlm.planner.links import collective_parts, group_link
from shardlm.planner.traffic import fp8_gathered_elements, local_sgd_comm_bytes
from shardlm.planner.workload import StageParams, Strategy, Workload, zero_ranks

@dataclass
class CommTerm:
    """One term of a collective's time: what it is, its seconds, and what of it is exposed."""

    name: str
    seconds: float
    exposed: float


@dataclass
class CommTime:
    """One collective of the predicted step: its volume and time (the runtime's own
    collectives are comm/collectives.py Comm)."""

    name: str
    group: str
    """Which group and over what link: 'dp_shard (8, intra-node nvlink3)'."""
    bytes: float
    """Per rank per step, counted as the ZeRO paper counts (all-reduce = 2x its tensor)."""
    seconds: float
    exposed: float
    """What is left on the critical path after overlap with compute."""
    latency: float = 0.0
    """The alpha part of `seconds`: steps x link latency (the rest moves bytes)."""
    terms: list[CommTerm] = field(default_factory=list)
    """The exposure, term by term (which collective hides behind which compute, which has
    nothing to hide behind), as `shardlm estimate` prints it; they sum to `exposed`."""


def hidden(seconds: float, window: float, overlap: float, fixed: float = 0.0) -> float:
    """Exposed part of asynchronous communication: `fixed` cannot overlap (nothing computes
    beside it); the rest hides in `overlap` x the compute window."""
    rest = max(0.0, seconds - fixed)
    return fixed + max(0.0, rest - overlap * window)


@dataclass(frozen=True)
class Windows:
    """The compute that asynchronous communication can hide behind, seconds on one rank."""

    forward: float
    """One micro-batch's forward through this rank's blocks."""
    backward: float
    """One micro-batch's backward through them (a recomputed forward included)."""
    step: float
    """The whole step's compute (bubble included)."""
    blocks: int
    """Blocks on this rank: a unit's compute is forward / blocks, backward / blocks."""


def unit_collective(cluster: Cluster, op: str, nbytes: float, size: int, stride: int) -> tuple[float, float]:
    """(seconds, latency part) of one collective of `nbytes` over the group's link, with the
    device's measured factor for that collective (gloo's all-gather is not a ring)."""
    bw, lat, _ = group_link(cluster, size, stride)
    return measured_factor(cluster, op, *collective_parts(op, nbytes, size, bw, lat))


def measured_factor(cluster: Cluster, op: str, seconds: float, latency: float) -> tuple[float, float]:
    """(seconds, latency part) x the device's measured factor for `op`: gloo's all-gather and
    reduce-scatter, timed among matmuls, over the ring model's time for them (hardware/probe.py)."""
    factor = cluster.calibration.factor(op)
    return seconds * factor, latency * factor


def dp_comms(w: Workload, s: Strategy, cluster: Cluster, sp: StageParams, win: Windows) -> list[CommTime]:
    """The data-parallel collectives of the ZeRO engine, unit by unit as parallel/data/zero/engine.py and
    parallel/data/zero/params.py issue them (volumes sum to parallel.data.zero.partition.comm_bytes_per_step), and what of
    each the compute beside it cannot hide (overlap x that compute; docs/planner.md section 5):

    - a block's gradient reduction starts when its backward ends and runs during the next
      block's backward; the root unit's (embeddings, head) completes last, at the embedding's
      gradient, with nothing left to compute: exposed whole;
    - stage 3 gathers every unit before its forward and again before its backward
      (reshard_after_forward; a recomputed forward inside backward uses the backward's gather),
      every micro-step, prefetching one unit ahead (`prefetch`): the root's gather starts each
      forward with nothing to hide behind, and so does the first block's (the root's forward is
      an embedding lookup); each later block's gather hides behind the block before it. In
      backward the root is still gathered; a block's gather and the previous block's
      reduce-scatter share the link during one block's backward;
    - stages 1-2 all-gather the updated parameters after the optimizer step, before the next
      forward: nothing to hide behind; replicas all-reduce their shards after every reduction
      has completed (the engine's finish_backward): nothing to hide behind either.

    Context-parallel ranks are data-parallel ranks here: ZeRO shards over dp_shard x cp, stage
    0 all-reduces over dp_replicate x dp_shard x cp (comm/mesh.py); both groups are tp apart. With
    pp > 1 the gradients are reduced after the pipeline's last backward (the engine's
    finish_backward), not during it: those reductions are all exposed; at stage 3 each unit
    is gathered once, at its first forward of the step, and held to the last backward."""
    u, out = _dp_units(w, s, sp, win), []
    add = partial(_add_comm, out, cluster)
    shard, replicas = zero_ranks(s.layout), s.layout.dp_replicate
    if s.optimizer == "muon":  # parallel/data/zero/muon.py, around the tier's step: nothing computes beside them
        for name, op, size, stride, volume in muon_collectives(w, s, sp):
            per_unit = volume / max(1, sp.layers) / (2 if op == "all_reduce" else 1)
            add(name, size, stride, volume, [("a block unit, in the optimizer step",
                unit_collective(cluster, op, per_unit, size, stride), sp.layers, 0.0)])
    if s.local_sgd_every and replicas > 1:
        n = shard if s.zero_stage else 1  # the experts' shard: over the n / ep ranks holding them
        _local_sgd_comm(add, s, cluster, sp.dense / n + sp.experts / max(1, n // s.layout.ep), n)
        replicas = 1  # no gradient crosses replicas on the other steps
    if s.zero_stage == 0:
        _stage0_comms(add, s, cluster, u, replicas)
        return out
    rs = partial(unit_collective, cluster, "reduce_scatter", size=shard, stride=s.layout.tp)
    ag = partial(unit_collective, cluster, "all_gather", size=shard, stride=s.layout.tp)
    if s.zero_stage in (1, 2):
        add("reduce-scatter gradients", shard, s.layout.tp, u.g * u.psi, [
            ("block, behind the next block's backward", rs(u.g * u.block), u.layers, u.bwd_unit),
            ("root unit, last: nothing left to compute", rs(u.g * u.root), 1, 0.0)])
        add("all-gather updated parameters", shard, s.layout.tp, u.e * u.psi, [
            ("block, after the step: nothing to hide behind", ag(u.e * u.block), u.layers, 0.0),
            ("root unit, after the step", ag(u.e * u.root), 1, 0.0)])
    elif s.layout.pp > 1:
        _stage3_pipeline_comms(add, s, u, shard, rs, ag)
    else:
        _stage3_comms(add, s, u, shard, rs, ag)
    if replicas > 1:
        _replica_comms(add, s, cluster, u, shard, replicas)
    return out


@dataclass(frozen=True)
class _DpUnits:
    """What dp_comms prices the ZeRO engine's units with: bytes per parameter and per gradient
    element, a stage's parameters (all, the root unit's, one block's), stage 3's gathered bytes
    (a block's, the stage's), one unit's forward and backward compute, blocks and micro-steps."""

    e: float
    g: float
    psi: float
    root: float
    block: float
    gathered_block: float
    gathered: float
    fwd_unit: float
    bwd_unit: float
    layers: int
    micro: int


def _dp_units(w: Workload, s: Strategy, sp: StageParams, win: Windows) -> _DpUnits:
    d = s.dtypes
    e, g = d.param_bytes, d.grad_bytes
    blocks = max(1, sp.layers)
    psi, root = sp.dense + sp.experts, sp.root_unit
    block = (psi - root) / blocks if sp.layers else 0.0
    # stage 3's gathered bytes of a block: its FP8 linears' weights at 1 byte with fp8_all_gather
    fp8 = fp8_gathered_elements(w.model) / w.model.n_layers if d.fp8_all_gather and s.zero_stage == 3 else 0.0
    gathered_block = e * block - (e - 1) * fp8
    gathered = e * root + gathered_block * sp.layers  # e·Ψ without fp8_all_gather
    fwd_unit = win.forward / blocks
    bwd_unit = 0.0 if s.layout.pp > 1 else win.backward / blocks  # pp: nothing computes beside them
    return _DpUnits(e, g, psi, root, block, gathered_block, gathered, fwd_unit, bwd_unit, sp.layers,
                    s.grad_accum)


def _add_comm(out: list[CommTime], cluster: Cluster, name: str, size: int, stride: int, volume: float,
              terms) -> None:
    """One collective into `out`; terms: (what, one call's (seconds, latency), calls, compute
    window per call)."""
    if size <= 1 or volume <= 0:
        return
    overlap = cluster.calibration.overlap
    _, _, where = group_link(cluster, size, stride)
    listed, total, latency = [], 0.0, 0.0
    for what, (sec, lat), calls, window in terms:
        if calls <= 0 or sec <= 0:
            continue
        exposed = calls * max(0.0, sec - overlap * window)
        listed.append(CommTerm(f"{what}" + (f" x {calls:g}" if calls != 1 else ""), calls * sec, exposed))
        total, latency = total + calls * sec, latency + calls * lat
    out.append(CommTime(name, f"{size} ranks, {where}", volume, total,
                        sum(t.exposed for t in listed), latency, listed))


def _local_sgd_comm(add, s: Strategy, cluster: Cluster, elements: float, n: int) -> None:
    """parallel/data/zero/local_sgd.py: the replicas meet once a round, after its last step, in
    one all-reduce of the fp32 pseudo-gradient of the rank's master shard (`elements`: its dense
    part over the n shard ranks, its experts' over the n / ep holding the same experts)."""
    lay, replicas = s.layout, s.layout.dp_replicate
    add("all-reduce pseudo-gradient across replicas (local SGD)", replicas, lay.tp * n,
        local_sgd_comm_bytes(elements, 1, s.local_sgd_every),
        [(f"one a round of {s.local_sgd_every} steps, after its last: nothing to hide behind",
          unit_collective(cluster, "all_reduce", 4 * elements, replicas, lay.tp * n), 1 / s.local_sgd_every,
          0.0)])


def _stage0_comms(add, s: Strategy, cluster: Cluster, u: _DpUnits, replicas: int) -> None:
    """Stage 0: one all-reduce of the gradients over every data-parallel rank."""
    lay = s.layout
    size = lay.dp_size * lay.cp // lay.dp_replicate * replicas  # local SGD: within the replica
    ar = partial(unit_collective, cluster, "all_reduce", size=size, stride=lay.tp)
    add("all-reduce gradients", size, lay.tp, 2 * u.g * u.psi, [
        ("block, behind the next block's backward", ar(u.g * u.block), u.layers, u.bwd_unit),
        ("root unit, last: nothing left to compute", ar(u.g * u.root), 1, 0.0)])


def _stage3_pipeline_comms(add, s: Strategy, u: _DpUnits, shard: int, rs, ag) -> None:
    """Stage 3 on a pipeline: a unit gathered at its first forward of the step, held to the last
    backward (parallel/data/zero/params.py hold_for_step), reduced after it: exposed."""
    tp = s.layout.tp
    add("all-gather parameters", shard, tp, u.gathered, [
        ("root unit, first forward: starts the step", ag(u.e * u.root), 1, 0.0),
        ("block, first forward" + (": behind the block before it" if s.prefetch else ": waited for"),
         ag(u.gathered_block), u.layers, u.fwd_unit if s.prefetch else 0.0)])
    add("reduce-scatter gradients", shard, tp, u.g * u.psi, [
        ("block, after the last backward", rs(u.g * u.block), u.layers, 0.0),
        ("root unit, after the last backward", rs(u.g * u.root), 1, 0.0)])


def _stage3_comms(add, s: Strategy, u: _DpUnits, shard: int, rs, ag) -> None:
    """Stage 3 without a pipeline: every unit gathered before its forward and again before its
    backward, every micro-step; the gradients reduced on the last micro-step."""
    micro, layers = u.micro, u.layers
    ag_block, rs_block = ag(u.gathered_block), rs(u.g * u.block)
    # prefetch (depth 1) starts a block's gather while the unit before it computes; without
    # it a gather starts when its unit is reached, with nothing beside it
    behind_fwd = u.fwd_unit if s.layout.pp == 1 and s.prefetch else 0.0
    behind_bwd = u.bwd_unit if s.prefetch else 0.0
    blocks_after_first = micro * (layers - 1)
    gathers = [("root unit, forward: starts the pass", ag(u.e * u.root), micro, 0.0),
               ("first block, forward: behind the embedding lookup", ag_block, micro if layers else 0, 0.0),
               ("block, forward: behind the block before it" if s.prefetch else
                "block, forward: no prefetch, waited for", ag_block, blocks_after_first, behind_fwd)]
    if s.prefetch:  # backward: the root is still gathered; the last micro-step's gathers
        # share the link with the reduce-scatters (below)
        gathers.append(("block, backward: behind the block after it", ag_block,
                        (micro - 1) * layers, behind_bwd))
        last = ("block, with the last micro-step's backward gather, behind one block's backward",
                tuple(a + b for a, b in zip(ag_block, rs_block)), layers, u.bwd_unit)
    else:
        gathers.append(("block, backward: no prefetch, waited for", ag_block, micro * layers, 0.0))
        last = ("block, behind the next block's backward", rs_block, layers, u.bwd_unit)
    add("all-gather parameters", shard, s.layout.tp, 2 * micro * u.gathered, gathers)
    # the reduction runs on the last micro-step only (accumulation)
    add("reduce-scatter gradients", shard, s.layout.tp, u.g * u.psi, [
        last, ("root unit, last: nothing left to compute", rs(u.g * u.root), 1, 0.0)])


def _replica_comms(add, s: Strategy, cluster: Cluster, u: _DpUnits, shard: int, replicas: int) -> None:
    """finish_backward: after every reduction, all units at once: nothing computes beside them."""
    stride = s.layout.tp * shard
    arr = partial(unit_collective, cluster, "all_reduce", size=replicas, stride=stride)
    add("all-reduce shards across replicas", replicas, stride, 2 * u.g * u.psi / shard, [
        ("block shard, after the backward", arr(u.g * u.block / shard), u.layers, 0.0),
        ("root unit shard, after the backward", arr(u.g * u.root / shard), 1, 0.0)])
