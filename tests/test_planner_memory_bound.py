"""The memory-bound side of the step time (planner/memory_bound.py) and the context-parallel
modes' pricing (issue 29): counts checked against what autograd dispatches, terms against the
measured rates they are made of (injected: no test depends on this machine's speed)."""

from dataclasses import replace

import pytest

from conftest import private_cache
from shardlm.config.dims import ParallelDims
from shardlm.hardware import probe
from shardlm.hardware.catalog import (CALIBRATION, LINKS, Cluster, Device, MatmulCurve, Node, interpolate,
                                      local_cpu, parse_cluster)
from shardlm.planner.workload import Dtypes, Strategy, Workload
from shardlm.planner.timing import estimate_time
from shardlm.planner.cp_modes import cp_a2a_bytes, cp_mode_seconds
from shardlm.planner.memory_bound import block_work
from shardlm.planner.shapes import preset_model
from shardlm.planner.traffic import cp_comm_bytes
from shardlm.planner.workload import stage_params

MATMULS = {"mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu",
           "_scaled_dot_product_flash_attention_for_cpu_backward"}


def _dispatched(cfg, b: int = 2, s: int = 24) -> tuple[float, float, int]:
    """One block's forward and backward in fp32 under a dispatch tracker: (elements per token
    written to new tensors, weight gradients left out; elements per token read and written by
    the ops that are not matmuls or attention; ops dispatched)."""
    import torch

    from dispatch_count import dispatched
    from shardlm.models.decoder import build_model

    torch.manual_seed(0)
    model = build_model(cfg).float()
    block = model.blocks[0]
    weights = {tuple(p.shape) for p in block.parameters()}
    x = torch.randn(b, s, cfg.d_model, requires_grad=True)
    rope = (model.rope_cos[:s], model.rope_sin[:s]) if cfg.position == "rope" else None
    grad = torch.randn(b, s, cfg.d_model)
    rows = [(name, view, i, o, shape) for name, view, i, o, _, shape in
            dispatched(lambda: torch.autograd.backward(block(x, rope), grad))]
    tokens = b * s
    fresh = sum(o for name, view, _, o, shape in rows
                if not view and not (name in ("mm", "addmm") and shape in weights)) / tokens
    traffic = sum(i + o for name, view, i, o, _ in rows if not view and name not in MATMULS) / tokens
    return fresh, traffic, len(rows)


@pytest.mark.parametrize("variant", ["gpt-tiny", "llama-tiny", "gpt-tiny+rope", "gpt-tiny+rmsnorm"])
def test_block_work_is_what_autograd_dispatches(variant):
    name, _, change = variant.partition("+")
    cfg = preset_model(name)
    cfg = replace(cfg, **({"position": "rope"} if change == "rope" else {"norm": "rmsnorm"} if change else {}))
    fresh, traffic, ops = _dispatched(cfg)
    predicted = block_work(cfg)
    # the counts leave out a few statistics per token (a norm's mean and rstd, attention's
    # log-sum-exp, the biases' and norms' gradients spread over 48 tokens): within 2%
    assert predicted.fresh == pytest.approx(fresh, rel=0.02)
    assert predicted.traffic == pytest.approx(traffic, rel=0.02)
    assert abs(predicted.ops - ops) <= 2


def _cpu(**rates) -> Cluster:
    curve = MatmulCurve(((256, 64, 192, 1e11), (256, 64, 64, 1e11), (256, 256, 64, 1e11)), "test curve")
    cpu = Device("cpu (test)", "cpu", 8e9, {"fp32": 1e11}, 1e10, 1.0, "test", curves={"fp32": curve}, **rates)
    node = Node(1, LINKS["eth-10"], LINKS["eth-10"], 1, LINKS["eth-10"], 16e9, 1e10, 2e9, "test")
    return Cluster(1, 1, cpu, node, CALIBRATION["cpu"])


def test_each_term_is_its_work_over_its_measured_rate():
    w = Workload(preset_model("gpt-mini"), 128, 4)
    s = Strategy(ParallelDims(dp_shard=1), 0, 2, 2, dtypes=Dtypes("fp32"))
    rates = dict(op_seconds=5e-6, fresh_bandwidth=2e9, bandwidth_curve=((2**20, 4e10), (2**28, 1e10)),
                 adamw_curve=((2**18, 1e-9), (2**24, 3e-9)))
    base = estimate_time(w, s, _cpu(**rates))
    terms = {t.name: t.seconds for t in base.work}
    assert set(terms) == {"element-wise traffic", "fresh memory (page faults)", "per-op dispatch", "optimizer step"}
    assert base.memory_bound == pytest.approx(sum(v for k, v in terms.items() if k != "optimizer step"))
    assert base.step == pytest.approx(base.compute + base.memory_bound + base.exposed_comm + base.optimizer)
    block, m = block_work(w.model), w.model
    ops = m.n_layers * block.ops + 9 + 27  # the embedding's lookups; the final LayerNorm, head and loss
    assert terms["per-op dispatch"] == pytest.approx(2 * ops * 5e-6)  # 2 micro-batches
    # twice the measured rate, half the term; the others do not move
    faster = estimate_time(w, s, _cpu(**{**rates, "fresh_bandwidth": 4e9, "op_seconds": 2.5e-6}))
    half = {t.name: t.seconds for t in faster.work}
    assert half["fresh memory (page faults)"] == pytest.approx(terms["fresh memory (page faults)"] / 2)
    assert half["per-op dispatch"] == pytest.approx(terms["per-op dispatch"] / 2)
    assert half["element-wise traffic"] == terms["element-wise traffic"]
    # the optimizer: fused AdamW at the curve's rate for this many parameters (log-linear between
    # the measured sizes), never faster than its largest size's (the state is cold in a step),
    # plus the gradient norm's read
    psi = stage_params(w, s.layout)[0].dense
    device = _cpu(**rates).device
    assert interpolate(rates["adamw_curve"], psi) < 3e-9  # gpt-mini's 5 M: the curve is faster there
    assert terms["optimizer step"] == pytest.approx(3e-9 * psi + 4 * psi / device.bandwidth_at(4 * psi))
    nothing = estimate_time(w, s, _cpu())
    assert {t.name for t in nothing.work} == {"element-wise traffic", "optimizer step"}
    assert nothing.step < base.step


def test_a_catalog_gpu_keeps_element_wise_work_inside_its_efficiency(capsys):
    from shardlm.cli.main import main

    w = Workload(preset_model("gpt2-124m"), 1024, 32)
    s = Strategy(ParallelDims(dp_shard=8), 3, 4, 1, dtypes=Dtypes("bf16"))
    t = estimate_time(w, s, parse_cluster("8xA100-80GB"))
    assert t.memory_bound == 0.0 and [x.name for x in t.work] == ["element-wise traffic", "optimizer step"]
    assert main(["estimate", "--model", "gpt2-124m", "--gpus", "8xA100-80GB", "--zero-stage", "3",
                 "--micro-batch", "4", "--seq", "1024"]) == 0
    out = capsys.readouterr().out
    assert "memory-bound" not in out.split("step:")[1].split("\n")[0]  # 0 s: not in the step's parts
    assert "inside the catalog's end-to-end efficiency" in out and "optimizer step" in out


@pytest.mark.parametrize("mode,ulysses", [("ring", 0), ("ulysses", 0), ("hybrid", 2)])
def test_cp_step_time_prices_each_mode(mode, ulysses):
    """The step's context-parallel terms are cp_modes' per micro-batch (the bytes the ledger
    counts, the exposed seconds choose_cp_mode compares), times the micro-batches."""
    m = preset_model("llama-tiny")
    m = replace(m, n_heads=8, n_kv_heads=8, d_model=128, max_seq_len=512)
    cluster = parse_cluster("4xA100-80GB")
    w = Workload(m, 512, 2)
    s = Strategy(ParallelDims(dp_shard=1, cp=4), 0, 1, 2, dtypes=Dtypes("bf16"), cp_mode=mode, cp_ulysses=ulysses)
    t = estimate_time(w, s, cluster)
    cp = {c.name: c for c in t.comms if c.name.startswith("context-parallel")}
    a2a, ring = {"ring": (1, 4), "ulysses": (4, 1), "hybrid": (2, 2)}[mode]
    assert ("context-parallel all-to-all (Ulysses)" in cp) == (a2a > 1)
    assert ("context-parallel ring" in cp) == (ring > 1)
    sent = sum(c.bytes for c in cp.values())
    assert sent == 2 * (cp_a2a_bytes(m, 512, 4, a2a, 1, 2) + cp_comm_bytes(m, 512, ring, a2a, 2) * (ring > 1))
    if a2a > 1:  # nothing hides an all-to-all
        assert cp["context-parallel all-to-all (Ulysses)"].exposed == cp["context-parallel all-to-all (Ulysses)"].seconds
    bw, lat = cluster.node.intra.effective, cluster.node.intra.latency
    per_micro = cp_mode_seconds(m, 512, 4, 1, 2, "none", mode, ulysses, bw, lat, 0.0, 0.0)
    if mode != "ring":  # without overlap credit, the exposed time is cp_modes' per micro-batch x 2
        exposed_alone = sum(c.exposed for c in cp.values())
        ring_hidden = cp.get("context-parallel ring")
        hidden = (ring_hidden.seconds - ring_hidden.exposed) if ring_hidden else 0.0
        assert exposed_alone + hidden == pytest.approx(2 * per_micro.seconds, rel=1e-9)
    auto = estimate_time(w, replace(s, cp_mode="auto"), cluster)
    assert {c.name for c in auto.comms} <= {c.name for c in t.comms} | {
        "context-parallel ring", "context-parallel all-to-all (Ulysses)"}


def test_the_memory_probe_is_cached_and_local_cpu_reads_it(monkeypatch, tmp_path):
    private_cache(monkeypatch, tmp_path)
    calls = []
    monkeypatch.setattr(probe, "_elementwise_bandwidth", lambda n, repeats=5: calls.append(n) or 2e10)
    monkeypatch.setattr(probe, "_fresh_bandwidth", lambda n, repeats=5: 3e9)
    monkeypatch.setattr(probe, "_adamw_seconds_per_param", lambda n, repeats=5: 2e-9)
    monkeypatch.setattr(probe, "_op_seconds", lambda repeats=5: 4e-6)
    first = probe.memory_probe(1)
    assert first["elementwise"] == [[n, 2e10] for n in probe.ELEMENTWISE_SIZES] and first["op_seconds"] == 4e-6
    assert probe.memory_probe(1) == first and len(calls) == len(probe.ELEMENTWISE_SIZES)  # cached
    measured = {"cpu": "test cpu", "cores": 2, "threads": 1, "peak": {"fp32": 6e10, "bf16": 1e10, "fp16": 1e9},
                "memory_bandwidth": 2e10, "gloo_in_step_bandwidth": 1e9, "gloo_in_step_latency": 1e-4, "baseline_rss": 2e8,
                "gloo_in_step_all_gather_factor": 1.0, "gloo_in_step_reduce_scatter_factor": 1.0, "gloo_in_step_send_recv_factor": 1.0, "curve": {}, "memory": first}
    monkeypatch.setattr(probe, "measure_cpu", lambda n: measured)
    one, four = local_cpu(2).device, local_cpu(4).device  # 4 ranks on 2 cores: half a core each
    assert one.op_seconds == 4e-6 and four.op_seconds == 8e-6
    assert one.fresh_bandwidth == 3e9 and four.fresh_bandwidth == 1.5e9
    assert one.adamw_curve[0][1] == 2e-9 and four.adamw_curve[0][1] == 4e-9
    # the curve's DRAM end is the machine's copy rate, each rank its share
    assert one.bandwidth_at(2**30) == 1e10 and one.bandwidth_at(2**20) == 2e10
    # a rank of two threads is never slower than one of its threads (the bound that keeps a
    # two-thread try a loaded machine slowed from counting): the one-thread rates floor it
    slow = {**first, "fresh_bandwidth": 1e8, "op_seconds": 1e-3, "threads": 2}
    measured.update(threads=2, memory=slow, memory_one_thread=first)
    two = local_cpu(1).device
    assert two.fresh_bandwidth == 3e9 and two.op_seconds == 4e-6
    measured["memory_one_thread"] = {**first, "fresh_bandwidth": 1e7}
    assert local_cpu(1).device.fresh_bandwidth == 1e8  # the two-thread rate where it is the faster


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ring_work_is_what_the_ring_dispatches(tmp_path, dtype):
    """A context-parallel rank's ring (parallel/context/attention.py) on gpt-mini's attention shapes, 2 x
    128 tokens over 2 ranks, tracked op by op on both ranks: the bytes it writes to new tensors
    beyond the plain attention's own (its output and three gradients) are ring_work's within
    10% (the two ranks' front and back hops averaged), and its ops within 8."""
    from cp_cases import ring_work_case
    from shardlm.launch.spawn import run_ranks
    from shardlm.planner.memory_bound import ring_work

    m = preset_model("gpt-mini")
    heads, dim, length = m.n_heads, m.d_model // m.n_heads, 128
    ranks = run_ranks(ring_work_case, 2, tmp_path, heads, length, dim, dtype)
    e = 4 if dtype == "float32" else 2
    tokens = 2 * length // 2  # this rank's
    plain = 4 * e * tokens * m.d_model  # the attention's output and dq, dk, dv
    fresh = sum(r["forward"][1] + r["backward"][1] for r in ranks) / 2 - plain
    ops = sum(r["forward"][0] + r["backward"][0] for r in ranks) / 2 - 11
    predicted = ring_work(m, 1, 2, e)
    assert predicted.fresh * e * tokens == pytest.approx(fresh, rel=0.10)
    assert abs(predicted.ops - ops) <= 8
