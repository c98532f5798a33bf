"""The degrees of parallelism: dp_replicate × dp_shard × cp × tp × pp = world size (experts
reuse data- and context-parallel ranks: ep divides dp_shard × cp). Pure arithmetic, no torch: the
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
        if (dims.dp_shard * dims.cp) % ep:
            raise ConfigError(f"{dims.describe()}: ep ({ep}) must divide dp_shard × cp ({dims.dp_shard} × "
                              f"{dims.cp}): expert-parallel ranks are ranks of one shard group")
        return dims


def resolve_dims(parallel, world_size: int) -> ParallelDims:
    """The dims a [parallel] config section describes on `world_size` ranks."""
    return ParallelDims.resolve(world_size, parallel.dp_replicate, parallel.dp_shard,
                                getattr(parallel, "cp", 1), parallel.tp, parallel.pp, parallel.ep)


def grad_accum_for(train, parallel, world_size: int) -> int:
    """The grad_accum a [train] section asks for on `world_size` ranks: train.global_batch /
    (micro_batch x dp) when global_batch is set (the global batch kept whatever the world size),
    else train.grad_accum. Also checks the layout fits `world_size`."""
    dp = resolve_dims(parallel, world_size).dp_size
    if not train.global_batch:
        return train.grad_accum
    per_pass = train.micro_batch * dp
    if train.global_batch % per_pass:
        raise ConfigError(
            f"train.global_batch = {train.global_batch} is not divisible by train.micro_batch "
            f"({train.micro_batch}) x {dp} data-parallel rank(s) = {per_pass} at world size "
            f"{world_size}; choose a global batch that micro_batch x dp divides at every world "
            f"size the job may run at, or a smaller micro_batch")
    return train.global_batch // per_pass


def split_layers(n_layers: int, pp: int, first_extra: float = 0.0, last_extra: float = 0.0) -> list[int]:
    """Blocks per pipeline stage: contiguous, each >= 1, summing to `n_layers`, balancing each
    stage's cost — its blocks, plus the embedding's cost on the first stage and the head's (and
    loss's) on the last, in units of one block. The most loaded stage is made as light as it can
    be; where stages tie, the earlier one gets fewer blocks (1F1B's first stage holds the most
    micro-batches of activations)."""
    if pp < 1 or n_layers < pp:
        raise ConfigError(f"parallel.pp = {pp} needs at least one of the model's {n_layers} layers "
                          f"per stage: choose pp <= {n_layers}")
    if pp == 1:
        return [n_layers]
    extra = [first_extra] + [0.0] * (pp - 2) + [last_extra]
    def capacity(limit: float) -> list[int]:  # noqa: E306
        return [max(1, int(limit - e + 1e-9)) for e in extra]
    limits = sorted({k + e for e in extra for k in range(1, n_layers + 1)})
    lo, hi = 0, len(limits) - 1  # the smallest limit whose capacities hold every layer
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if sum(capacity(limits[mid])) >= n_layers else (mid + 1, hi)
    counts = capacity(limits[lo])
    for _ in range(sum(counts) - n_layers):  # trim: the heaviest stage, the earliest of ties
        i = max((c + e, -i, i) for i, (c, e) in enumerate(zip(counts, extra)) if c > 1)[2]
        counts[i] -= 1
    return counts


def parse_layers(text: str, n_layers: int, pp: int) -> list[int]:
    """An explicit split ('4,4,3,5'): one positive count per stage, summing to the layers."""
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(f"parallel.pp_layers = {text!r}: write one layer count per stage, "
                          f"comma-separated, e.g. '4,4,3,5'") from None
    if len(counts) != pp or min(counts) < 1 or sum(counts) != n_layers:
        raise ConfigError(f"parallel.pp_layers = {text!r} must give {pp} positive counts (one per "
                          f"stage, parallel.pp = {pp}) summing to the model's {n_layers} layers "
                          f"(it gives {len(counts)} summing to {sum(counts)})")
    return counts
