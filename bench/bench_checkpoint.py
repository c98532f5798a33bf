"""Sharded checkpoints on 2 CPU ranks (gloo): save (synchronous and asynchronous), the stall
an asynchronous save causes in training, and load — next to the disk's own bandwidth.

Everything is written into one fresh directory under --dir (default ./runs), removed at the end.
1. The limit: the disk's write bandwidth (1 and 2 writers, each file fsync'ed; first / best of
   3), cold read, SHA-256 in memory and a 1 GiB memory copy (into new and into touched memory).
2. Per ZeRO stage, fresh ranks: the step time without a save, a synchronous save (stall, MB/s),
   then an asynchronous save's stall and background write while training goes on, the extra
   step time of the steps it overlapped, and each save's phases (pieces, write, SHA-256, fsync,
   snapshot, publish).
3. Load into a fresh run with checkpoint.readers "all" and "one", cold and warm (SHA-256 and
   after_load apart), then the stage-1 checkpoint into 1 process at stage 0.
The CPU seconds other processes took during each phase are printed (large: contaminated).
Method and results: docs/benchmarks.md, "Checkpoints".

Reproduce:  PYTHONPATH=src SHARDLM_CACHE=/tmp/shc python bench/bench_checkpoint.py   (~5 min)
            PYTHONPATH=src python bench/bench_checkpoint.py --preset gpt-mini --stages 1
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from checkpoint_io import MB, OtherCpu, Probe, cpu_seconds, disk_limits, drop_cache, save_phases
from common import (MiB, bench_parser, build, peak_rss_bytes, prepare, reproduce, run_overrides, setup_line,
                    start_ranks, table, table_row, timed_steps)
from shardlm.checkpoint.sharded import find_checkpoint
from shardlm.config.load import load_config


WORLD = 2


def overrides_for(args, stage: int, run_dir: str, name: str) -> dict:
    return {"model.preset": args.preset, "train.micro_batch": args.micro_batch, "train.seq_len": args.seq,
            "train.steps": 1000, "parallel.zero_stage": stage, "run.name": name, "checkpoint.every": 0,
            "checkpoint.keep": 10, "checkpoint.resume": "never", **run_overrides(run_dir)}


# -- rank functions (module level: spawned ranks import them) ---------------------------------


def _agree_max(value: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def save_rank(rank: int, world: int, overrides: dict, warmup: int, steps: int,
              max_async_steps: int) -> dict:
    import torch.distributed as dist

    from shardlm.train.checkpointing import save_checkpoint
    from shardlm.train.step import train_step

    run = build(overrides)
    probe = Probe()
    base = timed_steps(lambda s: train_step(run, s).loss, warmup, steps)["seconds"]
    step = warmup + steps
    rss_before = peak_rss_bytes()

    run.checkpoints.asynchronous = False
    dist.barrier()
    probe.reset()
    report = save_checkpoint(run, step)
    sync = {"step": step, "stall": report.stall_s, "write_s": report.write_s, "bytes": report.bytes,
            **save_phases(probe)}
    rss_sync = peak_rss_bytes()
    train_step(run, step)
    step += 1

    # Steps to run while the background write goes on: enough to outlast it, the same on every rank.
    n = min(max_async_steps, math.ceil(1.5 * _agree_max(report.stall_s) / statistics.median(base)) + 1)
    run.checkpoints.asynchronous = True
    dist.barrier()
    probe.reset()
    report = save_checkpoint(run, step)
    handed_off = time.monotonic()
    starts, seconds = [], []
    for _ in range(n):
        began = time.monotonic()
        train_step(run, step)
        step += 1
        starts.append(began)
        seconds.append(time.monotonic() - began)
    began = time.monotonic()
    run.checkpoints.wait()
    waited = time.monotonic() - began
    asyn = {"step": sync["step"] + 1, "stall": report.stall_s, "write_s": report.write_s,
            "bytes": report.bytes, "writer_end": handed_off + report.write_s, "starts": starts,
            "seconds": seconds, "waited": waited, **save_phases(probe)}
    return {"base": base, "sync": sync, "async": asyn, "rss_before": rss_before, "rss_sync": rss_sync,
            "rss_after": peak_rss_bytes(), "run_dir": str(run.run_dir)}


def load_rank(rank: int, world: int, overrides: dict, ckpt: str, modes: list) -> list[dict]:
    import torch.distributed as dist

    from shardlm.train.checkpointing import load_checkpoint

    run = build(overrides)
    probe = Probe()
    real_after_load = run.strategy.after_load

    def after_load():  # stage 1-2: all-gather the parameters from the loaded masters
        began = time.perf_counter()
        real_after_load()
        probe.events.append(("after_load", "", time.perf_counter() - began, 0))

    run.strategy.after_load = after_load
    out = []
    for readers, cold in modes:
        run.cfg.checkpoint.readers = readers
        if cold and rank == 0:
            for f in Path(ckpt).iterdir():
                drop_cache(f)
        dist.barrier()
        probe.reset()
        began = time.perf_counter()
        step = load_checkpoint(run, Path(ckpt))
        seconds = time.perf_counter() - began
        out.append({"readers": readers, "cold": cold, "s": seconds, "verify": probe.total("verify"),
                    "read": probe.total("read") - probe.total("verify"),
                    "after_load": probe.total("after_load"), "files": probe.files("verify"), "step": step})
    return out


# -- the report -------------------------------------------------------------------------------


def summarize_save(ranks: list[dict]) -> dict:
    sync = [r["sync"] for r in ranks]
    asyn = [r["async"] for r in ranks]
    base = max(statistics.median(r["base"]) for r in ranks)
    writer_end = max(a["writer_end"] for a in asyn)
    steps = [max(r["async"]["seconds"][i] for r in ranks) for i in range(len(asyn[0]["seconds"]))]
    overlap = [s for i, s in enumerate(steps)
               if min(r["async"]["starts"][i] for r in ranks) < writer_end]
    total = sum(s["bytes"] for s in sync)
    sync_s = max(s["stall"] for s in sync)
    return {
        "writers": sum(s["bytes"] > 0 for s in sync), "bytes": [s["bytes"] for s in sync],
        "total": total, "sync_s": sync_s, "sync_ranks": [s["stall"] for s in sync],
        "gb_s": total / sync_s / 1e9,
        "async_stall": max(a["stall"] for a in asyn), "async_write": max(a["write_s"] for a in asyn),
        "base": base, "overlap": overlap, "steps": steps,
        "steps_base": [max(r["base"][i] for r in ranks) for i in range(len(ranks[0]["base"]))],
        "extra": sum(s - base for s in overlap) + max(a["waited"] for a in asyn),
        "waited": max(a["waited"] for a in asyn),
        "phases": [(mode, rank, r[mode]) for mode in ("sync", "async") for rank, r in enumerate(ranks)],
        "rss": [(r["rss_before"], r["rss_sync"], r["rss_after"]) for r in ranks],
    }


def phase_rows(stage: int, summary: dict) -> list[list]:
    rows = []
    sync_snapshot = {rank: p["stall"] - p["write_s"] for mode, rank, p in summary["phases"] if mode == "sync"}
    for mode, rank, p in summary["phases"]:
        snapshot = sync_snapshot[rank] if mode == "sync" else p["stall"]
        publish = p["write_s"] - p["file"]
        rows.append([stage, mode, rank, f"{p['bytes'] / MB:,.0f}", f"{snapshot:.2f}", f"{p['pieces']:.2f}",
                     f"{p['write']:.2f}", f"{p['sha256']:.2f}", f"{p['fsync']:.2f}", f"{publish:.2f}",
                     f"{p['write_s']:.2f}", f"{p['stall']:.2f}"])
    return rows


def main() -> None:
    parser = bench_parser(__doc__, "gpt2-124m", 128, 1)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before the baseline")
    parser.add_argument("--steps", type=int, default=4, help="timed steps without a save")
    parser.add_argument("--async-steps", type=int, default=12, help="most steps run during an async save")
    parser.add_argument("--stages", default="1,0")
    parser.add_argument("--disk-mib", type=int, default=1024,
                        help="MiB per writer in the disk test (at least 64: it writes 64 MiB chunks)")
    parser.add_argument("--dir", default="runs", help="parent of the temporary benchmark directory")
    parser.add_argument("--no-one-process", action="store_true", help="skip the 1-process load")
    args = parser.parse_args()
    if args.disk_mib < 64:  # the disk test writes whole 64 MiB chunks: fewer would time nothing
        parser.error(f"--disk-mib {args.disk_mib}: at least 64 (the disk test writes 64 MiB chunks)")
    stages = [int(s) for s in args.stages.split(",")]

    cfg = load_config(overrides=overrides_for(args, 0, "", "x")).validate()
    threads = prepare(cfg, WORLD, mmap_threshold=None)
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir)).resolve()
    print(f"{setup_line(cfg, WORLD, threads)}, fp32, batch {WORLD}x{args.micro_batch}x"
          f"{args.seq}; directory {root}", flush=True)
    cpu_before = cpu_seconds()
    other = OtherCpu()
    began = time.monotonic()
    try:
        disk = disk_limits(root, args.disk_mib)
        w1, w2 = disk["write1"], disk["write2"]
        print(f"\nDisk ({disk['mib']} MiB per writer, write + fsync; first / best of 3): "
              f"1 writer {w1[0]:,.0f} / {w1[1]:,.0f} MB/s, 2 writers {w2[0]:,.0f} / {w2[1]:,.0f} MB/s; "
              f"read cold {disk['read_cold']:,.0f} MB/s, warm {disk['read_warm']:,.0f} MB/s; "
              f"SHA-256 in memory {disk['sha256']:,.0f} MB/s; memory copy into new memory "
              f"{disk['fresh_copy']:,.0f} MB/s (after 5 s idle: {disk['idle_copy']:,.0f} MB/s), into "
              f"touched memory {disk['touched_copy']:,.0f} MB/s ({other()})", flush=True)

        saves, loads = {}, {}
        for stage in stages:
            overrides = overrides_for(args, stage, str(root), f"s{stage}")
            case = Path(tempfile.mkdtemp(dir=root))
            saves[stage] = summarize_save(start_ranks(save_rank, WORLD, case, overrides, args.warmup,
                                                      args.steps, args.async_steps, timeout=1800))
            saves[stage]["ckpt"] = str(find_checkpoint(root / f"s{stage}"))  # latest is a file
            print(f"stage {stage}: saves done ({time.monotonic() - began:.0f} s; {other()})", flush=True)
            modes = [("all", True), ("all", False), ("one", True), ("one", False)]
            ckpt = str(Path(saves[stage]["ckpt"]).resolve())
            results = start_ranks(load_rank, WORLD, case, overrides_for(args, stage, str(root), f"l{stage}"),
                                ckpt, modes, timeout=1800)
            loads[(stage, WORLD, stage)] = results
            print(f"stage {stage}: loads done ({time.monotonic() - began:.0f} s; {other()})", flush=True)
        if not args.no_one_process:
            source = 1 if 1 in stages else stages[0]
            ckpt = str(Path(saves[source]["ckpt"]).resolve())
            case = Path(tempfile.mkdtemp(dir=root))
            loads[(source, 1, 0)] = start_ranks(load_rank, 1, case, overrides_for(args, 0, str(root), "l1p"),
                                              ckpt, [("all", True), ("all", False)], timeout=1800)
            print(f"1-process load done ({time.monotonic() - began:.0f} s; {other()})", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print("\n**Save** (total bytes = model fp32 + AdamW exp_avg + exp_avg_sq; sync GB/s = total / "
          "the slowest rank's synchronous save; disk = the same writer count's write + fsync, first "
          "/ best of 3; async lost = its stall + the extra time of the steps run during its write)\n")
    header = ("stage", "writers", "MB per rank", "total MB", "sync save s (per rank)",
              "sync MB/s", "disk MB/s first / best", "sync of disk first / best", "async stall s",
              "async write s", "step s no save", "steps during async write", "extra train s",
              "async lost s (sync: stall)")
    print(table(header, []))
    for stage, s in saves.items():
        first, best = disk["write2"] if s["writers"] == 2 else disk["write1"]
        during = ", ".join(f"{x:.2f}" for x in s["overlap"]) or "none"
        waited = f" + {s['waited']:.2f} wait" if s["waited"] > 0.005 else ""
        rate = s["gb_s"] * 1e3
        print(table_row([stage, s["writers"], " / ".join(f"{b / MB:,.0f}" for b in s["bytes"]),
                         f"{s['total'] / MB:,.0f}",
                         f"{s['sync_s']:.2f} ({' / '.join(f'{x:.2f}' for x in s['sync_ranks'])})",
                         f"{rate:,.0f}", f"{first:,.0f} / {best:,.0f}", f"{rate / first:.0%} / {rate / best:.0%}",
                         f"{s['async_stall']:.2f}", f"{s['async_write']:.2f}", f"{s['base']:.2f}",
                         f"{len(s['overlap'])}: {during}{waited}", f"{s['extra']:+.2f}",
                         f"{s['async_stall'] + s['extra']:.2f} ({s['sync_s']:.2f})"]))

    print("\nStep times without a save (s, slower rank; min / median / max): " + "; ".join(
        f"stage {stage}: {min(s['steps_base']):.2f} / {s['base']:.2f} / {max(s['steps_base']):.2f}"
        for stage, s in saves.items()) + ". During the async write, every step: " + "; ".join(
        f"stage {stage}: " + ", ".join(f"{x:.2f}" for x in s["steps"]) for stage, s in saves.items()))
    print("\n**Where a save's time goes**, per rank (seconds; snapshot = the async copy of the "
          "rank's state; pieces = slicing the tensors into the file's pieces; write = write() of the "
          "rank file into the page cache; SHA-256 and fsync of it; publish = the rest of write_s: "
          "the note, rank 0 waiting for the others' notes, manifest, renames, directory fsyncs)\n")
    header = ("stage", "mode", "rank", "MB", "snapshot", "pieces", "write", "SHA-256", "fsync",
              "publish", "write_s", "stall_s")
    print(table(header, [row for stage, s in saves.items() for row in phase_rows(stage, s)]))
    print("\nPeak RSS MiB per rank (before saving / after the sync save / after the async save): " +
          "; ".join(f"stage {stage}: " + ", ".join(" / ".join(f"{x / MiB:,.0f}" for x in r) for r in s["rss"])
                    for stage, s in saves.items()))

    print("\n**Load** (load_checkpoint into a freshly built run; cold = the checkpoint's pages "
          "dropped from the page cache first; load s = the slowest rank's; the parts are the "
          "busiest rank's: SHA-256 = verification, read = reading slices and copying them into "
          "the run's tensors, after_load = rebuilding parameters from the masters (stage 1: an "
          "all-gather), rest = load s - those (manifest, broadcasts with readers one, waiting for "
          "the other rank); GB/s = checkpoint bytes / "
          "load s)\n")
    header = ("saved at", "loaded into", "readers", "cache", "load s", "SHA-256 s", "SHA share",
              "read s", "after_load s", "rest s", "files verified (per rank)", "GB/s")
    print(table(header, []))
    for (saved, world, stage), ranks in loads.items():
        total = saves[saved]["total"]
        for i, mode in enumerate(ranks[0]):
            seconds = max(r[i]["s"] for r in ranks)
            busiest = max((r[i] for r in ranks), key=lambda m: m["verify"] + m["read"] + m["after_load"])
            verify, read, after = busiest["verify"], busiest["read"], busiest["after_load"]
            rest = seconds - verify - read - after
            files = " / ".join("+".join(f.removeprefix("rank-").removesuffix(".safetensors")
                                        for f, _ in r[i]["files"]) or "-" for r in ranks)
            print(table_row([f"stage {saved}, {WORLD} ranks", f"stage {stage}, {world} rank{'s' if world > 1 else ''}",
                             mode["readers"], "cold" if mode["cold"] else "warm", f"{seconds:.2f}",
                             f"{verify:.2f}", f"{verify / seconds:.0%}", f"{read:.2f}", f"{after:.2f}",
                             f"{rest:.2f}", files, f"{total / seconds / 1e9:.2f}"]))
    busy, own = (after - before for after, before in zip(cpu_seconds(), cpu_before))
    print(f"\nCPU time used by other processes while this ran: {busy - own:.0f} s "
          f"(this benchmark: {own:.0f} s, over {time.monotonic() - began:.0f} s x {os.cpu_count()} cores)")
    print(f"\nTotal {time.monotonic() - began:.0f} s. {reproduce()}")


if __name__ == "__main__":
    main()
