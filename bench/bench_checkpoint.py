"""Sharded checkpoints on 2 CPU ranks (gloo): save (synchronous and asynchronous), the stall
an asynchronous save causes in training, and load — next to the disk's own bandwidth.

Method. Everything is written into one fresh directory under --dir (default ./runs, so on the
file system checkpoints normally go to), removed at the end.

1. The limit: the disk's write bandwidth in that directory — 1 writer writing --disk-mib MiB,
   and 2 concurrent writers (threads) writing --disk-mib MiB each, every file written then
   fsync'ed, as the checkpoint writer does; MB/s = bytes / (first write → last fsync). Each
   figure is measured 3 times (first / best): on this VM the first touch of memory the guest
   has not used lately (page cache included) is slow, so a repeat is faster. Also: cold read
   (the file's pages dropped with posix_fadvise(DONTNEED)), SHA-256 in memory, and a 1 GiB
   memory copy into new memory (what the asynchronous snapshot does: right after freeing as
   much, and after 5 s idle, when a guest with free page reporting has handed it back to its
   host) and into touched memory.
2. Per stage (ZeRO 1: each rank writes half; ZeRO 0: rank 0 writes everything), one pair of
   fresh processes: build the run (gpt2-124m, fp32), --warmup steps, --steps timed steps (the
   median is the step time without a save), then a synchronous save (both ranks start it after a
   barrier; stall = SaveReport.stall_s = the whole save; the effective bandwidth = total bytes /
   the slowest rank's stall), one step, then an asynchronous save: its stall (snapshot +
   hand-off) and its background write time (SaveReport.write_s), while training steps go on.
   The number of steps run during it is agreed by the ranks: enough to outlast 1.5x the
   synchronous save (at most --async-steps). A step overlaps the write if it started before
   the last rank's writer finished (timestamps from CLOCK_MONOTONIC, shared by the processes);
   the extra time = sum over overlapping steps of (step time - median step time without a save),
   steps taken as the slower rank's. The phases of each save come from wrappers installed around
   the names shardlm.checkpoint.sharded calls (write_safetensors, _safetensors_pieces, hashlib's
   digest update, os.fsync): pieces, write (into the page cache), SHA-256 and fsync of the rank
   file; snapshot = the asynchronous stall (a synchronous save writes from the live tensors);
   "publish" = the rest of write_s (the note, rank 0 waiting for the others' notes, the
   manifest, renames, directory fsyncs).
3. Load, in a fresh pair of processes at the same layout: load_checkpoint into a freshly built
   run with checkpoint.readers = "all" and "one", each cold (rank 0 drops the checkpoint files'
   pages from the page cache first) and warm; the time includes SHA-256 verification, which is
   reported separately (a wrapper around sharded._sha256, the verification itself) and after_load
   (stage 1: the all-gather of the parameters). Then the stage-1 checkpoint loaded into 1
   process at stage 0. Load time = the slowest rank's.

The machine may be shared: the CPU seconds other processes took during each phase (machine busy
time from /proc/stat minus this benchmark's own) are printed; figures from a phase where they
are large are contaminated.

Reproduce:  PYTHONPATH=src SHARDLM_CACHE=/tmp/shc python bench/bench_checkpoint.py   (~5 min)
            PYTHONPATH=src python bench/bench_checkpoint.py --preset gpt-mini --stages 1
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from shardlm.checkpoint.sharded import find_checkpoint
from shardlm.config import load_config
from shardlm.data import build_dataset
from shardlm.launch.runtime import cpu_cores
from shardlm.models import count_params
from shardlm.launch.spawn import run_ranks
from shardlm.train.telemetry import peak_flops, peak_rss_bytes

WORLD = 2
MB, MiB = 1e6, 2**20


def overrides_for(args, stage: int, run_dir: str, name: str) -> dict:
    return {"model.preset": args.preset, "train.micro_batch": args.micro_batch,
            "train.seq_len": args.seq, "train.steps": 1000, "precision.compute": "fp32",
            "parallel.zero_stage": stage, "run.device": "cpu", "run.dir": run_dir,
            "run.name": name, "run.progress": "off", "train.eval_every": 0,
            "train.sample_tokens": 0, "checkpoint.every": 0, "checkpoint.keep": 10,
            "checkpoint.resume": "never"}


class OtherCpu:
    """CPU seconds other processes took since the last call (what contaminates a phase)."""

    def __init__(self):
        self.last = cpu_seconds()

    def __call__(self) -> str:
        now = cpu_seconds()
        machine, own = (a - b for a, b in zip(now, self.last))
        self.last = now
        return f"other processes used {machine - own:.0f} CPU s"


def cpu_seconds() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine, CPU seconds of this process and its finished
    children): their difference over the run is what other processes took from it."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    busy = sum(fields[i] for i in (0, 1, 2, 5, 6)) / os.sysconf("SC_CLK_TCK")  # user nice system irq softirq
    t = os.times()
    return busy, t.user + t.system + t.children_user + t.children_system


# -- the disk ---------------------------------------------------------------------------------


def drop_cache(path: Path) -> None:
    """Evict a (clean, fsync'ed) file's pages from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _write_fsync(path: Path, chunk: bytes, nbytes: int, start: threading.Barrier) -> None:
    start.wait()
    with open(path, "wb") as f:
        f.writelines(chunk for _ in range(nbytes // len(chunk)))
        f.flush()
        os.fsync(f.fileno())


def write_mb_s(directory: Path, writers: int, nbytes: int, chunk: bytes) -> float:
    """Aggregate MB/s of `writers` threads each writing `nbytes` then fsync'ing."""
    paths = [directory / f"disk-test-{i}.bin" for i in range(writers)]
    start = threading.Barrier(writers + 1)
    threads = [threading.Thread(target=_write_fsync, args=(p, chunk, nbytes, start)) for p in paths]
    for t in threads:
        t.start()
    start.wait()
    began = time.perf_counter()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - began
    for p in paths:
        p.unlink()
    return writers * nbytes / seconds / MB


def disk_limits(directory: Path, mib: int) -> dict:
    chunk = os.urandom(64 * MiB)
    nbytes = mib * MiB // len(chunk) * len(chunk)
    out = {"mib": nbytes // MiB}
    for writers in (1, 2):
        runs = [write_mb_s(directory, writers, nbytes, chunk) for _ in range(3)]
        out[f"write{writers}"] = (runs[0], max(runs))
    path = directory / "disk-test-read.bin"
    _write_fsync(path, chunk, nbytes, threading.Barrier(1))
    for label in ("cold", "warm"):
        if label == "cold":
            drop_cache(path)
        began = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while f.read(16 * MiB):
                pass
        out[f"read_{label}"] = nbytes / (time.perf_counter() - began) / MB
    path.unlink()
    data = chunk * (nbytes // len(chunk))
    began = time.perf_counter()
    hashlib.sha256(data).hexdigest()
    out["sha256"] = nbytes / (time.perf_counter() - began) / MB
    del data
    source = torch.ones(nbytes // 4)
    began = time.perf_counter()
    copied = source.clone()  # new memory, first touched by the copy: what the async snapshot does
    out["fresh_copy"] = nbytes / (time.perf_counter() - began) / MB
    began = time.perf_counter()
    copied.copy_(source)  # the same copy into memory already touched
    out["touched_copy"] = nbytes / (time.perf_counter() - began) / MB
    del copied
    # A guest kernel with free page reporting (virtio-balloon) hands freed memory back to the
    # host after ~2 s; touching it again then costs a host fault per page. A training process
    # allocates its snapshot long after it last freed that much.
    time.sleep(5)
    began = time.perf_counter()
    copied = source.clone()
    out["idle_copy"] = nbytes / (time.perf_counter() - began) / MB
    del copied
    return out


# -- probes around the checkpoint code (timing only; the calls are passed through unchanged) --


class Probe:
    """Times the phases of shardlm's save (the rank file: producing its pieces, write, SHA-256,
    fsync) and the SHA-256 verification inside its load, by wrapping the module-level names
    shardlm.checkpoint.sharded calls. The calls themselves pass through unchanged."""

    def __init__(self):
        from shardlm.checkpoint import reader as checkpoint_reader
        from shardlm.checkpoint import sharded

        self.events: list[tuple[str, str, float, int]] = []  # (kind, file, seconds, bytes)
        record = self.events.append
        inside = threading.local()  # set while the rank file is written (fsyncs are counted then)
        real_file, real_pieces, real_sha_file = (sharded.write_safetensors, sharded._safetensors_pieces,
                                                 sharded._sha256)

        def write_safetensors(path, tensors):
            inside.on = True
            began = time.perf_counter()
            try:
                size, digest = real_file(path, tensors)
            finally:
                inside.on = False
            record(("file", Path(path).name, time.perf_counter() - began, size))
            return size, digest

        def pieces(tensors):
            source = real_pieces(tensors)
            while True:
                began = time.perf_counter()
                piece = next(source, None)
                if piece is None:
                    return
                record(("pieces", "", time.perf_counter() - began, piece.nbytes))
                yield piece

        def sha_file(path):
            began = time.perf_counter()
            digest = real_sha_file(path)
            record(("verify", Path(path).name, time.perf_counter() - began, Path(path).stat().st_size))
            return digest

        class TimedDigest:
            def __init__(self, digest):
                self.digest = digest

            def update(self, data):
                began = time.perf_counter()
                self.digest.update(data)
                record(("sha256", "", time.perf_counter() - began, memoryview(data).nbytes))

            def __getattr__(self, name):
                return getattr(self.digest, name)

        class TimedHashlib:  # sharded.hashlib: the digest computed while the rank file is written
            def __getattr__(self, name):
                return getattr(hashlib, name)

            @staticmethod
            def sha256(*args):
                return TimedDigest(hashlib.sha256(*args))

        class TimedOs:  # sharded.os: the rank file's fsync
            def __getattr__(self, name):
                return getattr(os, name)

            @staticmethod
            def fsync(fd):
                began = time.perf_counter()
                os.fsync(fd)
                if getattr(inside, "on", False):
                    record(("fsync", "", time.perf_counter() - began, 0))

        real_read_range = checkpoint_reader.CheckpointReader.read_range

        def read_range(reader, *args, **kwargs):  # includes the first use's verification
            began = time.perf_counter()
            real_read_range(reader, *args, **kwargs)
            record(("read", "", time.perf_counter() - began, 0))

        sharded.write_safetensors, sharded._safetensors_pieces, sharded._sha256 = (
            write_safetensors, pieces, sha_file)
        checkpoint_reader._sha256 = sha_file  # the reader's verification: the same wrapper
        checkpoint_reader.CheckpointReader.read_range = read_range
        sharded.hashlib, sharded.os = TimedHashlib(), TimedOs()

    def reset(self) -> None:
        self.events.clear()

    def total(self, kind: str) -> float:
        return sum(s for k, _, s, _ in self.events if k == kind)

    def files(self, kind: str) -> list[tuple[str, int]]:
        return [(f, n) for k, f, _, n in self.events if k == kind]


def save_phases(probe: Probe) -> dict:
    phases = {k: probe.total(k) for k in ("file", "pieces", "sha256", "fsync")}
    phases["write"] = phases["file"] - phases["pieces"] - phases["sha256"] - phases["fsync"]
    return phases


# -- rank functions (module level: spawned ranks import them) ---------------------------------


def _agree_max(value: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def save_rank(rank: int, world: int, overrides: dict, warmup: int, steps: int,
              max_async_steps: int) -> dict:
    import torch.distributed as dist

    from shardlm.train.loop import build_run, train_step

    from shardlm.train.checkpointing import save_checkpoint

    run = build_run(load_config(overrides=overrides).validate())
    probe = Probe()
    step = 0
    base = []
    for i in range(warmup + steps):
        began = time.monotonic()
        train_step(run, step)
        step += 1
        if i >= warmup:
            base.append(time.monotonic() - began)
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

    from shardlm.train.loop import build_run

    from shardlm.train.checkpointing import load_checkpoint

    run = build_run(load_config(overrides=overrides).validate())
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


def phase_rows(stage: int, summary: dict) -> list[str]:
    rows = []
    sync_snapshot = {rank: p["stall"] - p["write_s"] for mode, rank, p in summary["phases"] if mode == "sync"}
    for mode, rank, p in summary["phases"]:
        snapshot = sync_snapshot[rank] if mode == "sync" else p["stall"]
        publish = p["write_s"] - p["file"]
        rows.append(f"| {stage} | {mode} | {rank} | {p['bytes'] / MB:,.0f} | {snapshot:.2f} | "
                    f"{p['pieces']:.2f} | {p['write']:.2f} | {p['sha256']:.2f} | {p['fsync']:.2f} | "
                    f"{publish:.2f} | {p['write_s']:.2f} | {p['stall']:.2f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt2-124m")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before the baseline")
    parser.add_argument("--steps", type=int, default=4, help="timed steps without a save")
    parser.add_argument("--async-steps", type=int, default=12, help="most steps run during an async save")
    parser.add_argument("--stages", default="1,0")
    parser.add_argument("--disk-mib", type=int, default=1024, help="MiB per writer in the disk test")
    parser.add_argument("--dir", default="runs", help="parent of the temporary benchmark directory")
    parser.add_argument("--no-one-process", action="store_true", help="skip the 1-process load")
    args = parser.parse_args()
    stages = [int(s) for s in args.stages.split(",")]

    cfg = load_config(overrides=overrides_for(args, 0, "", "x")).validate()
    build_dataset(cfg.data, cfg.model.vocab_size)  # tokenizer + token stream built once, here
    threads = max(1, cpu_cores() // WORLD)
    torch.set_num_threads(threads)
    peak_flops(torch.device("cpu"), "fp32")  # build_run's MFU peak: probed here on a cache miss
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir)).resolve()
    print(f"torch {torch.__version__}, {WORLD} gloo ranks x {threads} thread(s), {args.preset} "
          f"({count_params(cfg.model) / 1e6:.1f}M params), fp32, batch {WORLD}x{args.micro_batch}x"
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
            saves[stage] = summarize_save(run_ranks(save_rank, WORLD, case, overrides, args.warmup,
                                                    args.steps, args.async_steps, timeout=1800))
            saves[stage]["ckpt"] = str(find_checkpoint(root / f"s{stage}"))  # latest is a file
            print(f"stage {stage}: saves done ({time.monotonic() - began:.0f} s; {other()})", flush=True)
            modes = [("all", True), ("all", False), ("one", True), ("one", False)]
            ckpt = str(Path(saves[stage]["ckpt"]).resolve())
            results = run_ranks(load_rank, WORLD, case, overrides_for(args, stage, str(root), f"l{stage}"),
                                ckpt, modes, timeout=1800)
            loads[(stage, WORLD, stage)] = results
            print(f"stage {stage}: loads done ({time.monotonic() - began:.0f} s; {other()})", flush=True)
        if not args.no_one_process:
            source = 1 if 1 in stages else stages[0]
            ckpt = str(Path(saves[source]["ckpt"]).resolve())
            case = Path(tempfile.mkdtemp(dir=root))
            loads[(source, 1, 0)] = run_ranks(load_rank, 1, case, overrides_for(args, 0, str(root), "l1p"),
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
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for stage, s in saves.items():
        first, best = disk["write2"] if s["writers"] == 2 else disk["write1"]
        during = ", ".join(f"{x:.2f}" for x in s["overlap"]) or "none"
        waited = f" + {s['waited']:.2f} wait" if s["waited"] > 0.005 else ""
        rate = s["gb_s"] * 1e3
        print(f"| {stage} | {s['writers']} | {' / '.join(f'{b / MB:,.0f}' for b in s['bytes'])} | "
              f"{s['total'] / MB:,.0f} | {s['sync_s']:.2f} ({' / '.join(f'{x:.2f}' for x in s['sync_ranks'])}) | "
              f"{rate:,.0f} | {first:,.0f} / {best:,.0f} | {rate / first:.0%} / {rate / best:.0%} | "
              f"{s['async_stall']:.2f} | {s['async_write']:.2f} | {s['base']:.2f} | "
              f"{len(s['overlap'])}: {during}{waited} | {s['extra']:+.2f} | "
              f"{s['async_stall'] + s['extra']:.2f} ({s['sync_s']:.2f}) |")

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
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for stage, s in saves.items():
        print("\n".join(phase_rows(stage, s)))
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
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for (saved, world, stage), ranks in loads.items():
        total = saves[saved]["total"]
        for i, mode in enumerate(ranks[0]):
            seconds = max(r[i]["s"] for r in ranks)
            busiest = max((r[i] for r in ranks), key=lambda m: m["verify"] + m["read"] + m["after_load"])
            verify, read, after = busiest["verify"], busiest["read"], busiest["after_load"]
            rest = seconds - verify - read - after
            files = " / ".join("+".join(f.removeprefix("rank-").removesuffix(".safetensors")
                                        for f, _ in r[i]["files"]) or "-" for r in ranks)
            print(f"| stage {saved}, {WORLD} ranks | stage {stage}, {world} rank{'s' if world > 1 else ''} | "
                  f"{mode['readers']} | {'cold' if mode['cold'] else 'warm'} | {seconds:.2f} | "
                  f"{verify:.2f} | {verify / seconds:.0%} | {read:.2f} | {after:.2f} | {rest:.2f} | "
                  f"{files} | {total / seconds / 1e9:.2f} |")
    machine, own = (after - before for after, before in zip(cpu_seconds(), cpu_before))
    print(f"\nCPU time used by other processes while this ran: {machine - own:.0f} s "
          f"(this benchmark: {own:.0f} s, over {time.monotonic() - began:.0f} s x {os.cpu_count()} cores)")
    print(f"\nTotal {time.monotonic() - began:.0f} s. Reproduce: PYTHONPATH=src python "
          f"bench/bench_checkpoint.py {' '.join(sys.argv[1:])}")


if __name__ == "__main__":
    main()
