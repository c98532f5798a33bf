"""The rank grid: dp_replicate × dp_shard × tp × pp × ep = world size, as a named device mesh.

Ranks are laid out with dp_shard innermost (rank = replica * dp_shard + shard), so a sharding
group is a run of consecutive ranks — on a cluster, the GPUs of one node, where the
all-gathers and reduce-scatters of ZeRO-3 are cheapest — and replicas span nodes (HSDP).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardlm.config import ConfigError, ParallelConfig


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int = 1
    pp: int = 1
    ep: int = 1

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    @property
    def dp_size(self) -> int:
        """Ranks that see different data: every replica and every shard."""
        return self.dp_replicate * self.dp_shard


def resolve_dims(cfg: ParallelConfig, world_size: int) -> ParallelDims:
    """Fill dp_shard = -1 with what the other factors leave, and check the product. The error
    prints every factor, so the fix is arithmetic a user can do at a glance."""
    others = cfg.dp_replicate * cfg.tp * cfg.pp
    dp_shard = cfg.dp_shard
    if dp_shard == -1:
        if world_size % others:
            raise ConfigError(
                f"world size {world_size} is not divisible by dp_replicate ({cfg.dp_replicate}) × "
                f"tp ({cfg.tp}) × pp ({cfg.pp}) = {others}, so dp_shard = -1 cannot fill the rest")
        dp_shard = world_size // others
    dims = ParallelDims(cfg.dp_replicate, dp_shard, cfg.tp, cfg.pp, cfg.ep)
    if dims.world_size != world_size:
        raise ConfigError(
            f"dp_replicate ({dims.dp_replicate}) × dp_shard ({dims.dp_shard}) × tp ({dims.tp}) × "
            f"pp ({dims.pp}) = {dims.world_size}, but the world size is {world_size}; set "
            f"parallel.dp_shard = -1 to use every rank, or change --nproc")
    return dims


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
