"""The tiers that keep state in memory: optimizer state on the device or in host memory
(InMemoryTier, zero.offload_optimizer = 'none' | 'cpu'), stage-3 parameter shards where they
are (ResidentParams, zero.offload_params = 'none') or in host memory (HostParams, 'cpu').

Also TierStats, the telemetry every optimizer tier reports (the nvme tier imports it from here).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from shardlm.launch.allocator import host_tensor
from shardlm.config.schema import TrainConfig
from shardlm.parallel.data.zero.optim import init_adam_state


@dataclass
class TierStats:
    """What the last step moved and how long it took (telemetry)."""

    read_bytes: int = 0
    write_bytes: int = 0
    step_s: float = 0.0
    io_wait_s: float = 0.0
    """Time the step waited for reads or writes (the part the pipeline did not hide)."""


# ---------------------------------------------------------------------------------------------
# Optimizer state: `zero.offload_optimizer` = 'none' | 'cpu'


class InMemoryTier:
    """Device or cpu: masters and moments as tensors on `home`, stepped by torch's AdamW.
    When the master would be an exact copy of its target (same dtype, same device) the target
    itself is the master (no second copy)."""

    def __init__(self, home: torch.device, master_dtype: torch.dtype, may_alias: bool = True,
                 name: str = "none"):
        self.home, self.master_dtype, self.may_alias = home, master_dtype, may_alias
        self.name = name  # the zero.offload_optimizer value: 'none' (the device) or 'cpu'
        self.masters: list[nn.Parameter] = []
        self.targets: list[torch.Tensor] = []
        self.decay: list[bool] = []
        self.aliased: list[bool] = []
        self.stats = TierStats()
        self._uploaded: torch.cuda.Event | None = None
        """Recorded after the step's host -> device copies of the masters (offload to 'cpu')."""
        self._crosses_device = False
        """Masters on the host for targets on a GPU: each step's copies need synchronising."""

    def add(self, target: torch.Tensor, initial: torch.Tensor, decay: bool) -> None:
        alias = self.may_alias and target.dtype == self.master_dtype and target.device == self.home
        if alias:
            master = target
        else:
            master = (host_tensor(target.shape, self.master_dtype, pinned=target.is_cuda)
                      if self.home.type == "cpu" else
                      torch.empty(target.shape, dtype=self.master_dtype, device=self.home))
            master.copy_(initial)
        self._crosses_device |= self.home.type == "cpu" and target.is_cuda
        self.masters.append(nn.Parameter(master))
        self.targets.append(target)
        self.decay.append(decay)
        self.aliased.append(alias)

    def build_optimizer(self, train: TrainConfig) -> None:
        groups = [{"params": [m for m, d in zip(self.masters, self.decay) if d], "weight_decay": train.weight_decay},
                  {"params": [m for m, d in zip(self.masters, self.decay) if not d], "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=train.lr, betas=(train.beta1, train.beta2),
                                           eps=train.eps, fused=True)
        init_adam_state(self.optimizer)

    def step(self, grads: list[torch.Tensor]) -> None:
        start = time.perf_counter()
        if self._uploaded is not None:  # the last step's device copies still read the masters
            self._uploaded.synchronize()
            self._uploaded = None
        for master, grad in zip(self.masters, grads):
            master.grad = grad.to(master.device, master.dtype, non_blocking=True)
        if self._crosses_device:
            # Device -> host copies run on the stream, not the host: the host AdamW below must
            # not read a gradient still being copied.
            torch.cuda.current_stream().synchronize()
        self.optimizer.step()
        for master, target, alias in zip(self.masters, self.targets, self.aliased):
            master.grad = None
            if not alias:
                target.copy_(master.detach(), non_blocking=True)
        if self._crosses_device:
            # ... and host -> device copies from the pinned masters: the next step writes them.
            self._uploaded = torch.cuda.Event()
            self._uploaded.record()
        self.stats = TierStats(step_s=time.perf_counter() - start)

    def segment_state(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        state = self.optimizer.state[self.masters[i]]
        return self.masters[i].detach(), state["exp_avg"], state["exp_avg_sq"]

    def snapshot(self) -> None:
        return None  # in memory: an asynchronous save copies it (checkpoint/sharded.py)

    def refresh_targets(self) -> None:
        """After a checkpoint load wrote the masters: the targets from them."""
        for master, target, alias in zip(self.masters, self.targets, self.aliased):
            if not alias:
                target.copy_(master.detach())

    def held_bytes(self) -> dict[str, int]:
        """Optimizer-state bytes by where they live (aliased masters are the parameters')."""
        nbytes = sum(m.numel() * m.element_size() for m, a in zip(self.masters, self.aliased) if not a)
        nbytes += sum(t.numel() * t.element_size() for s in self.optimizer.state.values()
                      for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
        return {("cpu" if self.home.type == "cpu" else "device"): nbytes}


# ---------------------------------------------------------------------------------------------
# Parameter shards (stage 3): `zero.offload_params` = 'none' | 'cpu'


class ResidentParams:
    """'none': each unit's parameter shard stays where it is."""

    def fetch(self, unit) -> torch.Tensor:
        """The shard, ready to be the source of the unit's all-gather."""
        return unit.shard_param

    def release(self, unit) -> None:
        """The gather that needed the shard is complete."""

    def materialize_all(self, frozen: bool = True) -> None:
        """Every shard in memory (the optimizer step writes them)."""

    def store_all(self, frozen: bool = True) -> None:
        """The step is done: shards back to their tier."""

    def held_bytes(self) -> dict[str, int]:
        return {}

    def take_io_bytes(self) -> tuple[int, int]:
        """(read, written) bytes since the last call."""
        return 0, 0


class HostParams(ResidentParams):
    """'cpu': each shard in (pinned) host memory, on the device only from a gather's start to
    its end and during the optimizer step — the same lifecycle as FileParams, with host memory
    for the file. On a CPU-only machine the host memory is the device's: nothing moves."""

    def __init__(self, units: list, device: torch.device):
        self.units, self.moves = units, device.type != "cpu"
        self.host: dict[int, torch.Tensor] = {}
        if self.moves:
            for unit in units:
                shard = unit.shard_param.detach()
                self.host[id(unit)] = host_tensor(shard.shape, shard.dtype, pinned=True).copy_(shard)
                unit.shard_param.untyped_storage().resize_(0)

    def _read(self, unit) -> None:
        param = unit.shard_param
        param.untyped_storage().resize_(param.numel() * param.element_size())
        param.copy_(self.host[id(unit)], non_blocking=True)

    def fetch(self, unit) -> torch.Tensor:
        if self.moves:
            self._read(unit)
        return unit.shard_param

    def release(self, unit) -> None:
        if self.moves:
            unit.shard_param.untyped_storage().resize_(0)

    def materialize_all(self, frozen: bool = True) -> None:
        for unit in self.units if self.moves else ():
            if frozen or not unit.frozen:
                self._read(unit)

    def store_all(self, frozen: bool = True) -> None:
        for unit in self.units if self.moves else ():
            if frozen or not unit.frozen:
                self.host[id(unit)].copy_(unit.shard_param)
                unit.shard_param.untyped_storage().resize_(0)

    def held_bytes(self) -> dict[str, int]:
        return {"cpu": sum(t.numel() * t.element_size() for t in self.host.values())}
