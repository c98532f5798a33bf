"""What train.optimizer = 'muon' adds to a step (parallel/data/zero/muon.py, parallel/data/zero/optim.py), for the planner:
its momentum, its collectives and its Newton-Schulz products. One place; memory.py, comms.py
and timing.py call it when Strategy.optimizer is 'muon'.

    momentum     fp32, one word per element of the units holding Muon matrices (a block's
                 dense unit: Ψ_block), sharded like the moments; on the device, whatever tier
                 holds AdamW's state. One process (MuonWithAdamW) keeps it instead of AdamW's
                 two moments for the matrices themselves.
    collectives  per step, per block unit: all_gather + reduce_scatter of fp32 Ψ_block over the
                 shard group (stage 0: one all_reduce, counted 2Ψ); with tp the owned matrices'
                 pieces gathered whole over the tp group (4 B x the whole matrices / N)
    compute      Newton-Schulz on every whole matrix once, spread over the N shard ranks (and
                 repeated on each tp rank): `steps` x (4 m² n + 2 m³) FLOPs for m = min, n = max
                 of its sides, in fp32

Pure functions; no torch.
"""

from __future__ import annotations

from shardlm.hardware.catalog import Cluster
from shardlm.planner.memory_bound import WorkTerm
from shardlm.planner.workload import Item, StageParams, Strategy, Workload, matmul_shapes, zero_ranks

NS_STEPS = 5
"""train.muon_ns_steps' default (the planner's Strategy does not carry it)."""


def momentum_item(sp: StageParams, s: Strategy) -> Item:
    """The sharded engine's fp32 momentum over the blocks' units (parallel/data/zero/muon.py)."""
    n = zero_ranks(s.layout) if s.zero_stage else 1
    elements = sp.layers * sp.block_unit
    return Item("Muon momentum", 4.0 * elements / n,
                f"4 B x Ψ_blocks {elements / 1e6:,.1f}M" + (f" / N={n}" if n > 1 else "")
                + " (fp32, on the device; the tier's AdamW moments for them stay, as zeros)")


def local_saving(sp: StageParams) -> float:
    """One process: the Muon matrices keep one fp32 word (the momentum) where AdamW keeps two."""
    return 4.0 * sp.layers * sp.block_unit


def whole_matrices(m, layers: int) -> list[tuple[int, int, int]]:
    """(rows, cols, how many) of the Muon matrices of `layers` blocks, whole: every block linear
    (workload.matmul_shapes at tp 1) but the head's and a mixture of experts' banks (AdamW's)."""
    return [(k, n, per_step * layers // m.n_layers) for name, _, k, n, per_step in matmul_shapes(m, 1)
            if name != "head" and not (m.experts and name.startswith("mlp"))]


def collectives(w: Workload, s: Strategy, sp: StageParams) -> list[tuple[str, str, int, int, float]]:
    """(name, op, group size, stride, bytes per rank per step as the ledger counts them)."""
    lay, out = s.layout, []
    block = sp.block_unit  # a unit's elements, fp32 directions and updates
    if s.zero_stage == 0:
        size = lay.dp_size * lay.cp
        out.append(("all-reduce Muon updates", "all_reduce", size, lay.tp, 2 * 4.0 * block * sp.layers))
    else:
        n = zero_ranks(lay)
        out.append(("all-gather Muon directions", "all_gather", n, lay.tp, 4.0 * block * sp.layers))
        out.append(("reduce-scatter Muon updates", "reduce_scatter", n, lay.tp, 4.0 * block * sp.layers))
    if lay.tp > 1:  # the owned matrices' pieces, whole: this rank's share of them
        n = zero_ranks(lay) if s.zero_stage else 1
        out.append(("all-gather tp-cut Muon matrices", "all_gather", lay.tp, 1,
                    4.0 * sum(k * c * count for k, c, count in whole_matrices(w.model, sp.layers)) / n))
    return out


def newton_schulz_term(w: Workload, s: Strategy, cluster: Cluster, sp: StageParams) -> WorkTerm:
    """Newton-Schulz on this rank's share of the stage's whole matrices, fp32, at the device's
    measured fp32 matmul rate for the Gram products' shapes (or its peak x efficiency)."""
    dev, m = cluster.device, w.model
    curve = dev.curves.get("fp32")
    flops = seconds = 0.0
    for k, n_out, count in whole_matrices(m, sp.layers):
        small, large = sorted((k, n_out))
        work = NS_STEPS * (4 * small * small * large + 2 * small ** 3) * count
        rate = curve.rate(small, large, small) if curve else dev.peak.get("fp32", 1e12) * dev.efficiency
        flops, seconds = flops + work, seconds + work / rate
    n = zero_ranks(s.layout) if s.zero_stage and not s.local else 1
    return WorkTerm("Muon Newton-Schulz", seconds / n,
                    f"{flops / n / 1e9:,.2f} GFLOP fp32 ({NS_STEPS} quintic iterations on the stage's whole "
                    f"matrices{f', 1/{n} of them on each shard rank' if n > 1 else ''})")
