"""The planner: published numbers reproduced, formulas checked against what autograd really
keeps, the cluster syntax and its errors, the catalog (the commands and fit decisions:
test_planner_cli.py)."""

from __future__ import annotations

import math
from dataclasses import replace
from decimal import ROUND_HALF_UP, Decimal

import pytest

from shardlm.cli.main import main
from shardlm.errors import ConfigError
from shardlm.hardware.catalog import (DEVICES, LINKS, device_for_gpu_name, parse_cluster)
from shardlm.planner.memory import estimate_memory
from shardlm.planner.activations import ActivationDtypes, block_activation
from shardlm.planner.shapes import model_from_params, preset_model
from shardlm.planner.timing import estimate_time, group_link
from shardlm.config.dims import ParallelDims
from shardlm.planner.workload import Dtypes, Strategy, Workload, shape_of, stage_params
from shardlm.parallel.data.zero.partition import comm_bytes_per_step

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
    from shardlm.config.presets import PUBLISHED_PARAMS

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

    from shardlm.models.decoder import build_model
    from shardlm.parallel.blocks.activation import apply_ac

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

    name, _, hd = preset.partition("+head_dim=")  # a family's own head_dim (Gemma, Qwen3)
    cfg = replace(preset_model(name), head_dim=int(hd or 0))
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


@pytest.mark.parametrize("preset", ["gpt-tiny", "llama-tiny", "llama-tiny+head_dim=32"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_activation_formula_matches_what_autograd_keeps(preset, dtype, mode):
    from shardlm.planner.activations import activation_peak

    b, s = 2, 32
    cfg, after_forward, peak = _measure(preset, dtype, mode, b, s)
    e = 4 if dtype == "fp32" else 2
    # CPU autocast keeps LayerNorm's dtype; bf16 attention of 32 positions runs in fp32 here
    dt = ActivationDtypes(e, e, norms_in_fp32=False, cpu_half_attention=True)
    per_layer, _ = block_activation(cfg, dt, mode, seq=s)
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


def test_zero3_on_a_pipeline_gathers_each_stage_once_per_step():
    """ZeRO-3 with pp > 1 (issue 28): a stage's units are gathered once a step and held to its
    last backward (parallel/data/zero/params.py hold_for_step), so its data-parallel volume is the stage's
    comm_bytes_per_step(pipeline=True) whatever the micro-batches, and the stage's parameters
    are whole in memory ("gathered parameters": its Ψ_r, 2 B each in bf16)."""
    cluster = parse_cluster("2x8xA100-80GB")
    w = Workload(preset_model("gpt2-1.5b"), 1024, 64)
    for micro, accum in ((2, 4), (1, 8)):
        s = Strategy(ParallelDims(1, 8, pp=2), 3, micro, accum, dtypes=Dtypes("bf16"))
        t = estimate_time(w, s, cluster)
        sp = next(p for p in stage_params(w, s.layout) if p.name == t.stage)
        dp = [c for c in t.comms if c.name in ("all-gather parameters", "reduce-scatter gradients")]
        assert sum(c.bytes for c in dp) == pytest.approx(
            comm_bytes_per_step(sp.dense + sp.experts, 3, 2, 2, shard_world=8, pipeline=True), rel=1e-9)
        m = estimate_memory(w, s, cluster)
        held = next(p for p in stage_params(w, s.layout) if p.name == m.stage)
        gathered = next(b for b in m.items if b.name == "buffers").parts
        assert next(b.bytes for b in gathered if b.name == "gathered parameters") == pytest.approx(
            2 * (held.dense + held.experts))


def test_zero3_exposure_is_charged_unit_by_unit(capsys):
    """Stage 3 across nodes: each term's exposure is what the compute beside it cannot hide.
    The root's gather (starts the pass), the first block's (behind the embedding lookup) and the
    root's reduce-scatter (last, after the embedding's gradient) are exposed whole at any batch;
    a block's gather or reduce-scatter hides behind one block's compute, so a larger micro-batch
    hides more; the terms sum to the collective; `estimate` prints them."""
    cluster = parse_cluster("32x8xA100-80GB")
    w = Workload(model_from_params(13e9), 2048, 256 * 4)

    def comms(micro):
        s = Strategy(ParallelDims(1, 256), 3, micro, 4 // micro, "full", dtypes=Dtypes("bf16"))
        return {c.name: c for c in estimate_time(w, s, cluster).comms}

    small, large = comms(1), comms(4)
    for c in (*small.values(), *large.values()):
        assert sum(t.exposed for t in c.terms) == pytest.approx(c.exposed)
        assert sum(t.seconds for t in c.terms) == pytest.approx(c.seconds)
        assert 0 < c.latency < c.seconds
    for c in (small, large):
        term = {t.name.split(" x ")[0]: t for t in (*c["all-gather parameters"].terms,
                                                    *c["reduce-scatter gradients"].terms)}
        for whole in ("root unit, forward: starts the pass", "first block, forward: behind the embedding lookup",
                      "root unit, last: nothing left to compute"):
            assert term[whole].exposed == term[whole].seconds > 0
        assert term["block, forward: behind the block before it"].exposed < term[
            "block, forward: behind the block before it"].seconds
    # 4 micro-batches of 1 gather 4 times per step, one of 4 once: the per-gather compute grows 4x
    assert large["all-gather parameters"].exposed < small["all-gather parameters"].exposed / 3
    # parallel.prefetch = false: every gather waits whole (one block fewer held at a time)
    s = Strategy(ParallelDims(1, 256), 3, 4, 1, "full", dtypes=Dtypes("bf16"))
    waited = {c.name: c for c in estimate_time(w, replace(s, prefetch=False), cluster).comms}
    assert waited["all-gather parameters"].exposed == pytest.approx(waited["all-gather parameters"].seconds)
    both = ("all-gather parameters", "reduce-scatter gradients")  # the same collectives, regrouped
    assert sum(waited[n].seconds for n in both) == pytest.approx(sum(large[n].seconds for n in both))
    assert sum(waited[n].exposed for n in both) > sum(large[n].exposed for n in both)
    def buffers(strategy):
        return {b.name: b.bytes for i in estimate_memory(w, strategy, cluster).items if i.name == "buffers"
                for b in i.parts}

    held, held_off = buffers(s), buffers(replace(s, prefetch=False))
    block = model_from_params(13e9)
    assert held["gathered parameters"] - held_off["gathered parameters"] == pytest.approx(
        2 * (shape_of(w).total - stage_params(w, ParallelDims(1, 256))[0].root_unit) / block.n_layers, rel=1e-6)
    main(["estimate", "--params", "13e9", "--gpus", "32x8xA100-80GB", "--zero-stage", "3",
          "--micro-batch", "1", "--grad-accum", "4", "--recompute", "full", "--seq", "2048",
          "--precision", "bf16"])
    out = capsys.readouterr().out
    assert "root unit, last: nothing left to compute" in out and "ms of it latency" in out


def _test_cpu(monkeypatch, ranks: int = 2):
    """A local CPU cluster of `ranks` from a fixed measurement (no timing)."""
    import shardlm.hardware.probe as probe
    from shardlm.hardware.catalog import local_cpu

    monkeypatch.setattr(probe, "measure_cpu", lambda n: {
        "cpu": "test", "cores": 2, "threads": 1, "peak": {"fp32": 5e10}, "memory_bandwidth": 1e10,
        "gloo_in_step_bandwidth": 1e9, "gloo_in_step_latency": 1e-4, "baseline_rss": 2e8,
        "gloo_in_step_all_gather_factor": 1.0, "gloo_in_step_reduce_scatter_factor": 1.0,
        "gloo_in_step_send_recv_factor": 1.0})
    return local_cpu(ranks)


def test_gradient_shards_live_from_their_reduction_to_the_step(monkeypatch):
    """Stages 2-3 allocate a unit's gradient shard at its reduction and drop it after the step
    (parallel/data/zero/engine.py zero_grad; measured, moe-mini on 2 ranks at ZeRO-2: 531 MiB at a block's
    backward against 598 at stage 1, whose flat gradient is whole throughout): none at the loss's
    or a block's backward, every block's at the embedding's, all at the root's reduction; a
    pipeline stage's all at once after its last backward. Stages 0-1 hold theirs throughout."""
    w = Workload(preset_model("gpt-tiny"), 64, 4)
    cluster = _test_cpu(monkeypatch)

    def grads(stage, lay=ParallelDims(dp_shard=2), accum=1):
        memory = estimate_memory(w, Strategy(lay, stage, 2, accum, dtypes=Dtypes("fp32")), cluster)
        return next(i for i in memory.items if i.name == "gradients")

    root = 4 * stage_params(w, ParallelDims(dp_shard=2))[0].root_unit / 2
    for stage in (2, 3):
        item = grads(stage)
        assert item.bytes == pytest.approx(4 * stage_params(w, ParallelDims(dp_shard=2))[0].dense / 2)
        assert item.phases == pytest.approx({"embedding": item.bytes - root, "root": item.bytes})
    assert grads(1).phases == {} and grads(0).phases == {}
    piped = grads(2, ParallelDims(dp_shard=1, pp=2), accum=2)
    assert piped.phases == {"root": piped.bytes}


def test_stage3_gathered_parameters_by_phase_on_gloo(monkeypatch):
    """ZeRO-3 on a CPU (gloo's all-gather allocates its output again, alive until waited for),
    phase by phase as parallel/data/zero/params.py gathers: at the loss's backward the root is gathered and the
    last block's gather for backward is in flight when prefetching (root + block + its copy),
    nothing more without prefetch; in a block's backward the current block, the prefetched next
    and its copy beside the root."""
    w = Workload(preset_model("gpt-tiny"), 64, 2)
    s = Strategy(ParallelDims(dp_shard=2), 3, 1, 1, dtypes=Dtypes("fp32"))
    sp = stage_params(w, s.layout)[0]
    root, block = 4 * sp.root_unit, 4 * sp.block_unit
    cluster = _test_cpu(monkeypatch)

    def phases(strategy):
        memory = estimate_memory(w, strategy, cluster)
        return next(b for i in memory.items if i.name == "buffers" for b in i.parts
                    if b.name == "gathered parameters").phases

    on, off = phases(s), phases(replace(s, prefetch=False))
    assert on["loss"] == pytest.approx(root + 2 * block) and off["loss"] == pytest.approx(root)
    assert on["blocks"] == pytest.approx(root + 3 * block) and off["blocks"] == pytest.approx(root + 2 * block)
    assert on["embedding"] == off["embedding"] == pytest.approx(root)


def test_groups_inside_a_node_use_nvlink_and_across_nodes_their_adapter_share():
    cluster = parse_cluster("2x8xA100-80GB")
    nvlink, ib = LINKS["nvlink3"], LINKS["ib-hdr"]
    assert group_link(cluster, 8, 1)[0] == nvlink.effective
    # the slowest link: each rank's own adapter share, whether 8 members share the node or 1
    assert group_link(cluster, 16, 1)[0] == ib.effective
    assert group_link(cluster, 2, 8)[0] == ib.effective  # one member per node: one rail
    v100 = parse_cluster("2x8xV100-32GB")  # DGX-1: 4 EDR adapters for 8 GPUs
    assert group_link(v100, 2, 8)[0] == pytest.approx(LINKS["ib-edr"].effective / 2)


# ---------------------------------------------------------------------------------------------
# Context parallelism: activations 1/cp, model states over dp_shard x cp, the ring's bytes

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
    from shardlm.train.telemetry import gpu_peak_flops

    # True fp32 (torch leaves TF32 off for matmuls), and each MI250X GCD is a device.
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", "fp32") == DEVICES["A100-80GB"].peak["fp32"] == 19.5e12
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert gpu_peak_flops("AMD Instinct MI250X", "bf16") == 383e12 / 2
    with pytest.warns(UserWarning, match="no bf16 hardware"):
        assert math.isnan(gpu_peak_flops("Tesla V100-SXM2-16GB", "bf16"))
    with pytest.warns(UserWarning, match="not in the hardware catalog"):
        assert math.isnan(gpu_peak_flops("NVIDIA GeForce RTX 4090", "bf16"))


def test_cpu_share_time_shares_oversubscribed_cores():
    from shardlm.hardware.machine import cpu_share

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
