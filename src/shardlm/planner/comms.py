"""The collectives of a predicted step and what of them the compute beside them hides: the
data types (CommTime, its CommTerm parts, the compute Windows), one collective over a group's
link at the device's measured factor, and the ZeRO engine's data-parallel collectives unit by
unit (dp_comms). timing.py adds the model-parallel axes' and assembles the step.

Pure functions; no torch. docs/planner.md section 5.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    lay, d, overlap = s.layout, s.dtypes, cluster.calibration.overlap
    e, g = d.param_bytes, d.grad_bytes
    blocks = max(1, sp.layers)
    psi, root = sp.dense + sp.experts, sp.root_unit
    block = (psi - root) / blocks if sp.layers else 0.0
    # stage 3's gathered bytes of a block: its FP8 linears' weights at 1 byte with fp8_all_gather
    fp8 = fp8_gathered_elements(w.model) / w.model.n_layers if d.fp8_all_gather and s.zero_stage == 3 else 0.0
    gathered_block = e * block - (e - 1) * fp8
    gathered = e * root + gathered_block * sp.layers  # e·Ψ without fp8_all_gather
    fwd_unit = win.forward / blocks
    bwd_unit = 0.0 if lay.pp > 1 else win.backward / blocks  # pp: nothing computes beside them
    micro, out = s.grad_accum, []

    def comm(name, op, size, stride, volume, terms):
        """terms: (what, one call's (seconds, latency), calls, compute window per call)."""
        if size <= 1 or volume <= 0:
            return
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

    shard, replicas = zero_ranks(lay), lay.dp_replicate
    if s.optimizer == "muon":  # parallel/data/zero/muon.py, around the tier's step: nothing computes beside them
        for name, op, size, stride, volume in muon_collectives(w, s, sp):
            per_unit = volume / max(1, sp.layers) / (2 if op == "all_reduce" else 1)
            comm(name, op, size, stride, volume, [("a block unit, in the optimizer step",
                 unit_collective(cluster, op, per_unit, size, stride), sp.layers, 0.0)])
    if s.local_sgd_every and replicas > 1:  # parallel/data/zero/local_sgd.py: the replicas meet once a round,
        # after its last step, in one all-reduce of the fp32 pseudo-gradient of the rank's shard
        n = shard if s.zero_stage else 1
        comm("all-reduce pseudo-gradient across replicas (local SGD)", "all_reduce", replicas, lay.tp * n,
             local_sgd_comm_bytes(psi, n, s.local_sgd_every),
             [(f"one a round of {s.local_sgd_every} steps, after its last: nothing to hide behind",
               unit_collective(cluster, "all_reduce", 4 * psi / n, replicas, lay.tp * n), 1 / s.local_sgd_every,
               0.0)])
        replicas = 1  # no gradient crosses replicas on the other steps
    if s.zero_stage == 0:
        size = lay.dp_size * lay.cp // lay.dp_replicate * replicas  # local SGD: within the replica
        ar = lambda n: unit_collective(cluster, "all_reduce", n, size, lay.tp)  # noqa: E731
        comm("all-reduce gradients", "all_reduce", size, lay.tp, 2 * g * psi, [
            ("block, behind the next block's backward", ar(g * block), sp.layers, bwd_unit),
            ("root unit, last: nothing left to compute", ar(g * root), 1, 0.0)])
        return out
    rs = lambda n: unit_collective(cluster, "reduce_scatter", n, shard, lay.tp)  # noqa: E731
    ag = lambda n: unit_collective(cluster, "all_gather", n, shard, lay.tp)  # noqa: E731
    if s.zero_stage in (1, 2):
        comm("reduce-scatter gradients", "reduce_scatter", shard, lay.tp, g * psi, [
            ("block, behind the next block's backward", rs(g * block), sp.layers, bwd_unit),
            ("root unit, last: nothing left to compute", rs(g * root), 1, 0.0)])
        comm("all-gather updated parameters", "all_gather", shard, lay.tp, e * psi, [
            ("block, after the step: nothing to hide behind", ag(e * block), sp.layers, 0.0),
            ("root unit, after the step", ag(e * root), 1, 0.0)])
    elif lay.pp > 1:  # stage 3 on a pipeline: a unit gathered at its first forward of the step,
        # held to the last backward (parallel/data/zero/params.py hold_for_step), reduced after it: exposed
        comm("all-gather parameters", "all_gather", shard, lay.tp, gathered, [
            ("root unit, first forward: starts the step", ag(e * root), 1, 0.0),
            ("block, first forward" + (": behind the block before it" if s.prefetch else ": waited for"),
             ag(gathered_block), sp.layers, fwd_unit if s.prefetch else 0.0)])
        comm("reduce-scatter gradients", "reduce_scatter", shard, lay.tp, g * psi, [
            ("block, after the last backward", rs(g * block), sp.layers, 0.0),
            ("root unit, after the last backward", rs(g * root), 1, 0.0)])
    else:
        ag_block, rs_block = ag(gathered_block), rs(g * block)
        # prefetch (depth 1) starts a block's gather while the unit before it computes; without
        # it a gather starts when its unit is reached, with nothing beside it
        behind_fwd = fwd_unit if lay.pp == 1 and s.prefetch else 0.0
        behind_bwd = bwd_unit if s.prefetch else 0.0
        blocks_after_first = micro * (sp.layers - 1)
        gathers = [("root unit, forward: starts the pass", ag(e * root), micro, 0.0),
                   ("first block, forward: behind the embedding lookup", ag_block, micro if sp.layers else 0, 0.0),
                   ("block, forward: behind the block before it" if s.prefetch else
                    "block, forward: no prefetch, waited for", ag_block, blocks_after_first, behind_fwd)]
        if s.prefetch:  # backward: the root is still gathered; the last micro-step's gathers
            # share the link with the reduce-scatters (below)
            gathers.append(("block, backward: behind the block after it", ag_block,
                            (micro - 1) * sp.layers, behind_bwd))
            last = ("block, with the last micro-step's backward gather, behind one block's backward",
                    tuple(a + b for a, b in zip(ag_block, rs_block)), sp.layers, bwd_unit)
        else:
            gathers.append(("block, backward: no prefetch, waited for", ag_block, micro * sp.layers, 0.0))
            last = ("block, behind the next block's backward", rs_block, sp.layers, bwd_unit)
        comm("all-gather parameters", "all_gather", shard, lay.tp, 2 * micro * gathered, gathers)
        # the reduction runs on the last micro-step only (accumulation)
        comm("reduce-scatter gradients", "reduce_scatter", shard, lay.tp, g * psi, [
            last, ("root unit, last: nothing left to compute", rs(g * root), 1, 0.0)])
    if replicas > 1:
        arr = lambda n: unit_collective(cluster, "all_reduce", n, replicas, lay.tp * shard)  # noqa: E731
        # finish_backward: after every reduction, all units at once: nothing computes beside them
        comm("all-reduce shards across replicas", "all_reduce", replicas, lay.tp * shard, 2 * g * psi / shard, [
            ("block shard, after the backward", arr(g * block / shard), sp.layers, 0.0),
            ("root unit shard, after the backward", arr(g * root / shard), 1, 0.0)])
    return out
