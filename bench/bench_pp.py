"""Pipeline parallelism on CPU ranks (gloo): shardlm's schedules against tensor parallelism,
ZeRO-3 and torch.distributed.pipelining's schedules, on the same model and batches.

    2 ranks   pp=2 GPipe / 1F1B / interleaved / zero-bubble / ZB-V / DualPipeV / 1F1B ZeRO-2,
              tp=2, dp=2 ZeRO-3, torch GPipe / 1F1B / interleaved / ZB-V / DualPipeV
    4 ranks   pp=4 1F1B, pp=2 x dp=2 1F1B, torch 1F1B pp=4 (--four; oversubscribed on 2 cores)

Every case trains the same global batch (G sequences of --seq tokens) in fp32 from the same
weights, with model.tie_embeddings=false (torch's stages would train two copies of a tied head);
step-1 and final losses must agree. Measured per case: tokens/s and CPU s/step, peak RSS per
stage at setup and over the steps (VmHWM reset between), pp_bubble from the trainer's step
record beside the schedule table's, the published formula's and the planner's, the off-CPU
share (1 - CPU s / wall s), rank 0's byte ledger by group, and the planner's prediction.
Method and results: docs/benchmarks.md, "Pipeline parallelism".

Reproduce:  PYTHONPATH=src python bench/bench_pp.py                 (gpt2-124m untied, 2 rounds, ~11 min idle)
            PYTHONPATH=src python bench/bench_pp.py --preset gpt-mini --steps 4 --no-four
            PYTHONPATH=src python bench/bench_pp.py --cases 1f1b,torch-1f1b --repeat 3
            PYTHONPATH=src python bench/bench_pp.py --cases interleaved,torch-interleaved \
                --set parallel.pp_layers=4,2,5,1                     (a split of your own)
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import warnings

from common import (MiB, add_step_args, bench_parser, build, combine, err, ledger_text, machine, peak_rss_bytes,
                    prepare, reproduce, reset_peak_rss, rounds, speed_text, start_ranks, step_overrides, summarize,
                    table, train_timed)
from pp_torch import torch_rank
from shardlm.config.load import load_config
from shardlm.parallel.pipeline.tables import V_SHAPED, check_table
from shardlm.parallel.pipeline.schedules import table_for
from shardlm.models.flops import count_params, pipeline_split

# key: (name, ranks, runner, spec). shardlm's spec: its overrides and the data-parallel degree
# (for the micro-batch); torch's: (schedule, pp, virtual).
CASES = {
    "gpipe": ("pp=2 GPipe", 2, "shardlm", ({"parallel.pp": 2, "parallel.pp_schedule": "gpipe"}, 1)),
    "1f1b": ("pp=2 1F1B", 2, "shardlm", ({"parallel.pp": 2, "parallel.pp_schedule": "1f1b"}, 1)),
    "interleaved": ("pp=2 interleaved V=2", 2, "shardlm",
                    ({"parallel.pp": 2, "parallel.pp_schedule": "interleaved", "parallel.pp_virtual": 2}, 1)),
    "zb": ("pp=2 zero-bubble", 2, "shardlm", ({"parallel.pp": 2, "parallel.pp_schedule": "zb"}, 1)),
    "zbv": ("pp=2 ZB-V", 2, "shardlm",
            ({"parallel.pp": 2, "parallel.pp_schedule": "zbv", "parallel.pp_virtual": 2}, 1)),
    "dualpipev": ("pp=2 DualPipeV", 2, "shardlm",
                  ({"parallel.pp": 2, "parallel.pp_schedule": "dualpipev", "parallel.pp_virtual": 2}, 1)),
    "1f1b-z2": ("pp=2 1F1B ZeRO-2", 2, "shardlm",
                ({"parallel.pp": 2, "parallel.pp_schedule": "1f1b", "parallel.zero_stage": 2}, 1)),
    "tp": ("tp=2", 2, "shardlm", ({"parallel.tp": 2}, 1)),
    "zero3": ("dp=2 ZeRO-3", 2, "shardlm", ({"parallel.zero_stage": 3}, 2)),
    "torch-gpipe": ("torch GPipe pp=2", 2, "torch", ("gpipe", 2, 1)),
    "torch-1f1b": ("torch 1F1B pp=2", 2, "torch", ("1f1b", 2, 1)),
    "torch-interleaved": ("torch interleaved pp=2 V=2", 2, "torch", ("interleaved", 2, 2)),
    "torch-zbv": ("torch ZB-V pp=2", 2, "torch", ("zbv", 2, 2)),
    "torch-dualpipev": ("torch DualPipeV pp=2", 2, "torch", ("dualpipev", 2, 2)),
    "pp4": ("pp=4 1F1B", 4, "shardlm", ({"parallel.pp": 4, "parallel.pp_schedule": "1f1b"}, 1)),
    "pp2dp2": ("pp=2 x dp=2 1F1B", 4, "shardlm", ({"parallel.pp": 2, "parallel.pp_schedule": "1f1b"}, 2)),
    "torch-pp4": ("torch 1F1B pp=4", 4, "torch", ("1f1b", 4, 1)),
}
DEFAULT = ["gpipe", "1f1b", "interleaved", "zb", "zbv", "dualpipev", "1f1b-z2", "tp", "zero3", "torch-gpipe",
           "torch-1f1b", "torch-interleaved", "torch-zbv", "torch-dualpipev", "pp4", "pp2dp2", "torch-pp4"]
# ours beside torch's: (shardlm case, torch case)
PAIRS = [("gpipe", "torch-gpipe"), ("1f1b", "torch-1f1b"), ("1f1b-z2", "torch-1f1b"), ("interleaved", "torch-interleaved"),
         ("zbv", "torch-zbv"), ("dualpipev", "torch-dualpipev"), ("pp4", "torch-pp4")]


def batch_shape(args, key: str) -> tuple[int, int]:
    """(micro-batch, micro-batches per step) of a case, per data-parallel rank: pipelines run
    --micro-batch sequences at a time; tp and ZeRO-3 their whole share in one micro-batch."""
    _, ranks, runner, spec = CASES[key]
    if runner == "torch":
        return args.micro_batch, args.global_batch // args.micro_batch
    overrides, dp = spec
    if overrides.get("parallel.pp", 1) == 1:
        return args.global_batch // dp, 1
    return args.micro_batch, args.global_batch // (dp * args.micro_batch)


def overrides_for(args, key: str, run_dir: str) -> dict:
    _, _, runner, spec = CASES[key]
    micro, accum = batch_shape(args, key)
    return step_overrides(args, run_dir, {"model.tie_embeddings": False, "train.micro_batch": micro,
                                          "train.grad_accum": accum,
                                          **(spec[0] if runner == "shardlm" else torch_layout(spec))})


def torch_layout(spec: tuple) -> dict:
    """torch's case as shardlm's config would say it (validates parallel.pp_layers, if set; the
    split torch's stages take is the one shardlm takes for it)."""
    name, pp, virtual = spec
    return {"parallel.pp": pp, "parallel.pp_schedule": name, "parallel.pp_virtual": virtual}


def shardlm_rank(rank: int, world: int, overrides: dict, warmup: int, steps: int) -> dict:
    from shardlm.train.loop import step_record

    # torch 2.13 deprecates all_gather_into_tensor (Schedule.by_stage calls it): once per rank
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*", category=FutureWarning)
    run = build(overrides)
    setup_rss = peak_rss_bytes()
    reset_peak_rss()  # the steps' own high-water mark follows (Linux; elsewhere the process's)
    records = []

    def after(s: int, seconds: float, result) -> None:  # not timed
        # every rank calls it (it gathers per-stage values over the pipeline)
        records.append(step_record(run, s, result, seconds))

    out = train_timed(run, warmup, steps, after)
    return {**out, "setup_rss": setup_rss, "steps_rss": peak_rss_bytes(),
            "stage": run.schedule.stage.index if run.schedule is not None else rank,
            "records": [{k: v for k, v in r.items() if k.startswith("pp_")} for r in records[warmup:]]}


# -- predictions and the tables ---------------------------------------------------------------

def predictions(cfg, ranks: int) -> dict:
    """predict_local, and every stage's peak (planner.memory.stage_memories)."""
    from shardlm.hardware.catalog import local_cpu
    from shardlm.planner.memory import stage_memories
    from shardlm.planner.search import config_strategy, predict_local

    p = predict_local(cfg, ranks)
    workload, strategy = config_strategy(cfg, local_cpu(ranks))
    stages = [m.peak for m in stage_memories(workload, strategy, local_cpu(ranks))]
    return {"tok_s": p.tokens_per_s, "peak": p.peak_process_bytes, "bubble": p.timing.bubble,
            "stage_peaks": stages}


def per_stage(ranks: list[dict], key: str) -> list[float]:
    """Max of `key` over each stage's ranks (each rank for cases without a pipeline)."""
    out: dict[int, float] = {}
    for r in ranks:
        out[r["stage"]] = max(out.get(r["stage"], 0), r[key])
    return [out[s] for s in sorted(out)]


def summarize_stages(ranks: list[dict], tokens_per_step: int) -> dict:
    """common.summarize, with memory marks and the off-CPU share by stage and the pipeline's
    bubble from rank 0's step records."""
    for r in ranks:
        r["peak"] = max(r["setup_rss"], r["steps_rss"])
        r["off_cpu"] = statistics.median(1 - c / w for c, w in zip(r["cpu"], r["seconds"]))
    records = ranks[0]["records"]
    out = {**summarize(ranks, tokens_per_step), "peak": per_stage(ranks, "peak"),
           "setup": per_stage(ranks, "setup_rss"), "steps": per_stage(ranks, "steps_rss"),
           "off_cpu": per_stage(ranks, "off_cpu"), "bubble": None}
    if records and "pp_bubble" in records[0]:
        out["bubble"] = statistics.median(r["pp_bubble"] for r in records)
        out["bubble_by_stage"] = [statistics.median(r["pp_bubble_by_stage"][i] for r in records)
                                  for i in range(len(records[0]["pp_bubble_by_stage"]))]
        out["formula"] = records[0]["pp_bubble_formula"]
        out["record_rss"] = [max(r["pp_peak_rss_bytes_by_stage"][i] for r in records)
                             for i in range(len(records[0]["pp_peak_rss_bytes_by_stage"]))]
    return out


def combine_stages(runs: list[dict]) -> dict:
    """common.combine, with the stages' highest memory marks and median off-CPU share and bubble."""
    out = {**combine(runs), "off_cpu": [statistics.median(v) for v in zip(*(r["off_cpu"] for r in runs))]}
    for key in ("peak", "setup", "steps"):
        out[key] = [max(v) for v in zip(*(r[key] for r in runs))]
    if runs[0]["bubble"] is not None:
        out["bubble"] = statistics.median(r["bubble"] for r in runs)
        out["bubble_by_stage"] = [statistics.median(v) for v in zip(*(r["bubble_by_stage"] for r in runs))]
    return out


def mib_list(values: list[float]) -> str:
    return " / ".join(f"{v / MiB:,.0f}" for v in values)


def speed_row(name: str, key: str, args, m: dict, pred: dict | None, ranks: int) -> str:
    micro, accum = batch_shape(args, key)
    if m["bubble"] is not None:
        bubble = f"{m['bubble']:.3f} ({' / '.join(f'{b:.3f}' for b in m['bubble_by_stage'])})"
        par = load_config(overrides=overrides_for(args, key, "")).validate().parallel
        table = f"{check_table(table_for(par.pp_schedule, par.pp, par.pp_virtual, accum)).idle:.3f}"
        formula = f"{m['formula']:.3f}"
    else:
        bubble = formula = table = "–"
    planner = err(pred["tok_s"], m["tok_s"]) if pred else "–"
    planner_bubble = f"{pred['bubble']:.3f}" if pred and m["bubble"] is not None else "–"
    off_cpu = " / ".join(f"{v:.2f}" for v in m["off_cpu"])
    return [name, ranks, f"{micro} x {accum}", speed_text(m, 1), f"{m['cpu_s']:.2f}", planner, bubble, table,
            formula, planner_bubble, off_cpu, ledger_text(m["ledger"], m["ledger_steady"])]


def memory_row(name: str, m: dict, pred: dict | None, first_ref: float) -> str:
    planner = "–"
    if pred:
        stages = pred["stage_peaks"] if len(pred["stage_peaks"]) == len(m["peak"]) else [pred["peak"]]
        planner = f"{mib_list(stages)} ({(pred['peak'] - max(m['peak'])) / max(m['peak']):+.0%} on the max)"
    loss = f"{m['first']:.4f} ({abs(m['first'] - first_ref):.0e})"
    loss += "" if m["repeatable"] else " (differs by run)"
    return [name, mib_list(m["peak"]), mib_list(m["setup"]), mib_list(m["steps"]), planner, loss, f"{m['last']:.4f}"]


def measure(args, key: str, tmp: str, tokens_per_step: int) -> dict:
    """One case in fresh processes."""
    _, ranks, runner, spec = CASES[key]
    over = overrides_for(args, key, tmp)
    if runner == "shardlm":
        out = start_ranks(shardlm_rank, ranks, tmp, over, args.warmup, args.steps)
    else:
        out = start_ranks(torch_rank, ranks, tmp, over, spec, args.warmup, args.steps)
    return summarize_stages(out, tokens_per_step)


def main() -> None:
    parser = bench_parser(__doc__, "gpt2-124m", 128, 2, micro_help="sequences per pipeline micro-batch")
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per step, every case")
    parser.add_argument("--four", action=argparse.BooleanOptionalAction, default=True,
                        help="the 4-rank cases (pp=4, pp=2 x dp=2, torch pp=4)")
    parser.add_argument("--cases", default="", help=f"comma-separated, from: {', '.join(CASES)} "
                                                    f"(default: {', '.join(DEFAULT)})")
    add_step_args(parser, steps=3, warmup=1, repeat=2)
    args = parser.parse_args()
    keys = args.cases.split(",") if args.cases else [k for k in DEFAULT if args.four or CASES[k][1] == 2]
    unknown = [k for k in keys if k not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}: choose from {', '.join(CASES)}")
    if args.global_batch % (2 * args.micro_batch):
        parser.error("--global-batch must divide by 2 x --micro-batch (pp=2 x dp=2 runs b x G/(2b))")
    cfg = load_config(overrides=overrides_for(args, keys[0], "")).validate()
    prepare(cfg, 2)
    tokens_per_step = args.global_batch * args.seq
    print(f"{machine()}; {args.preset} untied "
          f"({count_params(cfg.model) / 1e6:.1f}M params), fp32, global batch {args.global_batch}x{args.seq}, "
          f"pipeline micro-batch {args.micro_batch}, {args.warmup} warm-up + {args.steps} timed steps, "
          f"{args.repeat} run(s) per case, MALLOC_MMAP_THRESHOLD_={os.environ['MALLOC_MMAP_THRESHOLD_']}",
          flush=True)
    splits = {}
    for k in keys:
        par = load_config(overrides=overrides_for(args, k, "")).validate().parallel
        if par.pp > 1:
            n = par.pp * par.pp_virtual
            where = "v" if par.pp_schedule in V_SHAPED else "loop"
            splits.setdefault((n, par.pp_layers, where), pipeline_split(cfg.model, args.seq, n, par.pp_layers,
                                                                        par.pp_virtual, where))
    for (n, explicit, where), split in sorted(splits.items()):
        print(f"split over {n} stages{' in a V' if where == 'v' else ''} ({'parallel.pp_layers' if explicit else 'models.flops.pipeline_split'}): "
              f"{split} blocks", flush=True)
    preds = {k: predictions(load_config(overrides=overrides_for(args, k, "")).validate(), CASES[k][1])
             for k in keys if CASES[k][2] == "shardlm"}
    with tempfile.TemporaryDirectory() as tmp:
        runs = rounds(keys, args.repeat, lambda k: measure(args, k, tmp, tokens_per_step), lambda k: CASES[k][0])
    results = {k: combine_stages(runs[k]) for k in keys}
    header = ("case", "ranks", "micro-batch x M (per pipeline)",
              "tok/s" + (" median (range)" if args.repeat > 1 else ""), "CPU s/step (max rank)",
              "planner tok/s (err)", "bubble measured: mean (by stage)", "bubble of the table (simulated, F=I=W)",
              "bubble formula (published)",
              "planner bubble", "off-CPU share by stage (1 - CPU/wall)", "ledger MiB/step by group")
    print("\n" + table(header, [speed_row(CASES[k][0], k, args, results[k], preds.get(k), CASES[k][1]) for k in keys]))
    header = ("case", "peak RSS MiB by stage (or rank)", "setup RSS MiB", "steps' peak RSS MiB (after setup)",
              "planner peak MiB by stage (err)", "step-1 loss (\\|Δ\\| vs first row)",
              f"final loss (step {args.warmup + args.steps})")
    first_ref = results[keys[0]]["first"]
    print("\n" + table(header, [memory_row(CASES[k][0], results[k], preds.get(k), first_ref) for k in keys]))
    print()
    for ours, theirs in PAIRS:
        if ours in results and theirs in results:
            a, b = results[ours], results[theirs]
            print(f"- {CASES[ours][0]} vs {CASES[theirs][0]}: {a['tok_s'] / b['tok_s']:.2f}x the tokens/s, "
                  f"{a['cpu_s'] / b['cpu_s']:.2f}x the CPU s/step, peak RSS by stage "
                  + ", ".join(f"{(x - y) / MiB:+,.0f}" for x, y in zip(a["peak"], b["peak"]))
                  + " MiB, steps' peak by stage "
                  + ", ".join(f"{(x - y) / MiB:+,.0f}" for x, y in zip(a["steps"], b["steps"])) + " MiB")
    for k in keys:
        m = results[k]
        if "record_rss" in m:
            same = all(abs(x - y) <= 1 * MiB for x, y in zip(m["record_rss"], m["steps"]))
            if not same:
                print(f"- {CASES[k][0]}: step_record's pp_peak_rss_bytes_by_stage {mib_list(m['record_rss'])} "
                      f"MiB differs from the steps' peak {mib_list(m['steps'])} MiB")
    print(f"\n{reproduce()}")


if __name__ == "__main__":
    main()
