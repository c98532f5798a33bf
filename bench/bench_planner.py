"""The planner's predictions against real training on this machine.

For each case (1, 2 and 4 ranks; ZeRO stages 0-3; activation checkpointing none/full; the nvme
tier; tp=2 with and without SP, cp=2, cp=2 x tp=2, pp=2 1f1b/gpipe/zb; ep=2 with --preset
moe-mini) a fresh set of gloo ranks trains a few steps and reports from rank 0: the model-state
byte ledger, peak RSS (VmHWM), the bytes of new pages a step touches (minor faults x page size),
the median step time after the first, and the CPU other processes used meanwhile. Beside each,
`predict_local(cfg, ranks)` (after `shardlm calibrate --again`, and `--disk .` with nvme cases).
Targets: model-state bytes within 2%, peak process memory within 10%, step time within 20%
(issue 30). Method and results: docs/planner.md, docs/benchmarks.md.

Reproduce:  PYTHONPATH=src python bench/bench_planner.py                    (gpt2-124m, ~10 min)
            PYTHONPATH=src python bench/bench_planner.py --preset gpt-mini --steps 4
            PYTHONPATH=src python bench/bench_planner.py --only 4,2,none,none   (one case; repeatable)
            PYTHONPATH=src python bench/bench_planner.py --only 2,0,none,none,tp2sp --only 2,1,none,none,cp2
            PYTHONPATH=src python bench/bench_planner.py --predict-from docs/planner/quiet-2026-11-26-gpt-mini.json
                (no training: the saved measurements, predicted anew on this machine)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MiB = 2**20


AXES = {"": {}, "tp2": {"parallel.tp": 2}, "tp2sp": {"parallel.tp": 2, "parallel.sequence_parallel": True},
        "cp2": {"parallel.cp": 2}, "cp2tp2": {"parallel.cp": 2, "parallel.tp": 2},
        "pp2": {"parallel.pp": 2, "train.grad_accum": 4},
        "pp2gpipe": {"parallel.pp": 2, "parallel.pp_schedule": "gpipe", "train.grad_accum": 4},
        "pp2zb": {"parallel.pp": 2, "parallel.pp_schedule": "zb", "train.grad_accum": 4},
        "ep2": {"parallel.ep": 2}, "ep2tp2": {"parallel.ep": 2, "parallel.tp": 2},
        "ep2cp2": {"parallel.ep": 2, "parallel.cp": 2}}
"""Model axes a case can add (the last field of --only)."""


def cases(max_ranks: int, experts: bool = False) -> list[tuple[int, int, str, str, str]]:
    """(ranks, stage, activation checkpoint, offload, model axes) to run; a mixture of experts
    (`experts`) adds expert parallelism: ep = 2 at stages 0 and 3, over the cp ranks, beside dp = 2
    and in an ep 2 x tp 2 grid on 4 ranks."""
    out = [(1, 0, "none", "none", ""), (1, 0, "full", "none", ""), (1, 1, "none", "nvme", "")]
    for ranks in (2, 4):
        if ranks > max_ranks:
            continue
        out += [(ranks, stage, "none", "none", "") for stage in range(4)]
        out += [(ranks, 3, "full", "none", ""), (ranks, 2, "none", "nvme", "")]
    out += [(2, 0, "none", "none", "tp2"), (2, 0, "none", "none", "tp2sp"), (2, 0, "none", "none", "cp2"),
            (2, 3, "full", "none", "cp2")]
    out += [(2, 0, "none", "none", "pp2"), (2, 1, "none", "none", "pp2gpipe"), (2, 0, "none", "none", "pp2zb")]
    if max_ranks >= 4:
        out += [(4, 1, "none", "none", "cp2tp2")]
    if experts:
        out += [(2, 0, "none", "none", "ep2"), (2, 3, "none", "none", "ep2"), (2, 0, "none", "none", "ep2cp2")]
        out += [(4, 1, "none", "none", "ep2"), (4, 1, "none", "none", "ep2tp2")] if max_ranks >= 4 else []
    return out


def overrides_for(args, ranks: int, stage: int, ac: str, offload: str, axes: str, run_dir: str) -> dict:
    return {**AXES[axes], "model.preset": args.preset, "train.micro_batch": args.micro_batch,
            "train.seq_len": args.seq, "train.steps": args.steps, "train.eval_every": 0,
            "train.sample_tokens": 0, "precision.compute": args.precision, "parallel.zero_stage": stage,
            "activation.checkpoint": ac, "zero.offload_optimizer": offload, "run.device": "cpu",
            "run.dir": run_dir, "run.progress": "off"}


def measure(rank: int, world_size: int, overrides: dict, steps: int) -> dict:
    """Rank side: train `steps` steps; the ledger, peak RSS and step times."""
    from shardlm.config.load import load_config
    from shardlm.train.telemetry import peak_rss_bytes
    from shardlm.train.build import build_run
    from shardlm.train.step import train_step

    run = build_run(load_config(overrides=overrides).validate())
    seconds, faults, cpu = [], [], []
    for step in range(steps):
        before = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        train_step(run, step)
        seconds.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_SELF)
        faults.append(after.ru_minflt - before.ru_minflt)
        cpu.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    # Minor page faults x the page size: the bytes of new mappings a step touched, which no
    # load changes (the planner's "fresh memory" counts them: planner/memory_bound.py)
    return {"state": run.strategy.model_state_bytes(), "peak_rss": peak_rss_bytes(),
            "step_s": statistics.median(seconds[1:] or seconds),
            "fresh_bytes": statistics.median(faults[1:] or faults) * os.sysconf("SC_PAGE_SIZE"),
            "cpu_s": statistics.median(cpu[1:] or cpu)}  # the process's CPU time per step, all threads


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt2-124m")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--max-ranks", type=int, default=4)
    parser.add_argument("--json", default="")
    parser.add_argument("--only", action="append", default=[], metavar="RANKS,STAGE,AC,OFFLOAD[,AXES]",
                        help=f"run only this case (repeatable), e.g. 4,2,none,none; AXES one of "
                             f"{', '.join(a for a in AXES if a)}")
    parser.add_argument("--predict-from", default="", metavar="FILE",
                        help="train nothing: read the cases a run of this bench saved (its --json, "
                             "or its log's one JSON line per case), keep their measurements and "
                             "predict them anew; the run's preset, seq, micro-batch and precision "
                             "come from each case (older files: from these flags)")
    return parser.parse_args(argv)


def read_cases(path: str) -> list[dict]:
    """The cases a run saved: a JSON list (--json) or a log whose lines starting with '{' are
    one case each (the bench prints each case as it ends)."""
    text = Path(path).read_text()
    if text.lstrip().startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def run_case(args, ranks: int, stage: int, ac: str, offload: str, axes: str, tmp: Path) -> dict:
    """Train one case on `ranks` fresh gloo ranks; its measurements and the settings it ran."""
    from shardlm.launch.spawn import run_ranks

    overrides = overrides_for(args, ranks, stage, ac, offload, axes, str(tmp / "runs"))
    waited = wait_until_quiet()
    load_before = os.getloadavg()[0]
    busy, ours, start = cpu_busy_s(), own_cpu_s(), time.monotonic()
    measured = run_ranks(measure, ranks, tmp, overrides, args.steps, timeout=1800)[0]
    others = max(0.0, (cpu_busy_s() - busy) - (own_cpu_s() - ours)) / (time.monotonic() - start)
    load = max(load_before, os.getloadavg()[0])
    return {"ranks": ranks, "stage": stage, "ac": ac, "offload": offload, "axes": axes or "dp",
            "preset": args.preset, "seq": args.seq, "micro_batch": args.micro_batch,
            "precision": args.precision, "steps": args.steps,
            "state_measured": sum(measured["state"].values()), "peak_measured": measured["peak_rss"],
            "step_measured": measured["step_s"], "fresh_measured": measured["fresh_bytes"],
            "cpu_measured": measured["cpu_s"], "load_average": load, "other_cpu": others,
            "waited_s": waited}


def cpu_busy_s() -> float:
    """Seconds of CPU this machine's cores have spent busy since boot, every process and the
    kernel's own threads (/proc/stat: all but idle and iowait)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds of this process and of its children that have ended (the ranks, once joined)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def wait_until_quiet(limit_s: float = 60.0, window_s: float = 1.0, threshold: float = 0.1) -> float:
    """Before a case: write back dirty pages (an nvme case's files are flushed by the kernel's
    threads after it ends) and wait until the rest of the machine uses under `threshold` of a
    core over `window_s`, at most `limit_s`. The seconds waited (the load average lags by a
    minute, so it cannot tell)."""
    os.sync()
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        busy, ours = cpu_busy_s(), own_cpu_s()
        time.sleep(window_s)
        if (cpu_busy_s() - busy) - (own_cpu_s() - ours) < threshold * window_s:
            break
    return time.monotonic() - start


def predict_case(args, row: dict) -> dict:
    """The planner's prediction for a case (on this machine's cached probe and calibration)."""
    from shardlm.config.load import load_config
    from shardlm.planner.explain import step_parts
    from shardlm.planner.search import predict_local

    settings = argparse.Namespace(**{**vars(args), **{k: row[k] for k in
                                                      ("preset", "seq", "micro_batch", "precision", "steps")
                                                      if k in row}})
    axes = "" if row["axes"] == "dp" else row["axes"]
    overrides = overrides_for(settings, row["ranks"], row["stage"], row["ac"], row["offload"], axes, "unused")
    predicted = predict_local(load_config(overrides=overrides).validate(), row["ranks"])
    t = predicted.timing
    return {"state_predicted": sum(predicted.model_state_bytes.values()),
            "peak_predicted": predicted.peak_process_bytes, "step_predicted": predicted.step_time_s,
            "calibration": t.calibration, "fresh_predicted": sum(w.fresh_bytes for w in t.work),
            "step_parts": {k: v for k, v in step_parts(t).items() if v > 0}}


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the spawned ranks

    # The probe runs in a child of its own: a parent's peak RSS survives fork + exec into the
    # ranks (every case's peak read 774 MiB when the parent had probed).
    if args.predict_from:
        saved = read_cases(args.predict_from)
        wanted = [(r["ranks"], r["ac"], r["axes"]) for r in saved]
    else:
        from shardlm.config.presets import get_preset

        selected = cases(args.max_ranks, bool(get_preset(args.preset).get("experts")))
        if args.only:
            selected = [tuple(int(v) if i < 2 else v for i, v in enumerate((o + ",").split(",")[:5]))
                        for o in args.only]
        wanted = [(c[0], c[2], c[4]) for c in selected]
    counts = sorted({n for n, _, _ in wanted})
    subprocess.run([sys.executable, "-c", "import sys; from shardlm.hardware.probe import measure_cpu; "
                    f"[measure_cpu(n) for n in {counts}]"], check=True)
    # The model's whole pass at each rank count's threads (docs/planner.md sections 4, 4b), as
    # each case's rank runs it and plain; timed anew (--again): the machine drifts ~10% over hours
    first = saved[0] if args.predict_from else {}
    model = {k: first.get(k, getattr(args, k)) for k in ("preset", "seq", "micro_batch", "precision")}
    # (with tensor parallelism, the shard's matmul shapes: --tp)
    passes = {(n, 1, 1, "none") for n in counts} | {(n, 2 if "cp2" in axes else 1, 2 if "tp2" in axes else 1, ac)
                                                     for n, ac, axes in wanted}
    if not args.predict_from and any(case[3] == "nvme" for case in selected):
        # the disk as 1, 2 and 4 ranks stream through it, first: the drive settles before the cases
        subprocess.run([sys.executable, "-m", "shardlm", "calibrate", "--disk", ".", "--again"], check=True,
                       stdout=subprocess.DEVNULL)
    for n, split, tp, ac in sorted(passes):
        subprocess.run([sys.executable, "-m", "shardlm", "calibrate", "--model", model["preset"], "--seq",
                        str(model["seq"] // split), "--micro-batch", str(model["micro_batch"]), "--precision",
                        model["precision"], "--ranks", str(n), "--recompute", ac, "--tp", str(tp)]
                       + ([] if args.predict_from else ["--again"]), check=True, stdout=subprocess.DEVNULL)

    if not args.predict_from:
        # The tokenizer and token shards, built in a child of its own before the cases: built
        # inside the first case they set its peak RSS (522 MiB against its neighbours' 440-457)
        data = overrides_for(args, 1, 0, "none", "none", "", "unused")
        subprocess.run([sys.executable, "-c", "import sys, json; from shardlm.config.load import load_config; "
                        "from shardlm.data.loader import build_dataset; "
                        "cfg = load_config(overrides=json.loads(sys.argv[1])).validate(); "
                        "build_dataset(cfg.data, cfg.model.vocab_size, None, cfg.train.seq_len)",
                        json.dumps(data)], check=True, stdout=subprocess.DEVNULL)

    rows = []
    if args.predict_from:
        for row in saved:
            before = {k: row.get(k) for k in ("step_predicted", "peak_predicted")}
            rows.append({**row, **predict_case(args, row), "before": before})
            print(json.dumps(rows[-1]), flush=True)
    else:
        with tempfile.TemporaryDirectory(dir=".") as tmp:
            for case in selected:
                row = run_case(args, *case, Path(tmp))
                rows.append({**row, **predict_case(args, row)})
                print(json.dumps(rows[-1]), flush=True)
    print_table(args, rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def err(p: float, m: float) -> float:
    return (p - m) / m


def print_table(args, rows: list[dict]) -> None:
    first = rows[0] if rows else {}
    preset, precision = first.get("preset", args.preset), first.get("precision", args.precision)
    micro, seq, steps = first.get("micro_batch", args.micro_batch), first.get("seq", args.seq), first.get("steps", args.steps)
    again = any("before" in r for r in rows)
    print(f"\n{preset}, {precision}, batch {micro}x{seq} per rank, {steps} steps (median after the first)"
          + (f"; measured as saved in {args.predict_from}, predicted now" if again else "") + "\n")
    before = " step s pred before | err before |" if again else ""
    print("| ranks | axes | stage | AC | offload | state MiB meas / pred | err | peak RSS MiB meas / pred | err "
          f"| new pages MB meas / pred | err | step s meas / pred | err |{before} load | other CPU |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if again else "") + "---|---|")
    misses = []
    for r in rows:
        e = (err(r["state_predicted"], r["state_measured"]), err(r["peak_predicted"], r["peak_measured"]),
             err(r["step_predicted"], r["step_measured"]))
        for name, value, limit in zip(("state", "peak", "step"), e, (0.02, 0.10, 0.20)):
            if abs(value) > limit:
                misses.append(f"{r['ranks']} ranks {r['axes']} stage {r['stage']} AC {r['ac']} offload {r['offload']}: "
                              f"{name} off by {value:+.0%} (target ±{limit:.0%})")
        old = r.get("before", {}).get("step_predicted")
        was = (f" {old:.3f} | {err(old, r['step_measured']):+.1%} |" if old else " – | – |") if again else ""
        other = f"{r['other_cpu']:.2f}" if "other_cpu" in r else "–"
        fresh = (f"{r['fresh_measured'] / 1e6:,.1f} / {r['fresh_predicted'] / 1e6:,.1f} | "
                 f"{err(r['fresh_predicted'], r['fresh_measured']):+.1%}" if r.get("fresh_measured") else "– | –")
        print(f"| {r['ranks']} | {r['axes']} | {r['stage']} | {r['ac']} | {r['offload']} | "
              f"{r['state_measured'] / MiB:,.1f} / {r['state_predicted'] / MiB:,.1f} | {e[0]:+.1%} | "
              f"{r['peak_measured'] / MiB:,.0f} / {r['peak_predicted'] / MiB:,.0f} | {e[1]:+.1%} | {fresh} | "
              f"{r['step_measured']:.3f} / {r['step_predicted']:.3f} | {e[2]:+.1%} |{was} {r['load_average']:.1f} | {other} |")
    print(f"\nload: the 1-minute load average around each case on {os.cpu_count()} cores (above the "
          f"cores, other processes shared them and step times are not this machine's); other CPU: the cores'\n"
          f"worth of CPU the rest of the machine used while the case ran (/proc/stat's busy time less the\n"
          f"bench's own and its ranks'), after waiting for it to fall under 0.1 before each case")
    print("\npredicted step, by part (s):")
    for r in rows:
        parts = ", ".join(f"{k} {v:.3g}" for k, v in r.get("step_parts", {}).items())
        print(f"  {r['ranks']} {r['axes']} stage {r['stage']} {r['ac']} {r['offload']}: {parts}")
    for source in sorted({r["calibration"] for r in rows}):
        print(f"compute rate from {source}")
    print("\nmisses:" if misses else "\nevery case within its target")
    for m in misses:
        print("  " + m)
    print(f"\nReproduce: PYTHONPATH=src python bench/bench_planner.py --preset {preset} "
          f"--steps {steps} --micro-batch {micro} --seq {seq}"
          + (f"  (predictions only: --predict-from {args.predict_from})" if again else ""))


if __name__ == "__main__":
    sys.exit(main())
