"""ZeRO stages 0-3 on 2 CPU ranks (gloo): shardlm's engine against torch's own implementations.

    case 0   shardlm zero_stage=0  <->  torch DistributedDataParallel
    case 1   shardlm zero_stage=1  <->  torch ZeroRedundancyOptimizer(AdamW) + DDP
    case 2   shardlm zero_stage=2  <->  torch FSDP2 fully_shard(reshard_after_forward=False)
    case 2f  shardlm zero_stage=3 + reshard_after_forward=false  <->  the same torch run as 2
    case 3   shardlm zero_stage=3  <->  torch FSDP2 fully_shard(reshard_after_forward=True)

Both sides train the same Decoder from the same weights on the same batches in fp32 with the
same fused AdamW and clipping at 1.0. Measured: step time (median, slowest rank), global
tokens/s, peak RSS (fresh processes, MALLOC_MMAP_THRESHOLD_=65536), "state" (parameters,
gradients and optimizer states a rank holds) and |Δ first| (step-1 loss against DDP's).
Method and results: docs/benchmarks.md, "Data parallel".

Reproduce:  PYTHONPATH=src python bench/bench_zero.py                       (gpt2-124m, ~15 min)
            PYTHONPATH=src python bench/bench_zero.py --preset gpt-mini --steps 6
            PYTHONPATH=src python bench/bench_zero.py --stages 3 --set model.d_model=512 \
                --set model.n_heads=8                                     (a 64M-parameter GPT-2)
"""

from __future__ import annotations

import os
import tempfile

import torch

from common import (MiB, add_step_args, bench_parser, peak_rss_bytes, prepare, reproduce, setup_line, shardlm_rank,
                    start_ranks, step_overrides, summarize, table, table_row, timed_steps)
from common.peer import adamw, peer_step, reference_setup
from shardlm.config.load import load_config
from shardlm.parallel.data.zero.optim import param_groups

WORLD = 2
# (case, shardlm's overrides, torch reference); the reference names are what torch_rank
# dispatches on (and what the reference's run is cached under: cases 2 and 2f share one).
FSDP2_ZERO2, FSDP2_ZERO3 = "FSDP2 reshard_after_forward=False", "FSDP2 reshard_after_forward=True"
CASES = [("0", {"parallel.zero_stage": 0}, "DDP"),
         ("1", {"parallel.zero_stage": 1}, "ZeRO-1 (ZeroRedundancyOptimizer + DDP)"),
         ("2", {"parallel.zero_stage": 2}, FSDP2_ZERO2),
         ("2f", {"parallel.zero_stage": 3, "parallel.reshard_after_forward": False}, FSDP2_ZERO2),
         ("3", {"parallel.zero_stage": 3}, FSDP2_ZERO3)]


def overrides_for(args, case: dict, run_dir: str) -> dict:
    return step_overrides(args, run_dir, {"train.micro_batch": args.micro_batch, **case})


def wrap_torch(model, reference: str, cfg):
    """The reference's usual wrapping; returns (module to call, optimizer)."""
    t = cfg.train
    if reference.startswith("FSDP2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (WORLD,))
        reshard = reference.endswith("True")
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        # Groups made after sharding: the DTensor parameters are what the optimizer steps.
        return model, adamw(param_groups(model, t.weight_decay), t)
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model)
    if reference == "DDP":
        return ddp, adamw(param_groups(model, t.weight_decay), t)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ddp, ZeroRedundancyOptimizer(param_groups(model, t.weight_decay), optimizer_class=torch.optim.AdamW,
                                        lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, fused=True)


def local_bytes(tensors) -> int:
    tensors = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in tensors)


def torch_state_bytes(model, optimizer) -> int:
    """Local parameters + gradients + optimizer states (ZeroRedundancyOptimizer: its shard)."""
    inner = getattr(optimizer, "optim", optimizer)
    params = list(model.parameters())
    states = [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    return (local_bytes(params) + local_bytes(p.grad for p in params if p.grad is not None)
            + local_bytes(states))


def torch_rank(rank: int, world: int, overrides: dict, reference: str, warmup: int,
               steps: int) -> dict:
    """One step as a torch user writes it (DDP / FSDP average gradients over ranks: shardlm's
    global-divisor sum); the model-state bytes are read while gradients exist (zero_grad frees
    them; shardlm's stage 0-1 buffer persists)."""
    cfg, loader, model = reference_setup(overrides, rank, world)
    forward, optimizer = wrap_torch(model, reference, cfg)
    setup_rss, held = peak_rss_bytes(), {}

    def step(s: int) -> float:
        return peer_step(forward, optimizer, loader, cfg.train, s, WORLD,
                         lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip),
                         lambda: held.update(state=torch_state_bytes(model, optimizer)))

    return {**timed_steps(step, warmup, steps), "setup_rss": setup_rss, "rss": peak_rss_bytes(), "state": held["state"]}


def measure(fn, tmp: str, tokens_per_step: int, *args) -> dict:
    """One side of a case in fresh processes; rank 0's model-state bytes beside the summary."""
    ranks = start_ranks(fn, WORLD, tmp, *args, timeout=1800)
    return {**summarize(ranks, tokens_per_step), "state": ranks[0]["state"]}


def row(case: str, reference: str, ref: dict, ours: dict, ddp_first: float) -> list[str]:
    return [case, reference, f"{ref['tok_s']:,.0f}", f"{ours['tok_s']:,.0f}", f"{ours['tok_s'] / ref['tok_s']:.2f}",
            f"{ref['rss'] / MiB:,.0f}", f"{ours['rss'] / MiB:,.0f}", f"{ours['rss'] / ref['rss']:.2f}",
            f"{ref['setup_rss'] / MiB:,.0f} / {ours['setup_rss'] / MiB:,.0f}",
            f"{ref['state'] / MiB:,.1f}", f"{ours['state'] / MiB:,.1f}",
            f"{abs(ref['first'] - ddp_first):.1e} / {abs(ours['first'] - ddp_first):.1e}",
            f"{ref['last']:.4f} / {ours['last']:.4f}"]


def main() -> None:
    parser = bench_parser(__doc__, "gpt2-124m", 128, 2)
    parser.add_argument("--stages", default="0,1,2,2f,3",
                        help="cases to run (0, 1, 2, 2f, 3: see the docstring)")
    add_step_args(parser, steps=5, warmup=2)
    args = parser.parse_args()
    cfg = load_config(overrides=overrides_for(args, {}, "")).validate()
    threads = prepare(cfg, WORLD)
    tokens_per_step = args.micro_batch * args.seq * WORLD
    print(f"{setup_line(cfg, WORLD, threads)}, fp32, batch {WORLD}x{args.micro_batch}x{args.seq}, "
          f"{args.warmup} warm-up + {args.steps} timed steps, "
          f"MALLOC_MMAP_THRESHOLD_={os.environ['MALLOC_MMAP_THRESHOLD_']}")
    header = ("case", "torch reference", "torch tok/s", "shardlm tok/s", "tok/s ratio",
              "torch peak RSS MiB", "shardlm peak RSS MiB", "RSS ratio", "setup RSS MiB t / s",
              "torch state MiB", "shardlm state MiB", "|Δ first loss| t / s", "final loss t / s")
    print(table(header, []), flush=True)  # rows follow as the cases finish (each takes minutes)
    ddp_first, refs = None, {}
    wanted = args.stages.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        for name, case, reference in CASES:
            if name not in wanted:
                continue
            overrides = overrides_for(args, case, tmp)
            if reference not in refs:
                refs[reference] = measure(torch_rank, tmp, tokens_per_step, overrides, reference,
                                          args.warmup, args.steps)
            ref = refs[reference]
            ours = measure(shardlm_rank, tmp, tokens_per_step, overrides, args.warmup, args.steps)
            ddp_first = ref["first"] if ddp_first is None else ddp_first
            print(table_row(row(name, reference, ref, ours, ddp_first)), flush=True)
    print(f"\n{reproduce()}")


if __name__ == "__main__":
    main()
