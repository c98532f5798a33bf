"""gloo between spawned local ranks, as the planner's local CPU cluster needs it (hardware.
catalog.local_cpu): back to back (a one-float all-reduce's latency, 8 MiB collectives'
bandwidth) and as a step issues its collectives, among matmuls (_in_step). Measurements only;
hardware/probe.py caches them per machine (measure_cpu). docs/planner.md section 7.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

MIB = 2**20


GLOO_TRIES = 20
"""Timings of each back-to-back collective: the best one-float all-reduce (the latency), the
median of the 8 MiB ones (what bounds the in-step fit: _fit_in_step)."""


def _single_tensor_collectives(dist):
    """(all-gather, reduce-scatter) into / from one tensor, as the runtime runs them on gloo
    (comm/collectives.py; this layer sits below comm): the all-gather by torch 2.13's name or
    the older one it replaces; the reduce-scatter as an all-reduce of the input in place and a
    copy of this rank's chunk (what every reduce-scatter of the runtime's runs on gloo:
    `scratch_input`), not gloo's own, which clones the input first (measured here, 2 ranks:
    2.9x a half ring's time against the all-reduce's 2x)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def scatter(shard, whole):
        dist.all_reduce(whole)
        shard.copy_(whole.view(dist.get_world_size(), -1)[dist.get_rank()])

    return gather, scatter


def _shift(dist, send, recv) -> None:
    """One hop of a ring as context parallelism's ring attention runs it (comm/collectives.py
    Comm.shift): send to the next rank and receive the previous one's, posted together."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ops = [dist.P2POp(dist.isend, send, (rank + 1) % world), dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _gloo_rank(rank: int, world_size: int) -> dict[str, float]:
    """On a spawned rank: of GLOO_TRIES timings each, the best of a one-float all-reduce
    (latency) and the median of an 8 MiB one; the all-reduce, all-gather and reduce-scatter
    among matmuls (_in_step); and this rank's RSS with torch, gloo and a worker's libraries imported — the floor of any worker's
    memory."""
    import numpy  # noqa: F401  (a worker's libraries are part of its baseline)
    import safetensors.torch  # noqa: F401
    import tokenizers  # noqa: F401
    import torch.distributed as dist

    # Resident now, not ru_maxrss: a spawned child's high-water mark can start at its parent's.
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    n = 8 * MIB // 4
    small, full = torch.zeros(1), torch.zeros(n)
    ops = {"latency": lambda: dist.all_reduce(small), "all_reduce": lambda: dist.all_reduce(full)}
    out = {}
    for name, op in ops.items():
        op()  # warm up
        times = []
        for _ in range(GLOO_TRIES):
            start = time.perf_counter()
            op()
            times.append(time.perf_counter() - start)
        out[name] = min(times) if name == "latency" else statistics.median(times)
    return {**out, "rss": float(rss), "bytes": float(n * 4), "in_step": _in_step(dist)}


IN_STEP_SIZES = (16 * 1024, 256 * 1024, 4 * MIB, 16 * MIB)
"""Bytes of the collectives _in_step times: a norm's statistics to a micro-batch's activations
(tensor parallelism's collectives) and gradient buckets. The 16 MiB one holds the fit's
bandwidth (measured here, 2 ranks, three probes each: 1.02-1.12 GB/s with it, 1.02-1.67
without: a 4 MiB all-reduce among matmuls took 4.6-5.9 ms)."""
IN_STEP_OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")
IN_STEP_FACTORS = IN_STEP_OPS[1:]
"""What _in_step times, and those priced by a factor over the ring model's time (_fit_in_step):
the all-reduces are the model's fit."""
IN_STEP_PRODUCTS = 4
"""Products of 256 x 256 x 1024 between two collectives (~2 ms at one thread of an Intel Xeon
with AMX): a block's matmuls between tensor parallelism's collectives."""


def _in_step(dist, rounds: int = 20) -> dict[str, list[list[float]]]:
    """{op: [[bytes, seconds], ...]} of an all-reduce, all-gather and reduce-scatter of each
    IN_STEP_SIZES (the whole tensor) and a ring hop (send_recv: that many bytes to the next
    rank, as many from the previous), issued as a step issues them: what a round of
    IN_STEP_PRODUCTS matmuls on the rank's threads and then the collective takes over a round
    of the matmuls alone, each the mean of `rounds` rounds (the first few dropped). The mean,
    not the best: the wait for the slower rank, gloo's threads waking on cores the ranks'
    compute holds and the loopback's system calls are what a collective costs inside a step.
    Over the matmuls' own round, not the collective's own time: with more ranks than cores, a
    rank that finished its matmuls first waits in the collective while the others finish theirs
    on the cores it left, and that wait is time-sharing the planner already charges to compute
    (measured here, 4 ranks on 2 cores: a 16 KiB all-reduce took 8.8 ms from the rank's last
    matmul, and 6.6 ms over the matmuls' round; 2 ranks on 2 cores: 1.07 and 1.10 ms)."""
    a, b = torch.randn(256, 256), torch.randn(256, 1024)
    world, (gather, scatter) = dist.get_world_size(), _single_tensor_collectives(dist)

    def mean_round(op=None) -> float:
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(IN_STEP_PRODUCTS):
                a @ b
            if op is not None:
                op()
            times.append(time.perf_counter() - start)
        return statistics.mean(times[3:])

    out: dict[str, list[list[float]]] = {op: [] for op in IN_STEP_OPS}
    for nbytes in IN_STEP_SIZES:
        full, shard, recv = torch.zeros(nbytes // 4), torch.zeros(nbytes // 4 // world), torch.zeros(nbytes // 4)
        ops = {"all_reduce": lambda: dist.all_reduce(full), "all_gather": lambda: gather(full, shard),
               "reduce_scatter": lambda: scatter(shard, full), "send_recv": lambda: _shift(dist, full, recv)}
        for name, op in ops.items():
            matmuls = mean_round()
            out[name].append([float(nbytes), max(0.0, mean_round(op) - matmuls)])
    return out


def gloo_probe() -> dict[str, float]:
    """Two spawned ranks' back-to-back ring-model latency and bus bandwidth from the
    all-reduces (2(N-1) steps, 2(N-1)/N of the bytes each way: what floors the in-step fit and
    stands in for a slope it cannot take), their baseline RSS, and the in-step figures the
    planner reads (gloo_in_step_*: _fit_in_step)."""
    import tempfile

    from shardlm.launch.spawn import run_ranks

    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(_gloo_rank, world, tmp)
    worst = {k: max(r[k] for r in results) for k in results[0] if k != "in_step"}
    steps = 2 * (world - 1)
    latency = worst["latency"] / steps
    bandwidth = steps / world * worst["bytes"] / max(worst["all_reduce"] - steps * latency, 1e-9)
    return {"gloo_latency": latency, "gloo_bandwidth": bandwidth, "baseline_rss": worst["rss"],
            **_fit_in_step([r["in_step"] for r in results], world, latency, bandwidth)}


def _fit_in_step(ranks: list[dict], world: int, latency: float, bandwidth: float) -> dict:
    """The gloo_in_step_* figures from each rank's _in_step timings (their average): the
    all-reduces fit the ring model's latency and bandwidth, seconds = 2(N-1) x latency +
    2(N-1)/N x bytes / bandwidth (least squares; the latency floored by `latency`, the
    back-to-back one); the all-gathers', reduce-scatters' and ring hops' summed times over that
    model's (N-1 steps of bytes/N; a hop, one step of all its bytes: planner.links) are their
    factors. Measured here, 2 ranks: a 256 KiB hop added 1.94 ms to a round of matmuls, an
    all-reduce of it (two steps) 2.28 ms."""
    def mean(op: str) -> list[tuple[float, float]]:
        return [(nbytes, statistics.mean(r[op][i][1] for r in ranks)) for i, (nbytes, _) in enumerate(ranks[0][op])]

    steps = 2 * (world - 1)
    points = mean("all_reduce")
    slope, intercept = _line([x for x, _ in points], [y for _, y in points])
    in_latency = max(intercept / steps, latency)
    in_bandwidth = steps / world / slope if slope > 0 else bandwidth
    model = {"all_gather": lambda n: (world - 1) * (in_latency + n / world / in_bandwidth),
             "send_recv": lambda n: in_latency + n / in_bandwidth}
    model["reduce_scatter"] = model["all_gather"]
    return {"gloo_in_step": {op: [list(p) for p in mean(op)] for op in IN_STEP_OPS},
            "gloo_in_step_latency": in_latency, "gloo_in_step_bandwidth": in_bandwidth,
            **{f"gloo_in_step_{op}_factor": max(1.0, sum(t for _, t in mean(op)) / sum(model[op](n) for n, _ in points))
               for op in IN_STEP_FACTORS}}


def _in_step_rank(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    return _in_step(dist)


def in_step_probe(n_ranks: int, latency: float, bandwidth: float) -> dict:
    """The gloo_in_step_* figures of `n_ranks` spawned ranks (_in_step, fitted by _fit_in_step;
    `latency` and `bandwidth`, two ranks' back-to-back figures, floor the fit and stand in for a
    slope it cannot take)."""
    import tempfile

    from shardlm.launch.spawn import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(_in_step_rank, n_ranks, tmp)
    return _fit_in_step(results, n_ranks, latency, bandwidth)


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares slope and intercept of ys over xs."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return slope, my - slope * mx
