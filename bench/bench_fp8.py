"""FP8 numerics on this CPU (precision.compute = 'fp8', precision.fp8_emulate = true): each
scaling recipe's loss curve against bf16's, and its overflow / underflow fractions.

The same run (model, data order, seed, lr) in bf16, in fp32 (the gap a change of precision alone
makes) and in emulated fp8 with each recipe. Per case: loss (mean of the last 20), vs bf16 and
max |diff|, validation loss, overflow and underflow (mean of the JSONL's fp8_overflow /
fp8_underflow, overall and by tensor), s/step (the emulation is slower than bf16: numerics, not
speed).

Reproduce:  PYTHONPATH=src python bench/bench_fp8.py                  (gpt-tiny, 300 steps, lr 1e-3)
            PYTHONPATH=src python bench/bench_fp8.py --lr 3e-3 --seed 1       (a chaotic regime)
            PYTHONPATH=src python bench/bench_fp8.py --steps 100 --recipes tensorwise
"""

from __future__ import annotations

import os
import statistics
import tempfile

from common import bench_parser, machine, reproduce, table, table_row, timed_steps
from shardlm.config.load import load_config
from shardlm.launch.runtime import cpu_cores
from shardlm.train.build import build_run
from shardlm.train.step import evaluate, train_step

RECIPES = ("tensorwise", "delayed", "blockwise")


def overrides_for(args, compute: str, recipe: str, run_dir: str, seed: int = 0) -> dict:
    fp8 = ({"precision.fp8_emulate": True, "precision.fp8_recipe": recipe} if compute == "fp8" else {})
    if recipe == "blockwise":
        fp8["precision.fp8_block"] = args.block
    return {"model.preset": args.preset, "precision.compute": compute, "train.seq_len": args.seq,
            "train.micro_batch": args.micro_batch, "train.steps": args.steps, "train.lr": args.lr,
            "train.warmup_steps": 20, "train.eval_every": 0, "train.sample_tokens": 0,
            "train.eval_batches": 20, "train.seed": seed,
            "data.max_bytes": 2_000_000, "run.dir": run_dir, "run.progress": "off", **fp8}


def run_case(args, compute: str, recipe: str = "", seed: int = 0) -> dict:
    with tempfile.TemporaryDirectory() as run_dir:
        run = build_run(load_config(overrides=overrides_for(args, compute, recipe, run_dir, seed)).validate())
        results, records = [], []

        def step_fn(step: int) -> float:
            results.append(train_step(run, step))
            return results[-1].loss
        timed = timed_steps(step_fn, 1, args.steps - 1,  # the figures read outside the timing
                            lambda step, seconds: records.append(dict(results[-1].state.fp8_record)))
        val = evaluate(run)["val_loss"]
    return {"losses": timed["losses"], "records": records, "s_per_step": statistics.mean(timed["seconds"]),
            "val": val}


def mean_of(records: list[dict], key: str, role: str | None = None) -> float:
    return statistics.mean((r[key][role] if role else r[key]) for r in records)


def main() -> None:
    parser = bench_parser(__doc__, "gpt-tiny", 64, 8)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--block", type=int, default=32, help="blockwise tile width")
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--seed", type=int, default=0, help="train.seed of every case")
    args = parser.parse_args()
    # One thread per process: a tiny model only loses time to thread synchronisation.
    os.environ["LOCAL_WORLD_SIZE"] = str(cpu_cores())
    tail = 20
    base = run_case(args, "bf16", seed=args.seed)
    base_tail = statistics.mean(base["losses"][-tail:])

    def row(name: str, got: dict, counts: tuple = ("—", "—")) -> str:
        mean = statistics.mean(got["losses"][-tail:])
        gap = max(abs(a - b) for a, b in zip(got["losses"], base["losses"]))
        versus = ("—", "—") if got is base else (f"{mean - base_tail:+.4f}", f"{gap:.3f}")
        return table_row([name, f"{mean:.4f}", *versus, f"{got['val']:.4f}", *counts, f"{got['s_per_step']:.3f}"])

    print(f"{machine()}; {args.preset}, seed {args.seed}, {args.steps} steps of {args.micro_batch} x {args.seq} "
          f"tokens, lr {args.lr}; loss = mean of the last {tail} steps\n")
    print(table(("case", "loss", "vs bf16", "max \\|diff\\|", "val", "overflow",
                 "underflow (input / weight / grad)", "s/step"), []))
    print(row("bf16", base))
    print(row("fp32", run_case(args, "fp32", seed=args.seed)), flush=True)
    for recipe in args.recipes.split(","):
        got = run_case(args, "fp8", recipe, args.seed)
        recs = got["records"]
        roles = " / ".join(f"{mean_of(recs, 'fp8_underflow_by_tensor', r):.2e}"
                           for r in ("input", "weight", "grad_output"))
        name = f"fp8 {recipe}" + (f" ({args.block}-wide tiles)" if recipe == "blockwise" else "")
        counts = (f"{mean_of(recs, 'fp8_overflow'):.2e}", f"{mean_of(recs, 'fp8_underflow'):.2e} ({roles})")
        print(row(name, got, counts), flush=True)
    print(f"\n{reproduce()}")


if __name__ == "__main__":
    main()
