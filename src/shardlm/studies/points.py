"""A study's measured points: each one `shardlm train` run in its own process, its JSONL
summarised, kept in the output directory's points.jsonl so that a rerun skips it; the
largest-batch search (exponential, then bisection) shared by measurement and prediction; a
progress bar.

A point is (label, world size, config overrides): its key is a hash of what it trains, so a
changed spec makes new points and never reuses a stale one. The command that reproduces a point
is the one the runner ran, minus the run directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

MiB = 2**20

COMMON = {"precision.compute": "fp32", "train.eval_every": 0, "train.eval_batches": 1,
          "train.sample_tokens": 0, "train.warmup_steps": 1, "train.log_every": 1,
          "checkpoint.every": 0, "run.progress": "off", "run.device": "cpu"}
"""Every measured point: fp32 (pinned, not the CPU-dependent 'auto'), no evaluation beyond the
last step's one batch, no sample, every step logged, no checkpoint."""


@dataclass(frozen=True)
class Point:
    label: str
    """What the point is, for people: 'zero2 b=8'."""
    ranks: int
    overrides: tuple[tuple[str, object], ...]
    """`--key=value` settings of `shardlm train`, COMMON included."""

    @staticmethod
    def make(label: str, ranks: int, settings: dict) -> "Point":
        return Point(label, ranks, tuple(sorted({**COMMON, **settings}.items())))

    @property
    def key(self) -> str:
        blob = json.dumps([self.ranks, [[k, v] for k, v in self.overrides]])
        slug = "".join(c if c.isalnum() else "-" for c in self.label).strip("-")
        return f"{slug}-{hashlib.sha1(blob.encode()).hexdigest()[:8]}"

    @property
    def cores(self) -> list[int] | None:
        """One core per rank: the cores a point of r ranks is pinned to when this process may
        use more than r (None: all of them). torch gives each rank cores // ranks threads, so
        unpinned, one rank would get every core as threads while two ranks get one each; on a
        shared machine a process's threads then wait on each other (measured here: gpt-mini on
        one rank, 84 tokens/s with 2 threads under load, 421 pinned to one core), and a rank's
        compute would differ with the rank count."""
        available = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        return available[:self.ranks] if self.ranks < len(available) else None

    def argv(self) -> list[str]:
        args = [f"--{k}={v}" for k, v in self.overrides]
        return args + (["--nproc", str(self.ranks)] if self.ranks > 1 else [])

    @property
    def command(self) -> str:
        pin = f"taskset -c {','.join(map(str, self.cores))} " if self.cores else ""
        return pin + "shardlm train " + " ".join(self.argv())


def summarise(records: list[dict]) -> dict:
    """One point's figures from its rank-0 JSONL records: medians over the steps after the first
    (which pays for setup and warm-up) of tokens/s, MFU, HFU and step time; the largest peak RSS
    (the rank-0 process's high-water mark, VmHWM); the model-state byte ledger and the last step's
    communication bytes (every step sends the same)."""
    steady = records[1:] or records
    def med(key: str) -> float | None:  # None: not reported (a NaN MFU is written as null)
        values = [r[key] for r in steady if r.get(key) is not None]
        return statistics.median(values) if values else None

    last = records[-1]
    return {"steps": len(records), "tokens_per_s": med("tokens_per_s"), "mfu": med("mfu"),
            "hfu": med("hfu"), "step_time_s": med("step_time_s"),
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in records),
            "model_state_bytes": last["model_state_bytes"], "comm_bytes": last["comm_bytes"],
            "comm_bytes_by_op": last.get("comm_bytes_by_op", {}), "loss": last["loss"]}


MMAP_THRESHOLD = 65536
"""The malloc mmap threshold a study's runs have (their environment's, which wins over the
config): blocks from 64 KiB go back to the OS, so a point's RSS follows the bytes alive; the
planner predicts the points at it (predict.predict_here)."""
Runner = Callable[[Point, Path], dict]
"""(point, output directory) -> a summary (summarise's keys) or {'error': why}."""


def subprocess_runner(point: Point, out: Path) -> dict:
    """Train the point as `python -m shardlm train ...` in a fresh process (or `--nproc N` of
    them): nothing of one point's memory leaks into the next. The rank-0 JSONL is kept as
    raw/<key>.jsonl; the run directory (weights) is removed."""
    run_dir = out / "runs"
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}  # RSS follows what is alive
    argv = [sys.executable, "-m", "shardlm", "train", *point.argv(), f"--run.dir={run_dir}",
            f"--run.name={point.key}"]
    cores = point.cores
    done = subprocess.run(argv, env=env, capture_output=True, text=True,
                          preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)
    metrics = run_dir / point.key / "metrics.jsonl"
    try:
        if done.returncode != 0 or not metrics.exists():
            lines = [line for line in (done.stderr + done.stdout).splitlines() if "error" in line.lower()]
            why = (lines or (done.stderr + done.stdout).splitlines()[-3:] or ["no output"])[0]
            return {"error": f"exit status {done.returncode}: {why.strip()[:300]}"}
        raw = out / "raw" / f"{point.key}.jsonl"
        raw.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(metrics, raw)
        return summarise([json.loads(line) for line in raw.read_text().splitlines() if line.strip()])
    finally:
        shutil.rmtree(run_dir / point.key, ignore_errors=True)
        try:
            run_dir.rmdir()  # the last point's: nothing else lives there
        except OSError:
            pass


@dataclass
class PointStore:
    """points.jsonl in the output directory: one line per finished point (key, label, ranks,
    overrides, command, result). Loaded at start; a point already there is not run again.
    Failed points are recorded too but retried on the next run."""

    out: Path
    runner: Runner = subprocess_runner
    progress: "Progress | None" = None
    done: dict[str, dict] = field(default_factory=dict)
    ran: int = 0
    """Points run (not taken from the file) in this process."""

    def __post_init__(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / "points.jsonl"
        if path.exists():
            for line in path.read_text().splitlines():
                if line.strip():
                    row = json.loads(line)
                    if "error" not in row["result"]:
                        self.done[row["key"]] = row

    def measure(self, point: Point) -> dict:
        if point.key in self.done:
            result = self.done[point.key]["result"]
        else:
            if self.progress is not None:
                self.progress.start(point.label)
            result = self.runner(point, self.out)
            self.ran += 1
            row = {"key": point.key, "label": point.label, "ranks": point.ranks,
                   "overrides": dict(point.overrides), "command": point.command, "result": result}
            with open(self.out / "points.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            if "error" not in result:
                self.done[point.key] = row
        if self.progress is not None:
            self.progress.advance()
        return result


def largest_fitting(fits: Callable[[int], bool], limit: int) -> tuple[int, list[int]]:
    """The largest b in [1, limit] with fits(b), for a fits that is monotone (true up to a
    boundary, false beyond): probe 1, 2, 4, ... until a miss or `limit`, then bisect between the
    last fit and the first miss. Returns (b, or 0 when 1 does not fit; the probes in order)."""
    if limit < 1:
        raise ValueError(f"limit {limit} must be >= 1")
    probes: list[int] = []

    def test(b: int) -> bool:
        probes.append(b)
        return fits(b)

    if not test(1):
        return 0, probes
    good, bad = 1, None
    while bad is None and good < limit:
        nxt = min(2 * good, limit)
        if test(nxt):
            good = nxt
        else:
            bad = nxt
    while bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        if test(mid):
            good = mid
        else:
            bad = mid
    return good, probes


class Progress:
    """A rich progress bar over a study's points on a terminal; one line per point otherwise.
    The total grows as searches decide to probe more."""

    def __init__(self, title: str, total: int = 0):
        self.title, self.total, self.count = title, total, 0
        self._bar = None
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeElapsedColumn

            self._bar = Bar(TextColumn(title), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[point]}"), TimeElapsedColumn(),
                            console=Console(stderr=True))
            self._task = self._bar.add_task(title, total=total or None, point="")
            self._bar.start()

    def expect(self, more: int) -> None:
        self.total += more
        if self._bar is not None:
            self._bar.update(self._task, total=self.total)

    def start(self, label: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, point=label)
        else:
            print(f"{self.title}: point {self.count + 1}: {label}", file=sys.stderr, flush=True)

    def advance(self) -> None:
        self.count += 1
        if self._bar is not None:
            self._bar.update(self._task, completed=self.count, total=max(self.total, self.count))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
