"""The planner's predictions against real training on this machine.

For each case — 1, 2 and 4 ranks; ZeRO stages 0-3; activation checkpointing none/full; the
nvme offload tier; the model axes: tensor parallelism (tp=2, with and without sequence
parallelism), context parallelism (cp=2), both (cp=2 x tp=2), pipelines (pp=2: 1f1b, gpipe, zb;
4 micro-batches) — a fresh set of gloo ranks trains a few steps and reports, from rank 0:
the model-state byte ledger (params + grads + optimizer, what the engine holds), the process's
peak RSS (ru_maxrss) and the median step time after the first, and the load average around it.
The planner's `predict_local(cfg, ranks)` predicts the same three from the config alone (its
compute rate from this machine's matmul curve: the probe's shapes and whatever `shardlm
calibrate` cached; the table says which). MALLOC_MMAP_THRESHOLD_=65536 is set for
the ranks so RSS follows what is alive.

Targets: model-state bytes within 2%, peak process memory within 10%, step time within 20% (issue 30).

Reproduce:  PYTHONPATH=src python bench/bench_planner.py                    (gpt2-124m, ~10 min)
            PYTHONPATH=src python bench/bench_planner.py --preset gpt-mini --steps 4
            PYTHONPATH=src python bench/bench_planner.py --only 4,2,none,none   (one case; repeatable)
            PYTHONPATH=src python bench/bench_planner.py --only 2,0,none,none,tp2sp --only 2,1,none,none,cp2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

MiB = 2**20


AXES = {"": {}, "tp2": {"parallel.tp": 2}, "tp2sp": {"parallel.tp": 2, "parallel.sequence_parallel": True},
        "cp2": {"parallel.cp": 2}, "cp2tp2": {"parallel.cp": 2, "parallel.tp": 2},
        "pp2": {"parallel.pp": 2, "train.grad_accum": 4},
        "pp2gpipe": {"parallel.pp": 2, "parallel.pp_schedule": "gpipe", "train.grad_accum": 4},
        "pp2zb": {"parallel.pp": 2, "parallel.pp_schedule": "zb", "train.grad_accum": 4}}
"""Model axes a case can add (the last field of --only)."""


def cases(max_ranks: int) -> list[tuple[int, int, str, str, str]]:
    """(ranks, stage, activation checkpoint, offload, model axes) to run."""
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
    return out


def overrides_for(args, ranks: int, stage: int, ac: str, offload: str, axes: str, run_dir: str) -> dict:
    return {**AXES[axes], "model.preset": args.preset, "train.micro_batch": args.micro_batch,
            "train.seq_len": args.seq, "train.steps": args.steps, "train.eval_every": 0,
            "train.sample_tokens": 0, "precision.compute": args.precision, "parallel.zero_stage": stage,
            "activation.checkpoint": ac, "zero.offload_optimizer": offload, "run.device": "cpu",
            "run.dir": run_dir, "run.progress": "off"}


def measure(rank: int, world_size: int, overrides: dict, steps: int) -> dict:
    """Rank side: train `steps` steps; the ledger, peak RSS and step times."""
    from shardlm.config import load_config
    from shardlm.train.telemetry import peak_rss_bytes
    from shardlm.train.loop import build_run, train_step

    run = build_run(load_config(overrides=overrides).validate())
    seconds = []
    for step in range(steps):
        start = time.perf_counter()
        train_step(run, step)
        seconds.append(time.perf_counter() - start)
    return {"state": run.strategy.model_state_bytes(), "peak_rss": peak_rss_bytes(),
            "step_s": statistics.median(seconds[1:] or seconds)}


def main() -> None:
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
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the spawned ranks

    from shardlm.config import load_config
    from shardlm.planner.search import predict_local
    from shardlm.launch.spawn import run_ranks

    # The probe (its 256 MiB bandwidth buffers, its gloo ranks) runs in a child of its own: a
    # process's peak RSS survives fork + exec into the ranks spawned after it (every case's
    # measured peak read 774 MiB when the parent had probed), so this parent only reads the cache.
    import subprocess
    counts = sorted({c[0] for c in cases(args.max_ranks)} | {int(o.split(",")[0]) for o in args.only})
    subprocess.run([sys.executable, "-c", "import sys; from shardlm.hardware.probe import measure_cpu; "
                    f"[measure_cpu(n) for n in {counts}]"], check=True)

    rows = []
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        selected = cases(args.max_ranks)
        if args.only:
            wanted = [tuple(int(v) if i < 2 else v for i, v in enumerate((o + ",").split(",")[:5]))
                      for o in args.only]
            selected = wanted
        for ranks, stage, ac, offload, axes in selected:
            overrides = overrides_for(args, ranks, stage, ac, offload, axes, str(Path(tmp) / "runs"))
            cfg = load_config(overrides=overrides).validate()
            predicted = predict_local(cfg, ranks)
            load_before = os.getloadavg()[0]
            measured = run_ranks(measure, ranks, Path(tmp), overrides, args.steps, timeout=1800)[0]
            load = max(load_before, os.getloadavg()[0])
            state_m = sum(measured["state"].values())
            state_p = sum(predicted.model_state_bytes.values())
            row = {"ranks": ranks, "stage": stage, "ac": ac, "offload": offload, "axes": axes or "dp",
                   "state_measured": state_m, "state_predicted": state_p,
                   "peak_measured": measured["peak_rss"], "peak_predicted": predicted.peak_process_bytes,
                   "step_measured": measured["step_s"], "step_predicted": predicted.step_time_s,
                   "load_average": load, "calibration": predicted.timing.calibration}
            rows.append(row)
            print(json.dumps(row), flush=True)

    def err(p: float, m: float) -> float:
        return (p - m) / m

    print(f"\n{args.preset}, {args.precision}, batch {args.micro_batch}x{args.seq} per rank, "
          f"{args.steps} steps (median after the first)\n")
    print("| ranks | axes | stage | AC | offload | state MiB meas / pred | err | peak RSS MiB meas / pred | err "
          "| step s meas / pred | err | load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    misses = []
    for r in rows:
        e = (err(r["state_predicted"], r["state_measured"]), err(r["peak_predicted"], r["peak_measured"]),
             err(r["step_predicted"], r["step_measured"]))
        for name, value, limit in zip(("state", "peak", "step"), e, (0.02, 0.10, 0.20)):
            if abs(value) > limit:
                misses.append(f"{r['ranks']} ranks {r['axes']} stage {r['stage']} AC {r['ac']} offload {r['offload']}: "
                              f"{name} off by {value:+.0%} (target ±{limit:.0%})")
        print(f"| {r['ranks']} | {r['axes']} | {r['stage']} | {r['ac']} | {r['offload']} | "
              f"{r['state_measured'] / MiB:,.1f} / {r['state_predicted'] / MiB:,.1f} | {e[0]:+.1%} | "
              f"{r['peak_measured'] / MiB:,.0f} / {r['peak_predicted'] / MiB:,.0f} | {e[1]:+.1%} | "
              f"{r['step_measured']:.3f} / {r['step_predicted']:.3f} | {e[2]:+.1%} | {r['load_average']:.1f} |")
    print(f"\nload: the 1-minute load average around each case on {os.cpu_count()} cores (above the "
          f"cores, other processes shared them and step times are not this machine's)")
    for source in sorted({r["calibration"] for r in rows}):
        print(f"compute rate from {source}")
    print("\nmisses:" if misses else "\nevery case within its target")
    for m in misses:
        print("  " + m)
    print(f"\nReproduce: PYTHONPATH=src python bench/bench_planner.py --preset {args.preset} "
          f"--steps {args.steps} --micro-batch {args.micro_batch} --seq {args.seq}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    sys.exit(main())
