"""parallelize(model, mesh, cfg): the one ordered composition of every strategy.

A plain model — ours built on the meta device, or any nn.Module — goes through the steps in a
fixed order, each a function that logs what it applied:

    activation checkpointing (apply_ac)  →  data parallelism / ZeRO (apply_data_parallel: the
    sharded build materialises the model here, one unit at a time)  →  compile

Tensor, context, expert and pipeline parallelism take their places before activation
checkpointing (tensor → context → expert → activation checkpointing → pipeline split → ZeRO →
compile) as they land; until then config validation refuses their degrees above 1.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from shardlm.comm.watchdog import CollectiveWatchdog
from shardlm.config import Config
from shardlm.mesh import Mesh
from shardlm.parallel.activation import apply_ac
from shardlm.parallel.data import DataParallelEngine, apply_data_parallel

log = logging.getLogger("shardlm")


@dataclass
class Parallelized:
    model: nn.Module
    """The plain model, transformed in place: what is saved and exported."""
    forward: nn.Module
    """What the training step calls: the model, or its compiled wrapper."""
    strategy: DataParallelEngine
    """Gradient synchronisation, clipping and the optimizer step (local or ZeRO)."""


def apply_compile(model: nn.Module, enabled: bool) -> nn.Module:
    if not enabled:
        return model
    log.info("compile: torch.compile over the whole model")
    return torch.compile(model)


def parallelize(model: nn.Module, mesh: Mesh, cfg: Config, device: torch.device,
                watchdog: CollectiveWatchdog | None = None, run_dir: Path = Path("runs")) -> Parallelized:
    """Apply every configured strategy to `model` in the documented order. `cfg` is resolved
    (resolve.resolve_config: no 'auto' left); `mesh` holds the process groups."""
    apply_ac(model, cfg.activation.checkpoint)
    strategy = apply_data_parallel(model, mesh, cfg, device, watchdog, run_dir)
    return Parallelized(model, apply_compile(model, cfg.train.compile), strategy)
