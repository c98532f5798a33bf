"""Faults through the real command line: SIGTERM writes a last checkpoint and `--resume`
finishes the run; a SIGKILLed worker under `--nproc 2 --max-restarts 2` is restarted with its
gang and the run ends with the same final loss as an uninterrupted one (bitwise: the same
layout, thread count and batches resume exactly).

Where the fault lands is fixed, not raced: $SHARDLM_FAULT=stop@N (launch.Fault) makes each
worker SIGSTOP itself once step N is done and logged, the test delivers its signal to the frozen
run and lets it go on. So a few small steps suffice (before: 60 steps of 32 sequences, so that
a signal sent after step 10 was seen would land before the run's end however fast the machine)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from cli_runs import children as _children
from conftest import tiny_overrides
from shardlm.launch.runtime import FAULT_ENV

STEPS = 10
PAUSE = 5
"""The workers freeze once step PAUSE is done: the SIGTERM, or the SIGKILL of one worker,
comes then."""
EVERY = 3
"""The killed run's checkpoint interval: the last whole checkpoint before PAUSE is step 3 (its
save done two steps before the kill, as before: 10 for a kill after step 12)."""


def _args(tmp_path, name: str, **extra) -> list[str]:
    overrides = tiny_overrides(tmp_path, train__steps=STEPS, train__seq_len=64,
                               train__eval_batches=1, run__name=name, **extra)
    return [f"--{k}={v}" for k, v in overrides.items()]


def _shardlm(*args: str, fault: str = "") -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
    if fault:
        env[FAULT_ENV] = fault
    return subprocess.Popen([sys.executable, "-m", "shardlm", "train", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _final_loss(run_dir: Path) -> float:
    last = _records(run_dir)[-1]
    assert last["step"] == STEPS
    return last["loss"]


def _stopped(pid: int) -> bool:
    """Whether the process is frozen by a stop signal (state T in /proc/<pid>/stat)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


def _wait_until_frozen(proc: subprocess.Popen, pids, count: int, timeout: float = 240) -> list[int]:
    """`pids()`'s processes once `count` of them are all frozen (stop@PAUSE has struck)."""
    deadline = time.monotonic() + timeout
    while True:
        found = pids()
        if len(found) == count and all(_stopped(p) for p in found):
            return found
        assert proc.poll() is None, f"the run ended before step {PAUSE}:\n{proc.stdout.read()}"
        assert time.monotonic() < deadline, f"not frozen after step {PAUSE} within {timeout} s"
        time.sleep(0.01)


def test_sigterm_saves_and_resume_finishes_equal(tmp_path):
    straight = _shardlm(*_args(tmp_path, "straight"))
    assert straight.wait(timeout=300) == 0, straight.stdout.read()
    run_dir = tmp_path / "runs" / "stopped"
    proc = _shardlm(*_args(tmp_path, "stopped"), fault=f"stop@{PAUSE}")
    (pid,) = _wait_until_frozen(proc, lambda: [proc.pid], 1)  # one process trains (no --nproc)
    assert _records(run_dir)[-1]["step"] == PAUSE
    os.kill(pid, signal.SIGTERM)  # pending while frozen: handled as soon as it runs again
    os.kill(pid, signal.SIGCONT)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out
    assert "stopped by SIGTERM" in out and "shardlm train --resume" in out
    stopped_at = _records(run_dir)[-1]["checkpoint_step"]
    assert PAUSE < stopped_at < STEPS  # it finished the step it was in, saved, and exited
    resumed = _shardlm(*_args(tmp_path, "ignored"), "--run.name=", "--resume", str(run_dir))
    out = resumed.communicate(timeout=300)[0]
    assert resumed.returncode == 0, out
    assert _final_loss(run_dir) == _final_loss(tmp_path / "runs" / "straight")


def test_killed_worker_restarts_and_finishes_equal(tmp_path):
    every = [f"--checkpoint.every={EVERY}"]
    straight = _shardlm("--nproc=2", *_args(tmp_path, "straight"), *every)
    assert straight.wait(timeout=300) == 0, straight.stdout.read()
    run_dir = tmp_path / "runs" / "killed"
    # stop@PAUSE fires in the first gang only (round 0): the restarted one runs through.
    proc = _shardlm("--nproc=2", "--max-restarts=2", *_args(tmp_path, "killed"), *every,
                    fault=f"stop@{PAUSE}")
    workers = _wait_until_frozen(proc, lambda: _children(proc.pid), 2)
    os.kill(workers[-1], signal.SIGKILL)  # one worker dies; the other goes on into a dead gang
    os.kill(workers[0], signal.SIGCONT)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out
    steps = [r["step"] for r in _records(run_dir)]
    resumed_at = next(b for a, b in zip(steps, steps[1:]) if b <= a)  # the log goes back once
    assert resumed_at > 1 and (resumed_at - 1) % EVERY == 0, steps
    assert _final_loss(run_dir) == _final_loss(tmp_path / "runs" / "straight")
