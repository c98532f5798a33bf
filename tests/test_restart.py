"""Faults through the real command line: SIGTERM writes a last checkpoint and `--resume`
finishes the run; a SIGKILLed worker under `--nproc 2 --max-restarts 2` is restarted with its
gang and the run ends with the same final loss as an uninterrupted one (bitwise: the same
layout resumes exactly)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import tiny_overrides

STEPS = 60


def _args(tmp_path, name: str, **extra) -> list[str]:
    overrides = tiny_overrides(tmp_path, train__steps=STEPS, train__seq_len=64,
                               train__micro_batch=32, train__eval_batches=1,
                               run__name=name, **extra)
    return [f"--{k}={v}" for k, v in overrides.items()]


def _shardlm(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "shardlm", "train", *args], env=dict(os.environ),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not any(r["step"] >= step for r in _records(run_dir)):
        assert proc.poll() is None, f"the run ended before step {step}:\n{proc.stdout.read()}"
        assert time.monotonic() < deadline, f"no step {step} within {timeout} s"
        time.sleep(0.01)


def _final_loss(run_dir: Path) -> float:
    last = _records(run_dir)[-1]
    assert last["step"] == STEPS
    return last["loss"]


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def test_sigterm_saves_and_resume_finishes_equal(tmp_path):
    straight = _shardlm(*_args(tmp_path, "straight"))
    assert straight.wait(timeout=300) == 0, straight.stdout.read()
    run_dir = tmp_path / "runs" / "stopped"
    proc = _shardlm(*_args(tmp_path, "stopped"))
    _wait_for_step(proc, run_dir, 10)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out
    assert "stopped by SIGTERM" in out and "shardlm train --resume" in out
    stopped_at = _records(run_dir)[-1]["checkpoint_step"]
    assert 10 <= stopped_at < STEPS
    resumed = _shardlm(*_args(tmp_path, "ignored"), "--run.name=", "--resume", str(run_dir))
    out = resumed.communicate(timeout=300)[0]
    assert resumed.returncode == 0, out
    assert _final_loss(run_dir) == _final_loss(tmp_path / "runs" / "straight")


def test_killed_worker_restarts_and_finishes_equal(tmp_path):
    every = ["--checkpoint.every=5"]
    straight = _shardlm("--nproc=2", *_args(tmp_path, "straight"), *every)
    assert straight.wait(timeout=300) == 0, straight.stdout.read()
    run_dir = tmp_path / "runs" / "killed"
    proc = _shardlm("--nproc=2", "--max-restarts=2", *_args(tmp_path, "killed"), *every)
    _wait_for_step(proc, run_dir, 12)
    workers = _children(proc.pid)
    assert len(workers) == 2, workers
    os.kill(workers[-1], signal.SIGKILL)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out
    steps = [r["step"] for r in _records(run_dir)]
    resumed_at = next(b for a, b in zip(steps, steps[1:]) if b <= a)  # the log goes back once
    assert resumed_at > 1 and (resumed_at - 1) % 5 == 0, steps
    assert _final_loss(run_dir) == _final_loss(tmp_path / "runs" / "straight")
