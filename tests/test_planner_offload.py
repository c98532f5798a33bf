"""The planner's view of activation offload (activation.offload, parallel/blocks/activation.py) and of
MFU against HFU (model FLOPs vs FLOPs executed, recomputation included)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from shardlm.config.load import load_config
from shardlm.config.dims import ParallelDims
from shardlm.errors import ConfigError
from shardlm.hardware.catalog import parse_cluster
from shardlm.models.flops import flops_per_token
from shardlm.planner.memory import estimate_memory
from shardlm.planner.search import config_strategy
from shardlm.planner.shapes import preset_model
from shardlm.planner.explain import describe_strategy
from shardlm.planner.timing import estimate_time
from shardlm.planner.workload import Dtypes, Strategy, Workload

A100 = parse_cluster("8xA100-80GB")
LLAMA = Workload(preset_model("llama-7b"), 4096, 8)
BASE = Strategy(ParallelDims(1, 8), 3, 1, 1, dtypes=Dtypes("bf16"))


def _saved(memory) -> float:
    activations = next(i for i in memory.items if i.name == "activations")
    return next(p.bytes for p in activations.parts if p.name == "saved by blocks")


def _host(memory, name: str) -> float:
    return sum(i.bytes for i in memory.host if i.name == name)


@pytest.mark.parametrize("blocks", [0, 8])
def test_offload_moves_the_offloaded_blocks_activations_to_host(blocks):
    layers = LLAMA.model.n_layers
    keep = estimate_memory(LLAMA, BASE, A100)
    off_s = replace(BASE, activation_offload="cpu", activation_offload_blocks=blocks)
    off = estimate_memory(LLAMA, off_s, A100)
    n = blocks or layers
    per_block = _saved(keep) / layers
    # the offloaded blocks leave the device but ~2 blocks' worth (copy in flight / prefetch)
    assert math.isclose(_saved(off), (layers - n + 2) * per_block, rel_tol=1e-12)
    assert off.activations < keep.activations and off.peak < keep.peak
    assert math.isclose(_host(off, "offloaded activations"), n * per_block, rel_tol=1e-12)
    assert off.host_per_node > keep.host_per_node
    # time: 2 x the offloaded bytes over the node's PCIe, hidden up to the overlap fraction
    t_keep, t_off = estimate_time(LLAMA, BASE, A100), estimate_time(LLAMA, off_s, A100)
    transfer = next(c for c in t_off.comms if c.name == "activation offload")
    assert math.isclose(transfer.bytes, 2 * n * per_block, rel_tol=1e-12)
    assert math.isclose(transfer.seconds, transfer.bytes / A100.node.pcie.effective, rel_tol=1e-12)
    assert 0 <= transfer.exposed <= transfer.seconds
    assert not any(c.name == "activation offload" for c in t_keep.comms)
    assert t_off.step >= t_keep.step
    assert "activations of" in describe_strategy(off_s)


def test_offload_changes_nothing_on_a_cpu():
    cpu = parse_cluster("2xcpu")
    w = Workload(preset_model("gpt-tiny"), 64, 4)
    s = Strategy(ParallelDims(1, 2), 2, 2, 1)
    off_s = replace(s, activation_offload="cpu")
    keep, off = estimate_memory(w, s, cpu), estimate_memory(w, off_s, cpu)
    assert off.peak == keep.peak and off.activations == keep.activations and off.host == keep.host
    assert estimate_time(w, off_s, cpu).step == estimate_time(w, s, cpu).step


def test_config_strategy_reads_activation_offload_and_refuses_recompute():
    cfg = load_config(overrides={"model.preset": "llama-7b", "activation.offload": "cpu",
                                 "activation.offload_blocks": 4, "precision.compute": "bf16",
                                 "parallel.zero_stage": 3})
    _, s = config_strategy(cfg, A100)
    assert (s.activation_offload, s.activation_offload_blocks) == ("cpu", 4)
    with pytest.raises(ConfigError, match="offload"):
        estimate_memory(LLAMA, replace(BASE, activation_offload="cpu", recompute="full"), A100)


def test_timing_reports_mfu_and_hfu():
    none = estimate_time(LLAMA, BASE, A100)
    assert none.hfu == none.mfu
    full = estimate_time(LLAMA, replace(BASE, recompute="full"), A100)
    m, seq = LLAMA.model, LLAMA.seq_len
    ratio = flops_per_token(m, seq, "full") / flops_per_token(m, seq)
    assert ratio > 1 and math.isclose(full.hfu, full.mfu * ratio, rel_tol=1e-12)
    selective = estimate_time(LLAMA, replace(BASE, recompute="selective"), A100)
    assert selective.hfu == selective.mfu  # element-wise ops only: no matmul FLOPs redone


def test_search_proposes_activation_offload_where_it_pays():
    """llama-13b, 4k tokens on 8 x A100-40GB: the search tries offloading a quarter, half or all
    of each stage's blocks' activations (fewest first) beside recomputation; the offloaded plans
    fit, the first is runnable, and the best plan is at least as fast as the best without offload. On a
    CPU cluster (the host is the device) nothing is offloaded."""
    from shardlm.planner.search import EVERYTHING, default_dtypes, search

    model = preset_model("llama-13b")
    cluster = parse_cluster("8xA100-40GB")
    w = Workload(model, 4096, 256)
    dtypes = default_dtypes(cluster, "auto", "fp32", "auto")
    with_offload = search(w, cluster, dtypes)
    without = search(w, cluster, dtypes, replace(EVERYTHING, activation_offload=("none",)))
    offloaded = [p for p in with_offload.plans if p.strategy.activation_offload == "cpu"]
    assert offloaded and all(p.memory.fits for p in offloaded) and offloaded[0].runtime_supported
    for p in offloaded:
        per_stage = model.n_layers // p.strategy.layout.pp
        assert p.strategy.activation_offload_blocks in (0, per_stage // 4, per_stage // 2)
    assert not any(p.strategy.activation_offload != "none" for p in without.plans)
    assert with_offload.plans[0].timing.tokens_per_s >= without.plans[0].timing.tokens_per_s
    overrides = offloaded[0].overrides()
    assert overrides["activation.offload"] == "cpu" and overrides["activation.checkpoint"] == "none"
    load_config(overrides={**{k: str(v) for k, v in overrides.items()}, "model.preset": "llama-13b"}).validate()
    cpu = search(Workload(preset_model("gpt-mini"), 256, 8), parse_cluster("2xcpu"),
                 default_dtypes(parse_cluster("2xcpu"), "fp32", "fp32", "auto"))
    assert cpu.plans and not any(p.strategy.activation_offload != "none" for p in cpu.plans)
