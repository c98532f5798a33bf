"""Ray Train for real (shardlm.integrations.ray): a local Ray cluster on this machine (2 CPUs, no
dashboard, shut down at the end), two CPU workers joined by Ray in a gloo group, training the tiny
model. The same config under `shardlm train --nproc 2` is the reference: the same losses, step
for step, through a run whose workers are SIGKILLed after step 3 ($SHARDLM_FAULT=kill@3): Ray's
FailureConfig(max_failures=1) starts a new worker group, which resumes from the step-2
checkpoint (the one Ray was told of) and finishes with the reference's losses.

Ray's own start-up is most of the wall time (its processes, then one controller and a worker
group per run, each importing ray and torch); the reference run starts first and overlaps it.
The cluster's tests are skipped where Ray Train is not installed (pip install 'shardlm[ray]'; the
test extra has it); the driver's checks need no Ray.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import tiny_overrides
from shardlm.errors import ConfigError
from shardlm.integrations.ray import ATTEMPTS, fit, wants_gpu, worker_args
from shardlm.launch.runtime import FAULT_ENV

STEPS, EVERY = 6, 2
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
           "RAY_TRAIN_METRICS_ENABLED": "0", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
           "CUDA_VISIBLE_DEVICES": ""}
"""For the cluster's processes (they inherit the environment ray.init starts them in): no usage
report, none of Ray Train's optional watcher and metrics actors (each a process importing ray, on
2 cores), the controller polling its workers every 0.5 s instead of 2 s (it sees a finished or a
dead group sooner), no GPU."""


def _args(root: Path, name: str) -> list[str]:
    overrides = tiny_overrides(root, train__steps=STEPS, checkpoint__every=EVERY, run__name=name)
    return [f"--{k}={v}" for k, v in overrides.items()]


def _losses(run_dir: Path) -> dict[int, float]:
    """step -> loss from metrics.jsonl; a step logged twice (before a kill, then again after the
    restart) keeps its last record."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def test_gpus_follow_the_config_and_the_cluster():
    assert not wants_gpu("cpu", 8) and not wants_gpu("auto", 0)
    assert wants_gpu("auto", 8) and wants_gpu("cuda", 8)
    with pytest.raises(ConfigError, match="has no GPU"):
        wants_gpu("cuda", 0)


def test_the_driver_checks_the_config_and_fixes_the_run(tmp_path, monkeypatch):
    """Before any worker starts (no Ray needed): the config valid for N ranks, a checkpoint to
    restart from when restarts are allowed; paths absolute, the run name fixed."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.toml").write_text("[train]\nsteps = 5\n")
    args, cfg = worker_args(["c.toml", "--checkpoint.every=2"], 2, 1)
    assert args[0] == str(tmp_path / "c.toml") and cfg.train.steps == 5
    assert cfg.run.dir == str(tmp_path / "runs") and cfg.run.name and f"--run.name={cfg.run.name}" in args
    with pytest.raises(ConfigError, match="checkpoint.every = 0"):
        worker_args([], 2, 1)
    with pytest.raises(ConfigError, match="not divisible"):
        worker_args(["--parallel.dp_replicate=4"], 6, 0)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The reference `shardlm train --nproc 2` run, started first, then a local Ray cluster while
    it trains. Yields (the reference's losses, the runs' root). Skipped without Ray Train."""
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.train.torch")
    root = tmp_path_factory.mktemp("ray")
    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
    reference = subprocess.Popen([sys.executable, "-m", "shardlm", "train", "--nproc", "2",
                                  *_args(root, "reference")], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
    with pytest.MonkeyPatch.context() as mp:
        for key, value in RAY_ENV.items():
            mp.setenv(key, value)
        mp.delenv(FAULT_ENV, raising=False)
        ray.init(num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=True)
        try:
            out, _ = reference.communicate(timeout=300)
            assert reference.returncode == 0, out
            yield _losses(root / "runs" / "reference"), root
        finally:
            ray.shutdown()
            if reference.poll() is None:
                reference.kill()


def test_ray_train_matches_shardlm_train_nproc_2_through_a_killed_worker_group(cluster):
    """One Ray run for both claims (each run is a controller and a worker group starting on 2
    cores): its losses are the reference's, and they stay so through a restart."""
    reference, root = cluster
    # Every worker SIGKILLs itself once step 3 is done and reported (in the first group only:
    # kill@3 is round 0, the restarted group is round 1). The last checkpoint before: step 2.
    result = fit(_args(root, "killed"), num_workers=2, max_failures=1, env={FAULT_ENV: "kill@3"})
    run_dir = root / "runs" / "killed"
    assert (run_dir / ATTEMPTS).read_text().strip() == "2"  # Ray started a second group
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    # The first group logged 1..3; the second resumed after step 2 (not 0): 3..STEPS again.
    assert steps == [1, 2, 3, *range(3, STEPS + 1)]
    # Bitwise: both runs are 2 ranks of 1 thread each (cores // local ranks, on the same cores;
    # the perturbed mode's SHARDLM_CPU_CORES reaches both), the same batches per rank, and
    # gloo's all-reduce over 2 ranks: the same operations on the same operands, in the same
    # order, whichever CPU runs them. Only who started the processes and formed the group differs.
    # The first group's steps before the kill, and the resumed group's after it (restored
    # optimizer, RNG and data position), each equal the reference's.
    assert [r["loss"] for r in records if "loss" in r][:3] == [reference[s] for s in (1, 2, 3)]
    assert _losses(run_dir) == reference
    # Ray saw every step, and our last checkpoint, where it lies: nothing was copied.
    assert result.metrics["step"] == STEPS and result.metrics["loss"] == reference[STEPS]
    assert result.metrics["tokens_per_s"] > 0
    assert Path(result.checkpoint.path) == run_dir / "checkpoints" / f"step-{STEPS:08d}"
    assert (Path(result.checkpoint.path) / "manifest.json").exists()
