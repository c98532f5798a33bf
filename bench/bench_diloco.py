"""DiLoCo / local SGD (train.local_sgd) against synchronous data parallelism, on 2 CPU ranks (gloo).

    ddp      parallel.dp_replicate = 2, gradients all-reduced every step (ZeRO stage 0: DDP)
    H=4, H=8 train.local_sgd = {every = H, outer = "diloco"} (outer Nesterov, lr 0.7, momentum 0.9)
    avg H=4  (--outer average) plain local SGD: the replicas' parameters averaged every H steps

Same model, data, inner optimizer and schedule. Per case: the training loss at equal steps (mean
over the replicas), the final model's validation loss, the bytes crossing replicas per step
(byte ledger) and tokens/s. --pretrain N starts every case from one checkpoint of N synchronous
steps. Results: docs/benchmarks.md, "Local SGD / DiLoCo".

Reproduce:  PYTHONPATH=src python bench/bench_diloco.py                 (gpt-mini, 48 steps)
            PYTHONPATH=src python bench/bench_diloco.py --steps 94 [--outer average]
            PYTHONPATH=src python bench/bench_diloco.py --pretrain 48 --steps 46
"""

from __future__ import annotations

import statistics
import tempfile

from common import (add_step_args, bench_parser, build, by_group, prepare, reproduce, rounds, run_overrides, setup_line,
                    speed_text, start_ranks, table, train_timed)
from shardlm.checkpoint.sharded import CHECKPOINTS
from shardlm.config.load import load_config
from shardlm.train.checkpointing import save_checkpoint
from shardlm.train.step import evaluate, train_step

WORLD = 2


def cases(outer: str) -> dict[str, dict]:
    base = {"parallel.dp_replicate": WORLD, "parallel.dp_shard": 1, "parallel.zero_stage": 0}
    name = "DiLoCo" if outer == "diloco" else "average"
    return {"ddp": base,
            **{f"{name} H={h}": {**base, "train.local_sgd.every": h, "train.local_sgd.outer": outer}
               for h in (4, 8)}}


def bench_rank(rank: int, world: int, overrides: dict, warmup: int, steps: int) -> dict:
    """warmup + steps steps from where the run starts (step 0, or --pretrain's checkpoint),
    each timed step's ledger; the final model's validation loss."""
    run = build(overrides)
    return {**train_timed(run, warmup, steps, first=run.start_step), "val_loss": evaluate(run)["val_loss"]}


def pretrain_rank(rank: int, world: int, overrides: dict, steps: int) -> str:
    """--pretrain: `steps` synchronous steps, then a checkpoint every case starts from."""
    run = build(overrides)
    for step in range(steps):
        train_step(run, step)
    save_checkpoint(run, steps)  # rank 0 publishes it before returning
    return str(sorted((run.run_dir / CHECKPOINTS).glob("step-*"))[-1]) if rank == 0 else ""


def measure(overrides: dict, warmup: int, steps: int, tokens_per_step: int, tmp: str) -> dict:
    ranks = start_ranks(bench_rank, WORLD, tmp, overrides, warmup, steps, timeout=3600)
    seconds = [max(s) for s in zip(*(r["seconds"] for r in ranks))]  # ranks wait for each other
    crossing = [sum(b for g, b in by_group(led).items() if g in ("dp", "dp_replicate"))
                for led in ranks[0]["ledgers"]]
    return {"losses": ranks[0]["losses"], "val_loss": ranks[0]["val_loss"],
            "tok_s": tokens_per_step * len(seconds) / sum(seconds),
            "cross_bytes": sum(crossing) / len(crossing), "first": ranks[0]["losses"][0],
            "last": ranks[0]["losses"][-1]}


def main() -> None:
    parser = bench_parser(__doc__, "gpt-mini", 128, 4)
    parser.add_argument("--outer", default="diloco", choices=("diloco", "average"),
                        help="the outer step of the H=4 and H=8 cases")
    parser.add_argument("--pretrain", type=int, default=0,
                        help="first train this many steps synchronously (the ddp case) and start every "
                             "case from that checkpoint: DiLoCo's recipe (0 = every case from scratch)")
    add_step_args(parser, steps=46, warmup=2, repeat=1)
    args = parser.parse_args()
    total = args.pretrain + args.warmup + args.steps
    resume = {}

    def overrides(case: dict, run_dir: str) -> dict:
        return {"model.preset": args.preset, "train.micro_batch": args.micro_batch, "train.seq_len": args.seq,
                "train.steps": total, "train.warmup_steps": min(10, total // 5), "train.eval_batches": 16,
                **resume, **case, **run_overrides(run_dir, args.set)}

    cfg = load_config(overrides=overrides({}, "")).validate()
    threads = prepare(cfg, WORLD)
    tokens_per_step = args.micro_batch * args.seq * WORLD
    print(f"{setup_line(cfg, WORLD, threads)}, fp32, batch {WORLD}x{args.micro_batch}x{args.seq}, "
          f"{args.warmup} warm-up + {args.steps} timed steps", flush=True)
    named = cases(args.outer)
    with tempfile.TemporaryDirectory() as tmp:
        if args.pretrain:
            path = start_ranks(pretrain_rank, WORLD, tmp, overrides(named["ddp"], tmp), args.pretrain)[0]
            resume["checkpoint.resume"] = path
            print(f"pretrained {args.pretrain} synchronous steps: {path}", flush=True)
        runs = rounds(list(named), args.repeat,
                      lambda name: measure(overrides(named[name], tmp), args.warmup, args.steps,
                                           tokens_per_step, tmp))
    run_steps = args.warmup + args.steps  # after --pretrain's
    marks = sorted({s for s in (1, run_steps // 4, run_steps // 2, 3 * run_steps // 4, run_steps) if s >= 1})
    header = ["case", *(f"loss @{args.pretrain + s}" for s in marks), "val loss (final)", "cross-replica MiB/step", "tokens/s"]
    rows = []
    for name in named:
        results = runs[name]
        losses = [statistics.mean(r["losses"][s - 1] for r in results) for s in marks]
        speeds = [r["tok_s"] for r in results]
        rows.append([name, *(f"{v:.4f}" for v in losses), f"{statistics.mean(r['val_loss'] for r in results):.4f}",
                     f"{results[0]['cross_bytes'] / 2**20:,.3f}",
                     speed_text({"tok_s": statistics.median(speeds), "tok_s_range": (min(speeds), max(speeds))})])
    print("\n" + table(header, rows))
    print(f"\n{reproduce()}")


if __name__ == "__main__":
    main()
