"""`shardlm compare RUN_A RUN_B`: two runs' metrics.jsonl side by side.

Per logged step: loss, grad norm, tokens/s and memory (the process's peak RSS, and the device's
peak where the run had one) of both runs; then a summary. The runs match when every step both
logged has the same loss within a tolerance, as numpy.isclose: |a - b| <= atol + rtol * |b|
(b the loss of RUN_B; defaults DEFAULT_RTOL and DEFAULT_ATOL), and both logged the same steps.
The first step where they diverge, and every other one, is named. Exit status 0 when they
match, 1 when they diverge, 2 for an input that is not a run's log (shardlm.cli.main): a CI script
can compare a run against a reference run.

Only the loss decides; grad norm, speed and memory are shown, not judged (speed and memory
differ between any two runs). A resumed run logs again the steps after its checkpoint: the last
record of a step is the one that counts (the resumed run's). A step's loss is null in the JSONL
when it was not finite: two nulls match, a null and a number do not.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from shardlm.errors import ConfigError
from shardlm.launch.failures import is_cut_off

LOG = "metrics.jsonl"
"""The file `shardlm train` writes in the run directory (rank 0: train.loop.train)."""
DEFAULT_RTOL = 1e-5
DEFAULT_ATOL = 1e-8
"""numpy.isclose's defaults: a few ulps of fp32 at loss values near 1-10, so the same run
repeated (same seed, data and layout: bitwise on the CPU) matches, and any real change does not."""
MIB = 2**20


@dataclass
class RunLog:
    path: Path
    """The JSONL file read."""
    steps: dict[int, dict] = field(default_factory=dict)
    """step -> its last record."""
    repeated: int = 0
    """Records of a step logged again (a resume)."""
    cut_off: int = 0
    """Records cut off mid-line (launch/failures.py is_cut_off: a process killed writing them)."""


@dataclass
class Comparison:
    a: RunLog
    b: RunLog
    rtol: float
    atol: float
    common: list[int]
    diverged: list[int]
    """Common steps whose losses differ beyond the tolerance, in order."""

    @property
    def only_a(self) -> list[int]:
        return sorted(set(self.a.steps) - set(self.b.steps))

    @property
    def only_b(self) -> list[int]:
        return sorted(set(self.b.steps) - set(self.a.steps))

    @property
    def match(self) -> bool:
        return bool(self.common) and not self.diverged and not self.only_a and not self.only_b


def read_run(path: str | Path, label: str = "RUN") -> RunLog:
    """A run directory's metrics.jsonl (or a .jsonl file given itself), by step. A path without
    one, an empty log, a line that is not a JSON object with a 'step' is a ConfigError; a record
    cut off by a kill (is_cut_off) is skipped and counted."""
    path = Path(path)
    file = path / LOG if path.is_dir() else path
    if not path.exists():
        raise ConfigError(f"{label} {str(path)!r} does not exist (give a run directory, such as "
                          f"runs/latest, or its {LOG})")
    if not file.is_file():
        raise ConfigError(f"{label} {str(path)!r} has no {LOG}: not a run directory written by "
                          f"`shardlm train` (rank 0 writes {LOG} at the first logged step), or the "
                          f"run ended before it logged one")
    log = RunLog(file)
    try:
        f = open(file, "rb")  # bytes: a line of binary garbage is named, not a traceback
    except OSError as e:
        raise ConfigError(f"{label} {file} cannot be read: {e.strerror or e}") from None
    with f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(f"{file}:{lineno}: not UTF-8 text (byte {e.start} of the line: "
                                  f"{raw[e.start:e.start + 4]!r}): binary data, not a {LOG} of "
                                  f"`shardlm train` (damaged by a crash or a bad copy?)") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                if is_cut_off(line):
                    log.cut_off += 1
                    continue
                raise ConfigError(f"{file}:{lineno}: not JSON ({e.msg}): is this a {LOG} of "
                                  f"`shardlm train`?") from None
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ConfigError(f"{file}:{lineno}: a record without an integer 'step': is this a "
                                  f"{LOG} of `shardlm train`?")
            log.repeated += record["step"] in log.steps
            log.steps[record["step"]] = record
    if not log.steps:
        raise ConfigError(f"{label} {file} is empty: the run logged no step")
    return log


def losses_match(a: float | None, b: float | None, rtol: float, atol: float) -> bool:
    if a is None or b is None:  # not finite (written as null)
        return a is None and b is None
    return abs(a - b) <= atol + rtol * abs(b)


def compare_runs(a: RunLog, b: RunLog, rtol: float = DEFAULT_RTOL, atol: float = DEFAULT_ATOL) -> Comparison:
    if rtol < 0 or atol < 0 or not (math.isfinite(rtol) and math.isfinite(atol)):
        raise ConfigError(f"--rtol {rtol} and --atol {atol} must be finite and >= 0")
    common = sorted(set(a.steps) & set(b.steps))
    diverged = [s for s in common if not losses_match(a.steps[s].get("loss"), b.steps[s].get("loss"), rtol, atol)]
    return Comparison(a, b, rtol, atol, common, diverged)


def _number(value: float | None, digits: int = 6) -> str:
    return "null" if value is None else f"{value:.{digits}g}"


def _memory(record: dict) -> str:
    """Peak RSS (and the device's peak, on a GPU) in MiB."""
    rss = record.get("peak_rss_bytes")
    text = "-" if rss is None else f"{rss / MIB:,.0f}"
    device = record.get("peak_device_bytes")
    return text if device is None else f"{text} / {device / MIB:,.0f}"


def _mean_speed(log: RunLog) -> float | None:
    """Mean tokens/s over the steps after the first (which pays warm-up), as train() reports."""
    speeds = [r["tokens_per_s"] for s, r in sorted(log.steps.items()) if r.get("tokens_per_s") is not None]
    speeds = speeds[1:] if len(speeds) > 1 else speeds
    return sum(speeds) / len(speeds) if speeds else None


def render(c: Comparison, diverging_only: bool = False) -> str:
    """The per-step table (every common step, or only the diverging ones) and the summary."""
    header = ("step", "loss A", "loss B", "|Δ loss|", "grad_norm A", "grad_norm B", "tok/s A", "tok/s B",
              "mem MiB A", "mem MiB B", "")
    rows = []
    for step in c.common:
        if diverging_only and step not in c.diverged:
            continue
        ra, rb = c.a.steps[step], c.b.steps[step]
        la, lb = ra.get("loss"), rb.get("loss")
        delta = "-" if la is None or lb is None else f"{abs(la - lb):.3g}"
        flag = ("FIRST DIVERGENCE" if c.diverged and step == c.diverged[0]
                else "diverges" if step in c.diverged else "")
        rows.append((str(step), _number(la), _number(lb), delta, _number(ra.get("grad_norm"), 4),
                     _number(rb.get("grad_norm"), 4), _number(ra.get("tokens_per_s"), 4),
                     _number(rb.get("tokens_per_s"), 4), _memory(ra), _memory(rb), flag))
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [f"A: {c.a.path}", f"B: {c.b.path}", ""]
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    lines += ["", *summary(c)]
    return "\n".join(lines)


def summary(c: Comparison) -> list[str]:
    tolerance = f"|a - b| <= {c.atol:g} + {c.rtol:g}·|b|"
    out = [f"steps compared: {len(c.common)} (loss tolerance {tolerance})"]
    for label, only in (("A", c.only_a), ("B", c.only_b)):
        if only:
            out.append(f"steps only in {label}: {len(only)} ({_steps(only)})")
    for label, log in (("A", c.a), ("B", c.b)):
        if log.cut_off:
            out.append(f"{label} has {log.cut_off} record(s) cut off mid-line (a process killed while "
                       f"writing it): skipped")
        if log.repeated:
            out.append(f"{label} logged {log.repeated} step(s) again (a resume): the last record of each counts")
    pairs = [(c.a.steps[s].get("loss"), c.b.steps[s].get("loss")) for s in c.common]
    finite = [(x, y) for x, y in pairs if x is not None and y is not None]
    if finite:
        worst = max(abs(x - y) for x, y in finite)
        out.append(f"max |Δ loss|: {worst:.3g}")
    if c.common:
        last = c.common[-1]
        out.append(f"last common step {last}: loss A {_number(c.a.steps[last].get('loss'))}, "
                   f"B {_number(c.b.steps[last].get('loss'))}")
    speeds = [_mean_speed(c.a), _mean_speed(c.b)]
    if None not in speeds:
        out.append(f"mean tokens/s (after the first step): A {speeds[0]:,.1f}, B {speeds[1]:,.1f}")
    peaks = [max((r.get("peak_rss_bytes") or 0) for r in log.steps.values()) for log in (c.a, c.b)]
    out.append(f"peak RSS: A {peaks[0] / MIB:,.0f} MiB, B {peaks[1] / MIB:,.0f} MiB")
    if c.diverged:
        first = c.diverged[0]
        out.append(f"DIVERGED at step {first} (loss A {_number(c.a.steps[first].get('loss'))}, "
                   f"B {_number(c.b.steps[first].get('loss'))}); {len(c.diverged)} of {len(c.common)} "
                   f"steps beyond the tolerance: {_steps(c.diverged)}")
    elif not c.common:
        out.append("NO STEP IN COMMON: the runs logged different steps (train.log_every?)")
    elif c.only_a or c.only_b:
        out.append("DIFFERENT STEPS: the losses of the steps both logged match, but the runs did not "
                   "log the same steps")
    else:
        out.append("MATCH: every step's loss within the tolerance")
    return out


def _steps(steps: list[int], shown: int = 20) -> str:
    text = ", ".join(map(str, steps[:shown]))
    return text + (f", ... ({len(steps) - shown} more)" if len(steps) > shown else "")


def compare_args(sub) -> None:
    """`shardlm compare`: its options (registered by shardlm.cli.main)."""
    p = sub.add_parser(
        "compare", help="two runs' metrics.jsonl side by side; exit status 1 where their losses diverge",
        description="Loss, grad norm, tokens/s and memory per logged step of two runs, and a summary "
                    "naming the first step (and every step) where the losses differ by more than "
                    "atol + rtol·|loss B|. Exit status 0 if they match, 1 if they diverge (or logged "
                    "different steps), 2 if a path is not a run's log.")
    p.add_argument("run_a", metavar="RUN_A", help="a run directory (its metrics.jsonl), or a .jsonl file")
    p.add_argument("run_b", metavar="RUN_B", help="the run to compare with (the reference: rtol scales its loss)")
    p.add_argument("--rtol", type=float, default=DEFAULT_RTOL,
                   help=f"relative loss tolerance (default {DEFAULT_RTOL:g})")
    p.add_argument("--atol", type=float, default=DEFAULT_ATOL,
                   help=f"absolute loss tolerance (default {DEFAULT_ATOL:g})")
    p.add_argument("--diverging-only", action="store_true", help="list only the steps beyond the tolerance")


def cmd_compare(args: argparse.Namespace) -> int:
    c = compare_runs(read_run(args.run_a, "RUN_A"), read_run(args.run_b, "RUN_B"), args.rtol, args.atol)
    print(render(c, args.diverging_only))
    return 0 if c.match else 1
