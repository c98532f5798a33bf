"""Context parallelism on CPU ranks (gloo): one long sequence, split over cp ranks.

    one, cp (ZeRO-0), cp3 (ZeRO-3), tpsp (tp=2 SP), ulysses on 2 ranks; ring4, ulysses4,
    hybrid4 (2x2) on 4 ranks

Every case trains the same sequences in fp32 from the same weights; step-1 losses must agree.
Per rank: activations (the saved-tensor ledger of one forward), peak RSS, step RSS (peak minus
the RSS after setup), the byte ledger by group (cp beside planner.cp_modes.cp_mode_bytes) and
the planner's tokens/s, activations and peak with their errors; --cap-mib M marks what fits.
--sweep L1,L2,...: every length in one launch per case (VmHWM restarted before each build),
--doc-mask on/off/both; a row per mode x cp x doc mask x length (activations beside the
planner's, peak and step RSS, tok/s with the load average).
Method and results: docs/benchmarks.md, "Context parallelism".

Reproduce:  PYTHONPATH=src python bench/bench_cp.py                       (gpt-mini, 8192 tokens)
            PYTHONPATH=src python bench/bench_cp.py --seq 4096 --cases one,cp
            PYTHONPATH=src python bench/bench_cp.py --seq 2048 --cases one,cp,ulysses,ring4,ulysses4,hybrid4
            PYTHONPATH=src python bench/bench_cp.py --preset gpt-tiny --layers 1 --heads 4 \
                --sweep 4096,8192,16384 --doc-mask both --steps 1 --warmup 0     (docs/benchmarks.md)
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time

import torch

from common import (MiB, build, by_group, err, ledger_text, machine, peak_rss_bytes, prepare, reproduce, reset_peak_rss,
                    run_overrides, start_ranks, table, table_row, train_timed)
from shardlm.config.load import load_config
from shardlm.models.flops import count_params

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


def overrides_for(args, case: dict, run_dir: str, seq: int = 0, mask: str = "") -> dict:
    seq, mask = seq or args.seq, mask or ("on" if args.doc_mask == "on" else "off")
    layers = {"model.n_layers": args.layers} if args.layers else {}
    if args.heads:
        layers["model.n_heads"] = args.heads
    return {"model.preset": args.preset, "model.max_seq_len": seq, "train.seq_len": seq, **layers,
            "train.micro_batch": args.batch, "train.steps": max(1, args.warmup + args.steps),
            **run_overrides(run_dir), "data.document_mask": mask, **case}


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


def documents_per_row(run) -> float:
    """Documents in the first micro-batch's rows (1 without document masks)."""
    x = run.train_loader.micro_batches(0)[0][0]
    positions = getattr(x, "positions", None)
    return 1.0 if positions is None else float((positions == 0).sum()) / positions.shape[0]


def measure(run, warmup: int, steps: int) -> dict:
    """The activation ledger's forward + backward, then train_timed (with no timed step, the
    ledger's seconds stand as the step's)."""
    setup_rss = peak_rss_bytes()
    start = time.perf_counter()
    activations = saved_activation_bytes(run)
    ledger_s = time.perf_counter() - start
    out = train_timed(run, warmup, steps)
    return {"losses": out["losses"], "seconds": out["seconds"] or [ledger_s], "setup_rss": setup_rss,
            "rss": peak_rss_bytes(), "activations": activations, "ledger": (out["ledgers"] or [{}])[-1],
            "documents": documents_per_row(run), "load": os.getloadavg()[0]}


def rank_case(rank: int, world: int, overrides: dict, warmup: int, steps: int) -> dict:
    return measure(build(overrides), warmup, steps)


def rank_sweep(rank: int, world: int, overrides: list[dict], warmup: int, steps: int) -> list[dict]:
    """One case at each sequence length in turn in the same processes (one launch, one process
    group), the peak RSS restarted before each build."""
    from shardlm.launch.runtime import init_runtime
    from shardlm.train.build import build_run

    results, runtime = [], None
    for over in overrides:
        cfg = load_config(overrides=over).validate()
        runtime = runtime or init_runtime(cfg.run.device, cfg.parallel.collective_timeout_s)
        gc.collect()
        fresh = reset_peak_rss()
        run = build_run(cfg, runtime)
        results.append({**measure(run, warmup, steps), "fresh_peak": fresh})
        del run
    return results


SWEEP_CASES = "one,cp,ulysses,ring4,ulysses4,hybrid4"
MODE = {"1 rank": ("–", 1), "cp=2 ZeRO-0": ("ring", 2), "cp=2 ulysses": ("ulysses", 2),
        "cp=4 ring": ("ring", 4), "cp=4 ulysses": ("ulysses", 4), "cp=4 hybrid 2x2": ("hybrid 2x2", 4)}


def planned_saved(pred, cfg) -> float:
    """The planner's bytes one micro-batch's forward saves for backward on a rank: its blocks'
    (the activation term's 'saved by blocks') and the loss's (activations.loss_saved)."""
    from shardlm.planner.activations import ActivationDtypes, loss_saved

    act = next(i for i in pred.memory.items if i.name == "activations")
    blocks = next(p.bytes for p in act.parts if p.name == "saved by blocks")
    tokens = cfg.train.micro_batch * cfg.train.seq_len / cfg.parallel.cp
    return blocks + tokens * loss_saved(cfg.model, ActivationDtypes(4, 4, False))


def sweep_row(name: str, world: int, over: dict, per_rank: list[dict], batch: int) -> tuple:
    """One table row: a case at one sequence length, its ranks' measurements and the planner's."""
    from shardlm.planner.search import predict_local

    cfg = load_config(overrides=over).validate()
    want = planned_saved(predict_local(cfg, world), cfg) / MiB
    got = max(r["activations"] for r in per_rank) / MiB
    step_s = max(statistics.median(r["seconds"]) for r in per_rank)
    mode, cp = MODE[name]
    return (mode, cp, over["data.document_mask"], f"{over['train.seq_len']:,}", f"{per_rank[0]['documents']:.1f}",
            f"{got:,.1f}", f"{want:,.1f}", f"{(want - got) / got:+.1%}",
            " / ".join(f"{r['rss'] / MiB:,.0f}" for r in per_rank),
            f"{max(r['rss'] - r['setup_rss'] for r in per_rank) / MiB:,.0f}",
            f"{batch * over['train.seq_len'] / step_s:,.0f}", f"{per_rank[0]['load']:.1f}",
            f"{per_rank[0]['losses'][0]:.4f}" if per_rank[0]["losses"] else "–")


def sweep(args, cases: list, masks: list[str]) -> None:
    """Each case x document mask at every sequence length of --sweep, ascending, in one launch;
    one table row per mode x cp x seq (module docstring)."""
    seqs = sorted(int(n) for n in args.sweep.split(","))
    bad = [n for n in seqs if n % 8]
    if bad:
        raise SystemExit(f"--sweep {bad}: each length must divide by 2·cp = 8 (the ring's load-balanced chunks)")
    header = ("mode", "cp", "doc mask", "seq", "docs/seq", "activations MiB/rank measured", "planned", "error",
              "peak RSS MiB per rank", "step RSS MiB (max)", "tok/s", "load avg", "step-1 loss")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        plan = [(name, world, [overrides_for(args, case, tempfile.mkdtemp(dir=tmp), seq, mask) for seq in seqs])
                for mask in masks for name, world, case in cases]
        for _, _, overs in plan:  # a refused case stops the sweep here, before any rank is spawned
            for over in overs:
                load_config(overrides=over).validate()
        for name, world, overs in plan:
            ranks = start_ranks(rank_sweep, world, tmp, overs, args.warmup, args.steps, timeout=14400)
            for i, over in enumerate(overs):
                rows.append(sweep_row(name, world, over, [r[i] for r in ranks], args.batch))
                print(" | ".join(map(str, rows[-1])), flush=True)
            if not all(r[0]["fresh_peak"] for r in ranks):
                print("(no VmHWM reset on this kernel: each peak is the highest so far)")
    print(f"\nsizes run: {', '.join(f'{n:,}' for n in seqs)} tokens; cases: {', '.join(c[0] for c in cases)}; "
          f"document masks: {', '.join(masks)}; load average at the end {os.getloadavg()[0]:.1f}")
    print("\n" + table(header, rows))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt-mini")
    parser.add_argument("--seq", type=int, default=8192, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=1, help="sequences per step")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per case (--sweep: 0 times the "
                        "activation ledger's forward + backward instead, no optimizer step)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per case")
    parser.add_argument("--cap-mib", type=float, default=0,
                        help="a per-rank memory budget to check each case's peak RSS against "
                             "(0: halfway between the one-rank and the cp=2 ZeRO-3 peaks)")
    parser.add_argument("--cases", default="", help=f"comma-separated: {', '.join(KEYS)} "
                        f"(default one,cp,cp3,tp; with --sweep {SWEEP_CASES})")
    parser.add_argument("--sweep", default="", help="comma-separated sequence lengths: every case at each, "
                        "one row per case x length (e.g. 4096,8192,16384,32768,65536)")
    parser.add_argument("--doc-mask", default="off", choices=("off", "on", "both"),
                        help="data.document_mask: several documents per sequence, attention kept in each")
    parser.add_argument("--layers", type=int, default=0, help="model.n_layers (0: the preset's)")
    parser.add_argument("--heads", type=int, default=0, help="model.n_heads (0: the preset's; Ulysses "
                        "needs them to divide by cp)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    keys = (args.cases or (SWEEP_CASES if args.sweep else "one,cp,cp3,tp")).split(",")
    unknown = [k for k in keys if k not in KEYS]
    if unknown:
        raise SystemExit(f"--cases {','.join(unknown)}: choose from {', '.join(KEYS)}")
    cases = [c for c in CASES if c[0] in {KEYS[k] for k in keys}]
    masks = ["off", "on"] if args.doc_mask == "both" else [args.doc_mask]
    if args.sweep and not {c[0] for c in cases} <= MODE.keys():
        raise SystemExit(f"--sweep runs the cases {SWEEP_CASES} (ZeRO-3 and tp change more than the cp mode)")
    cfg = load_config(overrides=overrides_for(args, {}, "")).validate()
    prepare(cfg, 2)
    from shardlm.planner.cp_modes import cp_mode_bytes
    from shardlm.planner.search import predict_local

    m = cfg.model
    print(f"{machine()}; {args.preset} ({count_params(m) / 1e6:.1f}M params: {m.n_layers} layers, "
          f"{m.n_heads} heads, d_model {m.d_model}, vocab {m.vocab_size}), fp32, "
          f"{args.batch} x {args.sweep or args.seq} tokens per step, {args.warmup} warm-up + {args.steps} timed "
          f"steps{' (the activation ledger forward + backward first)' if args.sweep else ''}"
          f"{' (tok/s: of the ledger forward + backward)' if not args.steps else ''}, "
          f"MALLOC_MMAP_THRESHOLD_={os.environ['MALLOC_MMAP_THRESHOLD_']}", flush=True)
    if args.sweep:
        return sweep(args, cases, masks)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, world, case in cases:
            over = overrides_for(args, case, tmp)
            ranks = start_ranks(rank_case, world, tmp, over, args.warmup, args.steps, timeout=7200)
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
    print("\n" + table(header, []))
    one_act = None
    for name, (ranks, over) in results.items():
        step_s = max(statistics.median(r["seconds"]) for r in ranks)
        act = max(r["activations"] for r in ranks) / MiB
        one_act = one_act or act
        rss = max(r["rss"] for r in ranks) / MiB
        step_rss = max(r["rss"] - r["setup_rss"] for r in ranks) / MiB
        groups = by_group(ranks[0]["ledger"])
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
        print(table_row([name, f"{tok_s:,.0f}", err(pred.tokens_per_s, tok_s), f"{ranks[0]['losses'][0]:.4f}",
                         f"{act:,.0f} ({act / one_act:.2f})", err(pred.activation_bytes / MiB, act), f"{rss:,.0f}",
                         err(pred.peak_process_bytes / MiB, rss), f"{step_rss:,.0f}",
                         ("yes" if rss <= cap else "no") if cap else "–", ledger_text(ranks[0]["ledger"]),
                         formula]))
    print(f"\n{reproduce()}")


if __name__ == "__main__":
    main()
