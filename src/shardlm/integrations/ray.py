"""Ray Train: `shardlm train`'s config run as a Ray Train `TorchTrainer` (pip install
'shardlm[ray]'; docs/launch.md, Ray).

Workers are ranks: `ScalingConfig(num_workers=N, use_gpu=...)`, GPUs when the config's run.device
asks for them or ('auto') when the cluster has them. Ray starts the workers, sets the launcher's
variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT) and joins them in a
process group (gloo on CPU workers, nccl on GPU workers) before our entry runs; `init_runtime`
takes that group as it is. Each worker then runs what one rank of `shardlm train` runs
(cli/train.py: `preflight`, then `train_here`), with a hook that reports each step to Ray
(`ray.train.report`: loss, tokens/s, ...) and, on a checkpoint step, our sharded checkpoint as
Ray's checkpoint: Ray's experiment directory is the run directory (storage_path = run.dir,
name = run.name), so `Checkpoint.from_directory(run_dir/checkpoints/step-N)` is inside it and is
registered where it is (CheckpointUploadMode.NO_UPLOAD: nothing copied).

A restart (FailureConfig(max_failures)) starts a new worker group on the same run directory:
rank 0 counts the group's attempts in the run directory (`ATTEMPTS`) and every worker sets
RESTART_COUNT_ENV from it, so the run resumes from its own newest usable checkpoint as it does
under torchrun's --max-restarts (train/checkpointing.py), and a planned fault (tests) fires once.
Running the same driver again continues the run the same way (the run name is fixed).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from shardlm.errors import ConfigError

ATTEMPTS = ".ray-attempts"
"""In the run directory: how many worker groups Ray Train has started on this run (rank 0's)."""
METRICS = ("loss", "tokens_per_s", "mfu", "lr", "grad_norm", "step_time_s", "val_loss",
           "checkpoint_step")
"""What each step reports to Ray (from the step's metrics.jsonl record), besides `step`."""


def split_args(train_args: list[str]) -> tuple[str | None, list[str]]:
    """`shardlm train`'s arguments as (the config file or None, the --section.key=value overrides)."""
    if train_args and not train_args[0].startswith("-"):
        return train_args[0], list(train_args[1:])
    return None, list(train_args)


def wants_gpu(device: str, cluster_gpus: float) -> bool:
    """Whether the workers take a GPU each: run.device 'cpu' never, 'cuda' always (refused on a
    cluster without GPUs), 'auto' when the cluster has GPUs."""
    if device == "cpu":
        return False
    if device.startswith("cuda") and cluster_gpus < 1:
        raise ConfigError(f"run.device = {device!r} but the Ray cluster has no GPU; use "
                          f"run.device = 'auto' or 'cpu'")
    return device.startswith("cuda") or cluster_gpus >= 1


def worker_args(train_args: list[str], num_workers: int, max_failures: int) -> tuple[list[str], Any]:
    """The workers' train arguments, checked here before any worker starts (as `shardlm train
    --nproc N` checks them): the config valid, its layout fitting N ranks, a checkpoint to restart
    from when restarts are allowed; the config path and run.dir made absolute (a worker's working
    directory is not the driver's) and run.name fixed (every restart finds the same run)."""
    from shardlm.config.load import load_config, parse_overrides
    from shardlm.config.dims import resolve_dims
    from shardlm.launch.run_dir import unique_run_name

    if num_workers < 1 or max_failures < 0:
        raise ConfigError(f"num_workers {num_workers} must be >= 1 and max_failures {max_failures} >= 0")
    config, overrides = split_args(train_args)
    cfg = load_config(config, parse_overrides(overrides)).validate()
    resolve_dims(cfg.parallel, num_workers)
    if cfg.parallel.fault_tolerant:
        raise ConfigError("parallel.fault_tolerant runs a process group per replica, restarted alone "
                          "(parallel/data/fault_tolerant/launcher.py); Ray Train makes one group of every worker: use "
                          "`shardlm train --nproc N` or torchrun for it")
    if max_failures and not cfg.checkpoint.every:
        raise ConfigError(f"max_failures {max_failures} restarts the workers from the latest checkpoint, "
                          f"but checkpoint.every = 0 saves none: add --checkpoint.every=N")
    config = str(Path(config).resolve()) if config else None
    overrides += [f"--run.dir={Path(cfg.run.dir).resolve()}",
                  f"--run.name={cfg.run.name or unique_run_name()}"]
    cfg = load_config(config, parse_overrides(overrides)).validate()
    return ([config] if config else []) + overrides, cfg


def fit(train_args: list[str], num_workers: int, max_failures: int = 0, use_gpu: bool | None = None,
        env: dict[str, str] | None = None):
    """Train `train_args` (what follows `shardlm train`) on `num_workers` Ray Train workers, on the
    cluster `ray.init()` finds (RAY_ADDRESS, a running local cluster, or a new local one), with up
    to `max_failures` restarts; `env`: environment variables for the workers (e.g. NCCL_*).
    Returns Ray's `Result`: `.metrics` the last step's report,
    `.checkpoint` the newest checkpoint (a directory of the run), `.path` the run directory.
    Raises ray.train.TrainingFailedError when the run fails more often than allowed."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from shardlm.launch.runtime import process_group_timeout_s

    args, cfg = worker_args(train_args, num_workers, max_failures)
    if not ray.is_initialized():
        ray.init()
    if use_gpu is None:
        use_gpu = wants_gpu(cfg.run.device, ray.cluster_resources().get("GPU", 0.0))
    timeout_s = cfg.parallel.collective_timeout_s
    trainer = TorchTrainer(
        worker, train_loop_config={"args": args},
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu),
        # The group's timeout as ours (runtime.process_group_timeout_s); Ray's default else.
        torch_config=TorchConfig(
            timeout_s=math.ceil(process_group_timeout_s(timeout_s)) if timeout_s > 0 else 1800),
        # Ray's experiment directory is the run directory; our checkpoint.keep rotates the
        # checkpoints (Ray keeps its records of them all: num_to_keep None, it deletes none).
        run_config=RunConfig(name=cfg.run.name, storage_path=cfg.run.dir,
                             failure_config=FailureConfig(max_failures=max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=None),
                             worker_runtime_env={"env_vars": dict(env)} if env else None))
    return trainer.fit()


def worker(loop_config: dict) -> None:
    """One rank, in a Ray Train worker (the process group exists): count the attempt, then
    `shardlm train`'s per-rank entry with the reporting hook, then the last report."""
    import ray.train
    from ray.train.collective import broadcast_from_rank_zero

    from shardlm.cli.train import preflight, train_here
    from shardlm.config.load import load_config, parse_overrides
    from shardlm.launch.runtime import RESTART_COUNT_ENV

    config, overrides = split_args(loop_config["args"])
    cfg = load_config(config, parse_overrides(overrides)).validate()
    run_dir = Path(cfg.run.dir) / cfg.run.name
    main = ray.train.get_context().get_world_rank() == 0
    attempt = broadcast_from_rank_zero(next_attempt(run_dir) if main else None)
    os.environ[RESTART_COUNT_ENV] = str(attempt)
    if main and attempt:
        given = ray.train.get_checkpoint()
        print(f"shardlm: Ray Train restart {attempt}: resuming {run_dir} from its newest usable "
              f"checkpoint (Ray's latest: {given.path if given else 'none'})", flush=True)
    preflight(cfg, 0)
    reports = Reports()
    train_here(cfg, on_step=reports.step)
    reports.finish()


def next_attempt(run_dir: Path) -> int:
    """Rank 0: this worker group's attempt on `run_dir` (0 the first), counted in its ATTEMPTS."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / ATTEMPTS
    try:
        attempt = int(path.read_text().strip() or 0)
    except (FileNotFoundError, ValueError):
        attempt = 0
    tmp = path.with_name(f"{ATTEMPTS}.{os.getpid()}.tmp")
    tmp.write_text(f"{attempt + 1}\n")
    os.replace(tmp, path)
    return attempt


class Reports:
    """The hook of `train` (train.loop) that reports each step to Ray Train: every rank calls
    `ray.train.report` once per step (it is a barrier) and once more at the end; rank 0 attaches
    a checkpoint once it is published (a synchronous save: at its step; checkpoint.async: at a
    later step, or at the end)."""

    def __init__(self) -> None:
        self.pending: Path | None = None
        self.last: dict[str, Any] = {}

    def step(self, run, record: dict) -> None:
        from shardlm.checkpoint.manifest import CHECKPOINTS, step_dir_name

        if "checkpoint_step" in record and run.runtime.is_main:
            self.pending = run.run_dir / CHECKPOINTS / step_dir_name(record["checkpoint_step"])
        self.last = {"step": record["step"], **{k: record[k] for k in METRICS if k in record}}
        self._report(self.last)

    def finish(self) -> None:
        """After training: the last checkpoint if it is not reported yet, with the last metrics."""
        self._report({**self.last, "done": True})

    def _report(self, metrics: dict) -> None:
        import ray.train
        from ray.train import Checkpoint, CheckpointUploadMode

        checkpoint = None
        if self.pending is not None and self.pending.is_dir():  # published (renamed into place)
            checkpoint, self.pending = Checkpoint.from_directory(str(self.pending)), None
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=None,
                         checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)
