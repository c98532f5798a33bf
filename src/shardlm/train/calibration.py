"""`shardlm calibrate`'s model pass: one forward, loss and backward of the whole model, timed in
this process as a training step runs it (the rank's threads, the compute dtype's autocast,
every weight's gradient a new tensor; the command fixes the allocator's mmap threshold).

The planner's CPU step time adds up parts timed apart (the matmul curve, element-wise ops, fresh
pages, per-op dispatch: planner/memory_bound.py); in a step the same work runs slower than
apart (operands no longer in the core's cache, threads woken from other work, the model's own
Python). The measured pass over the planner's parts for that same pass is the machine's
in-situ factor (planner.in_situ.in_situ_factor), applied to those parts of every layout's
step. docs/planner.md section 4b.
"""

from __future__ import annotations

import statistics
import time

import torch

from shardlm.config.model import ModelConfig
from shardlm.config.schema import PrecisionConfig
from shardlm.hardware import probe
from shardlm.models.decoder import build_model
from shardlm.models.precision import build_precision
from shardlm.parallel.blocks.activation import apply_ac
from shardlm.planner.in_situ import pass_key


def time_model_pass(model: ModelConfig, micro_batch: int, seq: int, compute: str, threads: int,
                    repeats: int = 7, recompute: str = "none") -> float:
    """Median seconds of one forward + cross-entropy + backward of `model` on a micro-batch of
    `micro_batch` x `seq` random tokens at `threads` threads, after one warm-up pass, its blocks
    checkpointed as activation.checkpoint = `recompute` checkpoints them (parallel/blocks/activation.py).
    The allocator is the calling process's: `shardlm calibrate` fixes its mmap threshold first,
    as a training process does (launch/allocator.py), so that large blocks map fresh pages."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        net = apply_ac(build_model(model), recompute)
        autocast = build_precision(PrecisionConfig(compute=compute), torch.device("cpu")).autocast
        generator = torch.Generator().manual_seed(0)
        x, y = (torch.randint(model.vocab_size, (micro_batch, seq), generator=generator) for _ in range(2))

        def one() -> float:
            start = time.perf_counter()
            with autocast():
                logits = net(x)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
            loss.backward()
            elapsed = time.perf_counter() - start
            for p in net.parameters():
                p.grad = None  # each step's weight gradients are new tensors (set_to_none)
            return elapsed

        one()
        # The median, not the best: the in-situ factor stands for what a training step's pass
        # takes, whose median a run's end line and bench/bench_planner.py compare against (the
        # best of nine ran 2-4% under their median here, gpt-mini in one process)
        return statistics.median(one() for _ in range(repeats))
    finally:
        torch.set_num_threads(before)


def measured_pass(model: ModelConfig, micro_batch: int, seq: int, compute: str, threads: int,
                  again: bool = False, repeats: int = 7, recompute: str = "none") -> dict:
    """time_model_pass, cached per (CPU, torch, threads, pass_key) with the load around it
    (hardware.probe.cached_pass), which the planner's local_cpu devices read."""
    def measure() -> dict:
        load_before, cores = probe.machine_load()
        seconds = time_model_pass(model, micro_batch, seq, compute, threads, repeats, recompute)
        load = max(load_before, probe.machine_load()[0])
        return {"seconds": seconds, "load_average": load, "cores": cores, "loaded": load > cores,
                "measured_at": time.time()}

    return probe.cached_pass(pass_key(model, micro_batch, seq, compute, recompute), threads, measure, again)
