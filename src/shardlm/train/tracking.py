"""Experiment tracking and profiling: the JSONL's scalars and the resolved config to TensorBoard,
Weights & Biases or MLflow (run.tracker); a torch.profiler Chrome trace of chosen steps
(run.profile_steps); and each step's time split by phase (run.time_split).

Every tracker has one small interface — log_config(config), log_scalars(step, record), close() —
and imports its package only when a run asks for it (each is an optional extra; config
validation names the `pip install` of one that is missing). Only rank 0 tracks. docs/tracking.md.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

import torch

from shardlm.config.load import flatten
from shardlm.config.fields import TRACKERS, profile_step_numbers, tracker_install_hint, tracker_names
from shardlm.errors import ConfigError
from shardlm.launch.runtime import tracker_environment

log = logging.getLogger("shardlm")


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a JSONL record, flattened: {'comm_bytes_by_op': {'all_gather/dp': 8}} ->
    'comm_bytes_by_op/all_gather/dp', a list's items by index ('pp_bubble_by_stage/0'), booleans
    as 0/1. The step is the trackers' x axis, not a scalar; None (a non-finite value) is left out."""
    out: dict[str, float] = {}

    def visit(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                visit(f"{prefix}/{key}", item)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                visit(f"{prefix}/{i}", item)
        elif isinstance(value, (bool, int, float)):
            out[prefix] = float(value)

    for key, value in record.items():
        if key != "step":
            visit(key, value)
    return out


def flat_config(config: dict[str, dict[str, Any]]) -> dict[str, bool | int | float | str]:
    """Config.to_dict() as 'section.key' -> a scalar (lists and None as their text); a nested
    section's keys as 'section.nested.key'."""
    return {key: value if isinstance(value, (bool, int, float, str)) else str(value)
            for key, value in flatten(config).items()}


class Tracker(Protocol):
    def log_config(self, config: dict[str, dict[str, Any]]) -> None: ...
    def log_scalars(self, step: int, record: dict[str, Any]) -> None: ...
    def close(self, failed: bool = False) -> None: ...


class TensorBoardTracker:
    """Event files in run_dir/tensorboard (torch's SummaryWriter); the config as hparams (in the
    same event file, so it belongs to this run) and as JSON text."""

    def __init__(self, run_dir: Path, env: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log_config(self, config: dict[str, dict[str, Any]]) -> None:
        from torch.utils.tensorboard.summary import hparams

        for summary in hparams(flat_config(config), {}):
            self.writer.file_writer.add_summary(summary)
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=1) + "\n```")
        self.writer.flush()

    def log_scalars(self, step: int, record: dict[str, Any]) -> None:
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # as the JSONL: a crashed run keeps what it logged

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run in run_dir/wandb: offline (`wandb sync` uploads it later) unless WANDB_MODE or
    WANDB_API_KEY is set, so a run never needs a network or a login."""

    def __init__(self, run_dir: Path, env: dict):
        import wandb

        self.run = wandb.init(project=env["wandb_project"], name=run_dir.name, dir=str(run_dir),
                              mode=None if env["wandb_configured"] else "offline",
                              settings=wandb.Settings(console="off"))  # our log is the JSONL

    def log_config(self, config: dict[str, dict[str, Any]]) -> None:
        self.run.config.update(config)

    def log_scalars(self, step: int, record: dict[str, Any]) -> None:
        self.run.log(scalars(record), step=step)

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class MlflowTracker:
    """An MLflow run (named after the run directory) in a file store at run_dir/mlruns, or at
    MLFLOW_TRACKING_URI; the config as params ('section.key')."""

    PARAMS_PER_CALL, METRICS_PER_CALL = 100, 1000  # MLflow's log_batch limits

    def __init__(self, run_dir: Path, env: dict):
        from mlflow.tracking import MlflowClient

        uri = env["mlflow_uri"]
        if not uri:
            uri = (run_dir / "mlruns").absolute().as_uri()
            # MLflow 3 keeps the file store in maintenance mode behind this opt-in; the light
            # mlflow-skinny extra has no database store, and a run directory needs no server.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(env["mlflow_experiment"])
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(env["mlflow_experiment"]))
        self.run_id = self.client.create_run(experiment_id, run_name=run_dir.name).info.run_id

    def log_config(self, config: dict[str, dict[str, Any]]) -> None:
        from mlflow.entities import Param

        params = [Param(k, str(v)) for k, v in flat_config(config).items()]
        for i in range(0, len(params), self.PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=params[i:i + self.PARAMS_PER_CALL])

    def log_scalars(self, step: int, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in scalars(record).items()]
        for i in range(0, len(metrics), self.METRICS_PER_CALL):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + self.METRICS_PER_CALL])

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


_OPEN = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker}
assert set(_OPEN) == set(TRACKERS), "config_rules.TRACKERS and the trackers here name the same set"


class Trackers:
    """The run's trackers as one (none at all on ranks other than 0, or with run.tracker = 'none')."""

    def __init__(self, trackers: list[Tracker]):
        self.trackers = trackers

    def log_config(self, config: dict[str, dict[str, Any]]) -> None:
        for tracker in self.trackers:
            tracker.log_config(config)

    def log_scalars(self, step: int, record: dict[str, Any]) -> None:
        for tracker in self.trackers:
            tracker.log_scalars(step, record)

    def close(self, failed: bool = False) -> None:
        """Close every tracker, even when one fails to (the first error is raised after)."""
        errors = []
        for tracker in self.trackers:
            try:
                tracker.close(failed)
            except Exception as e:  # the others must still write their files
                errors.append(e)
        self.trackers = []
        if errors:
            raise errors[0]


def open_trackers(names: str, run_dir: Path, enabled: bool = True) -> Trackers:
    """The trackers run.tracker names, writing under `run_dir`; none unless `enabled` (rank 0)."""
    if not enabled:
        return Trackers([])
    env, opened = tracker_environment(), []
    try:
        for name in tracker_names(names):
            try:
                opened.append(_OPEN[name](run_dir, env))
            except ImportError as e:  # validate() checked; an install can still be broken
                raise ConfigError(f"run.tracker = {names!r}: {name} cannot be imported ({e}): "
                                  f"{tracker_install_hint(name)}") from e
    except BaseException:
        Trackers(opened).close(failed=True)
        raise
    return Trackers(opened)


# -- profiling --------------------------------------------------------------------------------


class StepProfiler:
    """torch.profiler over run.profile_steps (numbered as the JSONL's `step`, from 1): one
    Chrome trace per run of consecutive steps, run_dir/profile/steps-A-B-rank-NNNNN.json
    (load it in Perfetto or chrome://tracing). Each step is a `step N` range in the trace."""

    def __init__(self, steps: str, run_dir: Path, rank: int, device: torch.device):
        self.steps = set(profile_step_numbers(steps))
        self.dir, self.rank, self.device = run_dir / "profile", rank, device
        self.paths: list[Path] = []
        self._profile, self._first, self._last, self._mark = None, 0, 0, None

    def begin(self, step: int) -> None:
        """Before step number `step` (from 1)."""
        if step in self.steps and self._profile is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profile = torch.profiler.profile(activities=activities)
            self._profile.start()
            self._first = step
        if self._profile is not None:
            self._last = step
            self._mark = torch.profiler.record_function(f"step {step}")
            self._mark.__enter__()

    def end(self, step: int) -> None:
        """After step `step`: the trace is written when the next step is not profiled."""
        if self._mark is not None:
            self._mark.__exit__(None, None, None)
            self._mark = None
        if self._profile is not None and step + 1 not in self.steps:
            self.close()

    def close(self) -> None:
        """Stop and write the trace in progress, if any (also what a crash has collected)."""
        if self._profile is None:
            return
        if self._mark is not None:
            self._mark.__exit__(None, None, None)
            self._mark = None
        self._profile.stop()
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"steps-{self._first}-{self._last}-rank-{self.rank:05d}.json"
        self._profile.export_chrome_trace(str(path))
        self._profile = None
        self.paths.append(path)
        log.info("profile: steps %d-%d of rank %d -> %s", self._first, self._last, self.rank, path)


# -- the time split ---------------------------------------------------------------------------

PHASES = ("forward", "backward", "optimizer")


def time_split_on(mode: str, device: torch.device) -> bool:
    """run.time_split: 'auto' times where the device computes synchronously (the CPU); elsewhere
    timing needs a device synchronize at each phase boundary, done only when asked ('on')."""
    return mode == "on" or (mode == "auto" and device.type == "cpu")


def device_synchronize(device: torch.device) -> Callable[[], None] | None:
    """What waits for the device's queued work (None on the CPU: nothing is queued)."""
    if device.type == "cpu":
        return None
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "synchronize"):
        return lambda: accelerator.synchronize(device)
    return lambda: getattr(torch, device.type).synchronize(device)


class StepTimes:
    """One step's seconds by phase. Phases are disjoint: a phase inside another (the pipeline's
    forwards inside its schedule) is taken out of the outer one, and so is every communication
    wait (the ledger's wait_s, counted once as time_comm_wait_s). What is in no phase and no
    wait (data, the loss's all-reduce, MoE bookkeeping) is time_other_s, so the five sum to
    step_time_s."""

    def __init__(self, ledger, enabled: bool, synchronize: Callable[[], None] | None = None):
        """`ledger`: the run's comm.collectives.CommLedger (its waits are timed there, bracketed
        by `synchronize` where the device is asynchronous)."""
        self.ledger, self.enabled, self.synchronize = ledger, enabled, synchronize
        if enabled:
            ledger.synchronize = synchronize
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._wait_start = self.waited = 0.0

    def start(self) -> None:
        if self.enabled:
            self.seconds = dict.fromkeys(PHASES, 0.0)
            self._wait_start, self.waited = self.ledger.wait_s, 0.0

    def stop(self) -> None:
        if self.enabled:
            self.waited = self.ledger.wait_s - self._wait_start

    def timed(self, name: str, fn: Callable) -> Callable:
        """`fn` with each call timed as phase `name` (a pipeline schedule's forwards)."""
        if not self.enabled:
            return fn

        def call(*args, **kwargs):
            with self.phase(name):
                return fn(*args, **kwargs)
        return call

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        if self.synchronize is not None:
            self.synchronize()
        start, waits, inner = time.perf_counter(), self.ledger.wait_s, sum(self.seconds.values())
        try:
            with torch.profiler.record_function(name):  # a range in a profiler trace
                yield
        finally:
            if self.synchronize is not None:
                self.synchronize()
            elapsed = time.perf_counter() - start
            self.seconds[name] += (elapsed - (self.ledger.wait_s - waits)
                                   - (sum(self.seconds.values()) - inner))

    def record(self, step_seconds: float) -> dict[str, float]:
        """The JSONL keys ({} when off)."""
        if not self.enabled:
            return {}
        out = {f"time_{name}_s": max(0.0, s) for name, s in self.seconds.items()}
        out["time_comm_wait_s"] = self.waited
        out["time_other_s"] = max(0.0, step_seconds - math.fsum(out.values()))
        return out
