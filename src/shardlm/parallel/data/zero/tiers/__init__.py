"""Where the optimizer's state lives: the offload tiers of ZeRO-Offload (Ren et al. 2021) and
ZeRO-Infinity (Rajbhandari et al. 2021), chosen once when the engine is built.

    device  fp32 masters and AdamW moments next to the parameters (no offload)
    cpu     in host memory (pinned where CUDA exists): the gradient shard comes over, torch's
            fused AdamW runs on the CPU, the updated parameters go back
    nvme    in files under zero.nvme_path. The step streams them in chunks through a fixed ring
            of aligned buffers: read chunk k+1 while updating chunk k while writing chunk k-1,
            so host memory stays `nvme_buffers` chunks whatever the model's size, and the
            disk is busy in both directions while the CPU computes

Every tier runs the same kernel (torch's fused AdamW) over the same segments. Element-wise in
exact arithmetic, but not in its rounding: its vector loop and scalar tail round differently
(FMA or not), so a chunked step equals the whole-segment step bit for bit only where the chunk
boundaries fall on multiples of the widest vector (16 floats; nvme chunks are multiples of 1024
elements) — and the tests' bitwise parity with a per-tensor reference holds for models whose
every tensor is a multiple of 32 floats (tests/test_zero.py). It runs over the same segments: contiguous pieces of this rank's shard,
one per (unit, weight-decay group). A tier is given each segment's target — the compute-dtype
parameter slice it must refresh after the step — and its fp32 initial values.

At stage 3 the parameter shards themselves have a tier too (`zero.offload_params`): a
ParamStore holds each unit's shard between gathers.

    memory.py  InMemoryTier (device, or cpu: host memory); ResidentParams, HostParams
    nvme.py    NvmeTier (files, streamed step)
    nvme_params.py FileParams (stage-3 shards in files)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from shardlm.config.schema import OFFLOAD_TIERS, TrainConfig
from shardlm.errors import ConfigError
from shardlm.parallel.data.zero.tiers.memory import HostParams, InMemoryTier, ResidentParams, TierStats
from shardlm.parallel.data.zero.tiers.nvme import NvmeTier
from shardlm.parallel.data.zero.tiers.nvme_params import FileParams

__all__ = ["OptimizerTier", "ParamStore", "TierStats", "build_param_store", "build_tier"]


class OptimizerTier(Protocol):
    """Holds the fp32 masters and AdamW moments of this rank's segments and steps them."""

    name: str
    """The zero.offload_optimizer value this tier implements (one of OFFLOAD_TIERS)."""
    optimizer: Any
    """What the loop and checkpoints see as the optimizer (param_groups, the step count in
    state): a torch AdamW, or StreamedAdamW for state that is not in memory. Set by
    build_optimizer."""
    stats: TierStats
    """What the last step moved and how long it took."""

    def add(self, target: torch.Tensor, initial: torch.Tensor, decay: bool) -> None:
        """Take one segment: `target` is the compute-dtype parameter slice the step refreshes,
        `initial` its fp32 values (the master starts from them, not from a rounded cast),
        `decay` whether weight decay applies. Segments are numbered in the order added."""

    def build_optimizer(self, train: TrainConfig) -> None:
        """Every segment is added: create the optimizer (and its state) for them."""

    def step(self, grads: list[torch.Tensor]) -> None:
        """One AdamW step from each segment's gradient (in the order added), then write the
        updated masters to the targets."""

    def segment_state(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(master, exp_avg, exp_avg_sq) of segment i as tensors a checkpoint reads and a load
        writes in place."""

    def refresh_targets(self) -> None:
        """After a checkpoint load wrote the masters: the targets from them."""

    def snapshot(self) -> Any:
        """None for state in memory; for state in files, a DiskSnapshot (tiers/nvme.py) whose
        `view_of(tensor)` gives a segment_state tensor's values as they are now, from a copy
        on the same disk (an asynchronous checkpoint writes from it)."""

    def held_bytes(self) -> dict[str, int]:
        """Optimizer-state bytes by where they live ('device', 'cpu' or 'nvme')."""


class ParamStore(Protocol):
    """Where each unit's stage-3 parameter shard lives between the gathers that need it. A unit
    is the engine's (parallel/data/zero/engine.py Unit; not imported here: the engine imports this package):
    a store may free and refill the storage of `unit.shard_param`; the optimizer tier's views
    into it stay valid."""

    def fetch(self, unit) -> torch.Tensor:
        """The shard, ready to be the source of the unit's all-gather."""

    def release(self, unit) -> None:
        """The gather that needed the shard is complete."""

    def materialize_all(self, frozen: bool = True) -> None:
        """Every shard in memory (the optimizer step writes them; a load writes frozen units'
        too). `frozen` False: the trainable units' only (a step leaves frozen ones as they are)."""

    def store_all(self, frozen: bool = True) -> None:
        """The step (or load) is done: shards back to their tier (`frozen`: as materialize_all)."""

    def held_bytes(self) -> dict[str, int]:
        """Parameter-shard bytes by where they live ('cpu' or 'nvme'; none when resident)."""

    def take_io_bytes(self) -> tuple[int, int]:
        """(read, written) bytes since the last call."""


def _known(kind: str, key: str) -> None:
    if kind not in OFFLOAD_TIERS:
        raise ConfigError(f"{key} = {kind!r} is not a tier: choose one of {', '.join(OFFLOAD_TIERS)}")


def build_tier(kind: str, device: torch.device, master_dtype: torch.dtype, directory: Path,
               chunk_bytes: int, buffers: int, params_offloaded: bool = False) -> OptimizerTier:
    """The tier `zero.offload_optimizer` names. When the parameter shards themselves leave
    memory (offload_params = 'nvme') a master can no longer be the parameter it updates."""
    _known(kind, "zero.offload_optimizer")
    if kind == "nvme":
        return NvmeTier(directory, master_dtype, chunk_bytes, buffers)
    return InMemoryTier(torch.device("cpu") if kind == "cpu" else device, master_dtype,
                        may_alias=not params_offloaded, name=kind)


def build_param_store(kind: str, units: list, device: torch.device, directory: Path) -> ParamStore:
    """The store `zero.offload_params` names (stage 3)."""
    _known(kind, "zero.offload_params")
    if kind == "nvme":
        return FileParams(units, directory)
    if kind == "cpu":
        return HostParams(units, device)
    return ResidentParams()
