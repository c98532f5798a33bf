"""The in-situ factor: how much slower this CPU runs a model's work inside a training pass than
the sum of its parts timed apart.

The step's compute and memory-bound terms (compute.py, memory_bound.py) each come from a probe
that times one kind of work on its own. Measured on an Intel Xeon with AMX, a whole forward +
loss + backward of gpt-mini ran 1.19-1.65x that sum (two threads to one, 256 tokens to 128):
in a pass the matmuls' operands are no longer in the core's cache and its threads wake from
other work (the same products ran 20-28% faster back to back), the element-wise ops read
activations written long before, and the model's own Python runs between them. `shardlm
calibrate --model ...` times that pass in one process (train/calibration.py, cached per CPU,
torch, threads and pass_key); its seconds over the
planner's for the same pass scale those terms of every layout of that model, micro-batch,
sequence and dtype at that thread count. Communication, the optimizer step and the ZeRO
engine's copies are not scaled: they are timed as they run. Pure functions; no torch.
docs/planner.md section 4b.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import asdict, replace

from shardlm.config.model import ModelConfig
from shardlm.config.dims import ParallelDims
from shardlm.hardware.catalog import Cluster
from shardlm.planner.compute import compute_rate, model_flops_per_token
from shardlm.planner.memory_bound import memory_bound_terms
from shardlm.planner.workload import Strategy, Workload, pipeline_layers, stage_params


def pass_key(m: ModelConfig, micro_batch: int, seq: int, compute: str, recompute: str = "none") -> str:
    """What a measured pass is cached under: the model's architecture (every field but its
    name and where it came from: any preset or config of the same shape shares it), the
    micro-batch, the sequence, the compute dtype and the blocks' checkpointing."""
    fields = {k: v for k, v in sorted(asdict(m).items()) if k not in ("preset", "hf_path")}
    digest = hashlib.sha256(repr(fields).encode()).hexdigest()[:12]
    return (f"L{m.n_layers} h{m.d_model} v{m.vocab_size} {digest} | b{micro_batch} s{seq} {compute}"
            + (f" ac-{recompute}" if recompute != "none" else ""))


def predicted_pass(w: Workload, s: Strategy, cluster: Cluster) -> float:
    """The planner's seconds for what train/calibration.py times: one process, one micro-batch
    of s.micro_batch x the sequence, forward + loss + backward, its blocks recomputed as
    s.recompute says: compute at the measured matmul curve and the memory-bound terms, on
    `cluster`'s device."""
    one = Strategy(ParallelDims(), micro_batch=s.micro_batch, recompute=s.recompute, dtypes=s.dtypes)
    rate, _ = compute_rate(w, one, cluster)
    compute = model_flops_per_token(w, s.recompute, "kernel") * s.micro_batch * w.seq_len / rate
    stage = stage_params(w, one.layout, pipeline_layers(w, one))[0]
    return compute + sum(t.seconds for t in memory_bound_terms(w, one, cluster, stage, 1.0))


def _measured(w: Workload, s: Strategy, cluster: Cluster) -> tuple[float, str, int] | None:
    """(seconds, recompute, sequence) of the pass in_situ_factor reads on `cluster`'s CPU: this
    run's recomputation, else the plain pass; the tokens a rank holds (1/cp of the sequence),
    else the whole sequence; None where none was measured."""
    passes = dict(cluster.device.passes)
    for recompute, seq in itertools.product(dict.fromkeys((s.recompute, "none")),
                                            dict.fromkeys((w.seq_len // s.layout.cp, w.seq_len))):
        measured = passes.get(pass_key(w.model, s.micro_batch, seq, s.dtypes.compute, recompute))
        if measured:
            return measured, recompute, seq
    return None


def _timed_here(cluster: Cluster, s: Strategy) -> bool:
    """A local CPU with a matmul curve for the run's dtype: where a pass can scale the parts."""
    return cluster.device.kind == "cpu" and s.dtypes.compute in cluster.device.curves


def calibrate_command(w: Workload, s: Strategy, cluster: Cluster) -> str:
    """The `shardlm calibrate` command that times the pass this run's prediction would read on
    `cluster`'s CPU, where none was measured yet; '' where one was, or on a catalog device. A
    run's first metrics record carries it (search.run_prediction), its end line names it."""
    if not _timed_here(cluster, s) or _measured(w, s, cluster):
        return ""
    return (f"shardlm calibrate --model {w.model.preset or '...'} --seq {w.seq_len} --micro-batch "
            f"{s.micro_batch} --precision {s.dtypes.compute}"
            + (f" --recompute {s.recompute}" if s.recompute != "none" else "")
            + (f" --ranks {cluster.world_size}" if cluster.world_size > 1 else ""))


def in_situ_factor(w: Workload, s: Strategy, cluster: Cluster) -> tuple[float, str]:
    """(measured pass / predicted pass, what it came from) for this run's model, micro-batch,
    compute dtype, recomputation and the tokens of the sequence a rank holds (1/cp of it: a
    rank's pass is what a one-process pass of that length runs, attention's share apart), on
    `cluster`'s device; else the plain pass, else the whole sequence's (_measured); (1.0, '') on
    a catalog device, (1.0, the calibrate command that would time one) where none was measured.
    Per-op costs weigh more in a shorter pass: gpt-mini's 2 x 64 tokens ran x 1.65 its parts,
    2 x 128 x 1.34."""
    if not _timed_here(cluster, s):
        return 1.0, ""
    found = _measured(w, s, cluster)
    if found is None:
        return 1.0, (f"no pass of this model measured (`{calibrate_command(w, s, cluster)}` times one): its "
                     f"parts as timed apart, which a step runs slower (docs/planner.md section 4b)")
    measured, recompute, seq = found
    one = replace(w, seq_len=seq)
    predicted = predicted_pass(one, replace(s, layout=ParallelDims(), recompute=recompute), cluster)
    factor = step_pass_factor(measured, predicted)
    return factor, (f"in situ x {factor:.2f}: a measured forward + loss + backward of this model "
                    f"({s.micro_batch} x {seq} tokens, one process"
                    + (f", {recompute} recompute" if recompute != "none" else "") + f") took {measured * 1e3:,.1f} ms, "
                    f"its parts timed apart {predicted * 1e3:,.1f} ms (`shardlm calibrate`)"
                    + ("; a step's pass is held at its parts, not under them" if measured < predicted else ""))


def step_pass_factor(measured: float, parts: float) -> float:
    """The in-situ factor a step's pass runs at: the calibrated pass over its parts timed apart,
    never under 1. Each part is its probe's best time alone, which a pass inside a step does
    not beat; a calibrated pass under its parts' sum was timed as the calibration's loop runs
    it, back to back with the previous pass's memory warm and its weight gradients released
    after the timer stops (train/calibration.py), which a step pays inside its time
    (zero_grad). Measured on an AMD EPYC (Zen 4, 32 MiB L3): gpt-mini's pass took 106.5 ms
    against 128.9 ms of parts (x 0.83) and its one-process step less the optimizer 126 ms;
    on the Intel Xeon (AMX) the factor read 0.94-1.70 at two threads, 1.09-2.04 at one.
    docs/planner.md section 4b."""
    return max(1.0, measured / parts)
