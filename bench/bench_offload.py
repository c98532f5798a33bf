"""Train a model whose model states do not fit in this machine's RAM, in one process, by
streaming the optimizer state (fp32 masters + AdamW moments) from disk: the NVMe tier.

ZeRO stage 1 on one rank, bf16 compute, zero.offload_optimizer = "nvme" under --dir. The disk is
probed with the step's own I/O (O_DIRECT, 64 MiB blocks: write, read, both at once) before and
after training; then per step the wall time, the optimizer step's time, the bytes it moved and
peak RSS. Results: docs/benchmarks.md, "Offload".

Reproduce:  PYTHONPATH=src python bench/bench_offload.py                      (gpt2-2.7b, ~10 min)
            PYTHONPATH=src python bench/bench_offload.py --preset gpt2-1.5b --steps 2
Needs ~12 bytes per parameter free under --dir (33 GB for gpt2-2.7b).
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

from common import (MMAP_THRESHOLD, GiB, bench_parser, machine, peak_rss_bytes, reproduce, run_overrides, table,
                    timed_steps)

BLOCK = 64 << 20


def measure_disk(directory: Path, nbytes: int, streams: int = 2) -> dict[str, float]:
    """Sequential O_DIRECT write, read, and read+write at once, in bytes/s, each direction with
    `streams` threads taking alternate 64 MiB blocks (the step keeps one read and one write in
    flight; the probe allows two of each)."""
    directory.mkdir(parents=True, exist_ok=True)
    source = mmap.mmap(-1, BLOCK)
    source.write(os.urandom(1 << 20) * (BLOCK >> 20))
    a, b = directory / "disk-a.bin", directory / "disk-b.bin"
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0)

    def blocks(path: Path, write: bool) -> list[threading.Thread]:
        fd = os.open(path, flags)
        if write:
            os.ftruncate(fd, nbytes)

        def run(first: int) -> None:
            buf = source if write else mmap.mmap(-1, BLOCK)
            for off in range(first * BLOCK, nbytes, streams * BLOCK):
                (os.pwritev if write else os.preadv)(fd, [buf], off)
        return [threading.Thread(target=run, args=(i,)) for i in range(streams)]

    def timed(threads: list[threading.Thread]) -> float:
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - start

    out = {"write": nbytes / timed(blocks(a, True))}
    out["read"] = nbytes / timed(blocks(a, False))
    out["read+write"] = 2 * nbytes / timed(blocks(a, False) + blocks(b, True))
    a.unlink()
    b.unlink()
    return out


def main() -> None:
    parser = bench_parser(__doc__, "gpt2-2.7b", 128, 1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dir", default="runs/bench-offload", help="where the nvme tier's files go")
    parser.add_argument("--disk-probe-gib", type=float, default=4.0)
    parser.add_argument("--json", default="", help="also write the results here")
    args = parser.parse_args()
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != MMAP_THRESHOLD:  # glibc reads it at start: run again
        os.execve(sys.executable, [sys.executable, *sys.argv],
                  {**os.environ, "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD})

    from shardlm.config.load import load_config
    from shardlm.models.flops import count_params
    from shardlm.train.build import build_run
    from shardlm.train.step import train_step

    root = Path(args.dir)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    probe_bytes = int(args.disk_probe_gib * GiB) // BLOCK * BLOCK
    disk = measure_disk(root / "probe", probe_bytes)
    print("disk before (O_DIRECT, 64 MiB blocks): " + ", ".join(f"{k} {v / 1e9:.2f} GB/s" for k, v in disk.items()),
          flush=True)

    cfg = load_config(overrides={
        "model.preset": args.preset, "train.seq_len": args.seq, "train.micro_batch": args.micro_batch,
        "train.steps": args.steps, "train.warmup_steps": 100,
        # GPT-3's peak lr for 2.7B (Brown et al. 2020, table 2.1) and a warmup: a full-size
        # first Adam step (sign descent on every weight) throws a model this wide off.
        "train.lr": 1.6e-4, **run_overrides(root / "runs", precision="bf16"), "parallel.zero_stage": 1, "zero.offload_optimizer": "nvme", "zero.nvme_path": str(root / "nvme")}).validate()
    psi = count_params(cfg.model)
    print(f"{machine()}; {args.preset}: {psi / 1e9:.2f}B parameters; full model states 16 x Ψ = "
          f"{16 * psi / GiB:.1f} GiB = {16 * psi / ram:.2f} x this machine's RAM ({ram / GiB:.1f} GiB)",
          flush=True)
    start = time.perf_counter()
    run = build_run(cfg)
    build_s = time.perf_counter() - start
    print(f"built in {build_s:.0f} s; in memory: " + ", ".join(
        f"{k} {v / GiB:.2f} GiB" for k, v in run.strategy.model_state_bytes().items())
          + f"; on disk: {run.strategy.offload_report()['optimizer_bytes_by_tier']['nvme'] / GiB:.1f} GiB; "
          f"peak RSS so far {peak_rss_bytes() / GiB:.2f} GiB", flush=True)
    rows, results = [], []

    def step_fn(step: int) -> float:
        results.append(train_step(run, step))
        return results[-1].loss

    def record(step: int, seconds: float) -> None:  # outside the timing
        report = run.strategy.offload_report()
        moved = report["disk_read_bytes"] + report["disk_write_bytes"]
        rows.append({"step": step + 1, "loss": results[step].loss, "step_s": seconds,
                     "optimizer_s": report["optimizer_step_s"], "compute_s": seconds - report["optimizer_step_s"],
                     "io_wait_s": report["optimizer_io_wait_s"], "disk_read_bytes": report["disk_read_bytes"],
                     "disk_write_bytes": report["disk_write_bytes"],
                     "optimizer_bytes_per_s": moved / report["optimizer_step_s"], "peak_rss_bytes": peak_rss_bytes()})
        r = rows[-1]
        print(f"step {r['step']}: loss {r['loss']:.3f}, {r['step_s']:.1f} s (compute {r['compute_s']:.1f} s, "
              f"optimizer {r['optimizer_s']:.1f} s of which waiting on disk {r['io_wait_s']:.1f} s), "
              f"disk {moved / 1e9:.1f} GB at {r['optimizer_bytes_per_s'] / 1e9:.2f} GB/s, "
              f"peak RSS {r['peak_rss_bytes'] / GiB:.2f} GiB", flush=True)

    timed_steps(step_fn, 0, args.steps, record)

    # The disk again, after: it is a shared virtual disk whose speed drifts; the faster of the
    # two probes is the limit we hold the step to (the conservative choice).
    after = measure_disk(root / "probe", probe_bytes)
    print("disk after: " + ", ".join(f"{k} {v / 1e9:.2f} GB/s" for k, v in after.items()), flush=True)
    disk = {k: max(v, after[k]) for k, v in disk.items()}
    # Step 1 reads the moments as the files' holes (zeros, no disk reads): it is left out.
    steady = rows[1:] or rows
    achieved = statistics.median(r["optimizer_bytes_per_s"] for r in steady)
    peak = max(r["peak_rss_bytes"] for r in rows)
    print()
    last = rows[-1]
    header = ("preset", "params", "16Ψ / RAM", "peak RSS", "disk per step (read + write)", "step s", "compute s",
              "optimizer s", "optimizer disk GB/s", "disk read+write GB/s", "ratio")
    print(table(header, [[
        args.preset, f"{psi / 1e9:.2f}B", f"{16 * psi / GiB:.1f} / {ram / GiB:.1f} GiB = {16 * psi / ram:.2f}x",
        f"{peak / GiB:.2f} GiB", f"{last['disk_read_bytes'] / 1e9:.1f} + {last['disk_write_bytes'] / 1e9:.1f} GB",
        f"{statistics.median(r['step_s'] for r in steady):.1f}", f"{statistics.median(r['compute_s'] for r in steady):.1f}",
        f"{statistics.median(r['optimizer_s'] for r in steady):.1f}", f"{achieved / 1e9:.2f}",
        f"{disk['read+write'] / 1e9:.2f}", f"{achieved / disk['read+write']:.0%}"]]))
    print(f"\nmedians over steps 2..{args.steps}; disk (faster of the probes before and after): write "
          f"{disk['write'] / 1e9:.2f} GB/s, read {disk['read'] / 1e9:.2f} GB/s; "
          f"build {build_s:.0f} s. {reproduce()}")
    if args.json:
        Path(args.json).write_text(json.dumps({"disk": disk, "rows": rows, "params": psi, "ram": ram}, indent=1))
    run = None  # its tier's buffers and files go before the directory
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
