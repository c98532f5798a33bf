"""Tensor parallelism on 2 CPU ranks (gloo): shardlm's tp=2 against data parallelism and against
torch's own tensor parallelism (DTensor parallel styles) on the same model.

    dp=2 ZeRO-0 / dp=2 ZeRO-3   shardlm, micro-batch B/2 per rank
    tp=2 / tp=2 SP              shardlm, parallel.tp=2 (+ sequence_parallel), micro-batch B
    torch TP / torch TP SP      parallelize_module on shardlm's Decoder: ColwiseParallel on
                                attn.qkv and mlp.fc, RowwiseParallel on attn.proj and mlp.proj
                                (the fused qkv rows regrouped per rank), + SequenceParallel norms

Every case trains the same global batch B in fp32 from the same weights; step-1 losses must
agree. Measured: global tokens/s (median and range over --repeat rounds), CPU s/step, peak RSS
(max over ranks, setup included), the byte ledger of one step by group (tp cases beside
planner.traffic.tp_comm_bytes) and planner.search.predict_local for each shardlm case.
Method and results: docs/benchmarks.md, "Tensor parallelism".

Reproduce:  PYTHONPATH=src python bench/bench_tp.py --repeat 2          (gpt2-124m, ~9 min idle)
            PYTHONPATH=src python bench/bench_tp.py --preset gpt-mini --steps 6
            PYTHONPATH=src python bench/bench_tp.py --cases tp,torch-tp
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

import torch

from common import (MiB, add_step_args, bench_parser, by_group, combine, err, ledger_text, peak_rss_bytes, prepare,
                    reproduce, rounds, setup_line, shardlm_rank, speed_text, start_ranks, step_overrides, summarize,
                    table, timed_steps)
from common.peer import adamw, peer_step, reference_setup
from shardlm.config.load import load_config
from shardlm.parallel.data.zero.optim import param_groups

WORLD = 2
# (name, runner, data-parallel degree, shardlm's overrides or torch's sequence_parallel)
CASES = [("dp=2 ZeRO-0", "shardlm", 2, {"parallel.zero_stage": 0}),
         ("dp=2 ZeRO-3", "shardlm", 2, {"parallel.zero_stage": 3}),
         ("tp=2", "shardlm", 1, {"parallel.tp": 2}),
         ("tp=2 SP", "shardlm", 1, {"parallel.tp": 2, "parallel.sequence_parallel": True}),
         ("torch TP", "torch", 1, False),
         ("torch TP SP", "torch", 1, True)]
KEYS = {"dp0": "dp=2 ZeRO-0", "dp3": "dp=2 ZeRO-3", "tp": "tp=2", "tp-sp": "tp=2 SP",
        "torch-tp": "torch TP", "torch-tp-sp": "torch TP SP"}


def overrides_for(args, dp: int, case: dict, run_dir: str) -> dict:
    return step_overrides(args, run_dir, {"train.micro_batch": args.global_batch // dp, **case})


# -- torch's tensor parallelism on the same Decoder -------------------------------------------

@torch.no_grad()
def regroup_rows(linear, segments: list[int], n: int) -> None:
    """Reorder a fused Linear's output features [seg_0 | seg_1 | …] so the n contiguous blocks
    ColwiseParallel cuts are [seg_0 part r | seg_1 part r | …] for r = 0..n-1."""
    index, offset = [[] for _ in range(n)], 0
    for size in segments:
        part = size // n
        for r in range(n):
            index[r].append(torch.arange(offset + r * part, offset + (r + 1) * part))
        offset += size
    order = torch.cat([i for parts in index for i in parts])
    linear.weight.copy_(linear.weight[order])
    if linear.bias is not None:
        linear.bias.copy_(linear.bias[order])


def apply_torch_tp(model, mesh, sequence_parallel: bool) -> None:
    """torch's parallel styles on a materialised Decoder, a plan in the manner of torchtitan's
    apply_tp, with the embedding and head left replicated."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    from shardlm.models.decoder import SwiGLU

    n = mesh.size()
    sharded = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout
    colwise = ColwiseParallel(input_layouts=sharded)
    rowwise = RowwiseParallel(output_layouts=sharded)
    plan = {}
    for i, block in enumerate(model.blocks):
        attn, mlp = block.attn, block.mlp
        regroup_rows(attn.qkv, [attn.n_heads * attn.head_dim] + 2 * [attn.n_kv_heads * attn.head_dim], n)
        attn.n_heads, attn.n_kv_heads = attn.n_heads // n, attn.n_kv_heads // n
        up, down = ("gate_up", "down") if isinstance(mlp, SwiGLU) else ("fc", "proj")
        if isinstance(mlp, SwiGLU):
            regroup_rows(mlp.gate_up, [mlp.hidden, mlp.hidden], n)
            mlp.hidden //= n
        plan.update({f"blocks.{i}.attn.qkv": colwise, f"blocks.{i}.attn.proj": rowwise,
                     f"blocks.{i}.mlp.{up}": colwise, f"blocks.{i}.mlp.{down}": rowwise})
        if sequence_parallel:
            plan.update({f"blocks.{i}.attn_norm": SequenceParallel(),
                         f"blocks.{i}.mlp_norm": SequenceParallel()})
    if sequence_parallel:  # replicated embedding output -> this rank's chunk; gathered for the head
        plan.update({"blocks.0": PrepareModuleInput(input_layouts=(Replicate(), None),
                                                    desired_input_layouts=(Shard(1), None),
                                                    use_local_output=True),
                     "norm_f": SequenceParallel(),
                     "head": PrepareModuleInput(input_layouts=(Shard(1),),
                                                desired_input_layouts=(Replicate(),),
                                                use_local_output=True)})
    parallelize_module(model, mesh, plan)


def split_groups(model, weight_decay: float) -> list[dict]:
    """param_groups with DTensors and plain tensors in separate groups: fused AdamW runs one
    kernel per group and refuses a mix of the two."""
    from torch.distributed.tensor import DTensor

    out = []
    for group in param_groups(model, weight_decay):
        for is_dtensor in (True, False):
            params = [p for p in group["params"] if isinstance(p, DTensor) == is_dtensor]
            if params:
                out.append({**group, "params": params})
    return out


def clip_grad_norm(model, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over DTensor and plain gradients: each kind's norm on its
    own (torch's foreach norm refuses a mix), the DTensor one completed over the group."""
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if p.grad is not None]
    kinds = [k for k in ([p for p in params if isinstance(p, DTensor)],
                         [p for p in params if not isinstance(p, DTensor)]) if k]
    norms = [torch.nn.utils.get_total_norm([p.grad for p in kind]) for kind in kinds]
    total = torch.stack([(n.full_tensor() if isinstance(n, DTensor) else n) ** 2 for n in norms]).sum().sqrt()
    for kind in kinds:  # takes the parameters and scales their .grad
        torch.nn.utils.clip_grads_with_norm_(kind, max_norm, total)
    return total


def torch_rank(rank: int, world: int, overrides: dict, sequence_parallel: bool, warmup: int,
               steps: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    cfg, loader, model = reference_setup(overrides, 0, 1)  # every tensor-parallel rank sees the whole batch
    t = cfg.train
    apply_torch_tp(model, init_device_mesh("cpu", (world,)), sequence_parallel)
    optimizer = adamw(split_groups(model, t.weight_decay), t)
    setup_rss = peak_rss_bytes()

    def step(s: int) -> float:  # logits whole on every rank; the loss the same on both
        return peer_step(model, optimizer, loader, t, s, world, lambda: clip_grad_norm(model, t.grad_clip))

    return {**timed_steps(step, warmup, steps), "setup_rss": setup_rss, "rss": peak_rss_bytes()}


# -- predictions and the table ----------------------------------------------------------------

def predictions(cfg) -> dict:
    """predict_local for a shardlm case, the tp formula for tp cases, and (for the report) the
    same prediction with parallel.sequence_parallel passed through (config_strategy leaves the
    Strategy's default, True)."""
    from shardlm.hardware.catalog import local_cpu
    from shardlm.planner.memory import estimate_memory
    from shardlm.planner.search import config_strategy, predict_local
    from shardlm.planner.timing import estimate_time
    from shardlm.planner.traffic import tp_comm_bytes

    p = predict_local(cfg, WORLD)
    out = {"tok_s": p.tokens_per_s, "peak": p.peak_process_bytes, "formula": None}
    par, t = cfg.parallel, cfg.train
    workload, strategy = config_strategy(cfg, local_cpu(WORLD))
    out["strategy_sp"] = strategy.sequence_parallel
    if par.tp > 1:
        out["formula"] = t.grad_accum * tp_comm_bytes(cfg.model, t.micro_batch * t.seq_len, par.tp,
                                                      par.sequence_parallel, 4, cfg.activation.checkpoint)
    if strategy.layout.tp > 1 and strategy.sequence_parallel != par.sequence_parallel:
        fixed = dataclasses.replace(strategy, sequence_parallel=par.sequence_parallel)
        cluster = local_cpu(WORLD)
        out["fixed"] = (estimate_time(workload, fixed, cluster).tokens_per_s,
                        estimate_memory(workload, fixed, cluster).peak)
    return out


def row(name: str, m: dict, pred: dict | None, first_ref: float) -> list[str]:
    formula = "–"
    if pred and pred["formula"] is not None:
        tp_bytes = by_group(m["ledger"]).get("tp", 0)
        formula = f"{pred['formula'] / MiB:,.2f} ({tp_bytes / pred['formula']:.4f})"
    loss = f"{m['first']:.4f} ({abs(m['first'] - first_ref):.0e})"
    loss += "" if m["repeatable"] else " (differs by run)"
    return [name, speed_text(m), f"{m['cpu_s']:.2f}", err(pred["tok_s"], m["tok_s"]) if pred else "–",
            f"{m['rss'] / MiB:,.0f}", err(pred["peak"] / MiB, m["rss"] / MiB) if pred else "–",
            f"{m['setup_rss'] / MiB:,.0f}", loss, f"{m['last']:.4f}", ledger_text(m["ledger"], m["ledger_steady"]),
            formula]


def measure(args, case: tuple, tmp: str, tokens_per_step: int) -> dict:
    """One case in fresh processes."""
    _, runner, dp, spec = case
    if runner == "shardlm":
        ranks = start_ranks(shardlm_rank, WORLD, tmp, overrides_for(args, dp, spec, tmp), args.warmup, args.steps)
    else:
        ranks = start_ranks(torch_rank, WORLD, tmp, overrides_for(args, dp, {}, tmp), spec, args.warmup,
                            args.steps)
    return summarize(ranks, tokens_per_step)


def main() -> None:
    parser = bench_parser(__doc__, "gpt2-124m", 128)
    parser.add_argument("--global-batch", type=int, default=4, help="sequences per step, every case")
    parser.add_argument("--cases", default=",".join(KEYS), help=f"comma-separated: {', '.join(KEYS)}")
    add_step_args(parser, steps=4, warmup=2, repeat=1)
    args = parser.parse_args()
    if args.global_batch % WORLD:
        parser.error(f"--global-batch {args.global_batch} must divide by the {WORLD} data-parallel ranks")
    unknown = [k for k in args.cases.split(",") if k not in KEYS]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}: choose from {', '.join(KEYS)}")
    wanted = {KEYS[k] for k in args.cases.split(",")}
    cases = {c[0]: c for c in CASES if c[0] in wanted}
    cfg = load_config(overrides=overrides_for(args, 1, {}, "")).validate()
    threads = prepare(cfg, WORLD)
    tokens_per_step = args.global_batch * args.seq
    print(f"{setup_line(cfg, WORLD, threads)}, fp32, global batch {args.global_batch}x"
          f"{args.seq}, {args.warmup} warm-up + {args.steps} timed steps, {args.repeat} run(s) per case, "
          f"MALLOC_MMAP_THRESHOLD_={os.environ['MALLOC_MMAP_THRESHOLD_']}", flush=True)
    preds, notes = {}, []
    for name, runner, dp, case in cases.values():
        if runner == "shardlm":
            preds[name] = predictions(load_config(overrides=overrides_for(args, dp, case, "")).validate())
            if "fixed" in preds[name]:
                fixed = preds[name]["fixed"]
                notes.append(f"{name}: predict_local models sequence_parallel={preds[name]['strategy_sp']} "
                             f"(config_strategy does not pass parallel.sequence_parallel); passed "
                             f"through: {fixed[0]:,.0f} tok/s, {fixed[1] / MiB:,.0f} MiB")
    with tempfile.TemporaryDirectory() as tmp:
        runs = rounds(list(cases), args.repeat, lambda name: measure(args, cases[name], tmp, tokens_per_step))
    header = ("case", "tok/s" + (" median (range)" if args.repeat > 1 else ""),
              "CPU s/step (max rank)", "planner tok/s (err)",
              "peak RSS MiB (max rank)", "planner peak MiB (err)", "setup RSS MiB",
              "step-1 loss (|Δ| vs first row)", "final loss", "ledger MiB/step by group",
              "tp formula MiB/step (ledger / formula)")
    results = {name: combine(runs[name]) for name in cases}
    first_ref = next(iter(results.values()))["first"]
    print("\n" + table(header, [row(name, m, preds.get(name), first_ref) for name, m in results.items()]))
    for note in notes:
        print(f"- {note}")
    print(f"\n{reproduce()}")


if __name__ == "__main__":
    main()
