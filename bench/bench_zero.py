"""ZeRO stages 0-3 on 2 CPU ranks (gloo): shardlm's engine against torch's own implementations.

    case 0   shardlm zero_stage=0  <->  torch DistributedDataParallel
    case 1   shardlm zero_stage=1  <->  torch ZeroRedundancyOptimizer(AdamW) + DDP
    case 2   shardlm zero_stage=2  <->  torch FSDP2 fully_shard(reshard_after_forward=False)
    case 2f  shardlm zero_stage=3 + reshard_after_forward=false
                                   <->  torch FSDP2 fully_shard(reshard_after_forward=False)
    case 3   shardlm zero_stage=3  <->  torch FSDP2 fully_shard(reshard_after_forward=True)

Case 2f is FSDP2's own ZeRO-2: a unit's parameters are gathered for its forward and kept until
its backward is done, so they are sharded between steps (stage 2 keeps them whole); the
communication is stage 2's (one all-gather and one reduce-scatter per step). Cases 2 and 2f share
one torch run.

Both sides train the same Decoder (shardlm.models.build_model, same seed, so the same initial
weights) on the same batches (shardlm's Loader, rank r's slice of each global batch), in fp32 —
on this CPU fp32 matmul is faster than bf16, so fp32 is the fast setting and not a handicap —
with the same AdamW (lr schedule lr_at, betas, eps, weight decay on matrices only, fused=True on
every side; torch accepts it for plain tensors, DTensors and ZeroRedundancyOptimizer's local
AdamW alike), gradient clipping at 1.0 and loss = cross entropy of logits.float().
The torch side applies fully_shard to every block and then to the root, as torchtitan does.

Every case runs in fresh processes (peak RSS is a per-process high-water mark, so cases cannot
share a process). MALLOC_MMAP_THRESHOLD_=65536 is set before spawning unless the environment
sets it (the ranks inherit it): glibc then serves blocks >= 64 KiB with mmap and returns them to
the OS on free, so RSS follows what is actually alive — without it freed shards and gathers stay
in the heap and RSS hides sharding. Peak RSS includes the interpreter, torch and the tokenizer (a baseline shared by both
sides). Step time is the median of the timed steps after warm-up (slowest rank); tokens/s is
global (micro_batch * seq_len * 2 ranks per step). "state" is the bytes of parameters, gradients
and optimizer states the rank holds (shardlm: run.strategy.model_state_bytes(); torch: local
shards of the same three, counted after optimizer.step while gradients exist; DDP's gradient
buckets and FSDP2's transient unsharded buffers are not counted).
Step-1 losses must agree (same weights, same batches): |Δ first| is against DDP's.

Reproduce:  PYTHONPATH=src python bench/bench_zero.py                       (gpt2-124m, ~15 min)
            PYTHONPATH=src python bench/bench_zero.py --preset gpt-mini --steps 6
            PYTHONPATH=src python bench/bench_zero.py --stages 3 --set model.d_model=512 \
                --set model.n_heads=8                                     (a 64M-parameter GPT-2)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardlm.config import load_config, typed_overrides
from shardlm.data import Loader, build_dataset
from shardlm.launch.runtime import cpu_cores
from shardlm.models import build_model, count_params
from shardlm.zero.optim import lr_at, param_groups, set_lr
from shardlm.launch.spawn import run_ranks
from shardlm.train.telemetry import peak_flops, peak_rss_bytes
from shardlm.train.loop import build_run, train_step

WORLD = 2
# (case, shardlm's overrides, torch reference); the reference names are what torch_rank
# dispatches on (and what the reference's run is cached under: cases 2 and 2f share one).
FSDP2_ZERO2, FSDP2_ZERO3 = "FSDP2 reshard_after_forward=False", "FSDP2 reshard_after_forward=True"
CASES = [("0", {"parallel.zero_stage": 0}, "DDP"),
         ("1", {"parallel.zero_stage": 1}, "ZeRO-1 (ZeroRedundancyOptimizer + DDP)"),
         ("2", {"parallel.zero_stage": 2}, FSDP2_ZERO2),
         ("2f", {"parallel.zero_stage": 3, "parallel.reshard_after_forward": False}, FSDP2_ZERO2),
         ("3", {"parallel.zero_stage": 3}, FSDP2_ZERO3)]
MiB = 2**20


def overrides_for(args, case: dict, run_dir: str) -> dict:
    extra = typed_overrides(dict(kv.split("=", 1) for kv in args.set))
    return {"model.preset": args.preset, "train.micro_batch": args.micro_batch,
            "train.seq_len": args.seq, "train.steps": args.warmup + args.steps,
            "precision.compute": "fp32", "run.device": "cpu",
            "run.dir": run_dir, "run.progress": "off", "train.eval_every": 0,
            "train.sample_tokens": 0, **case, **extra}


def timed_steps(step_fn, warmup: int, steps: int) -> tuple[list[float], list[float]]:
    """(losses of every step, seconds of each timed step)."""
    losses, seconds = [], []
    for step in range(warmup + steps):
        start = time.perf_counter()
        losses.append(step_fn(step))
        if step >= warmup:
            seconds.append(time.perf_counter() - start)
    return losses, seconds


def shardlm_rank(rank: int, world: int, overrides: dict, warmup: int, steps: int) -> dict:
    run = build_run(load_config(overrides=overrides).validate())
    setup_rss = peak_rss_bytes()
    losses, seconds = timed_steps(lambda s: train_step(run, s)[0], warmup, steps)
    return {"losses": losses, "seconds": seconds, "setup_rss": setup_rss, "rss": peak_rss_bytes(),
            "state": sum(run.strategy.model_state_bytes().values())}


def wrap_torch(model, reference: str, cfg):
    """The reference's usual wrapping; returns (module to call, optimizer)."""
    t = cfg.train
    adamw = {"lr": t.lr, "betas": (t.beta1, t.beta2), "eps": t.eps, "fused": True}
    if reference.startswith("FSDP2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (WORLD,))
        reshard = reference.endswith("True")
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        # Groups made after sharding: the DTensor parameters are what the optimizer steps.
        return model, torch.optim.AdamW(param_groups(model, t.weight_decay), **adamw)
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model)
    if reference == "DDP":
        return ddp, torch.optim.AdamW(param_groups(model, t.weight_decay), **adamw)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ddp, ZeroRedundancyOptimizer(param_groups(model, t.weight_decay),
                                        optimizer_class=torch.optim.AdamW, **adamw)


def torch_step(forward, model, optimizer, loader: Loader, cfg, step: int, held: dict) -> float:
    """One step as a torch user writes it; the loss is averaged over ranks for the report, as
    shardlm's train_step does (one scalar all-reduce on both sides). `held` gets the model-state
    bytes while gradients exist (zero_grad frees them; shardlm's stage 0-1 buffer persists)."""
    set_lr(optimizer, lr_at(step, cfg.train))
    (x, y), = loader.micro_batches(step)  # grad_accum = 1
    logits = forward(x)  # (B, T, vocab)
    loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    loss.backward()  # DDP / FSDP average gradients over ranks: shardlm's global-divisor sum
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
    optimizer.step()
    held["state"] = torch_state_bytes(model, optimizer)
    optimizer.zero_grad(set_to_none=True)
    total = loss.detach() / WORLD
    dist.all_reduce(total)
    return float(total)


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
    cfg = load_config(overrides=overrides).validate()
    t = cfg.train
    torch.manual_seed(t.seed)
    dataset = build_dataset(cfg.data, cfg.model.vocab_size)
    loader = Loader(dataset.train, t.seq_len, t.micro_batch, grad_accum=1, seed=t.seed,
                    dp_rank=rank, dp_size=world)
    model = build_model(cfg.model, "cpu", seed=t.seed)
    forward, optimizer = wrap_torch(model, reference, cfg)
    setup_rss, held = peak_rss_bytes(), {}
    losses, seconds = timed_steps(
        lambda s: torch_step(forward, model, optimizer, loader, cfg, s, held), warmup, steps)
    return {"losses": losses, "seconds": seconds, "setup_rss": setup_rss, "rss": peak_rss_bytes(),
            "state": held["state"]}


def summarize(ranks: list[dict], tokens_per_step: int) -> dict:
    """Ranks wait for each other in every collective: the slowest rank's median is the step."""
    step_s = max(statistics.median(r["seconds"]) for r in ranks)
    return {"tok_s": tokens_per_step / step_s, "rss": max(r["rss"] for r in ranks),
            "setup_rss": max(r["setup_rss"] for r in ranks), "state": ranks[0]["state"],
            "first": ranks[0]["losses"][0], "last": ranks[0]["losses"][-1]}


def run_case(fn, tmp: str, *args) -> list[dict]:
    # A fresh rendezvous directory per case: run_ranks names its file by pid and id(fn), which
    # repeat across cases.
    case_dir = tempfile.mkdtemp(dir=tmp)
    return run_ranks(fn, WORLD, Path(case_dir), *args, timeout=1800)


def row_text(case: str, reference: str, ref: dict, ours: dict, ddp_first: float) -> str:
    return (f"| {case} | {reference} | {ref['tok_s']:,.0f} | {ours['tok_s']:,.0f} | "
            f"{ours['tok_s'] / ref['tok_s']:.2f} | {ref['rss'] / MiB:,.0f} | {ours['rss'] / MiB:,.0f} | "
            f"{ours['rss'] / ref['rss']:.2f} | {ref['setup_rss'] / MiB:,.0f} / {ours['setup_rss'] / MiB:,.0f} | "
            f"{ref['state'] / MiB:,.1f} | {ours['state'] / MiB:,.1f} | "
            f"{abs(ref['first'] - ddp_first):.1e} / {abs(ours['first'] - ddp_first):.1e} | "
            f"{ref['last']:.4f} / {ours['last']:.4f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt2-124m")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per case")
    parser.add_argument("--stages", default="0,1,2,2f,3",
                        help="cases to run (0, 1, 2, 2f, 3: see the docstring)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for both sides (repeatable), e.g. model.d_model=512")
    args = parser.parse_args()
    # Inherited by the spawned ranks: large freed blocks go back to the OS (see the docstring).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    cfg = load_config(overrides=overrides_for(args, {}, "")).validate()
    build_dataset(cfg.data, cfg.model.vocab_size)  # tokenizer + token stream built once, here
    # build_run looks up the CPU's matmul peak (for MFU), probing with 3 matrices of 16 MiB on a
    # cache miss. Probed here at the ranks' thread count, so no rank's peak RSS includes it.
    threads = max(1, cpu_cores() // WORLD)
    torch.set_num_threads(threads)
    peak_flops(torch.device("cpu"), "fp32")
    tokens_per_step = args.micro_batch * args.seq * WORLD
    print(f"torch {torch.__version__}, {WORLD} gloo ranks x {threads} "
          f"thread(s), {args.preset} ({count_params(cfg.model) / 1e6:.1f}M params), fp32, "
          f"batch {WORLD}x{args.micro_batch}x{args.seq}, {args.warmup} warm-up + {args.steps} timed steps, "
          f"MALLOC_MMAP_THRESHOLD_={os.environ['MALLOC_MMAP_THRESHOLD_']}")
    header = ("case", "torch reference", "torch tok/s", "shardlm tok/s", "tok/s ratio",
              "torch peak RSS MiB", "shardlm peak RSS MiB", "RSS ratio", "setup RSS MiB t / s",
              "torch state MiB", "shardlm state MiB", "|Δ first loss| t / s", "final loss t / s")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header), flush=True)
    ddp_first, refs = None, {}
    wanted = args.stages.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        for name, case, reference in CASES:
            if name not in wanted:
                continue
            overrides = overrides_for(args, case, tmp)
            if reference not in refs:
                refs[reference] = summarize(run_case(torch_rank, tmp, overrides, reference,
                                                     args.warmup, args.steps), tokens_per_step)
            ref = refs[reference]
            ours = summarize(run_case(shardlm_rank, tmp, overrides, args.warmup, args.steps),
                             tokens_per_step)
            ddp_first = ref["first"] if ddp_first is None else ddp_first
            print(row_text(name, reference, ref, ours, ddp_first), flush=True)
    print(f"\nReproduce: PYTHONPATH=src python bench/bench_zero.py {' '.join(sys.argv[1:])}")


if __name__ == "__main__":
    main()
