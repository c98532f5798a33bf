"""What a training run holds once `build_run` (build.py) has built it, and what `train` returns:
plain records, so that the loop and the run's checkpoints (checkpointing.py) share them without
importing each other."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from shardlm.checkpoint.sharded import CheckpointWriter, SaveReport
from shardlm.comm.mesh import Mesh
from shardlm.parallel.data.fault_tolerant.quorum import ReplicaGroup
from shardlm.comm.watchdog import CollectiveWatchdog
from shardlm.config.schema import Config
from shardlm.data.loader import Dataset, Loader
from shardlm.launch.runtime import Runtime
from shardlm.models.moe import MoEStats
from shardlm.models.precision import Precision
from shardlm.parallel.build import StepHooks
from shardlm.parallel.data.engine import DataParallelEngine
from shardlm.parallel.pipeline.executor import Schedule
from shardlm.train.tracking import StepTimes


@dataclass
class Run:
    """Everything a training run holds, built once (build.py build_run). What changes with each
    step is that step's own (step.py StepResult); only `start_step`, where training resumes,
    is set after the build (a checkpoint loaded, a replica rejoined)."""

    cfg: Config
    runtime: Runtime
    mesh: Mesh
    dataset: Dataset
    model: nn.Module
    """The plain model (parameters, state_dict) — what is saved."""
    forward: nn.Module
    """What is called in the step: the model, possibly compiled."""
    strategy: DataParallelEngine
    """Gradient synchronisation, clipping and the optimizer step (local or ZeRO)."""
    watchdog: CollectiveWatchdog | None
    """Reports a collective that outlives parallel.collective_timeout_s (several ranks only)."""
    precision: Precision
    train_loader: Loader
    val_loader: Loader
    run_dir: Path
    peak_flops_per_device: float
    flops_per_token: float
    """Model FLOPs per token (PaLM appendix B, no recomputation): MFU's numerator."""
    checkpoints: CheckpointWriter
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = None
    """(logits, targets) -> mean cross-entropy in fp32 (vocabulary-parallel under tensor
    parallelism): parallel.build.Parallelized.loss."""
    token_sums: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = None
    """(logits, targets) -> float64 [summed cross-entropy, correct argmax, targets] over the
    targets that carry loss (evaluation): parallel.build.Parallelized.token_sums."""
    start_step: int = 0
    """The first step to run: 0, or where the checkpoint resumed from left off."""
    schedule: Schedule | None = None
    """The pipeline schedule of this rank's stage (parallel.pp > 1)."""
    hooks: StepHooks = field(default_factory=StepHooks)
    """Each feature's part in the training step (parallel.build.StepHooks; the fault-tolerant
    replicas' added by fault_tolerance.add_step_hooks)."""
    step_on_device: bool = False
    """The optimizer step decided on the device (parallel.build.Parallelized.step_on_device)."""
    replicas_apart: int = 1
    """train.local_sgd: dp_replicate (a replica's gradient is its own data's mean); else 1."""
    moe: MoEStats | None = None
    """A mixture-of-experts model's routing state: its biases are checkpointed and saved."""
    hardware_flops_per_token: float | None = None
    """FLOPs per token the step executes, recomputation included (activation.checkpoint 'full'
    redoes each block's forward; 'selective' only element-wise ops, 0 matmul FLOPs): HFU's
    numerator. None = flops_per_token (nothing recomputed)."""
    times: StepTimes = field(default_factory=lambda: StepTimes(None, enabled=False))
    """The step's time split by phase (run.time_split; shardlm.train.tracking.StepTimes)."""
    replicas: ReplicaGroup | None = None
    """parallel.fault_tolerant: the quorum of live replicas and its group (parallel/data/fault_tolerant/quorum.py)."""


@dataclass
class TrainResult:
    run_dir: Path
    losses: list[float] = field(default_factory=list)
    val_loss: float | None = None
    """The last evaluation's mean loss per validation target that carries loss."""
    val_perplexity: float | None = None
    """exp(val_loss)."""
    val_token_accuracy: float | None = None
    """The last evaluation's fraction of those targets that the logits' argmax predicts."""
    tokens_per_s: float = 0.0
    """Mean over the steps after the first (which pays one-off warm-up costs)."""
    mfu: float = 0.0
    """Model FLOPs utilisation (PaLM appendix B: recomputation is not model work)."""
    hfu: float = 0.0
    """Hardware FLOPs utilisation: MFU's FLOPs plus what activation checkpointing recomputes."""
    skipped_steps: int = 0
    stopped_by: str | None = None
    """The signal that ended the run early (after a final checkpoint), if one did."""
    saves: list[SaveReport] = field(default_factory=list)
