"""What a run reports: device peak FLOPs (for MFU), process peak memory, the JSONL log, and a
progress display for people.

MFU (PaLM, Chowdhery et al. 2022, appendix B) = model FLOPs per second / the device's dense peak.
For GPUs the peak comes from the hardware catalog (hardware/catalog.py DEVICES: the
vendors' published dense numbers, sources cited there); for a CPU it is measured by a short
matmul probe in the run's precision, once per machine, and cached.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import re
import resource
import sys
import warnings
from pathlib import Path
from typing import Any, TextIO

import torch

from shardlm.hardware.probe import cpu_peak_flops

log = logging.getLogger("shardlm")


def peak_flops(device: torch.device, precision: str) -> float:
    """Dense peak FLOP/s of one device in `precision` ('fp32', 'bf16', 'fp16')."""
    if device.type == "cuda":
        return gpu_peak_flops(torch.cuda.get_device_name(device), precision)
    return cpu_peak_flops(precision)


@functools.lru_cache(maxsize=None)
def remeasured_cpu_peak(precision: str, threads: int) -> float:
    """This CPU's matmul peak measured anew, once a process (the cache takes the new figure)."""
    return cpu_peak_flops(precision, threads, again=True)


def restate_cpu_peak(run, record: dict) -> None:
    """A CPU run whose MFU is above 1 proves the cached peak low: measured while other work
    shared the cores (seen: 59 GFLOP/s cached at 2 threads against 83 measured alone at one,
    the README's first command then reporting MFU 112-115%). The peak is measured again, once
    a process; the larger is kept and the record's MFU and HFU restated, with a warning."""
    old = run.peak_flops_per_device
    new = remeasured_cpu_peak(run.precision.gemm, torch.get_num_threads())
    if new <= old:  # measured again already, or the FLOP count is what is high: left as it is
        return
    run.peak_flops_per_device = new
    warnings.warn(f"MFU {record['mfu']:.0%} is above 100%: this CPU's cached {run.precision.gemm} peak "
                  f"({old / 1e9:,.1f} GFLOP/s) was measured while other work shared its cores; "
                  f"measured again: {new / 1e9:,.1f} GFLOP/s (the cache now holds it)", stacklevel=2)
    for key in ("mfu", "hfu"):
        record[key] *= old / new


def gpu_peak_flops(name: str, precision: str) -> float:
    """The catalog's dense peak for the GPU torch calls `name`. NaN, with a warning, when the
    catalog has no such GPU or the GPU has no hardware for `precision` (V100 bf16 is emulated):
    MFU is then not reported rather than reported against a wrong peak."""
    from shardlm.hardware.catalog import DEVICES, device_for_gpu_name

    device = device_for_gpu_name(name)
    if device is None:
        gpus = ", ".join(d.name for d in DEVICES.values() if d.kind in ("cuda", "rocm"))
        warnings.warn(f"GPU {name!r} is not in the hardware catalog ({gpus}): MFU is not "
                      f"reported; add it to shardlm.hardware.catalog.DEVICES", stacklevel=2)
        return math.nan
    if precision not in device.peak:
        warnings.warn(f"GPU {name!r} ({device.name}) has no {precision} hardware (it has "
                      f"{', '.join(device.peak)}): MFU is not reported", stacklevel=2)
        return math.nan
    return device.peak[precision]


def reset_peak_rss() -> bool:
    """Reset this process's high-water mark (VmHWM) to its current RSS, so the next
    peak_rss_bytes is what follows (Linux: "5" to /proc/self/clear_refs); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """This process's peak resident set size: VmHWM of /proc/self/status where there is one
    (Linux), else getrusage's ru_maxrss (macOS reports bytes, others KiB).

    Not ru_maxrss on Linux: fork + exec carries the parent's resident set into the child's
    ru_maxrss (the kernel keeps the larger of the two at exec), so a run started by a large
    process (a test session, a notebook, a study) would report at least its parent's memory.
    VmHWM belongs to the process's own address space, made new at exec."""
    try:
        with open("/proc/self/status") as f:
            return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) * 1024
    except (OSError, AttributeError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def device_memory_record(device: torch.device) -> dict:
    """On CUDA: {'peak_device_bytes': the most torch's allocator has held on `device` since the
    process started (torch.cuda.max_memory_allocated)}; on the CPU nothing (peak_rss_bytes is it)."""
    if device.type != "cuda":
        return {}
    return {"peak_device_bytes": torch.cuda.max_memory_allocated(device)}


def _ends_mid_line(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(0, 2)
        if f.tell() == 0:
            return False
        f.seek(-1, 2)
        return f.read(1) != b"\n"


class MetricsLog:
    """One JSON object per line; flushed per write so a crashed run keeps its log. `first`'s
    keys join the first record written (the planner's "predicted" for the run), in place: the
    trackers that log the same record next hold them too. Appending to a log whose last record
    was cut off (launch/failures.py is_cut_off), it first ends that line."""

    def __init__(self, path: Path | None, first: dict[str, Any] | None = None):
        self.path = path
        self._file: TextIO | None = open(path, "a", buffering=1) if path else None
        if self._file is not None and _ends_mid_line(path):
            self._file.write("\n")
            log.warning("%s: its last record was cut off (the run was killed while writing it): "
                        "left as it is, this run's records start on the next line", path)
        self._first = first or {}

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            record.update(self._first)
            self._first = {}
            # NaN/inf are not JSON: a non-finite value (an fp16 overflow step) is written as null.
            clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v
                     for k, v in record.items()}
            self._file.write(json.dumps(clean, allow_nan=False) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def prediction_summary(predicted: dict[str, Any], step_times: list[float], device: torch.device) -> str:
    """The end-of-run line: measured / predicted step time (the median of the steps after the
    first) and peak memory per rank against the planner's prediction in the run's first JSONL
    record. On a CPU: the process's peak RSS against the whole predicted peak. On a GPU: what
    torch's allocator reserved at most (torch.cuda.max_memory_reserved: blocks cached and
    fragmented included) against the predicted peak less the runtime reserve (the CUDA context
    and library workspaces, which the allocator does not see)."""
    if "unavailable" in predicted or not predicted.get("step_time_s") or not predicted.get("peak_bytes_per_rank"):
        return f"planner: no prediction for this run ({predicted.get('unavailable', 'no step time or peak')})"
    step = sorted(step_times)[len(step_times) // 2]
    if device.type == "cuda":
        peak, what = torch.cuda.max_memory_reserved(device), "allocator reserved"
        expected = predicted["peak_bytes_per_rank"] - (predicted.get("runtime_reserve_bytes") or 0)
    else:
        peak, what, expected = peak_rss_bytes(), "process RSS", predicted["peak_bytes_per_rank"]
    hint = predicted.get("calibrate_command")  # the pass the prediction lacked (planner.in_situ)
    return (f"measured / predicted (planner, {predicted['hardware']}): step "
            f"{step:.3g} / {predicted['step_time_s']:.3g} s = {step / predicted['step_time_s']:.2f}, "
            f"peak per rank ({what}) {peak / 2**20:,.0f} / {expected / 2**20:,.0f} MiB = {peak / expected:.2f}"
            + (f" (this model's pass was never timed here: `{hint}` times it, and later predictions "
               f"use it)" if hint else ""))


class ProgressDisplay:
    """A rich progress bar with loss, tokens/s and MFU on a terminal; on a pipe (CI, logs),
    a plain line at every tenth of the run instead."""

    def __init__(self, total_steps: int, mode: str, enabled: bool = True):
        interactive = sys.stderr.isatty() if mode == "auto" else mode == "on"
        self.enabled = enabled and mode != "off"
        self.total = total_steps
        self.every = max(1, total_steps // 10)
        self._bar = None
        if self.enabled and interactive:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeRemainingColumn)

            self._bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[status]}"), TimeRemainingColumn(),
                                 transient=False)
            self._task = self._bar.add_task("train", total=total_steps, status="")
            self._bar.start()

    def update(self, step: int, status: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(self._task, completed=step + 1, status=status)
        elif (step + 1) % self.every == 0 or step == 0:
            print(f"step {step + 1}/{self.total} {status}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
