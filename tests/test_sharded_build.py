"""The sharded build: a model is constructed on the meta device and each ZeRO unit is
materialised, initialised and sharded one at a time, so a rank never holds more than its
shards plus one unit in full — and the result equals, bit for bit, the model one process
builds whole, at every stage and world size (initialisation is a function of (seed, name))."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from conftest import tiny_overrides
from memory_ledger import StorageLedger
from shardlm.config.load import load_config
from shardlm.models.decoder import build_model
from shardlm.launch.spawn import run_ranks
from shardlm.config.dims import resolve_dims
from shardlm.launch.runtime import init_runtime
from shardlm.comm.mesh import build_mesh
from shardlm.parallel.build import parallelize
from shardlm.train.build import build_run

DEEP = {"model.preset": "llama-tiny", "model.n_layers": 16, "model.d_model": 256}
"""Sixteen blocks of 0.8M parameters, 13M in all: the whole model is ~16x its largest unit."""


def test_initialisation_is_a_function_of_seed_and_name():
    cfg = load_config(overrides={"model.preset": "gpt-tiny"}).model
    whole = build_model(cfg, "cpu", seed=7)
    meta = build_model(cfg, "meta")
    names = [n for n, _ in meta.named_parameters()]
    random.Random(0).shuffle(names)  # any order, any subset: each parameter alone
    for name in names:
        assert torch.equal(meta.initial_value(name, 7), whole.get_parameter(name).detach()), name
    assert not torch.equal(meta.initial_value("tok_emb.weight", 8), whole.tok_emb.weight)  # the seed matters
    assert whole.head.weight is whole.tok_emb.weight  # GPT-2's tie survives materialisation


def _built(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    out = []
    for overrides in cases:
        run = build_run(load_config(overrides=overrides).validate())
        with run.strategy.full_parameters():
            out.append({n: p.detach().float().clone() for n, p in run.model.named_parameters()})
    return out


def test_every_stage_builds_the_one_process_model(tmp_path):
    base = tiny_overrides(tmp_path, **{**DEEP, "model.n_layers": 3})
    reference = build_model(load_config(overrides=base).model, "cpu", seed=base.get("train.seed", 1337))
    cases = [{**base, "parallel.zero_stage": s, "run.name": f"s{s}"} for s in range(4)]
    for rank_result in run_ranks(_built, 2, tmp_path, cases, timeout=300):
        for stage, params in enumerate(rank_result):
            for name, value in reference.named_parameters():
                assert torch.equal(params[name], value.detach()), (stage, name)


def _setup_bytes(rank: int, world_size: int, overrides: dict, whole_model_first: bool) -> dict:
    """The live tensor bytes while the model is built and parallelized on this rank."""
    cfg = load_config(overrides=overrides).validate()
    runtime = init_runtime(cfg.run.device)
    mesh = build_mesh(resolve_dims(cfg.parallel, world_size), runtime.device, runtime.rank)
    with StorageLedger() as ledger:
        if whole_model_first:  # what the trainer did before the sharded build
            model = build_model(cfg.model, "cpu", seed=cfg.train.seed)
            ledger.track(*model.parameters())
        else:
            model = build_model(cfg.model, "meta")
        built = parallelize(model, mesh, cfg, runtime.device, run_dir=Path(cfg.run.dir))
        final = ledger.live_bytes()
    largest_unit = max(u.layout.padded for u in built.strategy.units)
    return {"peak": ledger.peak, "final": final, "largest_unit": largest_unit,
            "numel": built.strategy.numel}


def test_setup_never_holds_more_than_shards_plus_one_unit(tmp_path):
    """ZeRO-3 on 2 ranks, bf16, optimizer state and parameter shards on the nvme tier: once
    built, a rank holds little more than its bf16 gradient shard. The setup's peak above that
    is at most one unit's transients — its fp32 initial values, one parameter's freshly drawn
    values, the unit in bf16 and this rank's shard of it: under 16 bytes per element of the
    largest unit — plus, allocated during setup, the nvme tier's ring of buffers (a fixed
    nvme_buffers x 4 x nvme_chunk_mb, whatever the model's size). Building the whole fp32
    model first (what every rank did before) peaks at 4 bytes per parameter of the whole model,
    16 units here, and fails the same bound."""
    base = tiny_overrides(tmp_path, **DEEP, **{
        "parallel.zero_stage": 3, "precision.compute": "bf16", "zero.offload_optimizer": "nvme",
        "zero.offload_params": "nvme", "zero.nvme_chunk_mb": 1, "zero.nvme_buffers": 3})
    ring = 3 * 4 * 2**20
    sharded = run_ranks(_setup_bytes, 2, tmp_path, {**base, "run.name": "a"}, False, timeout=300)
    whole = run_ranks(_setup_bytes, 2, tmp_path, {**base, "run.name": "b"}, True, timeout=300)
    for rank in range(2):
        bound = 16 * sharded[rank]["largest_unit"] + ring
        assert 4 * sharded[rank]["numel"] > 1.5 * bound  # the bound is far below one whole fp32 copy
        assert sharded[rank]["peak"] - sharded[rank]["final"] <= bound, sharded[rank]
        assert whole[rank]["peak"] >= 4 * whole[rank]["numel"], whole[rank]
        assert whole[rank]["peak"] - whole[rank]["final"] > bound, whole[rank]
