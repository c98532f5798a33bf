"""This machine, measured: the CPU's matmul peak per precision, memory bandwidth, gloo between
two local ranks, a worker's baseline RSS. One module, one cache file
(`<shardlm cache>/hardware_probe.json`), used by telemetry (MFU's denominator), by the trainer
(what precision.compute = 'auto' resolves to, decided once per run on rank 0) and by the planner
(hardware/catalog.py local_cpu).

A timing never decides arithmetic on its own: the trainer reads the probe on one rank, records
the decision in the run's resolved config and its checkpoints, and a resume keeps it.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

from shardlm.files import atomic_write
from shardlm.launch import cache_root, cpu_cores

MIB = 2**20
_MATMUL_MAX = 2048
_VERSION = 4
"""Bumped when what is measured changes: older entries are ignored."""
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), part of every cache key."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_path() -> Path:
    return cache_root() / "hardware_probe.json"


def _cached(key: str, measure) -> dict | float:
    """The cache's entry for `key`, measured (and written) on first use. Concurrent ranks may
    both measure; the file is replaced atomically, so a reader never sees a torn table."""
    path = _cache_path()
    full_key = f"v{_VERSION}|{cpu_name()}|torch {torch.__version__}|{key}"
    table = json.loads(path.read_text()) if path.is_file() else {}
    if full_key not in table:
        value = measure()
        table = json.loads(path.read_text()) if path.is_file() else {}
        table[full_key] = value
        atomic_write(path, json.dumps(table, indent=1))
    return table[full_key]


def _time_matmul(dtype: torch.dtype, seconds: float = 0.5) -> float:
    """Best sustained FLOP/s of a square matmul on the CPU with the current thread count. The
    size grows from 256 while one product takes under 50 ms, up to 2048: a dtype the CPU only
    emulates (bf16 without AVX-512-BF16 or AMX: ~1 GFLOP/s) is measured in a second, not in the
    minute a 2048 product would take, and a fast one at a size that fills the cores."""
    size = 256
    while True:
        a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
        a @ b  # warm up kernels and caches
        start = time.perf_counter()
        a @ b
        if size >= _MATMUL_MAX or time.perf_counter() - start > 0.05:
            break
        size *= 2
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        a @ b
        best = max(best, 2 * size**3 / (time.perf_counter() - start))
    return best


def cpu_peak_flops(precision: str, threads: int | None = None) -> float:
    """Dense matmul peak FLOP/s of this CPU in `precision` at `threads` threads (default: the
    current torch thread count); measured once per (CPU, torch, threads, precision)."""
    threads = threads or torch.get_num_threads()

    def measure() -> float:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return _time_matmul(DTYPES[precision])
        finally:
            torch.set_num_threads(before)

    return float(_cached(f"threads={threads}|matmul {precision}", measure))


def measure_cpu(n_ranks: int) -> dict:
    """This CPU's numbers for `n_ranks` local ranks: matmul peak per precision at
    cores // n_ranks threads, and (once per machine) a 256 MiB copy's memory bandwidth, gloo
    all-reduce latency and bandwidth between two spawned ranks, and those ranks' baseline RSS
    (a few seconds the first time)."""
    # Ranks first: they must not start from this process's big buffers.
    machine = _cached(f"cores={cpu_cores()}|machine", lambda: {**_gloo_probe(),
                                                               "memory_bandwidth": _memory_bandwidth()})
    threads = max(1, cpu_cores() // n_ranks)
    return {**machine, "cpu": cpu_name(), "cores": cpu_cores(), "threads": threads,
            "peak": {p: cpu_peak_flops(p, threads) for p in DTYPES}}


def _memory_bandwidth(nbytes: int = 256 * MIB, repeats: int = 5) -> float:
    """Best copy rate (read + write bytes / s) of a buffer far larger than the caches."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def _gloo_rank(rank: int, world_size: int) -> dict[str, float]:
    """On a spawned rank: the best of five timings of a one-float all-reduce (latency) and of
    an 8 MiB all-reduce, all-gather (4 MiB shards) and reduce-scatter (8 MiB input), and this
    rank's RSS with torch, gloo and a worker's libraries imported — the floor of any worker's
    memory."""
    import numpy  # noqa: F401  (a worker's libraries are part of its baseline)
    import safetensors.torch  # noqa: F401
    import tokenizers  # noqa: F401
    import torch.distributed as dist

    # Resident now, not ru_maxrss: a spawned child's high-water mark can start at its parent's.
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    n = 8 * MIB // 4
    small, full, shard = torch.zeros(1), torch.zeros(n), torch.zeros(n // world_size)
    ops = {"latency": lambda: dist.all_reduce(small), "all_reduce": lambda: dist.all_reduce(full),
           "all_gather": lambda: dist.all_gather_into_tensor(full, shard),
           "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full)}
    out = {}
    for name, op in ops.items():
        op()  # warm up
        times = []
        for _ in range(5):
            start = time.perf_counter()
            op()
            times.append(time.perf_counter() - start)
        out[name] = min(times)
    return {**out, "rss": float(rss), "bytes": float(n * 4)}


def _gloo_probe() -> dict[str, float]:
    """Ring-model latency and bus bandwidth from the all-reduces (2(N-1) steps, 2(N-1)/N of
    the bytes each way), and how much slower gloo's all-gather and reduce-scatter are than a
    ring of that bandwidth would be."""
    import tempfile

    from shardlm.spawn import run_ranks

    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(_gloo_rank, world, tmp)
    worst = {k: max(r[k] for r in results) for k in results[0]}
    steps = 2 * (world - 1)
    latency = worst["latency"] / steps
    bandwidth = steps / world * worst["bytes"] / max(worst["all_reduce"] - steps * latency, 1e-9)
    ring = (world - 1) * latency + (world - 1) / world * worst["bytes"] / bandwidth
    return {"gloo_latency": latency, "gloo_bandwidth": bandwidth, "baseline_rss": worst["rss"],
            "gloo_all_gather_factor": max(1.0, worst["all_gather"] / ring),
            "gloo_reduce_scatter_factor": max(1.0, worst["reduce_scatter"] / ring)}
