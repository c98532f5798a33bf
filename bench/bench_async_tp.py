"""Overlapped tensor parallelism (parallel.async_tp) against blocking sequence parallelism on 2
CPU ranks (gloo): tp=2 + sequence_parallel, the same model, batches and weights.

    blocking SP   parallel.tp=2, parallel.sequence_parallel=true
    async TP      the same + parallel.async_tp=true

Measured: tokens/s (median over interleaved rounds, with range), step-1 and final losses (equal
bit for bit), the ledger's bytes per step (the same), "comm wait s/step" (CommLedger.wait_s: what
overlap can hide) and planner.search.predict_local. On a CPU gloo's copies share the cores with
the matmuls: expect little or no gain. Results: docs/benchmarks.md, "Overlapped tensor parallelism".

Reproduce:  PYTHONPATH=src python bench/bench_async_tp.py --repeat 3               (gpt-mini)
            PYTHONPATH=src python bench/bench_async_tp.py --preset gpt2-124m --repeat 2
"""

from __future__ import annotations

import os
import statistics
import tempfile

from common import (add_step_args, bench_parser, build, combine, err, ledger_text, prepare, reproduce, rounds,
                    setup_line, speed_text, start_ranks, step_overrides, summarize, table, train_timed)
from shardlm.config.load import load_config


WORLD = 2
CASES = {"blocking SP": {}, "async TP": {"parallel.async_tp": True}}


def overrides_for(args, case: dict, run_dir: str) -> dict:
    return step_overrides(args, run_dir, {"train.micro_batch": args.global_batch, "parallel.tp": WORLD,
                                          "parallel.sequence_parallel": True, **case})


def async_tp_rank(rank: int, world: int, overrides: dict, warmup: int, steps: int) -> dict:
    """train_timed with each timed step's wait seconds and collective calls beside its ledger."""
    run = build(overrides)
    ledger, calls, waits = run.strategy.ledger, [], []

    def after(s: int, seconds: float, result) -> None:
        calls.append(dict(ledger.calls))
        waits.append(ledger.wait_s)

    out = train_timed(run, warmup, steps, after)
    return {**out, "calls": calls[-1], "wait_s": statistics.median(waits[warmup:])}


def measure(args, case: dict, tmp: str, tokens_per_step: int) -> dict:
    ranks = start_ranks(async_tp_rank, WORLD, tmp, overrides_for(args, case, tmp), args.warmup, args.steps)
    return {**summarize(ranks, tokens_per_step), "wait_s": ranks[0]["wait_s"], "calls": ranks[0]["calls"],
            "losses": ranks[0]["losses"]}


def main() -> None:
    from shardlm.planner.search import predict_local

    parser = bench_parser(__doc__, "gpt-mini", 256)
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per step (every tp rank sees all)")
    add_step_args(parser, steps=6, warmup=2, repeat=3)
    args = parser.parse_args()
    cfg = load_config(overrides=overrides_for(args, {}, "")).validate()
    threads = prepare(cfg, WORLD)
    tokens_per_step = args.global_batch * args.seq
    print(f"{setup_line(cfg, WORLD, threads)}, fp32, tp=2 + SP, global batch "
          f"{args.global_batch}x{args.seq}, {args.warmup} warm-up + {args.steps} timed steps, "
          f"{args.repeat} round(s), MALLOC_MMAP_THRESHOLD_={os.environ['MALLOC_MMAP_THRESHOLD_']}", flush=True)
    preds = {name: predict_local(load_config(overrides=overrides_for(args, case, "")).validate(), WORLD)
             for name, case in CASES.items()}
    with tempfile.TemporaryDirectory() as tmp:
        runs = rounds(list(CASES), args.repeat, lambda name: measure(args, CASES[name], tmp, tokens_per_step))
    results = {name: combine(runs[name]) for name in CASES}
    base = results["blocking SP"]
    header = ("case", "tok/s median (range)", "vs blocking", "CPU s/step (max rank)", "comm wait s/step (rank 0)",
              "planner tok/s (err)", "step-1 loss", "final loss", "same losses as blocking",
              "ledger MiB/step", "tp calls/step")
    rows = []
    for name, m in results.items():
        calls = sum(n for key, n in m["calls"].items() if key.endswith("/tp"))
        rows.append((name, speed_text(m, 1), f"{m['tok_s'] / base['tok_s'] - 1:+.1%}", f"{m['cpu_s']:.2f}",
                     f"{m['wait_s']:.3f}", err(preds[name].tokens_per_s, m["tok_s"]), f"{m['first']:.6f}",
                     f"{m['last']:.6f}", "yes" if all(r["losses"] == runs["blocking SP"][0]["losses"]
                                                      for r in runs[name]) else "NO",
                     ledger_text(m["ledger"], m["ledger_steady"]), calls))
    print("\n" + table(header, rows))
    print(f"- ledger bytes equal: {results['async TP']['ledger'] == base['ledger']}; "
          f"load average now {os.getloadavg()[0]:.1f}")
    print(f"\n{reproduce()}")


if __name__ == "__main__":
    main()
