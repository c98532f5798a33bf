"""This machine, measured: the CPU's matmul peak per precision, memory bandwidth, gloo between
two local ranks, a worker's baseline RSS. One module, one cache file
(`<shardlm cache>/hardware_probe.json`, or $SHARDLM_PROBE_CACHE: hardware/probe_cache.py), used
by telemetry (MFU's denominator), by the trainer (what precision.compute = 'auto' resolves to,
decided once per run on rank 0), by the planner (hardware/catalog.py local_cpu), and by
`shardlm calibrate` (matmul_curve: the model's own matmul shapes, best of N, load reported; on
a CPU or a GPU).

A timing never decides arithmetic on its own: the trainer reads the probe on one rank, records
the decision in the run's resolved config and its checkpoints, and a resume keeps it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

import torch

from shardlm.hardware.gloo_probe import gloo_probe, in_step_probe
from shardlm.hardware import probe_cache
from shardlm.hardware.probe_cache import cpu_name
from shardlm.launch.cache_files import file_lock, write_json_cache
from shardlm.launch.runtime import cpu_cores

MIB = 2**20
_MATMUL_MAX = 2048
_VERSION = probe_cache.VERSION
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _cache_path() -> Path:
    return probe_cache.cache_path()


def _cached(key: str, measure, machine: str | None = None, again: bool = False) -> dict | float:
    """The cache's entry for `key` on `machine` (default: this CPU's model), measured (and
    written) on first use, or anew with `again`. One process measures at a time (_measuring):
    another that misses the same entry meanwhile waits, then reads what the first wrote. The
    file is replaced atomically, so a reader never sees a torn table. A damaged file (cut short
    by a crash, garbage) is moved aside with a warning and measured again
    (launch/cache_files.py); an entry of the wrong shape is measured again."""
    full_key = f"v{_VERSION}|{machine or cpu_name()}|torch {torch.__version__}|{key}"

    def missing(table: dict) -> bool:
        return full_key not in table or not probe_cache.plausible(table[full_key])

    table = _table()
    if again or missing(table):
        with _measuring():
            table = _table()
            if again or missing(table):
                value = measure()
                table = _table()
                table[full_key] = value
                write_json_cache(_cache_path(), table, "hardware probe cache")
    return table[full_key]


_HELD = threading.RLock()
_depth = 0


@contextlib.contextmanager
def _measuring():
    """The probe's measuring lock: an flock on `<cache file>.lock`, so that of the processes
    missing an entry at once (the test suite's workers sharing a probe file, two runs started
    together) one measures and the rest wait, instead of all measuring on the cores they share
    (which slows each and skews what it measures). Held while measuring only (a read never
    waits), and re-entrant in a process (a measurement that reads another entry). Where the lock
    file cannot be created (a read-only cache) processes measure unlocked, as before it."""
    global _depth
    path = _cache_path()
    with _HELD:
        outer = _depth == 0
        _depth += 1
        try:
            with (file_lock(path.with_name(path.name + ".lock"), optional=True) if outer
                  else contextlib.nullcontext()):
                yield
        finally:
            _depth -= 1


def _table() -> dict:
    """The whole cache, as on disk now ({} where there is none, or it was damaged)."""
    return probe_cache.read_table(_cache_path())


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


def cpu_peak_flops(precision: str, threads: int | None = None, again: bool = False) -> float:
    """Dense matmul peak FLOP/s of this CPU in `precision` at `threads` threads (default: the
    current torch thread count); measured once per (CPU, torch, threads, precision), or anew
    with `again`."""
    threads = threads or torch.get_num_threads()

    def measure() -> float:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return _time_matmul(DTYPES[precision])
        finally:
            torch.set_num_threads(before)

    return float(_cached(f"threads={threads}|matmul {precision}", measure, again=again))


def measure_cpu(n_ranks: int) -> dict:
    """This CPU's numbers for `n_ranks` local ranks: matmul peak per precision and the
    memory-bound rates (memory_probe) at cores // n_ranks threads, and (once per machine) a
    256 MiB copy's memory bandwidth, gloo's latency and bandwidth between two spawned ranks
    (back to back, and among matmuls: _in_step), and those ranks' baseline RSS (a few seconds
    the first time); with more ranks than cores, the collectives among matmuls of that many
    ranks (oversubscribed_in_step, once per rank count); the disk's stream rates where
    `shardlm calibrate --disk` measured them (disk_streams)."""
    # Ranks first: they must not start from this process's big buffers.
    machine = _cached(f"cores={cpu_cores()}|machine", lambda: {**gloo_probe(),
                                                               "memory_bandwidth": _memory_bandwidth()})
    if n_ranks > cpu_cores():  # its collectives as they are with the cores time-shared
        machine = {**machine, **oversubscribed_in_step(n_ranks, machine["gloo_latency"], machine["gloo_bandwidth"]),
                   "in_step_ranks": n_ranks}
    threads = max(1, cpu_cores() // n_ranks)
    peak = {p: cpu_peak_flops(p, threads) for p in DTYPES}
    return {**machine, "cpu": cpu_name(), "cores": cpu_cores(), "threads": threads, "peak": peak,
            "passes": cached_passes(threads), "disk": disk_streams(),
            "curve": {p: machine_curve(p, threads, peak[p]) for p in DTYPES},
            "memory": memory_probe(threads), **({"memory_one_thread": memory_probe(1)} if threads > 1 else {})}


# ---------------------------------------------------------------------------------------------
# The memory-bound side of a step (docs/planner.md section 4a): what the matmul curve does not time

ELEMENTWISE_SIZES = tuple(2**k * MIB for k in (0, 3, 6))
"""Tensor sizes of the element-wise curve (1, 8, 64 MiB): a step's element-wise work runs on
tensors from a cache's size up; the machine's 256 MiB copy (measure_cpu) is its DRAM end."""
ELEMENTWISE_WORKING_SET = 64 * MIB
"""Bytes of inputs the element-wise probe rotates through (as many tensors of a size as fit,
at least two): a step's activations were written long before the op reads them, not by the
op just before it, so they come from beyond the core's cache."""
ADAMW_SIZES = (2**18, 2**21, 2**24)
"""Parameters of the fused-AdamW curve (its state 16 bytes each: 4 MiB to 256 MiB)."""
FRESH_BYTES = 1 * MIB
"""The fresh-mapping probe's block, an activation's size (the mapping's own system calls
included, as each tensor pays them): page faults cost per page, and a block of ~0.1 ms lets many
tries fit, one of them uninterrupted on a shared machine."""
OP_CHAIN = 50
"""Differentiable tiny ops in the per-op probe's chain."""


def memory_probe(threads: int, again: bool = False) -> dict:
    """This CPU's memory-bound rates at `threads` threads, measured once per (CPU, torch,
    threads) and cached (`shardlm calibrate` prints them; the planner's step time reads them,
    docs/planner.md section 4a):

    - elementwise: [bytes, read + write bytes/s] of element-wise ops on tensors of each
      ELEMENTWISE_SIZES (best of ≥ 5 tries and 0.15 s, _best): the rate of a step's element-wise
      work at its tensors' size, cache to DRAM (_elementwise_bandwidth);
    - fresh_bandwidth: bytes/s of writing freshly mapped memory (an anonymous mapping, first
      written, then unmapped: what glibc does for every block above the mmap threshold, which a
      training process fixes at start-up, docs/allocator.md): page faults, the kernel's zeroing
      and the unmap, per byte;
    - adamw: [parameters, seconds per parameter] of torch's fused AdamW (the runtime's
      optimizer, parallel/data/zero/optim.py) over one fp32 flat parameter of each ADAMW_SIZES;
    - op_seconds: per dispatched op, a chain of OP_CHAIN multiplications on 8 elements run
      forward and back (2·OP_CHAIN ops): the eager dispatch, autograd's recording and its
      backward node, nothing of the arithmetic."""

    def measure() -> dict:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return {"elementwise": [[n, _elementwise_bandwidth(n)] for n in ELEMENTWISE_SIZES],
                    "fresh_bandwidth": _fresh_bandwidth(FRESH_BYTES),
                    "adamw": [[n, _adamw_seconds_per_param(n)] for n in ADAMW_SIZES],
                    "op_seconds": _op_seconds(), "threads": threads,
                    "load_average": machine_load()[0], "measured_at": time.time()}
        finally:
            torch.set_num_threads(before)

    return _cached(f"threads={threads}|memory rates", measure, again=again)


def _best(fn, repeats: int = 5, min_seconds: float = 0.15) -> float:
    """Best seconds of `fn` over at least `repeats` tries and as many more as fit in
    `min_seconds` (on a shared machine, more tries give one that nothing interrupted)."""
    fn()  # warm up
    best, tries, deadline = float("inf"), 0, time.perf_counter() + min_seconds
    while tries < repeats or time.perf_counter() < deadline:
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
        tries += 1
    return best


def _fresh_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Bytes/s of mapping, first writing and unmapping `nbytes` of anonymous memory."""
    import mmap

    def fresh() -> None:
        region = mmap.mmap(-1, nbytes)
        torch.frombuffer(region, dtype=torch.uint8).fill_(1)
        region.close()

    return nbytes / _best(fresh, repeats)


def _adamw_seconds_per_param(n: int, repeats: int = 5) -> float:
    """Seconds per element of torch's fused AdamW step over one fp32 parameter of `n`."""
    from torch.optim.adamw import adamw

    param, grad, m, v = (torch.full((n,), 0.5) for _ in range(4))
    step = torch.zeros((), dtype=torch.float32)

    def one() -> None:
        adamw([param], [grad], [m], [v], [], [step], foreach=None, fused=True, amsgrad=False, beta1=0.9,
              beta2=0.95, lr=1e-4, weight_decay=0.1, eps=1e-8, maximize=False)

    return _best(one, repeats) / n


def _op_seconds(repeats: int = 5) -> float:
    """Seconds per dispatched op: a chain of OP_CHAIN multiplications on 8 elements run forward
    (recorded by autograd) and backward (one multiplication per link) is 2·OP_CHAIN ops."""
    x = torch.ones(8, requires_grad=True)

    def chain() -> None:
        y = x
        for _ in range(OP_CHAIN):
            y = y * 1.0001
        y.backward(torch.ones(8))
        x.grad = None

    return _best(chain, repeats) / (2 * OP_CHAIN)


def _elementwise_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Read + write bytes/s of a step's kind of element-wise ops on fp32 tensors of `nbytes`
    (rows of 256): an add (3 x nbytes), a GELU and a log-softmax (2 x nbytes each), each into a
    preallocated output (new pages are timed apart: _fresh_bandwidth), rotated over
    ELEMENTWISE_WORKING_SET of inputs. Measured on an Intel Xeon (AMX, 2 threads): 21-23 GB/s
    at 1-64 MiB, against 184 GB/s for a copy between two cached 1 MiB buffers, the rate this
    probe used before, which ran 4-10x faster than a training step's element-wise ops."""
    count = max(2, ELEMENTWISE_WORKING_SET // nbytes)
    inputs = [torch.randn(nbytes // 4 // 256, 256) for _ in range(count)]
    outputs = [torch.empty_like(x) for x in inputs]

    def ops() -> None:
        for i, (x, out) in enumerate(zip(inputs, outputs)):
            torch.add(x, inputs[i - 1], out=out)
            torch.ops.aten.gelu.out(x, out=out)
            torch.log_softmax(x, -1, out=out)

    return 7 * nbytes * count / _best(ops, repeats)


def _memory_bandwidth(nbytes: int = 256 * MIB, repeats: int = 5) -> float:
    """Best copy rate (read + write bytes / s) between two buffers of `nbytes`."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return 2 * nbytes / _best(lambda: dst.copy_(src), repeats)


def oversubscribed_in_step(n_ranks: int, latency: float, bandwidth: float) -> dict:
    """The gloo_in_step_* figures of `n_ranks` ranks on fewer cores (gloo_probe.in_step_probe,
    cached per rank count): ranks that time-share the cores wait for each other a scheduler's
    slice at a time, which two ranks on two cores never show (measured here, 4 ranks on 2 cores:
    a 16 KiB all-reduce adds 6.6 ms to a round of matmuls against 1.1 ms with 2 ranks)."""
    return _cached(f"cores={cpu_cores()}|ranks={n_ranks}|gloo in step",
                   lambda: in_step_probe(n_ranks, latency, bandwidth))


# ---------------------------------------------------------------------------------------------
# Per-machine calibration: the model's own matmuls (`shardlm calibrate`)

SPREAD_LOADED = 0.25
"""A shape whose median timing is this much slower than its best was measured beside other
work (another process on the cores, or the GPU shared): its best is kept, and the load reported."""


def device_name(device: str) -> str:
    """What a calibration's cache key names: the CPU's model, or the GPU's."""
    return cpu_name() if device == "cpu" else torch.cuda.get_device_name(torch.device(device))


def machine_load() -> tuple[float, int]:
    """(1-minute load average, cores): more runnable processes than cores means another job
    shares them (ours included in the average)."""
    try:
        return os.getloadavg()[0], cpu_cores()
    except OSError:
        return 0.0, cpu_cores()


def _time_product(m: int, k: int, n: int, dtype: torch.dtype, device: str, repeats: int,
                  min_seconds: float = 0.1) -> dict:
    """Best and median seconds of at least `repeats` (m x k) @ (k x n) products after a
    warm-up, and of as many more as fit in `min_seconds`: a product of a few milliseconds on a
    shared machine needs many tries for one that no other process interrupted (the best is
    what the product costs; the spread says how loaded the machine was). A GPU is
    synchronised around each timing."""
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, n, device=device).to(dtype)
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    a @ b  # warm up kernels and caches
    sync()
    times, deadline = [], time.perf_counter() + min_seconds
    while len(times) < repeats or time.perf_counter() < deadline:
        start = time.perf_counter()
        a @ b
        sync()
        times.append(time.perf_counter() - start)
    times.sort()
    return {"best_s": times[0], "median_s": times[len(times) // 2]}


def matmul_curve(shapes: list[tuple[int, int, int]], precision: str, threads: int | None = None,
                 device: str = "cpu", repeats: int = 5, again: bool = False,
                 origin: str = "calibrate") -> list[dict]:
    """FLOP/s of each (m, k, n) product (the model's own shapes: planner.workload.matmul_shapes),
    the best of `repeats` timings, each cached per (CPU or GPU model, torch version, threads,
    precision, shape); `again` measures anew. Every entry says whether it was measured under
    load: its median more than SPREAD_LOADED slower than its best, or the machine's load
    average above its cores when it was taken (entries: m, k, n, flops_per_s, spread, load
    average, cores, loaded, measured_at: the time it was taken, origin: 'calibrate' for the
    model's own shapes, 'probe' for GENERIC_SHAPES)."""
    threads = threads or torch.get_num_threads()
    out = []
    for m, k, n in shapes:
        def measure(m=m, k=k, n=n) -> dict:
            load_before, cores = machine_load()
            before = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                timed = _time_product(m, k, n, DTYPES[precision], device, repeats)
            finally:
                torch.set_num_threads(before)
            load = max(load_before, machine_load()[0])
            spread = timed["median_s"] / timed["best_s"] - 1
            return {"m": m, "k": k, "n": n, "flops_per_s": 2 * m * k * n / timed["best_s"],
                    "spread": spread, "load_average": load, "cores": cores,
                    "loaded": spread > SPREAD_LOADED or load > cores, "measured_at": time.time(),
                    "origin": origin}

        entry = _cached(f"threads={threads}|{precision}|mm {m}x{k}x{n}", measure, device_name(device), again)
        out.append(entry)
    return out


GENERIC_SHAPES = ((64, 1024, 1024), (256, 1024, 1024), (256, 1024, 4096), (1024, 1024, 1024))
"""What the probe times when no model is named: a transformer's matmuls from a short micro-batch
to a square one (tokens x h x h, the MLP's h x 4h), so the curve spans the arithmetic intensity of
small and large runs. `shardlm calibrate` adds the model's own shapes."""


def cached_curve(precision: str, threads: int, device: str = "cpu") -> list[dict]:
    """Every matmul_curve entry in the cache for this CPU or GPU model, torch version, thread
    count and precision: the model shapes any `shardlm calibrate` timed here, and the probe's
    generic ones. Read only: nothing is measured."""
    prefix = f"v{_VERSION}|{device_name(device)}|torch {torch.__version__}|threads={threads}|{precision}|mm "
    return [value for key, value in sorted(_table().items()) if key.startswith(prefix) and probe_cache.plausible(value)]


def cached_pass(key: str, threads: int, measure, again: bool = False) -> dict:
    """The cache's measured model pass for `key` (planner.in_situ.pass_key) at `threads`
    threads: train.calibration.measured_pass measures it, `shardlm calibrate` prints it."""
    return _cached(f"threads={threads}|pass {key}", measure, again=again)


def cached_passes(threads: int) -> dict[str, float]:
    """Every model pass `shardlm calibrate` cached on this CPU and torch at `threads` threads:
    pass_key -> seconds. Read only: nothing is measured."""
    prefix = f"v{_VERSION}|{cpu_name()}|torch {torch.__version__}|threads={threads}|pass "
    return {key[len(prefix):]: value["seconds"] for key, value in _table().items()
            if key.startswith(prefix) and isinstance(value, dict) and probe_cache.plausible(value.get("seconds"))}


def disk_streams(directory: Path | None = None, again: bool = False) -> dict[int, dict]:
    """{ranks streaming at once: {"bytes_per_s": read + write in all, "directory": ...}} of this
    machine's disk (hardware/disk_probe.py): measured under `directory` for each of its STREAMS
    (`shardlm calibrate --disk`; anew with `again`), else only what the cache holds ({} where it
    was never measured: the planner then assumes hardware.machine.LOCAL_DISK_BANDWIDTH)."""
    from shardlm.hardware.disk_probe import STREAMS, stream_bandwidth

    if directory is None:
        prefix = f"v{_VERSION}|{cpu_name()}|torch {torch.__version__}|disk|streams="
        return {int(key[len(prefix):]): value for key, value in _table().items()
                if key.startswith(prefix) and key[len(prefix):].isdigit() and probe_cache.plausible(value)}
    return {n: _cached(f"disk|streams={n}", lambda: {"bytes_per_s": stream_bandwidth(directory, n),
                                                       "directory": str(directory.resolve())}, again=again)
            for n in STREAMS}


def machine_curve(precision: str, threads: int, peak: float, device: str = "cpu",
                  budget_s: float = 0.05) -> list[dict]:
    """The points the planner's time model reads for this machine (catalog.MatmulCurve):
    GENERIC_SHAPES (measured once, cached; a shape the square peak says would take over
    `budget_s` per product is left out, so a precision the CPU only emulates costs seconds, not
    minutes; the smallest is always timed) and every `shardlm calibrate` entry cached for the
    same machine, threads and precision."""
    generic = [s for s in GENERIC_SHAPES if 2 * s[0] * s[1] * s[2] / peak <= budget_s] or [GENERIC_SHAPES[0]]
    matmul_curve(generic, precision, threads, device, repeats=3, origin="probe")
    return cached_curve(precision, threads, device)
