"""Which computation lever is worth it on this machine: each one switched on alone against the
same baseline run, and what the planner says the same levers do on a GPU.

Measured (`shardlm train` in a subprocess per case): tokens/s (median of the steps after the
first --skip), MFU and HFU from the run's JSONL, peak RSS and the last loss. Levers: baseline,
compile, attention=math, ckpt=selective, ckpt=full, offload=cpu, the other precision, fp8
(emulated: numerics, not speed). Predicted (--gpu): the planner's recomputation and offload
levers on one GPU in bf16. Every lever runs --rounds times in rotated orders; its row is the
median round. Results: docs/benchmarks.md, "Computation levers".

Reproduce:  PYTHONPATH=src python bench/bench_levers.py                      (gpt-mini, ~15 min)
            PYTHONPATH=src python bench/bench_levers.py --preset gpt2-124m --steps 8 --micro-batch 4
"""

from __future__ import annotations

import re
import statistics
import subprocess
import tempfile
from pathlib import Path

from common import bench_parser, machine, reproduce, rounds, table, table_row
from common.cli import read_jsonl, src_env, train_argv
from shardlm.config.model import ModelConfig
from shardlm.config.dims import ParallelDims
from shardlm.hardware.catalog import parse_cluster
from shardlm.planner.memory import estimate_memory
from shardlm.planner.timing import estimate_time
from shardlm.planner.workload import Dtypes, Strategy, Workload
from shardlm.config.presets import get_preset

LEVERS = {  # name -> the overrides that switch it on (precision-dependent ones filled in main)
    "baseline": {},
    "compile": {"train.compile": "true"},
    "attention=math": {"model.attention": "math"},
    "ckpt=selective": {"activation.checkpoint": "selective"},
    "ckpt=full": {"activation.checkpoint": "full"},
    "offload=cpu": {"activation.offload": "cpu"},
}


def run_case(name: str, overrides: dict[str, str], common: dict[str, str], root: Path) -> dict:
    """One `shardlm train` in its own process; its JSONL records."""
    run_name = re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-")
    done = subprocess.run(train_argv({**common, **overrides, "run.name": run_name}), env=src_env(),
                          capture_output=True, text=True)
    if done.returncode:
        return {"error": (done.stderr or done.stdout).strip().splitlines()[-1]}
    return {"records": read_jsonl(root / run_name / "metrics.jsonl")}


def run_lever(name: str, overrides: dict[str, str], common: dict[str, str], root: Path, skip: int) -> dict:
    out = run_case(name, overrides, common, root)
    return out if "error" in out else summarise(out["records"], skip)


def summarise(records: list[dict], skip: int) -> dict:
    steps = [r for r in records if "tokens_per_s" in r]
    timed = steps[skip:] or steps
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
            "mfu": statistics.median(r["mfu"] for r in timed),
            "hfu": statistics.median(r["hfu"] for r in timed),
            "peak_rss_mib": max(r["peak_rss_bytes"] for r in steps) / 2**20,
            "loss": steps[-1]["loss"],
            "compile_s": next((r["compile_s"] for r in steps if "compile_s" in r), None)}


def combine(runs: list[dict]) -> dict:
    """A lever's rounds as one row: the median round (by tokens/s), with the rounds' spread."""
    if any("error" in r for r in runs):
        return next(r for r in runs if "error" in r)
    ordered = sorted(runs, key=lambda r: r["tokens_per_s"])
    row = dict(ordered[len(ordered) // 2])
    row["spread"] = (ordered[0]["tokens_per_s"], ordered[-1]["tokens_per_s"])
    return row


def predicted(preset: str, micro: int, seq: int, gpu: str) -> list[tuple[str, float, float]]:
    """(lever, tokens/s, peak GB) on one `gpu` for the levers the planner models, in bf16."""
    model = ModelConfig(preset=preset, **get_preset(preset))
    cluster = parse_cluster(f"1x{gpu}")
    w = Workload(model, seq, micro)
    lay = ParallelDims.resolve(1)
    out = []
    for name, recompute, offload in (("baseline", "none", "none"), ("ckpt=selective", "selective", "none"),
                                     ("ckpt=full", "full", "none"), ("offload=cpu", "none", "cpu")):
        s = Strategy(lay, 0, micro, 1, recompute, dtypes=Dtypes("bf16"), activation_offload=offload)
        t, m = estimate_time(w, s, cluster), estimate_memory(w, s, cluster)
        out.append((name, t.tokens_per_s, m.peak / 1e9))
    return out


def main() -> None:
    ap = bench_parser(__doc__, "gpt-mini", 256, 8)
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--skip", type=int, default=3, help="steps left out of the median")
    ap.add_argument("--rounds", type=int, default=3, help="runs of every lever, interleaved")
    ap.add_argument("--gpu", default="A100-80GB", help="the device of the planner's prediction")
    ap.add_argument("--only", default="", help="comma-separated lever names")
    args = ap.parse_args()

    other = "fp32" if args.precision == "bf16" else "bf16"
    levers = {**LEVERS, other: {"precision.compute": other},
              "fp8 (emulated)": {"precision.compute": "fp8", "precision.fp8_emulate": "true"}}
    if args.only:
        levers = {k: v for k, v in levers.items() if k in args.only.split(",") or k == "baseline"}
    with tempfile.TemporaryDirectory(prefix="bench-levers-") as tmp:
        root = Path(tmp)
        common = {"model.preset": args.preset, "precision.compute": args.precision,
                  "train.steps": str(args.steps), "train.micro_batch": str(args.micro_batch),
                  "train.seq_len": str(args.seq), "train.eval_every": "0", "train.sample_tokens": "0",
                  "run.dir": str(root), "run.progress": "off", "data.max_bytes": "2000000"}
        # each lever's figure is the median of its rounds
        runs = rounds(list(levers), args.rounds, lambda name: run_lever(name, levers[name], common, root, args.skip),
                      note=lambda m: m.get("error") or f"{m['tokens_per_s']:,.0f} tok/s")
        results = {name: combine(runs[name]) for name in levers}

    base = results["baseline"]
    print(f"\n{machine()}; {args.preset}, {args.micro_batch} x {args.seq} tokens, {args.precision} baseline, "
          f"one process; median of steps {args.skip + 1}-{args.steps}, median of "
          f"{args.rounds} interleaved rounds (min-max over rounds)")
    header = ("lever", "tokens/s", "rounds", "x baseline", "MFU", "HFU", "peak RSS MiB", f"loss at step {args.steps}",
              "note")
    print(table(header, []))
    for name, r in results.items():
        if "error" in r:
            print(table_row([name, "–", "–", "–", "–", "–", "–", "–", f"refused: {r['error']}"]))
            continue
        note = f"compile {r['compile_s']:.1f} s in step 1" if r["compile_s"] else ""
        lo, hi = r["spread"]
        print(table_row([name, f"{r['tokens_per_s']:,.0f}", f"{lo:,.0f}-{hi:,.0f}",
                         f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}", f"{r['mfu']:.1%}", f"{r['hfu']:.1%}",
                         f"{r['peak_rss_mib']:,.0f}", f"{r['loss']:.4f}", note]))
    print(f"\npredicted on 1 x {args.gpu} (planner, bf16, same model and batch):")
    rows = predicted(args.preset, args.micro_batch, args.seq, args.gpu)
    print(table(("lever", "tokens/s", "x baseline", "peak GB"),
                [[name, f"{tps:,.0f}", f"{tps / rows[0][1]:.2f}", f"{peak:.2f}"] for name, tps, peak in rows]))
    print(f"\n{reproduce()}")

if __name__ == "__main__":
    main()
