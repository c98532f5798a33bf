"""The rank grid (config/dims.py ParallelDims) as a named device mesh and its process groups.

Ranks are laid out as (pp, dp_replicate, dp_shard, cp, tp) with tp innermost (rank = (((stage ·
dp_replicate + replica) · dp_shard + shard) · cp + c) · tp + t): a tensor-parallel group is a
run of consecutive ranks —
on a cluster, GPUs of one node, where its per-layer all-reduces are cheapest — then the
context-parallel ring (a K/V block per layer per hop), then a sharding group (ZeRO-3's gathers
once per unit), replicas span nodes (HSDP), and pipeline stages, which send one activation
per micro-batch to the next, are outermost (across nodes, where links are slowest).

Context-parallel ranks hold the same parameters and see the same sequences (each a different
part of them), so for ZeRO they are data-parallel ranks: model states are sharded over
dp_shard × cp (FSDP2's "dp_shard_cp" in torchtitan), and gradients reduced over it.

Expert parallelism takes its ep ranks from that shard group (consecutive positions of dp_shard ×
cp: context-parallel ranks hold different tokens, so they can hold different experts too —
Megatron-Core folds cp into the expert-data-parallel group the same way); with tp > 1 a MoE
block's experts are spread over the ep × tp ranks of the ep group and its tensor-parallel peers
(`expert_group`). The ranks holding the same experts (`ep_shard_group`, `ep_dp_group`) reduce and
shard them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardlm.config.dims import ParallelDims, resolve_dims

__all__ = ["Mesh", "ParallelDims", "build_mesh", "resolve_dims"]


@dataclass
class Mesh:
    """Process groups by name. A group of size 1 is None: nothing to communicate."""

    dims: ParallelDims
    rank: int
    device_mesh: DeviceMesh | None
    dp_shard_group: dist.ProcessGroup | None
    """What ZeRO shards over: dp_shard × cp ranks of one replica and tensor-parallel position."""
    dp_replicate_group: dist.ProcessGroup | None
    tp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    """Every data- and context-parallel rank of this rank's stage and tensor-parallel position
    (the world when there is no other axis; None when there is no data parallelism)."""
    cp_group: dist.ProcessGroup | None = None
    pp_group: dist.ProcessGroup | None = None
    """The pipeline: the ranks of every stage at this rank's position in the rest of the grid."""
    pp_ends_group: dist.ProcessGroup | None = None
    """The first and the last stage of this rank's pipeline (a tied embedding's two copies)."""
    ep_group: dist.ProcessGroup | None = None
    """Expert parallelism: ep consecutive ranks of a shard group (dp_shard × cp) at this rank's
    tensor-parallel position, each holding different experts."""
    ep_shard_group: dist.ProcessGroup | None = None
    """The dp_shard · cp / ep ranks of a shard group that hold the same experts (ZeRO shards them)."""
    ep_dp_group: dist.ProcessGroup | None = None
    """Every rank holding the same experts, replicas included (stage 0 all-reduces over it)."""
    expert_group: dist.ProcessGroup | None = None
    """The ranks a MoE block's experts are spread over and its tokens exchanged in: the ep group,
    or with tp > 1 too the ep × tp ranks of it and its tensor-parallel peers."""

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.dims.world_size // self.dims.pp)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.dims.tp

    @property
    def cp_rank(self) -> int:
        return self.rank // self.dims.tp % self.dims.cp

    @property
    def dp_rank(self) -> int:
        """This rank's position among the ranks that see different data (what the sampler
        needs): the ranks of one tensor- and context-parallel group see the same sequences."""
        return self.rank // (self.dims.tp * self.dims.cp) % self.dims.dp_size

    @property
    def shard_rank(self) -> int:
        """Position in the ZeRO sharding group (dp_shard × cp)."""
        return self.dp_rank % self.dims.dp_shard * self.dims.cp + self.cp_rank

    @property
    def replica_rank(self) -> int:
        return self.dp_rank // self.dims.dp_shard

    @property
    def ep_rank(self) -> int:
        """Position in the ep group (with tp > 1 the expert group's is ep_rank · tp + tp_rank)."""
        return self.shard_rank % self.dims.ep

    @property
    def ep_shard_rank(self) -> int:
        """Position among the ranks of the shard group holding the same experts."""
        return self.shard_rank // self.dims.ep


def _my_group(rank: int, groups: list[list[int]]) -> dist.ProcessGroup:
    """Create every group (all ranks must, in the same order) and return the one holding `rank`."""
    mine = None
    for ranks in groups:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


def build_mesh(dims: ParallelDims, device: torch.device, rank: int) -> Mesh:
    if dims.world_size == 1:
        return Mesh(dims, 0, None, None, None)
    names = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    shape = (dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp)
    keep = [i for i, n in enumerate(shape) if n > 1 or names[i].startswith("dp")]
    mesh = init_device_mesh(device.type, tuple(shape[i] for i in keep),
                            mesh_dim_names=tuple(names[i] for i in keep))
    group = lambda name: mesh.get_group(name) if name in mesh.mesh_dim_names and \
        shape[names.index(name)] > 1 else None  # noqa: E731
    shard = group("dp_shard")
    inner, stage = dims.cp * dims.tp, dims.world_size // dims.pp
    if dims.cp > 1 and dims.dp_shard * dims.cp > 1:  # shard over dp_shard × cp together
        shard = _my_group(rank, [[q * stage + (r * dims.dp_shard + s) * inner + c * dims.tp + t
                                  for s in range(dims.dp_shard) for c in range(dims.cp)]
                                 for q in range(dims.pp) for r in range(dims.dp_replicate)
                                 for t in range(dims.tp)])
    dp = None
    if dims.dp_size * dims.cp > 1:
        dp = dist.group.WORLD if dims.tp == dims.pp == 1 else _my_group(
            rank, [list(range(q * stage + t, (q + 1) * stage, dims.tp)) for q in range(dims.pp)
                   for t in range(dims.tp)])
    ends = None
    if dims.pp > 1:
        ends = _my_group(rank, [[i, (dims.pp - 1) * stage + i] for i in range(stage)])
    ep = ep_shard = ep_dp = experts = None
    if dims.ep > 1:
        # A replica's shard group holds S = dp_shard × cp positions s = b·cp + c (context-parallel
        # ranks fold into it, as in Megatron-Core's expert-data-parallel group), so the rank at
        # (stage q, replica r, shard position s, tp position t) is q·stage + (r·S + s)·tp + t.
        # Expert-parallel groups: ep consecutive shard positions s = g·ep + j.
        e, size, tp = dims.ep, dims.dp_shard * dims.cp, dims.tp
        per = size // e
        at = lambda q, r, g, j, t: q * stage + ((r * size) + g * e + j) * tp + t  # noqa: E731
        blocks = [(q, r) for q in range(dims.pp) for r in range(dims.dp_replicate)]
        ep = _my_group(rank, [[at(q, r, g, j, t) for j in range(e)]
                              for q, r in blocks for g in range(per) for t in range(tp)])
        if tp > 1:  # the experts spread over ep × tp ranks: Megatron-Core's ep × expert-tp grid
            experts = _my_group(rank, [[at(q, r, g, j, t) for j in range(e) for t in range(tp)]
                                       for q, r in blocks for g in range(per)])
        if per > 1:
            ep_shard = _my_group(rank, [[at(q, r, g, j, t) for g in range(per)]
                                        for q, r in blocks for j in range(e) for t in range(tp)])
        if per * dims.dp_replicate > 1:
            ep_dp = _my_group(rank, [[at(q, r, g, j, t) for r in range(dims.dp_replicate) for g in range(per)]
                                     for q in range(dims.pp) for j in range(e) for t in range(tp)])
    return Mesh(dims, rank, mesh, shard, group("dp_replicate"), group("tp"), dp, group("cp"),
                group("pp"), ends, ep, ep_shard, ep_dp, experts if experts is not None else ep)
