"""Context parallelism on CPU ranks (gloo): one long sequence, split over cp ranks.

    1 rank           the whole sequence in one process (ZeRO-0: the local engine)
    cp=2 ZeRO-0      parallel.cp=2: each rank 2 of the 4 load-balanced chunks, ring attention
    cp=2 ZeRO-3      the same, model states sharded over the two context-parallel ranks too
    tp=2 SP          parallel.tp=2 + sequence parallelism, for comparison: the other way to split
                     a long sequence's activations on 2 ranks
    cp=2 ulysses     parallel.cp_mode=ulysses: all-to-all over heads, whole-sequence attention
    cp=4 ring / ulysses / hybrid 2x2   the three modes on 4 ranks (hybrid: all-to-all over
                     pairs, a ring of the two pairs)

Every case trains the same sequences (global batch B sequences of L tokens, default 1 x 8192)
in fp32 from the same weights; the step-1 losses must agree. Per rank it reports:

    activations   our own ledger of what one micro-batch's forward saves for backward: the
                  distinct storages packed by torch.autograd.graph.saved_tensors_hooks (bytes
                  the tensors hold, not the allocator's view)
    peak RSS      the process's high-water mark (MALLOC_MMAP_THRESHOLD_=65536 unless set, so
                  freed blocks go back to the OS and RSS follows what is alive; see bench_zero)
    step RSS      peak RSS minus the RSS after setup: what training steps added on top of the
                  model states built at setup
    ledger        the byte ledger's bytes per step by group, the cp group's next to
                  planner.cp_modes.cp_mode_bytes (the mode's all-to-alls + ring hops)
    planner       planner.search.predict_local for the case's config on this CPU: tokens/s,
                  activations (its activation peak) and peak per process, each with its error

The cap check: with --cap-mib M (a per-rank memory budget), each case is marked as fitting or
not by its peak RSS. A sequence whose activations do not fit M on one rank trains on 2.

Reproduce:  PYTHONPATH=src python bench/bench_cp.py                       (gpt-mini, 8192 tokens)
            PYTHONPATH=src python bench/bench_cp.py --seq 4096 --cases one,cp
            PYTHONPATH=src python bench/bench_cp.py --seq 2048 --cases one,cp,ulysses,ring4,ulysses4,hybrid4
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

from shardlm.config import load_config
from shardlm.data import build_dataset
from shardlm.launch.runtime import cpu_cores
from shardlm.models import count_params
from shardlm.launch.spawn import run_ranks
from shardlm.train.telemetry import peak_flops, peak_rss_bytes

MiB = 2**20
# (name, ranks, overrides)
CASES = [("1 rank", 1, {}),
         ("cp=2 ZeRO-0", 2, {"parallel.cp": 2}),
         ("cp=2 ZeRO-3", 2, {"parallel.cp": 2, "parallel.zero_stage": 3}),
         ("tp=2 SP", 2, {"parallel.tp": 2, "parallel.sequence_parallel": True}),
         ("cp=2 ulysses", 2, {"parallel.cp": 2, "parallel.cp_mode": "ulysses"}),
         ("cp=4 ring", 4, {"parallel.cp": 4}),
         ("cp=4 ulysses", 4, {"parallel.cp": 4, "parallel.cp_mode": "ulysses"}),
         ("cp=4 hybrid 2x2", 4, {"parallel.cp": 4, "parallel.cp_mode": "hybrid", "parallel.cp_ulysses": 2})]
KEYS = {"one": "1 rank", "cp": "cp=2 ZeRO-0", "cp3": "cp=2 ZeRO-3", "tp": "tp=2 SP", "ulysses": "cp=2 ulysses",
        "ring4": "cp=4 ring", "ulysses4": "cp=4 ulysses", "hybrid4": "cp=4 hybrid 2x2"}


def overrides_for(args, case: dict, run_dir: str) -> dict:
    return {"model.preset": args.preset, "model.max_seq_len": args.seq, "train.seq_len": args.seq,
            "train.micro_batch": args.batch, "train.steps": args.warmup + args.steps,
            "precision.compute": "fp32", "run.device": "cpu", "run.dir": run_dir,
            "run.progress": "off", "train.eval_every": 0, "train.sample_tokens": 0, **case}


def saved_activation_bytes(run) -> int:
    """Bytes of the distinct storages one micro-batch's forward saves for its backward."""
    from shardlm.train.step import loss_of

    storages: dict[int, int] = {}

    def pack(t: torch.Tensor):
        if t.device.type != "meta":
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    params = {p.untyped_storage().data_ptr() for p in run.model.parameters() if p.numel()}
    x, y = run.train_loader.micro_batches(0)[0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_of(run, x, y)
    loss.backward()
    run.strategy.zero_grad()
    return sum(n for ptr, n in storages.items() if ptr not in params)  # weights are not activations


def rank_case(rank: int, world: int, overrides: dict, warmup: int, steps: int) -> dict:
    import time

    from shardlm.train.build import build_run
    from shardlm.train.step import train_step

    run = build_run(load_config(overrides=overrides).validate())
    setup_rss = peak_rss_bytes()
    activations = saved_activation_bytes(run)
    losses, seconds, ledgers = [], [], []
    for step in range(warmup + steps):
        run.strategy.ledger.reset()
        start = time.perf_counter()
        losses.append(train_step(run, step)[0])
        if step >= warmup:
            seconds.append(time.perf_counter() - start)
            ledgers.append(run.strategy.ledger.snapshot())
    return {"losses": losses, "seconds": seconds, "setup_rss": setup_rss, "rss": peak_rss_bytes(),
            "activations": activations, "ledger": ledgers[-1]}


def by_group(ledger: dict[str, int]) -> dict[str, int]:
    groups: dict[str, int] = defaultdict(int)
    for key, nbytes in ledger.items():
        groups[key.split("/", 1)[1]] += nbytes
    return dict(groups)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt-mini")
    parser.add_argument("--seq", type=int, default=8192, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=1, help="sequences per step")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per case")
    parser.add_argument("--cap-mib", type=float, default=0,
                        help="a per-rank memory budget to check each case's peak RSS against "
                             "(0: halfway between the one-rank and the cp=2 ZeRO-3 peaks)")
    parser.add_argument("--cases", default="one,cp,cp3,tp", help=f"comma-separated: {', '.join(KEYS)}")
    args = parser.parse_args()
    wanted = {KEYS[k] for k in args.cases.split(",")}
    cases = [c for c in CASES if c[0] in wanted]
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # inherited by the ranks
    cfg = load_config(overrides=overrides_for(args, {}, "")).validate()
    build_dataset(cfg.data, cfg.model.vocab_size)  # tokenizer + token stream built once, here
    torch.set_num_threads(max(1, cpu_cores() // 2))
    peak_flops(torch.device("cpu"), "fp32")  # the probe runs here, not inside a rank
    from shardlm.planner.search import predict_local
    from shardlm.planner.cp_modes import cp_mode_bytes

    def err(predicted: float, measured: float) -> str:
        return f"{predicted:,.0f} ({(predicted - measured) / measured:+.0%})"

    print(f"torch {torch.__version__}, {args.preset} ({count_params(cfg.model) / 1e6:.1f}M params), fp32, "
          f"{args.batch} x {args.seq} tokens per step, {args.warmup} warm-up + {args.steps} timed steps, "
          f"MALLOC_MMAP_THRESHOLD_={os.environ['MALLOC_MMAP_THRESHOLD_']}, load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, world, case in cases:
            over = overrides_for(args, case, tmp)
            ranks = run_ranks(rank_case, world, Path(tempfile.mkdtemp(dir=tmp)), over, args.warmup,
                              args.steps, timeout=7200)
            results[name] = (ranks, over)
            print(f"{name}: {args.batch * args.seq / max(statistics.median(r['seconds']) for r in ranks):,.0f} "
                  f"tok/s, peak RSS {max(r['rss'] for r in ranks) / MiB:,.0f} MiB", flush=True)
    peaks = {name: max(r["rss"] for r in ranks) / MiB for name, (ranks, _) in results.items()}
    cap = args.cap_mib or (0.5 * (peaks["1 rank"] + peaks["cp=2 ZeRO-3"])
                           if {"1 rank", "cp=2 ZeRO-3"} <= peaks.keys() else 0)
    header = ("case", "tok/s", "planner tok/s (err)", "step-1 loss", "activations MiB/rank (vs 1 rank)",
              "planner activation peak MiB (vs saved)", "peak RSS MiB (max rank)", "planner peak MiB (err)",
              "step RSS MiB", f"fits {cap:,.0f} MiB/rank", "ledger MiB/step by group",
              "cp formula MiB/step (ledger / formula)")
    print("\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    one_act = None
    for name, (ranks, over) in results.items():
        step_s = max(statistics.median(r["seconds"]) for r in ranks)
        act = max(r["activations"] for r in ranks) / MiB
        one_act = one_act or act
        rss = max(r["rss"] for r in ranks) / MiB
        step_rss = max(r["rss"] - r["setup_rss"] for r in ranks) / MiB
        groups = by_group(ranks[0]["ledger"])
        ledger = ", ".join(f"{g} {b / MiB:,.2f}" for g, b in sorted(groups.items())) or "0"
        formula = "–"
        cp = over.get("parallel.cp", 1)
        if cp > 1:
            model = load_config(overrides=over).validate().model
            want = sum(cp_mode_bytes(model, args.batch * args.seq, cp, over.get("parallel.tp", 1), 4,
                                     mode=over.get("parallel.cp_mode", "ring"),
                                     ulysses=over.get("parallel.cp_ulysses", 0)).values())
            formula = f"{want / MiB:,.2f} ({groups.get('cp', 0) / want:.4f})"
        pred = predict_local(load_config(overrides=over).validate(), len(ranks))
        tok_s = args.batch * args.seq / step_s
        print(f"| {name} | {tok_s:,.0f} | {err(pred.tokens_per_s, tok_s)} | {ranks[0]['losses'][0]:.4f} | "
              f"{act:,.0f} ({act / one_act:.2f}) | {err(pred.activation_bytes / MiB, act)} | {rss:,.0f} | "
              f"{err(pred.peak_process_bytes / MiB, rss)} | {step_rss:,.0f} | "
              f"{('yes' if rss <= cap else 'no') if cap else '–'} | {ledger} | {formula} |")
    print(f"\nReproduce: PYTHONPATH=src python bench/bench_cp.py {' '.join(sys.argv[1:])}")


if __name__ == "__main__":
    main()
