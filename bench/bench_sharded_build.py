"""The sharded build's memory: setup and training peak RSS per rank, next to one fp32 copy of
the model (4 bytes x parameters).

One invocation = one row = a fresh pair of ranks at ZeRO-3, bf16 compute, optimizer and
parameters offloaded to nvme under --dir (tmpfs refused), micro-batch 1, --steps steps. Per rank:
RSS of the bare interpreter and after `import torch`, the setup peak, the training peak (VmHWM
reset between phases through /proc/self/clear_refs), a phase table (each patched shardlm
function's peak), the ledger (model_state_bytes) and the formula (predicted_state_bytes).
--via-cli runs `shardlm train --nproc 2` with the same overrides and reads each worker's VmHWM
from /proc and rank 0's metrics.jsonl. Method and results: docs/benchmarks.md, "Sharded build".

Reproduce (one row per invocation; the 1.5B row takes ~10+ minutes):
    PYTHONPATH=src python bench/bench_sharded_build.py --preset gpt2-774m
    PYTHONPATH=src python bench/bench_sharded_build.py --preset gpt2-774m --via-cli
    PYTHONPATH=src python bench/bench_sharded_build.py --preset gpt2-1.5b
Needs ~14 bytes per parameter free under --dir (nvme tier: fp32 master + 2 moments, bf16 shards).
"""

from __future__ import annotations

import os


def _status() -> dict[str, int]:
    """/proc/self/status's memory lines, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.startswith(("Vm", "Rss")) and value.strip().endswith("kB"):
                out[key] = int(value.split()[0]) * 1024
    return out


# The rank's baseline: measured when a spawned rank imports this module (before it unpickles
# the rank function, i.e. before shardlm or the process group exist).
_BARE_RSS = _status()["VmRSS"]
import torch  # noqa: E402

_TORCH_RSS = _status()["VmRSS"]

import functools  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

from common import (GiB, MiB, bench_parser, machine, prepare, proc_status, reproduce, reset_peak_rss,  # noqa: E402
                    start_ranks, table)
from common.cli import children, rank_of, read_jsonl, train_argv  # noqa: E402
from shardlm.launch.allocator import DEFAULT_THRESHOLD  # noqa: E402

WORLD = 2


class Phases:
    """Peak RSS per phase: at every boundary the high-water mark since the last boundary is
    charged to the innermost running phase, then reset."""

    def __init__(self):
        self.stack: list[str] = []
        self.peak: dict[str, int] = {}
        self.rss_after: dict[str, int] = {}
        self.anon_after: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self.resets = True

    def _boundary(self) -> dict[str, int]:
        status = _status()
        if self.stack:
            name = "/".join(self.stack)
            self.peak[name] = max(self.peak.get(name, 0), status["VmHWM"])
        self.resets = reset_peak_rss() and self.resets
        return status

    def enter(self, name: str) -> None:
        self._boundary()
        self.stack.append(name)
        path = "/".join(self.stack)
        self.calls[path] = self.calls.get(path, 0) + 1

    def exit(self) -> None:
        status = self._boundary()
        path = "/".join(self.stack)
        self.rss_after[path], self.anon_after[path] = status["VmRSS"], status.get("RssAnon", 0)
        self.stack.pop()

    def within(self, prefix: str) -> int:
        """Peak over the phase `prefix` and everything nested in it."""
        return max(v for k, v in self.peak.items() if k == prefix or k.startswith(prefix + "/"))

    def wrap(self, owner, attr: str, label: str) -> None:
        original = getattr(owner, attr)

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            self.enter(label)
            try:
                return original(*args, **kwargs)
            finally:
                self.exit()
        setattr(owner, attr, wrapper)


def instrument(phases: Phases) -> None:
    """Phase wrappers around shardlm's setup and step, in this (rank) process only."""
    import shardlm.train.build as builder
    import shardlm.train.step as stepper
    from shardlm.parallel.data.zero import engine
    from shardlm.parallel.data.zero.params import ParamSharding
    from shardlm.parallel.data.zero.tiers.nvme import NvmeTier
    from shardlm.parallel.data.zero.tiers.nvme_params import FileParams

    for attr, label in [("resolve_config", "resolve config"), ("build_mesh", "mesh"),
                        ("build_dataset", "dataset (tokenizer + token memmap)"),
                        ("build_model", "model on meta"), ("parallelize", "parallelize"),
                        ("checkpoint_writer", "checkpoint writer"), ("Loader", "loaders"),
                        ("peak_flops", "peak_flops (cached)")]:
        phases.wrap(builder, attr, label)
    phases.wrap(stepper, "loss_of", "forward + loss")
    for attr, label in [("build_tier", "nvme tier (ring allocated)"),
                        ("build_param_store", "param store: every shard -> disk"),
                        ("materialize_buffers", "buffers")]:
        phases.wrap(engine, attr, label)
    phases.wrap(engine.Unit, "__init__", "unit: fp32 init -> bf16 flat + shard")
    phases.wrap(NvmeTier, "add", "master -> disk")
    phases.wrap(NvmeTier, "build_optimizer", "optimizer files")
    phases.wrap(ParamSharding, "__init__", "stage-3 hooks")
    phases.wrap(torch.Tensor, "backward", "backward")
    phases.wrap(engine.ZeroEngine, "finish_backward", "finish_backward (last reductions)")
    phases.wrap(engine.ZeroEngine, "clip_grad_norm", "clip")
    phases.wrap(engine.ZeroEngine, "step", "optimizer step")
    phases.wrap(FileParams, "materialize_all", "param shards <- disk")
    phases.wrap(NvmeTier, "step", "streamed AdamW (nvme ring)")
    phases.wrap(FileParams, "store_all", "param shards -> disk")


def rank_main(rank: int, world: int, overrides: dict, steps: int) -> dict:
    from shardlm.launch.allocator import apply_malloc_policy
    from shardlm.config.load import load_config
    from shardlm.train.build import build_run
    from shardlm.train.step import train_step

    cfg = load_config(overrides=overrides).validate()
    malloc = apply_malloc_policy(cfg.run.malloc_mmap_threshold)  # as shardlm.cli.train.train_here does
    entry = _status()
    phases = Phases()
    instrument(phases)
    phases.enter("setup")
    run = build_run(cfg)
    phases.exit()
    held = run.strategy.model_state_bytes()
    predicted = run.strategy.predicted_state_bytes()
    losses = []
    for step in range(steps):
        phases.enter(f"step {step + 1}")
        losses.append(train_step(run, step).loss)
        phases.exit()
    strategy = run.strategy
    return {
        "bare": _BARE_RSS, "after_torch": _TORCH_RSS, "entry": entry["VmRSS"],
        "setup_peak": phases.within("setup"), "setup_rss": phases.rss_after["setup"],
        "setup_anon": phases.anon_after["setup"],
        "train_peak": max(phases.within(f"step {s + 1}") for s in range(steps)),
        "end_rss": _status()["VmRSS"], "hwm_reset": phases.resets,
        "held": held, "predicted": predicted, "losses": losses, "malloc": malloc.report(),
        "offload": {k: v for k, v in strategy.offload_report().items() if "bytes_by_tier" in k},
        "direct_io": strategy.tier.direct_io, "n_units": len(strategy.units),
        "largest_unit": max(u.layout.padded for u in strategy.units),
        "phases": [(k, v, phases.rss_after.get(k, 0), phases.calls.get(k, 0)) for k, v in phases.peak.items()],
    }


def fs_type(path: Path) -> str:
    """The file system type of the mount holding `path` (longest matching mount point)."""
    best, kind = "", "?"
    resolved = str(path.resolve())
    with open("/proc/mounts") as f:
        for line in f:
            _, mount, fstype, *_ = line.split()
            if (resolved == mount or resolved.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
                best, kind = mount, fstype
    return kind


def worker_peaks(launcher: subprocess.Popen, peaks: dict[int, int], metrics: Path, steps: int,
                 at_last_step: dict[int, int]) -> None:
    """Until the launcher exits: the VmHWM of each of its child processes that is a rank (RANK in
    its environment), the largest seen per rank (the mark only grows while a process lives); and
    in `at_last_step` each rank's mark when rank 0 had written the last step's JSONL line (after
    the steps and the end-of-run evaluation, before the run's weights are saved; to within a
    0.1 s poll)."""
    while launcher.poll() is None:
        done = not at_last_step and metrics.exists() and f'"step": {steps},' in metrics.read_text()
        for pid in children(launcher.pid):
            rank = rank_of(pid)
            try:
                hwm = proc_status("VmHWM", pid)
            except (OSError, AttributeError):  # gone, or exiting (no memory lines left)
                continue
            if rank is not None:  # a worker
                peaks[rank] = max(peaks.get(rank, 0), hwm)
                if done:
                    at_last_step[rank] = peaks[rank]
        time.sleep(0.1)


def via_cli(args, overrides: dict, tmp: Path, psi: int) -> None:
    """The same run through `shardlm train --nproc 2` (fresh workers, torch's elastic launcher)."""
    overrides = {**overrides, "run.name": "cli"}
    cmd = train_argv(overrides, nproc=WORLD)
    print("$ " + " ".join(cmd[1:]), flush=True)
    start = time.perf_counter()
    peaks: dict[int, int] = {}
    at_last_step: dict[int, int] = {}
    metrics = tmp / "runs" / "cli" / "metrics.jsonl"
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watcher = threading.Thread(target=worker_peaks, args=(launcher, peaks, metrics, args.steps, at_last_step),
                               daemon=True)
    watcher.start()
    out = launcher.communicate(timeout=args.timeout)[0]
    watcher.join()
    wall = time.perf_counter() - start
    records = read_jsonl(metrics)
    shutil.rmtree(tmp, ignore_errors=True)
    print("\n".join(line for line in out.splitlines() if line.startswith(("shardlm", "done", "rank"))))
    if launcher.returncode != 0 or not records:
        print(f"\nFAILED (exit {launcher.returncode}) after {wall:.0f} s:\n{out}", flush=True)
        sys.exit(1)
    jsonl_peak = max(r["peak_rss_bytes"] for r in records)
    ledger = records[-1]["model_state_bytes"]
    fp32_copy = 4 * psi
    header = ("preset", "via", "rank", "JSONL peak_rss_bytes GiB (through the last step; rank 0 writes it)",
              "VmHWM GiB at the last step's JSONL line (+ final evaluation)",
              "VmHWM GiB, whole process (+ weights saved at the end)", "training peak / (4 B x Ψ)",
              "ledger model_state_bytes GiB")
    rows = []
    for rank in sorted(peaks):
        train_peak = jsonl_peak if rank == 0 else at_last_step.get(rank, 0)
        rows.append([args.preset, f"shardlm train --nproc {WORLD}", rank, gib(jsonl_peak) if rank == 0 else "-",
                     gib(at_last_step.get(rank, 0)), gib(peaks[rank]), f"{train_peak / fp32_copy:.2f}",
                     gib(ledger) if rank == 0 else "-"])
    print("\n" + table(header, rows))
    print(f"\n{wall:.0f} s for the launcher and its workers (shared machine, not a speed figure). {reproduce()}")


def gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def main() -> None:
    parser = bench_parser(__doc__, "gpt2-774m", 128, 1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--max-bytes", type=int, default=2_000_000, help="data.max_bytes")
    parser.add_argument("--chunk-mb", type=int, default=64, help="zero.nvme_chunk_mb (config default 64)")
    parser.add_argument("--buffers", type=int, default=4, help="zero.nvme_buffers (config default 4)")
    parser.add_argument("--dir", default=tempfile.gettempdir(),
                        help="a temporary directory for the nvme files and the run is made in here")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds for the ranks")
    parser.add_argument("--malloc-mmap-threshold", type=int, default=DEFAULT_THRESHOLD,
                        help="run.malloc_mmap_threshold (config default 8388608; 0 = glibc's dynamic default)")
    parser.add_argument("--via-cli", action="store_true",
                        help="run the same configuration through `shardlm train --nproc 2` (the command "
                             "users run) and report its workers' peaks")
    args = parser.parse_args()

    from shardlm.config.load import load_config
    from shardlm.models.flops import count_params

    base = Path(args.dir)
    fstype = fs_type(base)
    if fstype in ("tmpfs", "ramfs"):
        sys.exit(f"--dir {base} is on {fstype}: the nvme tier's files would live in RAM; pick a disk")
    tmp = Path(tempfile.mkdtemp(prefix="bench-sharded-build-", dir=base))
    overrides = {
        "model.preset": args.preset, "train.micro_batch": args.micro_batch, "train.seq_len": args.seq,
        "train.steps": args.steps, "train.grad_accum": 1, "train.eval_every": 0, "train.sample_tokens": 0,
        "data.max_bytes": args.max_bytes, "precision.compute": "bf16", "parallel.zero_stage": 3,
        "zero.offload_optimizer": "nvme", "zero.offload_params": "nvme", "zero.nvme_path": str(tmp / "nvme"),
        "zero.nvme_chunk_mb": args.chunk_mb, "zero.nvme_buffers": args.buffers,
        "run.dir": str(tmp / "runs"), "run.progress": "off", "run.device": "cpu"}
    if args.malloc_mmap_threshold != DEFAULT_THRESHOLD:  # else the default, as users get it
        overrides["run.malloc_mmap_threshold"] = args.malloc_mmap_threshold
    cfg = load_config(overrides=overrides).validate()
    psi = count_params(cfg.model)
    fp32_copy = 4 * psi
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    # the ranks apply run.malloc_mmap_threshold themselves, as `shardlm train` does
    threads = prepare(cfg, WORLD, mmap_threshold=None, precision="bf16")
    ring = args.buffers * 4 * args.chunk_mb * MiB
    print(f"{machine()}; {WORLD} gloo ranks x {threads} thread(s), {args.preset} "
          f"({psi / 1e6:.1f}M params; one fp32 copy 4 x Ψ = {gib(fp32_copy)} GiB), ZeRO-3, bf16 compute, "
          f"offload optimizer + params = nvme under {tmp} ({fstype}), batch {WORLD}x{args.micro_batch}x"
          f"{args.seq}, {args.steps} steps, data.max_bytes {args.max_bytes:,}, vocab {cfg.model.vocab_size}, "
          f"nvme ring {args.buffers} buffers x 4 x {args.chunk_mb} MiB = {ring / MiB:,.0f} MiB; "
          f"RAM {ram / GiB:.1f} GiB; "
          f"{'through `shardlm train --nproc 2`' if args.via_cli else 'ranks of run_ranks'}",
          flush=True)
    if args.via_cli:
        via_cli(args, overrides, tmp, psi)
        return
    start = time.perf_counter()
    try:
        ranks = start_ranks(rank_main, WORLD, tmp, overrides, args.steps, timeout=args.timeout)
    except Exception:
        print(f"\nFAILED after {time.perf_counter() - start:.0f} s:\n{traceback.format_exc()}", flush=True)
        shutil.rmtree(tmp, ignore_errors=True)
        sys.exit(1)
    wall = time.perf_counter() - start
    shutil.rmtree(tmp, ignore_errors=True)

    header = ("preset", "params", "rank", "baseline RSS (after import torch) GiB", "setup peak RSS GiB",
              "training peak RSS GiB", "peak / (4 B x Ψ)", "4 B x Ψ GiB", "ledger params / grads / optimizer GiB",
              "formula params / grads / optimizer GiB", "peak < 4 B x Ψ")
    rows = []
    for rank, r in enumerate(ranks):
        peak = max(r["setup_peak"], r["train_peak"])
        held, pred = r["held"], r["predicted"]
        rows.append([args.preset, f"{psi / 1e6:.0f}M", rank, gib(r["after_torch"]), gib(r["setup_peak"]),
                     gib(r["train_peak"]), f"{peak / fp32_copy:.2f}", gib(fp32_copy),
                     " / ".join(gib(held[k]) for k in ("params", "grads", "optimizer")),
                     " / ".join(gib(pred[k]) for k in ("params", "grads", "optimizer")),
                     "yes" if peak < fp32_copy else "NO"])
    print("\n" + table(header, rows))
    print(f"\nrank 0 {ranks[0]['malloc']}")
    for rank, r in enumerate(ranks):
        print(f"rank {rank}: bare interpreter {r['bare'] / MiB:,.0f} MiB, after import torch "
              f"{r['after_torch'] / MiB:,.0f} MiB, at rank entry (shardlm + gloo group) {r['entry'] / MiB:,.0f} MiB; "
              f"RSS after setup {r['setup_rss'] / MiB:,.0f} MiB (anonymous {r['setup_anon'] / MiB:,.0f}), at the end "
              f"{r['end_rss'] / MiB:,.0f} MiB; on disk {r['offload']}; direct I/O {r['direct_io']}; "
              f"{r['n_units']} units, largest {r['largest_unit'] / 1e6:.1f}M elements; losses "
              f"{', '.join(f'{x:.3f}' for x in r['losses'])}; HWM reset {'ok' if r['hwm_reset'] else 'FAILED'}")
    print("\nPeak RSS per phase, MiB (each phase's own segments; a parent's row excludes its children):")
    other = {name: (peak, after) for name, peak, after, _ in ranks[1]["phases"]}
    rows = []
    for name, peak, after, calls in ranks[0]["phases"]:
        p1, a1 = other.get(name, (0, 0))
        label = "› " * name.count("/") + name.rsplit("/", 1)[-1]
        rows.append([label, calls, f"{peak / MiB:,.0f}", f"{p1 / MiB:,.0f}", f"{after / MiB:,.0f}", f"{a1 / MiB:,.0f}"])
    print(table(("phase", "calls", "rank 0 peak", "rank 1 peak", "rank 0 RSS after (last call)", "rank 1 RSS after"),
                rows))
    print(f"\n{wall:.0f} s for the pair of ranks (setup + {args.steps} steps; shared machine, not a speed figure). "
          f"{reproduce()}")


if __name__ == "__main__":
    main()
