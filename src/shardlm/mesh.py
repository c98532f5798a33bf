"""The rank grid (dims.py ParallelDims) as a named device mesh and its process groups.

Ranks are laid out with dp_shard innermost (rank = replica * dp_shard + shard), so a sharding
group is a run of consecutive ranks — on a cluster, the GPUs of one node, where the
all-gathers and reduce-scatters of ZeRO-3 are cheapest — and replicas span nodes (HSDP).
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

    @property
    def dp_rank(self) -> int:
        """This rank's position among all data-parallel ranks (what the sampler needs)."""
        return self.rank  # tp = pp = 1 for now: every rank is a data-parallel rank

    @property
    def shard_rank(self) -> int:
        return self.rank % self.dims.dp_shard


def build_mesh(dims: ParallelDims, device: torch.device, rank: int) -> Mesh:
    if dims.world_size == 1:
        return Mesh(dims, 0, None, None, None)
    mesh = init_device_mesh(device.type, (dims.dp_replicate, dims.dp_shard),
                            mesh_dim_names=("dp_replicate", "dp_shard"))
    shard = mesh.get_group("dp_shard") if dims.dp_shard > 1 else None
    replicate = mesh.get_group("dp_replicate") if dims.dp_replicate > 1 else None
    return Mesh(dims, rank, mesh, shard, replicate)
