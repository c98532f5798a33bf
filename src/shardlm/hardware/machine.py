"""This machine, as the catalog's `local_cpu(n_ranks)` describes it from hardware/probe.py's
measurements: the memory the OS can give now, the disk the nvme tier streams through (measured
by `shardlm calibrate --disk`, else assumed), and the rules for a CPU's ranks (their share of the
cores, their memory rates floored by one thread's, how a bf16 run multiplies). Nothing here
imports torch or the catalog.
"""

from __future__ import annotations

import os

from shardlm.hardware.disk_probe import stream_rate


def _meminfo(key: str) -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_memory() -> float:
    """Bytes the OS can give processes now (MemAvailable), read at every call, never cached."""
    value = _meminfo("MemAvailable")
    if value is None:
        value = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return value


LOCAL_DISK_BANDWIDTH = 1.2e9
"""Read + write bytes/s of the disk the nvme tier streams through where `shardlm calibrate
--disk` never measured it (a disk probe writes GBs, so only when asked): bench/bench_offload.py
measured this machine's at 0.95-1.37 GB/s with O_DIRECT 64 MiB blocks reading and writing at
once, and the tier's own optimizer stream at 1.17-1.19 GB/s (runs/bench_offload.log)."""


def local_disk(streams: dict[int, dict], n_ranks: int) -> tuple[float, str]:
    """(read + write bytes/s in all while `n_ranks` ranks stream at once, its source): from the
    stream counts calibrate measured (hardware/disk_probe.py; linear between them), else
    LOCAL_DISK_BANDWIDTH. The planner gives each of the node's ranks 1/n of it."""
    if not streams:
        return LOCAL_DISK_BANDWIDTH, (f"{LOCAL_DISK_BANDWIDTH / 1e9:.2g} GB/s read + write assumed; "
                                      f"`shardlm calibrate --disk DIR` measures it")
    rate = stream_rate({n: v["bytes_per_s"] for n, v in streams.items()}, n_ranks)
    where = next(iter(streams.values()))["directory"]
    return rate, (f"{rate / 1e9:.2f} GB/s read + write with {n_ranks} rank(s) streaming at once, measured "
                  f"under {where} by `shardlm calibrate --disk`")


def local_disk_lone(streams: dict[int, dict], n_ranks: int) -> float:
    """Read + write bytes/s in all while `n_ranks` ranks each have one request in flight, one
    direction (0 where the disk was never measured). The disk probe's k streams are k readers
    and k writers at once, 2k requests in flight, reaching stream_rate(k); n requests are n/2
    streams' worth, by the same curve, and under one stream (one request: the nvme tier's first
    read or last write on a lone rank) in proportion to the requests, half a stream's rate: a
    lone stream is bound by its requests' latency, not the drive (an AMD EPYC's drive served one
    stream 1.30 GB/s, two 1.49, four 1.49)."""
    if not streams:
        return 0.0
    rates = {n: v["bytes_per_s"] for n, v in streams.items()}
    k, first = n_ranks / 2, min(rates)
    return rates[first] * k / first if k < first else stream_rate(rates, k)


def at_least_one_thread(rates: dict, one: dict) -> dict:
    """A rank's memory rates at t threads, none slower than at one thread: a rank can always run
    an op on one of its threads (a bound, not a fit), and one thread's short tries are the ones
    a shared machine disturbs least (the t-thread tries need t cores free at once)."""
    if not rates or not one:
        return rates
    best = dict(rates)
    best["elementwise"] = [[n, max(bw, dict((m, b) for m, b in one["elementwise"]).get(n, 0.0))]
                           for n, bw in rates["elementwise"]]
    best["fresh_bandwidth"] = max(rates["fresh_bandwidth"], one["fresh_bandwidth"])
    best["adamw"] = [[n, min(sec, dict((m, t) for m, t in one["adamw"]).get(n, sec))] for n, sec in rates["adamw"]]
    best["op_seconds"] = min(rates["op_seconds"], one["op_seconds"])
    return best


def cpu_share(n_ranks: int, cores: int) -> float:
    """Fraction of a probe-timed thread each of `n_ranks` local ranks gets: min(1, cores / n).
    The probe times matmuls at max(1, cores // n) threads on an idle machine; with more ranks
    than cores the processes time-share the cores (and gloo's copies run on them too)."""
    return min(1.0, cores / max(1, n_ranks))


def cpu_bf16_gemm(peak: dict[str, float]) -> str:
    """What precision.cpu_bf16_gemm = 'auto' means on a CPU whose native matmul peaks are `peak`:
    'fp32' (bf16 operands multiplied in fp32 GEMMs, models/precision.fp32_gemm) where torch's
    bf16 kernel is slower than its fp32 one (no AVX-512-BF16 or AMX), else 'native'."""
    return "fp32" if peak.get("bf16", 0.0) < peak["fp32"] else "native"
