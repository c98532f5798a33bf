"""The rank grid (dims.py ParallelDims) as a named device mesh and its process groups.

Ranks are laid out as (dp_replicate, dp_shard, tp) with tp innermost (rank = (replica *
dp_shard + shard) * tp + t): a tensor-parallel group is a run of consecutive ranks — on a
cluster, GPUs of one node, where its per-layer all-reduces are cheapest — then a sharding group,
the next cheapest (ZeRO-3's gathers once per unit), and replicas span nodes (HSDP).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardlm.dims import ParallelDims, resolve_dims

__all__ = ["Mesh", "ParallelDims", "build_mesh", "resolve_dims"]


@dataclass
class Mesh:
    """Process groups by name. A group of size 1 is None: nothing to communicate."""

    dims: ParallelDims
    rank: int
    device_mesh: DeviceMesh | None
    dp_shard_group: dist.ProcessGroup | None
    dp_replicate_group: dist.ProcessGroup | None
    tp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    """Every data-parallel rank of this rank's tensor-parallel position (replicas × shards); the
    whole world when tp = 1 (None: use the default group)."""

    @property
    def tp_rank(self) -> int:
        return self.rank % self.dims.tp

    @property
    def dp_rank(self) -> int:
        """This rank's position among all data-parallel ranks (what the sampler needs): the
        ranks of one tensor-parallel group see the same data."""
        return self.rank // self.dims.tp

    @property
    def shard_rank(self) -> int:
        return self.dp_rank % self.dims.dp_shard


def build_mesh(dims: ParallelDims, device: torch.device, rank: int) -> Mesh:
    if dims.world_size == 1:
        return Mesh(dims, 0, None, None, None)
    if dims.tp == 1:
        mesh = init_device_mesh(device.type, (dims.dp_replicate, dims.dp_shard),
                                mesh_dim_names=("dp_replicate", "dp_shard"))
    else:
        mesh = init_device_mesh(device.type, (dims.dp_replicate, dims.dp_shard, dims.tp),
                                mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    shard = mesh.get_group("dp_shard") if dims.dp_shard > 1 else None
    replicate = mesh.get_group("dp_replicate") if dims.dp_replicate > 1 else None
    tp = mesh.get_group("tp") if dims.tp > 1 else None
    dp = None
    if dims.tp > 1 and dims.dp_size > 1:  # every rank creates every group, in the same order
        for t in range(dims.tp):
            group = dist.new_group(list(range(t, dims.world_size, dims.tp)))
            if t == rank % dims.tp:
                dp = group
    return Mesh(dims, rank, mesh, shard, replicate, tp, dp)
