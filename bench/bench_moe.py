"""Mixture of experts on CPU ranks (gloo): expert parallelism under balanced and skewed routing,
the hot-expert remedy, and load balance over a run.

Part 1, 2 ranks, lr 1e-5 (the routing stays as initialised or as skewed): ep=2 balanced, ep=2
skewed (every router gets +SKEW on rank 0's experts), ep=2 skewed+replace
(parallel.ep_rebalance_every=2), dp=2 balanced/skewed. Per case: tokens/s, the all-to-all wait
per rank, expert and rank imbalance, peak RSS per rank, the all-to-all bytes beside
planner.traffic.ep_comm_bytes, the step-1 losses.
Part 2, one process of moe-tiny for --balance-steps steps with model.balance none / aux / bias:
moe_imbalance per step, plotted to --plot. Results: docs/benchmarks.md, "Mixture of experts".

Reproduce:  PYTHONPATH=src python bench/bench_moe.py
            PYTHONPATH=src python bench/bench_moe.py --preset moe-tiny --skip-balance
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch

from common import (MiB, build, machine, peak_rss_bytes, plot, prepare, reproduce, run_overrides, start_ranks,
                    summarize, table, table_row, train_timed)
from common.cli import read_jsonl
from shardlm.config.load import load_config
from shardlm.models.flops import active_params, count_params

SKEW = 10.0
"""Added to the hot experts' router scores for the choice (probabilities are <= 1: decisive)."""
SMALL = {"model.preset": "moe-tiny", "model.n_layers": 4, "model.d_model": 256, "model.n_heads": 8,
         "model.n_kv_heads": 4, "model.vocab_size": 8192, "model.max_seq_len": 256,
         "model.experts": 8, "model.top_k": 2, "model.expert_d_ff": 1024}
"""'moe-small': a MoE big enough for the experts' matmuls to dominate a CPU step (llama-style,
4 blocks, d 256, 8 experts of 1024, top 2)."""
CASES = [("ep=2 balanced", 2, {"parallel.ep": 2}, False),
         ("ep=2 skewed", 2, {"parallel.ep": 2, "model.balance": "none"}, True),
         ("ep=2 skewed+replace", 2, {"parallel.ep": 2, "model.balance": "none",
                                     "parallel.ep_rebalance_every": 2}, True),
         ("dp=2 balanced", 2, {}, False),
         ("dp=2 skewed", 2, {"model.balance": "none"}, True)]


def overrides_for(args, case: dict, run_dir: str) -> dict:
    base = SMALL if args.preset == "moe-small" else {"model.preset": args.preset}
    return {**base, "train.seq_len": args.seq, "train.micro_batch": args.micro_batch,
            "train.steps": args.warmup + args.steps, "train.lr": 1e-5, **run_overrides(run_dir), **case}


def rank_case(rank: int, world: int, overrides: dict, warmup: int, steps: int, skewed: bool) -> dict:
    from shardlm.models.moe import MoE
    from shardlm.train.loop import step_record

    run = build(overrides)
    if skewed:
        k = run.cfg.model.top_k
        for module in run.model.modules():
            if isinstance(module, MoE):
                module.router.bias = torch.tensor([SKEW if e < k else 0.0 for e in range(module.n_experts)])
    records = []

    def after(step: int, seconds: float, result) -> None:
        if step >= warmup:
            records.append(step_record(run, step, result, seconds))

    return {**train_timed(run, warmup, steps, after), "records": records, "rss": peak_rss_bytes()}


def part_one(args, tmp: str) -> None:
    from shardlm.planner.traffic import ep_comm_bytes

    wanted = set(args.cases.split(",")) if args.cases else None
    header = ("case", "tok/s", "step s (median)", "a2a wait s/step by rank", "expert imbalance (worst block)",
              "ep rank imbalance (worst block)", "blocks re-placed", "peak RSS MiB by rank",
              "a2a MiB/step rank 0 (planner, balanced)", "step-1 loss")
    print("\n" + table(header, []))
    for name, world, case, skewed in CASES:
        if wanted and name not in wanted:
            continue
        over = overrides_for(args, case, tmp)
        ranks = start_ranks(rank_case, world, tmp, over, args.warmup, args.steps, skewed)
        m = summarize(ranks, args.micro_batch * args.seq * world)
        timed = [r["records"] for r in ranks]
        wait = " / ".join(f"{statistics.median(t['moe_a2a_wait_s'] for t in recs):.3f}" for recs in timed)
        last = timed[0][-1]
        rank_imb = last.get("moe_rank_imbalance", float("nan"))
        moved = sum(t.get("moe_replaced_blocks", 0) for t in timed[0])
        a2a = statistics.median(t["moe_a2a_bytes"] for t in timed[0]) / MiB
        cfg = load_config(overrides=over).validate()
        ep = case.get("parallel.ep", 1)
        blocks = cfg.model.n_layers  # moe_every = 1
        rss = " / ".join(f"{r['rss'] / MiB:,.0f}" for r in ranks)
        want = (4 * blocks * ep_comm_bytes(cfg.model, args.micro_batch * args.seq, ep, 4) / MiB) if ep > 1 else 0
        print(table_row([name, f"{m['tok_s']:,.0f}", f"{m['step_s']:.3f}", wait, f"{last['moe_imbalance']:.2f}",
                         f"{rank_imb:.2f}", moved, rss, f"{a2a:.2f} ({want:.2f})", f"{m['first']:.4f}"]), flush=True)


def part_two(args, tmp: str) -> None:
    from shardlm.train.loop import train

    curves = {}
    for balance in ("none", "aux", "bias"):
        over = {"model.preset": "moe-tiny", "model.experts": 8, "model.top_k": 2, "model.balance": balance,
                "model.bias_update_rate": 0.01, "train.steps": args.balance_steps, "train.micro_batch": 8,
                "train.seq_len": 64, "train.lr": 3e-3, "train.warmup_steps": 10, **run_overrides(tmp),
                "run.name": f"balance-{balance}"}
        run = build(over)
        train(run)
        rows = read_jsonl(run.run_dir / "metrics.jsonl", "moe_imbalance")
        curves[balance] = [(r["step"], r["moe_imbalance"], r["loss"]) for r in rows]
        tail = curves[balance][-10:]
        print(f"balance={balance}: imbalance step 1 {curves[balance][0][1]:.2f}, mean of the last 10 steps "
              f"{statistics.mean(x[1] for x in tail):.2f}, max {max(x[1] for x in curves[balance]):.2f}; "
              f"loss {curves[balance][0][2]:.3f} -> {statistics.mean(x[2] for x in tail):.3f}", flush=True)
    if args.plot:
        def draw(ax) -> None:
            for balance, curve in curves.items():
                ax.plot([c[0] for c in curve], [c[1] for c in curve], label=f"balance = {balance}")
            ax.axhline(1.0, color="grey", lw=0.5)

        plot(args.plot, "moe-tiny, 8 experts, top 2: load balance over a run", "step",
             "imbalance: busiest expert / mean (worst block)", draw, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="moe-small", help="'moe-small' (see SMALL) or a preset")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--balance-steps", type=int, default=200)
    parser.add_argument("--skip-balance", action="store_true")
    parser.add_argument("--skip-parallel", action="store_true")
    parser.add_argument("--plot", default="docs/img/moe_imbalance.png")
    args = parser.parse_args()
    cfg = load_config(overrides=overrides_for(args, {}, "")).validate()
    prepare(cfg, 2)
    print(f"{machine()}; {args.preset}: {count_params(cfg.model) / 1e6:.1f}M "
          f"params ({active_params(cfg.model) / 1e6:.1f}M active), {cfg.model.experts} experts top-"
          f"{cfg.model.top_k}, fp32, {args.micro_batch} x {args.seq} tokens per rank per step, "
          f"{args.warmup} warm-up + {args.steps} timed steps", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_parallel:
            part_one(args, tmp)
        if not args.skip_balance:
            part_two(args, tmp)
    print(f"\n{reproduce()}")


if __name__ == "__main__":
    main()
