"""The degrees of parallelism: dp_replicate × dp_shard × cp × tp × pp = world size (experts
reuse data-parallel ranks: ep divides dp_replicate × dp_shard). Pure arithmetic, no torch: the
config validator, the planner and the mesh all use this one definition.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlm.errors import ConfigError


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    @property
    def dp_size(self) -> int:
        """Ranks that see different data: every replica and every shard."""
        return self.dp_replicate * self.dp_shard

    def describe(self) -> str:
        """Every degree, e.g. 'dp_replicate 1 × dp_shard 4 × cp 1 × tp 1 × pp 1 (ep 1)'."""
        return (f"dp_replicate {self.dp_replicate} × dp_shard {self.dp_shard} × cp {self.cp} × "
                f"tp {self.tp} × pp {self.pp} (ep {self.ep})")

    @classmethod
    def resolve(cls, world_size: int, dp_replicate: int = 1, dp_shard: int = -1, cp: int = 1,
                tp: int = 1, pp: int = 1, ep: int = 1) -> "ParallelDims":
        """Fill dp_shard = -1 with what the other degrees leave, and check the product. The error
        prints every factor, so the fix is arithmetic a user can do at a glance."""
        others = dp_replicate * cp * tp * pp
        if dp_shard == -1:
            if others < 1 or world_size % others:
                raise ConfigError(
                    f"world size {world_size} is not divisible by dp_replicate ({dp_replicate}) × "
                    f"cp ({cp}) × tp ({tp}) × pp ({pp}) = {others}, so dp_shard = -1 cannot fill "
                    f"the rest; change --nproc or the degrees")
            dp_shard = world_size // others
        dims = cls(dp_replicate, dp_shard, cp, tp, pp, ep)
        if dims.world_size != world_size:
            raise ConfigError(
                f"{dims.describe()}: the product is {dims.world_size}, but the world size is "
                f"{world_size}; set parallel.dp_shard = -1 to use every rank, or change --nproc")
        if dims.dp_size % ep:
            raise ConfigError(f"{dims.describe()}: ep ({ep}) must divide dp_replicate × dp_shard "
                              f"({dims.dp_size}): experts are sharded over data-parallel ranks")
        return dims


def resolve_dims(parallel, world_size: int) -> ParallelDims:
    """The dims a [parallel] config section describes on `world_size` ranks."""
    return ParallelDims.resolve(world_size, parallel.dp_replicate, parallel.dp_shard,
                                getattr(parallel, "cp", 1), parallel.tp, parallel.pp, parallel.ep)
