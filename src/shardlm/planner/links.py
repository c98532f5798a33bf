"""The links a group of ranks runs on and the alpha-beta time of a collective over one
(Thakur et al. 2005; NCCL's ring and tree): shared by timing.py and cp_modes.py.

Pure functions; no torch. docs/planner.md section 5.
"""

from __future__ import annotations

import math

from shardlm.hardware.catalog import Cluster


def group_link(cluster: Cluster, size: int, stride: int) -> tuple[float, float, str]:
    """(bytes/s, latency, description) of a ring over `size` ranks `stride` apart.

    Ranks are laid out pp, dp_replicate, dp_shard, cp, tp from outer to inner (comm/mesh.py: dp_shard
    inside dp_replicate; tp innermost as in torchtitan, the context-parallel ring next). A group
    inside one node runs on the intra-node link. One that spans nodes runs at its slowest link:
    a rank's own share of the node's network adapters, adapters x bandwidth / devices per node
    (every rank of the node sends through them at once: each group's ring passes through every
    member's path into the network). Pooling a node's adapters for one group (NCCL's multi-rail
    rings) would allow up to `members` times that; the published large-scale ZeRO-3 runs did not
    reach it (docs/planner.md section 5, tests/test_planner_published.py).
    """
    node, per_node = cluster.node, cluster.per_node
    members = min(size, max(1, per_node // stride)) if stride < per_node else 1
    nodes = ceil_div(size, members)
    if nodes == 1:
        return node.intra.effective, node.intra.latency, f"intra-node {node.intra.name}"
    bandwidth = min(node.inter.effective * node.nics / per_node, node.intra.effective)
    return bandwidth, node.inter.latency, f"{nodes} nodes, {node.inter.name}"


def collective_parts(op: str, nbytes: float, size: int, bandwidth: float, latency: float,
                     calls: int = 1) -> tuple[float, float]:
    """(seconds, the latency part of them) of `calls` equal collectives moving `nbytes` in
    total: the alpha-beta model (Thakur et al. 2005; NCCL's ring and tree). A ring all-gather
    or reduce-scatter takes N-1 steps of S/N bytes; an all-reduce is both, or a double binary
    tree (2 log2 N steps, full bandwidth) when latency dominates; a point-to-point one step."""
    if size <= 1 or nbytes <= 0:
        return 0.0, 0.0
    each = nbytes / calls
    if op == "p2p":
        steps, moved = 1, each
    elif op == "all_reduce":
        ring = (2 * (size - 1), 2 * (size - 1) / size * each)
        tree = (2 * log2_ceil(size), 2 * each)
        steps, moved = min(ring, tree, key=lambda sm: sm[0] * latency + sm[1] / bandwidth)
    else:  # all_gather, reduce_scatter, all_to_all
        steps, moved = size - 1, (size - 1) / size * each
    return calls * (steps * latency + moved / bandwidth), calls * steps * latency


def collective_seconds(op: str, nbytes: float, size: int, bandwidth: float, latency: float,
                       calls: int = 1) -> float:
    """Seconds of `calls` equal collectives moving `nbytes` in total (collective_parts)."""
    return collective_parts(op, nbytes, size, bandwidth, latency, calls)[0]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def log2_ceil(n: int) -> int:
    return max(1, math.ceil(math.log2(n))) if n > 1 else 0
