"""The planner: published numbers reproduced, formulas checked against what autograd really
keeps, the cluster syntax and its errors, and the commands (fast, JSON, no torch import)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from decimal import ROUND_HALF_UP, Decimal

import pytest

from shardlm.cli import main
from shardlm.config import ParallelConfig, load_config
from shardlm.errors import ConfigError
from shardlm.hardware.catalog import (CALIBRATION, DEVICES, LINKS, Cluster, Device, Node,
                                      device_for_gpu_name, parse_cluster)
from shardlm.planner.memory import ActivationDtypes, block_activation, estimate_memory
from shardlm.planner.search import (EVERYTHING, RUNTIME, describe_strategy, model_from_params,
                                    plan_for_run, predict_local, preset_model, search)
from shardlm.planner.timing import estimate_time, group_link
from shardlm.dims import ParallelDims
from shardlm.planner.workload import Dtypes, Strategy, Workload, shape_of, stage_params
from shardlm.zero.partition import comm_bytes_per_step

MIXED = Dtypes("fp16", "auto", "fp32")  # the ZeRO paper's mixed-precision Adam


def states(memory) -> float:
    return sum(memory.category(c) for c in ("parameters", "gradients", "optimizer states"))


def paper_round(x: float) -> float:
    """One decimal, halves up, as the ZeRO paper's figure prints them (1.875 -> 1.9)."""
    return float(Decimal(repr(x)).quantize(Decimal("0.1"), rounding=ROUND_HALF_UP))


# ---------------------------------------------------------------------------------------------
# Published numbers


def test_zero_paper_figure_1_exactly():
    # Rajbhandari et al. 2020, figure 1: Ψ = 7.5B, N_d = 64, K = 12 -> 120, 31.4, 16.6, 1.9 GB
    # per device for baseline, P_os, P_os+g, P_os+g+p. GB = 1e9 bytes. Through the planner:
    # `--params 7.5e9` keeps Ψ exact whatever shape is synthesised around it.
    cluster = parse_cluster("64xV100-32GB")
    w = Workload(model_from_params(7.5e9), seq_len=1024, global_batch=64, params=7.5e9)
    assert MIXED.optimizer_bytes == 12
    got = [paper_round(states(estimate_memory(w, Strategy(ParallelDims(1, 64), stage, dtypes=MIXED),
                                              cluster)) / 1e9) for stage in range(4)]
    assert got == [120.0, 31.4, 16.6, 1.9]


def test_optimizer_bytes_follow_the_precision_policy():
    assert Dtypes("bf16", "auto", "fp32").optimizer_bytes == 12  # fp32 master + m + v
    assert Dtypes("fp32", "auto", "fp32").optimizer_bytes == 8  # the master is the parameter
    assert Dtypes("bf16", "auto", "bf16").optimizer_bytes == 4  # FSDP "pure bf16"
    assert Dtypes("bf16", "fp32", "fp32").grad_bytes == 4


@pytest.mark.parametrize("name", ["gpt2-124m", "gpt2-350m", "gpt2-774m", "gpt2-1.5b", "llama-1b",
                                  "llama-7b", "llama-13b"])
def test_planner_parameter_counts_equal_published(name):
    from shardlm.presets import PUBLISHED_PARAMS

    w = Workload(preset_model(name), 1024, 8)
    assert shape_of(w).total == PUBLISHED_PARAMS[name]
    whole, = stage_params(w, ParallelDims(1, 8))
    assert whole.dense == pytest.approx(PUBLISHED_PARAMS[name], rel=1e-12)
    # Two pipeline stages hold every parameter once, plus the tied head's copy of the embedding.
    first, last = stage_params(w, ParallelDims(1, 4, pp=2))
    tied = w.model.vocab_size * w.model.d_model if w.model.tie_embeddings else 0
    assert first.dense + last.dense == pytest.approx(PUBLISHED_PARAMS[name] + tied, rel=1e-12)


def test_params_synthesises_a_shape_near_the_count():
    model = model_from_params(7.5e9)
    w = Workload(model, 1024, 8)
    assert shape_of(w).total == pytest.approx(7.5e9, rel=0.03)
    assert model.d_model % model.n_heads == 0 and model.d_model % 64 == 0
    assert model_from_params(1.3e9, layers=24).n_layers == 24
    with pytest.raises(ConfigError, match="not divisible"):
        model_from_params(1e9, hidden=1000, heads=3)


# ---------------------------------------------------------------------------------------------
# Activations: Korthikanti et al. 2022, and what autograd keeps in our decoder


def korthikanti_layer(s, b, h, a, t=1, sp=False, mode="none") -> float:
    """Table 2 of the paper, bytes per layer (16-bit activations, 1-byte dropout masks)."""
    if mode == "full":
        return s * b * h * 2
    if mode == "selective":
        return s * b * h * (34 / t if sp else 10 + 24 / t)
    return s * b * h * ((34 + 5 * a * s / h) / t if sp else 10 + 24 / t + 5 * a * s / (h * t))


def test_korthikanti_table_2_and_the_gpt3_example():
    # GPT-3 175B: a = 96, s = 2048, h = 12288: 5as/h = 80, so selective recomputation removes
    # 80 / 114 = 70% of a layer's activations (section 4.2), and sequence parallelism divides
    # the rest by t.
    s, h, a = 2048, 12288, 96
    assert 5 * a * s / h == 80
    assert 1 - korthikanti_layer(s, 1, h, a, mode="selective") / korthikanti_layer(s, 1, h, a) == \
        pytest.approx(0.70, abs=0.005)
    assert korthikanti_layer(s, 1, h, a, 8, sp=True, mode="selective") == s * h * 34 / 8


def test_our_block_is_korthikanti_without_dropout_with_flash_attention():
    # A 16-bit GPT-2 block: Korthikanti's 34sbh + 5as²b, minus two 1-byte dropout masks (2sbh)
    # and the s x s terms (flash attention keeps none), plus the fp32 logsumexp (4as b) and the
    # two LayerNorms' mean/rstd (in the 16-bit input dtype on CPU: 2 x 2 x 2 sb).
    m = preset_model("gpt2-1.5b")
    s, b, h, a = 1024, 4, m.d_model, m.n_heads
    for t, sp in ((1, False), (4, False), (4, True)):
        ours, _ = block_activation(m, ActivationDtypes(2, 2, False), "none", t, sp)
        split = t if sp else 1  # what sequence parallelism divides: the paper's replicated 10sbh
        expected = (korthikanti_layer(s, b, h, a, t, sp) - 2 * s * b * h / split
                    - 5 * a * s * s * b / t + 4 * a * s * b / t + 8 * s * b / split)
        assert ours * s * b == pytest.approx(expected, rel=1e-12)


def _measure(preset: str, param_dtype: str, mode: str, b: int = 2, s: int = 32):
    """Bytes alive after forward (saved for backward, plus logits) and the peak during backward
    of everything but parameters and their gradients, tracked op by op."""
    import torch
    import torch.nn.functional as F
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from shardlm.models import build_model
    from shardlm.parallel.activation import apply_ac

    class Live(TorchDispatchMode):
        def __init__(self, exclude):
            super().__init__()
            self.exclude, self.live, self.peak = exclude, {}, 0

        def current(self):
            self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
            return sum(n for _, n in self.live.values())

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    st, key = t.untyped_storage(), t.untyped_storage().data_ptr()
                    known = self.live.get(key)  # a freed storage's address may be reused
                    if key not in self.exclude and (known is None or known[0].expired()):
                        self.live[key] = (StorageWeakRef(st), st.nbytes())
            self.peak = max(self.peak, self.current())
            return out

    cfg = preset_model(preset)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[param_dtype]
    model = apply_ac(build_model(cfg).to(dtype), mode)
    idx = torch.randint(0, cfg.vocab_size, (b, s))
    with torch.no_grad():
        x0 = model.tok_emb(idx) + (model.pos_emb(torch.arange(s)) if cfg.position == "learned" else 0)
    x0 = x0.clone().requires_grad_()
    rope = (model.rope_cos[:s], model.rope_sin[:s]) if cfg.position == "rope" else None
    exclude = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers(), x0]}
    tracker = Live(exclude)
    with tracker, torch.autocast("cpu", torch.bfloat16, enabled=param_dtype == "bf16"):
        x = x0
        for block in model.blocks:
            x = block(x, rope)
        logits = model.head(model.norm_f(x))
        del x
        after_forward = tracker.current()
        loss = F.cross_entropy(logits.float().flatten(0, 1), idx.flatten())
        del logits
        torch.autograd.grad(loss, [x0])
    return cfg, after_forward, tracker.peak


@pytest.mark.parametrize("preset", ["gpt-tiny", "llama-tiny"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_activation_formula_matches_what_autograd_keeps(preset, dtype, mode):
    from shardlm.planner.memory import activation_peak

    b, s = 2, 32
    cfg, after_forward, peak = _measure(preset, dtype, mode, b, s)
    e = 4 if dtype == "fp32" else 2
    dt = ActivationDtypes(e, e, norms_in_fp32=False)  # CPU autocast keeps LayerNorm's dtype
    per_layer, _ = block_activation(cfg, dt, mode)
    norm = (8 * cfg.d_model + 4) if cfg.norm == "rmsnorm" else e * cfg.d_model + 2 * e
    saved = cfg.n_layers * per_layer + norm + e * cfg.d_model + e * cfg.vocab_size
    # The first block's input x0 is made outside the tracker: it is missing from the count
    # wherever the formula has the input itself (not an fp32 copy made by RMSNorm's autocast).
    fresh_copy = cfg.norm == "rmsnorm" and mode == "none" and e != 4
    x0 = 0 if fresh_copy else e * cfg.d_model
    assert after_forward + x0 * b * s == pytest.approx(saved * b * s, abs=64)
    predicted = activation_peak(cfg, s, b, cfg.n_layers, 1, dt, mode, 1, False, True, (0, 1, 1.0))
    measured_peak = peak + x0 * b * s
    assert measured_peak <= predicted.bytes <= 1.15 * measured_peak


# ---------------------------------------------------------------------------------------------
# Time: pipeline bubble, communication volumes, links


def test_pipeline_bubble_and_compute_time():
    cluster = parse_cluster("8xA100-80GB")
    w = Workload(preset_model("llama-7b"), 2048, 64)
    t1 = estimate_time(w, Strategy(ParallelDims(1, 1, pp=8), 0, 1, 64), cluster)
    assert t1.bubble == pytest.approx(7 / (64 + 7))  # (p - 1) / (m + p - 1)
    t2 = estimate_time(w, Strategy(ParallelDims(1, 1, pp=8), 0, 2, 32), cluster)
    assert t2.bubble == pytest.approx(7 / (32 + 7))
    # Same work per micro-batch pair: compute scales with (m + p - 1) micro-batch slots.
    assert t1.compute / t2.compute == pytest.approx((64 + 7) / (2 * (32 + 7)), rel=1e-9)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("replicas", [1, 2])
def test_collective_volumes_are_the_zero_formula(stage, replicas):
    cluster = parse_cluster("2x8xA100-80GB")
    w = Workload(preset_model("gpt2-1.5b"), 1024, 64)
    if stage == 0 and replicas > 1:
        return
    s = Strategy(ParallelDims(replicas, 16 // replicas), stage, 2, 2, dtypes=Dtypes("bf16"))
    t = estimate_time(w, s, cluster)
    expected = comm_bytes_per_step(int(shape_of(w).total), stage, 2, 2, True, 2, 16 // replicas, replicas)
    assert sum(c.bytes for c in t.comms) == pytest.approx(expected, rel=1e-9)


def test_groups_inside_a_node_use_nvlink_and_across_nodes_their_adapter_share():
    cluster = parse_cluster("2x8xA100-80GB")
    nvlink, ib = LINKS["nvlink3"], LINKS["ib-hdr"]
    assert group_link(cluster, 8, 1)[0] == nvlink.effective
    assert group_link(cluster, 16, 1)[0] == 8 * ib.effective  # all 8 rails carry the ring
    assert group_link(cluster, 2, 8)[0] == ib.effective  # one member per node: one rail
    v100 = parse_cluster("2x8xV100-32GB")  # DGX-1: 4 EDR adapters for 8 GPUs
    assert group_link(v100, 2, 8)[0] == pytest.approx(LINKS["ib-edr"].effective / 2)


# ---------------------------------------------------------------------------------------------
# Context parallelism: activations 1/cp, model states over dp_shard x cp, the ring's bytes

LONG = Workload(preset_model("llama-1b"), 32768, 8)
"""A sequence whose activations dominate: llama-1b (V = 128k) at 32k tokens."""
A100 = parse_cluster("8xA100-80GB")


def _cp_strategy(lay: ParallelDims, stage: int = 3, recompute: str = "none", micro: int = 1,
                 w: Workload = LONG) -> Strategy:
    return Strategy(lay, stage, micro, w.global_batch // (micro * lay.dp_size), recompute,
                    dtypes=Dtypes("bf16"))


def _part(memory, name: str) -> float:
    return next(p.bytes for p in memory.items[3].parts if p.name == name)


def test_context_parallel_halves_the_activations_of_a_long_sequence():
    one = estimate_memory(LONG, _cp_strategy(ParallelDims(1, 8)), A100)
    two = estimate_memory(LONG, _cp_strategy(ParallelDims(1, 4, cp=2)), A100)
    # every rank runs every layer, the loss included, on its half of the tokens
    assert _part(two, "saved by blocks") == pytest.approx(_part(one, "saved by blocks") / 2, rel=1e-12)
    assert _part(two, "backward peak") == pytest.approx(_part(one, "backward peak") / 2, rel=1e-12)
    # ... plus the ring's key/value blocks and fp32 gradients in flight: small
    ring = _part(two, "cp ring buffers")
    assert 0 < ring < 0.02 * two.activations
    assert two.activations == pytest.approx(one.activations / 2, rel=0.02)
    assert "cp ring buffers" not in [p.name for p in one.items[3].parts]
    # tp x cp: both divide
    four = estimate_memory(LONG, _cp_strategy(ParallelDims(1, 2, cp=2, tp=2)), A100)
    assert _part(four, "saved by blocks") < _part(two, "saved by blocks") / 1.9


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_shards_model_states_over_dp_shard_times_cp(stage):
    w = replace(LONG, seq_len=4096)
    four = estimate_memory(w, _cp_strategy(ParallelDims(1, 4, cp=1, tp=2), stage, w=w), A100)
    two_by_two = estimate_memory(w, _cp_strategy(ParallelDims(1, 2, cp=2, tp=2), stage, w=w), A100)
    for category in ("parameters", "gradients", "optimizer states"):
        assert two_by_two.category(category) == pytest.approx(four.category(category), rel=1e-12)
    # and the engine's collectives run over those 4 ranks, moving the same bytes
    comms = lambda lay: {c.name: c for c in  # noqa: E731
                         estimate_time(w, _cp_strategy(lay, stage, w=w), A100).comms}
    t4, t22 = comms(ParallelDims(1, 4, tp=2)), comms(ParallelDims(1, 2, cp=2, tp=2))
    assert t22["reduce-scatter gradients"].group.startswith("4 ranks")
    assert t22["reduce-scatter gradients"].bytes == pytest.approx(t4["reduce-scatter gradients"].bytes)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_context_parallel_ring_is_cp_comm_bytes_and_compute_is_split(recompute):
    from shardlm.planner.timing import cp_comm_bytes, tp_comm_bytes

    m, seq = LONG.model, LONG.seq_len
    s = _cp_strategy(ParallelDims(1, 2, cp=2, tp=2), 3, recompute)  # micro 1 x accum 4
    t = estimate_time(LONG, s, A100)
    comms = {c.name: c for c in t.comms}
    ring = comms["context-parallel ring"]
    assert ring.bytes == s.grad_accum * cp_comm_bytes(m, seq, 2, 2, 2, recompute, m.n_layers)
    assert ring.group.startswith("2 ranks, intra-node")
    assert 0 < ring.exposed <= ring.seconds
    # tensor-parallel collectives move this rank's half of the tokens
    tp_bytes = s.grad_accum * tp_comm_bytes(m, seq // 2, 2, True, 2, recompute, m.n_layers)
    assert comms["tensor-parallel all-reduces"].bytes == pytest.approx(tp_bytes)
    # the same global batch on 8 data-parallel ranks: the same compute per step, split differently
    dp = estimate_time(LONG, _cp_strategy(ParallelDims(1, 8), 3, recompute), A100)
    tp_only = estimate_time(LONG, _cp_strategy(ParallelDims(1, 4, tp=2), 3, recompute), A100)
    assert t.compute == pytest.approx(dp.compute, rel=1e-9) == pytest.approx(tp_only.compute, rel=1e-9)
    assert "context-parallel ring" not in [c.name for c in dp.comms]


def test_context_parallel_validation_names_every_factor():
    w = replace(LONG, seq_len=1000)
    with pytest.raises(ConfigError) as info:
        estimate_memory(w, _cp_strategy(ParallelDims(1, 2, cp=3), w=replace(w, global_batch=2)), A100)
    text = str(info.value)
    assert "dp_replicate (1) x dp_shard (2) x cp (3) x tp (1) x pp (1) = 6, but" in text
    assert "seq 1000 must divide by 6" in text


# ---------------------------------------------------------------------------------------------
# Pipeline parallelism: the runtime's bytes, the schedules' memory, what train runs

TINY = replace(preset_model("gpt-tiny"), n_layers=4)
"""tests/test_pipeline.py's model (vocab 512, d_model 64, a tied head), 4 blocks."""


def test_pp_comm_bytes_are_the_ledgers():
    """Per step: M activations forward from every chunk but the model's last, M gradients back
    from every chunk but its first, b·s/cp(/t with SP)·h·e each; the tied embedding's gradient
    all-reduced by the two ends (2x its tensor). The ledger's numbers on 2-4 gloo ranks
    (micro-batch 2 x seq 64, M = 4, fp32), as tests/test_pipeline.py's ledger test and a
    manual run of each layout measured them."""
    from shardlm.planner.timing import pp_comm_bytes

    act, tied = 2 * 64 * 64 * 4, 2 * 512 * 64 * 4
    llama = replace(preset_model("llama-tiny"), n_layers=4)  # untied
    assert pp_comm_bytes(TINY, 128, 4, 0, 2, 1, 1, False, 4, True) == 4 * act + tied
    assert pp_comm_bytes(TINY, 128, 4, 1, 2, 1, 1, False, 4, True) == 4 * act + tied
    # pp 4: the middle stages send both ways, no tied copy
    assert [pp_comm_bytes(TINY, 128, 4, r, 4, 1, 1, False, 4, True) for r in range(4)] == \
        [4 * act + tied, 8 * act, 8 * act, 4 * act + tied]
    # pp 2 x tp 2 with sequence parallelism: hidden states of half the tokens, half the vocabulary
    assert pp_comm_bytes(TINY, 128, 4, 0, 2, 2, 1, True, 4, True) == 4 * act // 2 + tied // 2
    assert pp_comm_bytes(TINY, 128, 4, 0, 2, 2, 1, False, 4, True) == 4 * act + tied // 2
    # interleaved, 2 chunks per rank: 3 of the 4 chunks send forward, 3 back
    assert pp_comm_bytes(TINY, 128, 4, 0, 2, 1, 1, False, 4, True, virtual=2) == 12 * act + tied
    # pp 2 x cp 2, llama (untied): this rank's half of the sequence
    assert pp_comm_bytes(llama, 128, 4, 1, 2, 1, 2, False, 4, False) == 4 * act // 2
    assert pp_comm_bytes(TINY, 128, 4, 0, 1, 1, 1, False, 4, True) == 0


def test_pipeline_timing_counts_the_ledgers_bytes_and_exposes_the_reduction():
    """The step's p2p volume is pp_comm_bytes of the stage shown; the data-parallel reduction
    after the pipeline's last backward (finish_backward) has no backward to hide in."""
    from shardlm.planner.timing import pp_comm_bytes

    w = Workload(preset_model("gpt2-350m"), 1024, 32)
    s = Strategy(ParallelDims(1, 4, pp=2), 2, 1, 8, dtypes=Dtypes("bf16"))
    t = estimate_time(w, s, A100)
    comms = {c.name: c for c in t.comms}
    index = 0 if t.stage == "first stage" else 1
    assert comms["pipeline send/recv"].bytes == pp_comm_bytes(w.model, 1024, 8, index, 2, 1, 1, True, 2, False)
    assert comms["tied embedding all-reduce"].bytes == 2 * w.model.vocab_size * w.model.d_model * 2
    reduce = comms["reduce-scatter gradients"]
    assert reduce.exposed == pytest.approx(reduce.seconds)
    flat = estimate_time(w, Strategy(ParallelDims(1, 8), 2, 1, 4, dtypes=Dtypes("bf16")), A100)
    flat_reduce = next(c for c in flat.comms if c.name == "reduce-scatter gradients")
    assert flat_reduce.exposed < flat_reduce.seconds  # without a pipeline, it hides in backward


@pytest.mark.parametrize("model", ["gpt2-350m", "llama-1b"])
def test_gpipe_holds_every_micro_batch_and_1f1b_peaks_on_the_first_stage(model):
    from shardlm.planner.memory import stage_memories
    from shardlm.planner.workload import pp_in_flight

    w = Workload(preset_model(model), 1024, 32)
    one_f = Strategy(ParallelDims(1, 2, pp=4), 1, 1, 16, dtypes=Dtypes("bf16"))  # M = 16 > P = 4
    gpipe = replace(one_f, pp_schedule="gpipe")
    assert [pp_in_flight(one_f, r) for r in range(4)] == [4, 3, 2, 1]
    assert [pp_in_flight(gpipe, r) for r in range(4)] == [16] * 4
    assert pp_in_flight(replace(one_f, grad_accum=2), 0) == 2  # never more than M
    ones, gpipes = stage_memories(w, one_f, A100), stage_memories(w, gpipe, A100)
    for a, b in zip(ones, gpipes):
        assert b.activations > a.activations and b.peak > a.peak
    # 1F1B: of the stages with the same blocks, the earliest holds the most; the first is the peak
    stages = stage_params(w, one_f.layout)
    same = [m.activations for m, sp in zip(ones, stages) if sp.layers == stages[0].layers]
    assert len(same) > 1 and same == sorted(same, reverse=True)
    assert estimate_memory(w, one_f, A100).stage == "first stage" == max(ones, key=lambda m: m.peak).stage
    # GPipe's last stage also keeps what the loss saved for every micro-batch
    assert any(p.name == "saved for the loss" for p in gpipes[-1].items[3].parts)
    assert not any(p.name == "saved for the loss" for p in ones[-1].items[3].parts)


def test_interleaved_and_zero_bubble_follow_the_runtimes_orders():
    """The planner's interleaved activation peak replays OneFOneB.order with V chunks; its
    zero-bubble idle share is the runtime's list schedule's (3M + 2(P-1) units long)."""
    from types import SimpleNamespace

    from shardlm.parallel.pipeline import OneFOneB, _list_schedule
    from shardlm.planner.workload import interleaved_peak, pp_bubble

    for p, v, m in [(2, 2, 4), (4, 2, 8), (4, 3, 4), (3, 2, 6)]:
        split = [(i * 7) % 3 + 1 for i in range(p * v)]
        for r in range(p):
            order = OneFOneB(SimpleNamespace(index=r, count=p, chunks=[range(0)] * v)).order(m)
            held = peak = 0
            for kind, chunk, _ in order:
                held += split[chunk * p + r] if kind == "F" else -split[chunk * p + r]
                peak = max(peak, held)
            assert interleaved_peak(split, p, v, r, m) == peak
    for p, m in [(2, 4), (2, 8), (4, 4), (4, 16), (8, 8)]:
        s = Strategy(ParallelDims(1, 1, pp=p), 1, 1, m, pp_schedule="zb")
        assert pp_bubble(s) == pytest.approx(1 - 3 * m / _list_schedule(p, m)[1])
        assert pp_bubble(replace(s, pp_schedule="1f1b")) == pytest.approx((p - 1) / (m + p - 1))


def test_runtime_plans_run_pipelines_without_zero3():
    w = Workload(preset_model("llama-7b"), 4096, 64)
    cluster = parse_cluster("4xA100-40GB")
    runtime = search(w, cluster, Dtypes("bf16"), RUNTIME)
    piped = [p for p in runtime.plans if p.strategy.layout.pp > 1]
    assert piped and all(p.strategy.zero_stage < 3 and p.runtime_supported for p in piped)
    everything = search(w, cluster, Dtypes("bf16"), EVERYTHING)
    blocked = [p for p in everything.plans if p.strategy.layout.pp > 1 and p.strategy.zero_stage == 3]
    assert blocked and not any(p.runtime_supported for p in blocked)
    assert "ZeRO-3 with pp > 1" in blocked[0].not_runnable
    best = piped[0]
    o = best.overrides()
    assert o["parallel.pp"] == best.strategy.layout.pp and o["parallel.pp_schedule"] == "1f1b"
    assert f"pp {best.strategy.layout.pp} 1f1b" in describe_strategy(best.strategy)
    cfg = best.apply(load_config(overrides={"model.preset": "llama-7b", "train.seq_len": "4096"}))
    assert cfg.parallel.pp == best.strategy.layout.pp and cfg.parallel.zero_stage < 3
    flat = next(p for p in runtime.plans if p.strategy.layout.pp == 1)
    assert flat.apply(cfg).parallel.pp == 1  # the layout is whole


def test_config_strategy_and_auto_keep_the_runs_pipeline():
    from shardlm.planner.search import config_strategy

    cfg = load_config(overrides={"model.preset": "gpt-mini", "parallel.pp": "2", "parallel.pp_schedule": "gpipe",
                                 "parallel.pp_layers": "1,3", "train.grad_accum": "4",
                                 "precision.compute": "fp32"}).validate()
    w, s = config_strategy(cfg, parse_cluster("4xA100-80GB"))
    assert (s.layout.pp, s.layout.dp_shard, s.pp_schedule, s.pp_layers) == (2, 2, "gpipe", "1,3")
    assert [sp.layers for sp in stage_params(w, s.layout, [1, 3])] == [1, 3]
    assert w.global_batch == cfg.train.micro_batch * 4 * 2
    plans = plan_for_run(cfg.model, 4, "4xA100-80GB", (cfg.train.micro_batch, 4, cfg.train.seq_len),
                         parallel=cfg.parallel)
    assert plans and all(p.strategy.layout.pp == 2 and p.strategy.zero_stage < 3 for p in plans)
    assert all((p.strategy.pp_schedule, p.strategy.pp_layers) == ("gpipe", "1,3") for p in plans)
    resolved = plans[0].apply(cfg)
    assert (resolved.parallel.pp, resolved.parallel.pp_schedule, resolved.parallel.pp_layers) == (2, "gpipe", "1,3")


def test_search_tries_context_parallelism_only_where_activations_matter():
    from dataclasses import replace as with_
    from shardlm.planner.search import AUTO, _layouts

    long = list(_layouts(LONG, A100, EVERYTHING, Dtypes("bf16")))
    assert {lay.cp for lay in long} == {1, 2, 4, 8}
    assert all(lay.cp * lay.tp <= 8 for lay in long)  # the ring stays inside a node
    assert {lay.cp for lay in _layouts(LONG, A100, with_(EVERYTHING, cp=False), Dtypes("bf16"))} == {1}
    assert {lay.cp for lay in _layouts(LONG, A100, AUTO, Dtypes("bf16"))} == {1}
    short = Workload(preset_model("gpt2-350m"), 1024, 64)  # activations a small share: no cp
    assert {lay.cp for lay in _layouts(short, A100, EVERYTHING, Dtypes("bf16"))} == {1}
    result = search(LONG, A100, Dtypes("bf16"), RUNTIME)
    best = result.plans[0]
    assert best.strategy.layout.cp > 1 and best.runtime_supported
    overrides = best.overrides()
    assert overrides["parallel.cp"] == best.strategy.layout.cp
    assert "cp " in describe_strategy(best.strategy)
    cfg = best.apply(load_config(overrides={"model.preset": "llama-1b", "train.seq_len": "32768"}))
    assert cfg.parallel.cp == best.strategy.layout.cp and cfg.parallel.tp == best.strategy.layout.tp
    no_cp = next(p for p in result.plans if p.strategy.layout.cp == 1)
    assert "cp" not in no_cp.overrides() and no_cp.apply(cfg).parallel.cp == 1  # the layout is whole


def test_auto_keeps_the_runs_own_tp_and_cp():
    model = preset_model("gpt2-350m")
    plans = plan_for_run(model, 8, "8xA100-80GB", (2, 1, 1024), parallel=ParallelConfig(cp=2))
    assert plans and all(p.strategy.layout.cp == 2 and p.strategy.layout.tp == 1 for p in plans)
    for p in plans:  # the configured global batch: 2 x 1 x (8 / cp) sequences
        assert p.strategy.micro_batch * p.strategy.grad_accum * p.strategy.layout.dp_size == 2 * 4
    both = plan_for_run(model, 8, "8xA100-80GB", (2, 1, 1024), parallel=ParallelConfig(tp=2, cp=2))
    assert both and all((p.strategy.layout.tp, p.strategy.layout.cp) == (2, 2) for p in both)
    with pytest.raises(ConfigError, match="does not divide the 8 ranks"):
        plan_for_run(model, 8, "8xA100-80GB", (2, 1, 1024), parallel=ParallelConfig(cp=3))


# ---------------------------------------------------------------------------------------------
# The cluster syntax


def test_cluster_syntax():
    c = parse_cluster("8xV100-16GB")
    assert (c.nodes, c.per_node, c.device.name, c.node.intra.name) == (1, 8, "V100-16GB", "nvlink2")
    c = parse_cluster("2x8xA100-80GB")
    assert (c.nodes, c.per_node, c.world_size) == (2, 8, 16)
    c = parse_cluster("16xa100-80gb", inter="roce-200", nics=4)
    assert (c.nodes, c.per_node, c.node.inter.name, c.node.nics) == (2, 8, "roce-200", 4)
    assert parse_cluster("4xH100-80GB").nodes == 1
    assert parse_cluster("H200-141GB").world_size == 1


@pytest.mark.parametrize("spec, message", [
    ("8xA100", r"unknown device 'A100'. Did you mean A100-40GB or A100-80GB\?"),
    ("8xV100-17GB", r"Did you mean V100-16GB"),
    ("8xB200", r"Known devices: V100-16GB, .*TPU-v4, and 'cpu'"),
    ("12xA100-80GB", r"12 devices do not fill A100-80GB nodes of 8.*2x6xA100-80GB"),
    ("2x3xcpu", r"write Nxcpu"),
    ("eight A100s", r"write COUNTxDEVICE or NODESxPER_NODExDEVICE"),
    ("0xA100-80GB", r"must be >= 1"),
])
def test_cluster_syntax_errors_name_the_fix(spec, message):
    with pytest.raises(ConfigError, match=message):
        parse_cluster(spec)


def test_unknown_link_is_named():
    with pytest.raises(ConfigError, match=r"unknown link 'ib-hdrr'. Did you mean 'ib-hdr'"):
        parse_cluster("16xA100-80GB", inter="ib-hdrr")


def test_bad_degrees_are_reported_all_at_once():
    cluster = parse_cluster("8xA100-80GB")
    w = Workload(preset_model("gpt2-1.5b"), 1024, 8)
    with pytest.raises(ConfigError) as info:
        estimate_memory(w, Strategy(ParallelDims(1, 2, tp=2, pp=2), 2, 1, 2, offload_params="cpu"), cluster)
    text = str(info.value)
    assert "tp = 2 does not divide the 25 attention heads" in text
    assert "offload_params = 'cpu' needs ZeRO stage 3" in text


# ---------------------------------------------------------------------------------------------
# Fits or not


def run_cli(args: list[str], capsys) -> tuple[int, str]:
    code = main(args)
    return code, capsys.readouterr().out


def test_gpt2_xl_plain_data_parallel_does_not_fit_a_v100(capsys):
    code, out = run_cli(["estimate", "--model", "gpt2-1.5b", "--gpus", "8xV100-16GB",
                         "--zero-stage", "0", "--micro-batch", "4", "--seq", "1024", "--json"], capsys)
    report = json.loads(out)
    assert code == 1 and report["memory"]["fits"] is False
    # 16Ψ of model states alone (24.9 GB) exceed the 16 GB card.
    held = sum(i["bytes"] for i in report["memory"]["items"][:3])
    assert held == pytest.approx(16 * 1_557_611_200)
    assert report["suggestions"]
    assert all(s["peak_bytes"] <= s["capacity_bytes"] for s in report["suggestions"])


def test_gpt2_xl_zero3_with_selective_recompute_fits(capsys):
    code, out = run_cli(["estimate", "--model", "gpt2-1.5b", "--gpus", "8xV100-16GB",
                         "--zero-stage", "3", "--micro-batch", "4", "--seq", "1024",
                         "--recompute", "selective"], capsys)
    assert code == 0 and "fits: peak" in out
    for category in ("parameters", "gradients", "optimizer states", "activations", "buffers",
                     "fragmentation allowance"):
        assert category in out
    assert "K=12 B x Ψ_r / N=8" in out


def test_peak_is_held_memory_plus_the_worst_phase():
    cluster = parse_cluster("8xA100-80GB")
    w = Workload(preset_model("gpt2-1.5b"), 1024, 32)
    memory = estimate_memory(w, Strategy(ParallelDims(1, 8), 3, 4, 1, dtypes=Dtypes("bf16")), cluster)
    parts = memory.items[:4] + memory.items[4].parts  # states, activations, each buffer
    held = sum(i.bytes for i in parts if not i.phases)
    phases = {p: sum(i.phases.get(p, 0) for i in parts) for p in ("loss", "blocks", "embedding", "root")}
    assert memory.train_peak == pytest.approx(held + 1.1 * max(phases.values()))
    # ... which is less than adding every row: transients of different phases never coexist.
    rows = sum(i.bytes for i in memory.items)
    assert memory.train_peak < rows


def test_gradient_accumulation_keeps_whole_gradients_even_at_stage_3():
    # The engine reduces on the last micro-step only: param.grad of every parameter lives
    # across the micro-steps, unsharded (zero/engine.py); the planner must say so.
    cluster = parse_cluster("8xA100-80GB")
    w = Workload(preset_model("llama-7b"), 1024, 16)
    one = estimate_memory(w, Strategy(ParallelDims(1, 8), 3, 2, 1, dtypes=Dtypes("bf16")), cluster)
    two = estimate_memory(replace(w, global_batch=32),
                          Strategy(ParallelDims(1, 8), 3, 2, 2, dtypes=Dtypes("bf16")), cluster)
    accumulated = next(i for i in two.items[4].parts if i.name == "accumulated gradients")
    assert accumulated.bytes == pytest.approx(2 * 6_738_415_616) and not accumulated.phases
    assert two.peak > one.peak + 10e9


def test_setup_holds_shards_plus_one_unit_at_stage_3():
    # The sharded build: a 70B model at stage 3 on 512 H100s never holds its whole fp32 copy
    # (280 GB) on a rank, only its shards and one block.
    cluster = parse_cluster("64x8xH100-80GB")
    w = Workload(model_from_params(70e9), 2048, 512, params=70e9)
    memory = estimate_memory(w, Strategy(ParallelDims(1, 512), 3, 1, 1, "full", dtypes=Dtypes("bf16")), cluster)
    states = sum(i.bytes for i in memory.items[:3])
    assert states < memory.setup_peak < states + 2e9 + 20 * 70e9 / 80  # ~80 blocks: one of them
    assert memory.setup_peak < memory.capacity


def test_estimate_degree_error_is_clear(capsys):
    assert main(["estimate", "--model", "gpt2-124m", "--gpus", "8xA100-80GB", "--tp", "3"]) == 2
    assert "world size 8 is not divisible by dp_replicate (1) × cp (1) × tp (3) × pp (1) = 3" in capsys.readouterr().err


def test_plan_ranks_what_fits_and_explains(capsys):
    code, out = run_cli(["plan", "--model", "llama-7b", "--gpus", "2x8xA100-80GB", "--json"], capsys)
    result = json.loads(out)
    assert code == 0
    speeds = [p["tokens_per_s"] for p in result["plans"]]
    assert speeds == sorted(speeds, reverse=True) and len(speeds) > 1
    assert all(p["peak_bytes"] <= p["capacity_bytes"] for p in result["plans"])
    assert result["explanation"][0].startswith("Best:")
    assert any("slower" in line or "within 1%" in line for line in result["explanation"])


def test_plan_runtime_only_and_plan_for_run():
    model = preset_model("gpt2-1.5b")
    plans = plan_for_run(model, 8, "8xV100-16GB", (4, 1, 1024))
    assert plans and all(p.runtime_supported for p in plans)
    best = plans[0]
    o = best.overrides()
    assert o["train.micro_batch"] * o["train.grad_accum"] * o["parallel.dp_shard"] * \
        o["parallel.dp_replicate"] == 4 * 8  # the global batch is kept
    assert o["precision.compute"] == "fp16"  # V100: no bf16
    everything = search(Workload(model, 1024, 32), parse_cluster("8xV100-16GB"), Dtypes("fp16"), EVERYTHING)
    assert len(everything.plans) >= len(search(Workload(model, 1024, 32), parse_cluster("8xV100-16GB"),
                                               Dtypes("fp16"), RUNTIME).plans)
    with pytest.raises(ConfigError, match="has 8 devices, the run 4 ranks"):
        plan_for_run(model, 4, "8xV100-16GB", 2**20)


def test_offload_appears_only_when_needed():
    model = preset_model("llama-13b")
    cluster = parse_cluster("1xA100-80GB")
    result = search(Workload(model, 2048, 8), cluster, Dtypes("bf16"), RUNTIME)
    assert result.plans, "13B on one 80 GB GPU fits only by offloading its optimizer states"
    assert all(p.strategy.offload_optimizer != "none" for p in result.plans)


# ---------------------------------------------------------------------------------------------
# The commands: fast, JSON, no torch


def test_commands_do_not_import_torch():
    # (Their speed follows from this — pure arithmetic — and is not timed here: a loaded machine
    # would make a timed test fail for nothing.)
    code = (
        "import json, sys\n"
        "from shardlm.cli import main\n"
        "main(['estimate', '--model', 'gpt2-1.5b', '--gpus', '8xV100-16GB', '--zero-stage', '3',"
        " '--micro-batch', '4', '--seq', '1024', '--json'])\n"
        "main(['plan', '--model', 'llama-7b', '--gpus', '2x8xA100-80GB', '--json'])\n"
        "print(json.dumps({'torch': 'torch' in sys.modules}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    last = json.loads(out.strip().splitlines()[-1])
    assert last["torch"] is False


def test_predict_local_maps_the_config(monkeypatch):
    # A stand-in for this CPU (the real one is measured by spawning ranks): what matters here
    # is that a Config becomes the strategy the runtime would build.
    cpu = Device("cpu (test)", "cpu", 8e9, {"fp32": 1e11, "bf16": 5e10}, 1e10, 0.65, "test")
    node = Node(2, LINKS["eth-10"], LINKS["eth-10"], 1, LINKS["eth-10"], 16e9, 1e10, 2e9, "test")
    monkeypatch.setattr("shardlm.planner.search.local_cpu",
                        lambda n: Cluster(1, n, cpu, replace(node, per_node=n), CALIBRATION["cpu"]))
    cfg = load_config(overrides={"model.preset": "gpt-mini", "parallel.zero_stage": "2",
                                 "train.micro_batch": "4", "train.seq_len": "128"})
    pred = predict_local(cfg, 2)
    psi = shape_of(Workload(cfg.model, 128, 8)).total
    assert pred.model_state_bytes["params"] == pytest.approx(4 * psi)  # auto -> fp32 here
    assert pred.model_state_bytes["grads"] == pytest.approx(4 * psi / 2)
    assert pred.model_state_bytes["optimizer"] == pytest.approx(8 * psi / 2)
    assert pred.peak_process_bytes > sum(pred.model_state_bytes.values()) + pred.activation_bytes
    assert pred.step_time_s > 0 and pred.tokens_per_s == pytest.approx(8 * 128 / pred.step_time_s)


def test_catalog_has_the_devices_the_issue_names():
    for name in ("V100-16GB", "V100-32GB", "A100-40GB", "A100-80GB", "H100-80GB", "H200-141GB",
                 "MI250X", "TPU-v4"):
        assert name in DEVICES and DEVICES[name].source
    for name in ("pcie3", "pcie4", "pcie5", "nvlink2", "nvlink3", "nvlink4", "ib-edr", "ib-hdr",
                 "ib-ndr", "roce-200", "eth-100"):
        assert name in LINKS


@pytest.mark.parametrize("torch_name, entry", [
    ("Tesla V100-SXM2-16GB", "V100-16GB"), ("Tesla V100-PCIE-32GB", "V100-32GB"),
    ("NVIDIA A100-SXM4-40GB", "A100-40GB"), ("NVIDIA A100 80GB PCIe", "A100-80GB"),
    ("NVIDIA H100 80GB HBM3", "H100-80GB"), ("NVIDIA H200", "H200-141GB"),
    ("AMD Instinct MI250X / MI250", "MI250X"),
    ("Quadro GV100", None), ("NVIDIA A10", None), ("NVIDIA GeForce RTX 4090", None)])
def test_torch_device_names_map_to_the_catalog(torch_name, entry):
    device = device_for_gpu_name(torch_name)
    assert (device.name if device else None) == entry


def test_telemetry_takes_gpu_peaks_from_the_catalog():
    from shardlm.telemetry import gpu_peak_flops

    # True fp32 (torch leaves TF32 off for matmuls), and each MI250X GCD is a device.
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", "fp32") == DEVICES["A100-80GB"].peak["fp32"] == 19.5e12
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert gpu_peak_flops("AMD Instinct MI250X", "bf16") == 383e12 / 2
    with pytest.warns(UserWarning, match="no bf16 hardware"):
        assert math.isnan(gpu_peak_flops("Tesla V100-SXM2-16GB", "bf16"))
    with pytest.warns(UserWarning, match="not in the hardware catalog"):
        assert math.isnan(gpu_peak_flops("NVIDIA GeForce RTX 4090", "bf16"))


def test_cpu_share_time_shares_oversubscribed_cores():
    from shardlm.hardware.catalog import cpu_share

    assert cpu_share(1, 2) == 1.0 and cpu_share(2, 2) == 1.0
    assert cpu_share(4, 2) == 0.5 and cpu_share(3, 8) == 1.0


def test_nvme_stream_buffers_count_what_the_slots_touch():
    # gpt2-124m's units: root 39.4M (wte + wpe + ln_f), blocks 7.09M. 64 MiB chunks (16.8M
    # fp32 elements), 4 slots. One rank: root chunks 64, 64, 22.8 MiB in slots 0-2, its tiny
    # no-decay segment in slot 3, then each block's decay chunk (27 MiB) in slots 0 and 2.
    from shardlm.planner.memory import nvme_stream_resident

    MiB, root, block = 2**20, 38_597_376 + 786_432 + 1536, 7_087_872
    sp = type("SP", (), {"root_unit": root, "block_unit": block, "layers": 12})()
    one, chunks = nvme_stream_resident(sp, 1, 64 * MiB, 4, 4)
    assert chunks == 3 + 1 + 12 * 2
    assert one == pytest.approx(4 * (64 + 64 + block * 4 / MiB) * MiB, rel=1e-3)
    two, _ = nvme_stream_resident(sp, 2, 64 * MiB, 4, 4)  # root shard 64 + 11 MiB, blocks 13.5
    assert two == pytest.approx(4 * (64 * MiB + 3 * 4 * block / 2), rel=1e-3)
    assert two < one < 4 * 4 * 64 * MiB
