"""What the search tries: the strategies the planner may choose (Supported), the rank layouts
of a cluster (tp within a node, cp for sequences whose activations matter, pp, dp as
replicate x shard, ep inside dp_shard x cp), the offload tiers and the recompute / activation-offload
choices, each cheapest first. search.py evaluates them.

Pure functions; no torch. docs/planner.md section 8.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlm.config.dims import ParallelDims
from shardlm.hardware.catalog import Cluster
from shardlm.planner.activations import ActivationDtypes, activation_peak
from shardlm.planner.workload import DTYPE_BYTES, Dtypes, Workload


@dataclass(frozen=True)
class Supported:
    """What the search may choose."""

    tp: bool = True
    cp: bool = True
    """Context parallelism: each sequence split over a ring of ranks (parallel/context/attention.py)."""
    pp: bool = True
    """Pipeline parallelism: the blocks in stages over ranks (parallel/pipeline/stages.py), 1F1B."""
    ep: bool = True
    hybrid: bool = True
    """dp_replicate > 1: shard within a node, replicate across nodes (HSDP)."""
    stages: tuple[int, ...] = (0, 1, 2, 3)
    zero3_with_pp: bool = True
    """ZeRO stage 3 on a pipeline (pp > 1): a stage's units gathered for the whole step."""
    recompute: tuple[str, ...] = ("none", "selective", "full")
    offload_optimizer: tuple[str, ...] = ("none", "cpu", "nvme")
    offload_params: tuple[str, ...] = ("none", "cpu", "nvme")
    activation_offload: tuple[str, ...] = ("none", "cpu")
    """activation.offload: every block's saved activations to host memory instead of recomputing
    them (tried on devices with their own memory; on a CPU the host is the device)."""


EVERYTHING = Supported()
"""Every strategy the planner models."""
RUNTIME = Supported()
"""What `shardlm train` runs today: pp x dp_replicate x dp_shard x cp x tp (x ep inside dp_shard
x cp, each expert on one rank of the ep x tp grid), ZeRO 0-3, recompute, offload."""
AUTO = Supported(tp=False, cp=False, pp=False, ep=False, zero3_with_pp=False)
"""What `parallel.strategy = "auto"` chooses from: data parallelism, until the planner's tensor-,
context- and pipeline-parallel models have been checked against our own measurements on this
machine (what a run set itself is kept: kept_settings, plan_for_run)."""
def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


CP_ACTIVATION_SHARE = 0.25
"""cp > 1 is searched only when one sequence's activations (micro-batch 1, no recomputation,
on the tensor-parallel layout) take at least this share of a device's memory."""


def _sequence_activations(w: Workload, cluster: Cluster, dtypes: Dtypes, tp: int) -> float:
    """Peak activation bytes of one whole sequence on a rank of `tp` (no recomputation)."""
    dt = ActivationDtypes(DTYPE_BYTES[dtypes.compute], DTYPE_BYTES[dtypes.compute],
                          cluster.calibration.norms_in_fp32 and dtypes.compute != "fp32")
    return activation_peak(w.model, w.seq_len, 1, w.model.n_layers, 1, dt, "none", tp, tp > 1,
                           True, (w.experts, w.top_k, w.capacity_factor)).bytes


def rank_layouts(w: Workload, cluster: Cluster, supported: Supported, dtypes: Dtypes,
             pinned: dict[str, int] | None = None):
    """Rank layouts to search. `pinned`: degrees by name (tp, cp, pp, ep, dp_replicate) that
    every layout has (a run's own, under strategy = 'auto'), whatever `supported` says."""
    m, world, per_node = w.model, cluster.world_size, cluster.per_node
    pinned = pinned or {}
    tps = [pinned["tp"]] if "tp" in pinned else divisors(per_node) if supported.tp else [1]
    for tp in tps:
        if m.n_heads % tp or (m.n_kv_heads or m.n_heads) % tp or world % tp or (m.experts and m.experts % tp):
            continue
        # Context parallelism, kept from multiplying the space: its ring passes a key/value
        # block per layer per hop, so it stays inside a node (cp <= devices per node / tp, on
        # the fast link); and it only pays where activations do — it moves data-parallel
        # work onto a ring and saves nothing else — so it is searched only when one sequence's
        # activations fill a good share of a device (CP_ACTIVATION_SHARE). A shorter sequence
        # fits without it at no ring traffic.
        cps = [1]
        if "cp" in pinned:
            cps = [pinned["cp"]]
        elif supported.cp and per_node // tp > 1 and _sequence_activations(w, cluster, dtypes, tp) \
                >= CP_ACTIVATION_SHARE * cluster.device.memory:
            cps = divisors(per_node // tp)
        for cp in cps:
            if w.seq_len % (2 * cp) or world % (tp * cp):
                continue
            pps = [pinned["pp"]] if "pp" in pinned else divisors(world // (tp * cp)) if supported.pp else [1]
            for pp in pps:
                if world % (tp * cp * pp):
                    continue
                dp = world // (tp * cp * pp)
                if pp > m.n_layers or w.global_batch % dp:
                    continue
                shards = {dp}
                if "dp_replicate" in pinned:
                    shards = {dp // pinned["dp_replicate"]} if dp % pinned["dp_replicate"] == 0 else set()
                elif supported.hybrid and dp > 1:  # shard inside a node, replicate across nodes
                    inside = max(1, per_node // (tp * cp))
                    if inside < dp and dp % inside == 0:
                        shards.add(inside)
                for shard in sorted(shards):
                    eps = [1]
                    # experts' ranks come out of dp_shard x cp; with tp, each holds experts / (ep x tp)
                    fits = [e for e in divisors(shard * cp) if w.experts and w.experts % (e * tp) == 0]
                    if "ep" in pinned:
                        eps = [pinned["ep"]] if pinned["ep"] in fits else []
                    elif supported.ep and w.experts:
                        eps = fits
                    else:  # ep = 1; a mixture of experts under tp spreads them over the tp ranks
                        eps = [1] if not w.experts or 1 in fits else []
                    for ep in eps:
                        yield ParallelDims(dp // shard, shard, cp=cp, tp=tp, pp=pp, ep=ep)


def offload_tiers(stage: int, cluster: Cluster, supported: Supported) -> list[tuple[str, str]]:
    """Cheapest first: none, then optimizer states, then parameters too (stage 3)."""
    tiers = [t for t in ("cpu", "nvme") if cluster.device.kind != "cpu" or t == "nvme"]
    out = [("none", "none")]
    if stage >= 1:
        out += [(t, "none") for t in tiers if t in supported.offload_optimizer]
    if stage == 3:
        out += [(t, t) for t in tiers if t in supported.offload_optimizer and t in supported.offload_params]
    return out


def activation_choices(cluster: Cluster, supported: Supported) -> list[tuple[str, str]]:
    """(recompute, activation offload), least memory saved first: keep everything; offload every
    block's activations to the host (a device with its own memory only); then recompute."""
    choices = [(r, "none") for r in supported.recompute]
    if cluster.device.kind != "cpu" and "cpu" in supported.activation_offload and "none" in supported.recompute:
        choices.insert(1, ("none", "cpu"))
    return choices


def offload_blocks(w: Workload, lay: ParallelDims) -> list[int]:
    """activation.offload_blocks to try, fewest first: a quarter, half, then every block (0) of a
    pipeline stage's; the fewest that fit move the fewest bytes over PCIe."""
    per_stage = w.model.n_layers // lay.pp
    return sorted({n for n in (per_stage // 4, per_stage // 2) if 0 < n < per_stage}) + [0]
