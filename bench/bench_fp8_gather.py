"""FP8 all-gather at ZeRO-3 (precision.fp8_all_gather, issue 29 item 4): the same ZeRO-3 run on 2
gloo ranks, FP8 emulated, with the blocks' FP8 linear weights gathered in bf16 or in E4M3 with
one scale per weight (parallel/data/zero/fp8_gather.py).

Per case: the all-gather bytes per step (byte ledger) beside the planner's, the amax
all-reduce's and the reduce-scatter's bytes, tokens/s (median over interleaved rounds, range),
peak RSS and the first and last loss (clipping off: both cases train to the same bits).
`--compose`: the compositions tests/test_fp8_all_gather.py does not spawn, 2 steps without and
with fp8_all_gather: the same losses, parameters and evaluation, and the all-gather bytes.
Results: docs/benchmarks.md, "FP8 all-gather at ZeRO-3".

Reproduce:  PYTHONPATH=src python bench/bench_fp8_gather.py                 (gpt-mini, ~5 min)
            PYTHONPATH=src python bench/bench_fp8_gather.py --preset gpt-tiny --steps 4
            PYTHONPATH=src python bench/bench_fp8_gather.py --compose       (~5 min)
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch

from common import (MiB, add_step_args, bench_parser, combine, machine, prepare, reproduce, rounds, run_overrides,
                    setup_line, shardlm_rank, speed_text, start_ranks, summarize, table)
from shardlm.config.load import load_config
from shardlm.hardware.catalog import parse_cluster

from shardlm.planner.search import config_strategy
from shardlm.planner.timing import estimate_time


WORLD = 2
CASES = {"bf16 gather": {}, "fp8 gather": {"precision.fp8_all_gather": True}}


def overrides_for(args, case: dict, run_dir: str) -> dict:
    return {**run_overrides(run_dir, args.set, precision="fp8"), "model.preset": args.preset,
            "train.seq_len": args.seq, "train.micro_batch": args.micro_batch, "train.grad_clip": 0.0,
            "precision.fp8_emulate": True, "parallel.zero_stage": 3, **case}


def planned_gather(overrides: dict) -> float:
    """The planner's ZeRO-3 all-gather bytes per step for this config on WORLD ranks."""
    cluster = parse_cluster(f"1x{WORLD}xA100-80GB")  # the bytes do not depend on the device
    w, s = config_strategy(load_config(overrides=overrides).validate(), cluster)
    return next(c.bytes for c in estimate_time(w, s, cluster).comms if c.name == "all-gather parameters")


def row(name: str, m: dict, planned: float) -> list:
    ledger = m["ledger"]
    gathered = ledger.get("all_gather/dp_shard", 0)
    return [name, speed_text(m, 1), f"{m['cpu_s']:.2f}", f"{gathered / MiB:,.3f}", f"{planned / MiB:,.3f}",
            f"{ledger.get('all_reduce/dp_shard', 0):,}", f"{ledger.get('reduce_scatter/dp_shard', 0) / MiB:,.3f}",
            f"{m['rss'] / MiB:,.0f}", f"{m['first']:.6f}", f"{m['last']:.6f}"
            + ("" if m["repeatable"] else " (differs by run)")]


COMPOSED = {  # name -> (ranks, overrides)
    "reshard_after_forward = false, 2 micro-steps": (2, {"parallel.reshard_after_forward": False,
                                                        "train.grad_accum": 2}),
    "activation.checkpoint = selective": (2, {"activation.checkpoint": "selective"}),
    "zero.offload_params = cpu": (2, {"zero.offload_params": "cpu"}),
    "MoE: 4 experts (top 2) + 1 shared": (2, {"model.experts": 4, "model.top_k": 2, "model.shared_experts": 1}),
    "train.optimizer = muon": (2, {"train.optimizer": "muon"}),
    "hybrid: dp_replicate 2 x dp_shard 2": (4, {"parallel.dp_replicate": 2, "parallel.dp_shard": 2}),
    "pp 2 x dp_shard 2, 2 micro-batches": (4, {"parallel.pp": 2, "train.grad_accum": 2}),
}


def compose(tmp: str) -> None:
    """Each COMPOSED case without and with fp8_all_gather, in one spawn: bitwise or not."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from fp8_gather_cases import gather_cases

    base = {**run_overrides(tmp, precision="fp8"), "model.preset": "gpt-tiny", "model.d_model": 32,
            "model.n_heads": 2, "train.seq_len": 16, "train.micro_batch": 4, "train.lr": 3e-3,
            "train.grad_clip": 0.0, "data.max_bytes": 1_000_000, "precision.fp8_emulate": True,
            "parallel.zero_stage": 3}
    rows = []
    for name, (ranks, extra) in COMPOSED.items():
        case = {**base, **extra}
        off, on = start_ranks(gather_cases, ranks, tmp, [(case, 2), ({**case, **CASES["fp8 gather"]}, 2)])[0]
        same = (off["losses"] == on["losses"] and off["records"] == on["records"] and off["eval"] == on["eval"]
                and all(torch.equal(v, on["params"][n]) for n, v in off["params"].items()))
        gathered = [led.get("all_gather/dp_shard", 0) for led in (off["ledgers"][-1], on["ledgers"][-1])]
        rows.append([name, ranks, "yes" if same else "**no**", f"{gathered[0]:,} / {gathered[1]:,}",
                     " ".join(f"{x:.6f}" for x in on["losses"])])
        print(f"{name}: {rows[-1][2]}", flush=True)
    print("\n" + table(("composed with", "ranks", "bitwise (losses, parameters, fp8 figures, eval)",
                         "all-gather B/step bf16 / fp8", "losses"), rows))


def main() -> None:
    parser = bench_parser(__doc__, "gpt-mini", 128, 4)
    parser.add_argument("--compose", action="store_true", help="the compositions' bitwise check instead")
    add_step_args(parser, steps=6, warmup=2, repeat=3)
    args = parser.parse_args()
    if args.compose:
        with tempfile.TemporaryDirectory() as tmp:
            print(machine(), flush=True)
            compose(tmp)
        print(f"\n{reproduce()}")
        return
    cfg = load_config(overrides=overrides_for(args, {}, "")).validate()
    threads = prepare(cfg, WORLD, precision="bf16")
    tokens_per_step = WORLD * args.micro_batch * args.seq
    print(f"{setup_line(cfg, WORLD, threads)}, ZeRO-3, fp8 emulated (tensorwise), fp32 master, "
          f"batch {WORLD}x{args.micro_batch}x{args.seq}, {args.warmup} warm-up + {args.steps} timed steps, "
          f"{args.repeat} round(s), MALLOC_MMAP_THRESHOLD_={os.environ['MALLOC_MMAP_THRESHOLD_']}", flush=True)
    planned = {name: planned_gather(overrides_for(args, case, "")) for name, case in CASES.items()}
    with tempfile.TemporaryDirectory() as tmp:
        def measure(name: str) -> dict:
            ranks = start_ranks(shardlm_rank, WORLD, tmp, overrides_for(args, CASES[name], tmp), args.warmup,
                                args.steps)
            return summarize(ranks, tokens_per_step)

        runs = rounds(list(CASES), args.repeat, measure)
    results = {name: combine(runs[name]) for name in CASES}
    header = ("case", "tok/s" + (" median (range)" if args.repeat > 1 else ""), "CPU s/step (max rank)",
              "all-gather MiB/step (ledger)", "planner MiB/step", "amax all-reduce B/step",
              "reduce-scatter MiB/step", "peak RSS MiB (max rank)", "first loss", "last loss")
    print("\n" + table(header, [row(name, m, planned[name]) for name, m in results.items()]))
    off, on = (results[n]["ledger"]["all_gather/dp_shard"] for n in CASES)
    print(f"\nall-gather bytes, fp8 / bf16: {on / off:.4f}")
    print(f"\n{reproduce()}")


if __name__ == "__main__":
    main()
