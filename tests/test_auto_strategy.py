"""parallel.strategy = 'auto': the run trains with the planner's best plan, the same on every
rank, and keeps the configured global batch."""

from __future__ import annotations

import pytest

from conftest import tiny_overrides
from shardlm.config.load import flatten, load_config
from shardlm.planner.search import default_dtypes, plan_for_run
from shardlm.hardware.catalog import local_cpu
from shardlm.launch.spawn import run_ranks
from shardlm.train.build import build_run
from shardlm.train.step import train_step


def _auto_run(rank: int, world_size: int, overrides: dict) -> dict:
    run = build_run(load_config(overrides=overrides).validate())
    loss = train_step(run, 0).loss
    return {"config": flatten(run.cfg.to_dict()), "global_batch": run.train_loader.global_batch,
            "loss": loss}


def _auto_overrides(tmp) -> dict:
    return tiny_overrides(tmp, **{"parallel.strategy": "auto", "train.micro_batch": 4, "precision.compute": "fp32"})


def _auto_compute_overrides(tmp) -> dict:
    return tiny_overrides(tmp, **{"precision.compute": "auto", "parallel.zero_stage": 1, "train.steps": 1})


def _auto_ep_overrides(tmp) -> dict:
    return tiny_overrides(tmp, **{"model.preset": "moe-tiny", "parallel.strategy": "auto", "parallel.ep": 2,
                                  "train.micro_batch": 2, "train.seq_len": 32, "train.steps": 1})


PROBES = (["bf16", "fp32"], ["fp32", "bf16"])
"""test_auto_compute_is_decided_once_on_rank_0_and_shared: which precision each rank's stand-in
probe finds faster (rank 0's, rank 1's), both ways round."""


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Every 2-rank run of this file in one spawned world (tests/worlds.py), one set of rank
    processes instead of four: the auto plan, the auto precision under both disagreeing probes,
    the auto plan keeping ep = 2. A case that patches a module (the probe, the planner's view of
    the machine) restores it before the next."""
    from worlds import several

    tmp = tmp_path_factory.mktemp("auto")
    calls = [(_auto_run, (_auto_overrides(tmp),)),
             *[(_auto_compute_run, (_auto_compute_overrides(tmp), faster)) for faster in PROBES],
             (_auto_ep_run, (_auto_ep_overrides(tmp),))]
    ranks = run_ranks(several, 2, tmp, calls, timeout=600)
    return {"tmp": tmp, "auto": [r[0] for r in ranks], "compute": [[r[1 + i] for r in ranks] for i in range(len(PROBES))],
            "ep": [r[-1] for r in ranks]}


def test_auto_takes_the_best_plan_on_every_rank(world):
    overrides = _auto_overrides(world["tmp"])
    ranks = world["auto"]
    assert ranks[0]["config"] == ranks[1]["config"]
    assert ranks[0]["global_batch"] == 4 * 2  # micro_batch x grad_accum x ranks, as configured
    cfg = load_config(overrides=overrides)
    hardware = local_cpu(2)
    best = plan_for_run(cfg.model, 2, hardware, (4, 1, cfg.train.seq_len),
                        dtypes=default_dtypes(hardware, "fp32"))[0]
    chosen = ranks[0]["config"]
    for key, value in best.overrides().items():
        assert chosen[key] == value, key
    assert chosen["parallel.strategy"] == "manual"  # the saved config is the resolved plan


def _probe_says(faster: str):
    """A stand-in for the matmul probe on which `faster` wins by 2x."""
    return lambda precision, threads=None: 2e9 if precision == faster else 1e9


def _auto_compute_run(rank: int, world_size: int, overrides: dict, faster: list[str]) -> dict:
    import shardlm.hardware.probe as probe

    measured = probe.cpu_peak_flops
    probe.cpu_peak_flops = _probe_says(faster[rank])  # each rank's probe disagrees
    try:
        run = build_run(load_config(overrides=overrides).validate())
        train_step(run, 0)
    finally:
        probe.cpu_peak_flops = measured
    return {"compute": run.cfg.precision.compute, "precision": run.precision.name}


def test_auto_compute_is_decided_once_on_rank_0_and_shared(world):
    """precision.compute = 'auto' follows rank 0's probe on every rank, even when another
    rank's probe would decide otherwise (a loaded machine, a different core)."""
    for faster, ranks in zip(PROBES, world["compute"]):
        assert [r["compute"] for r in ranks] == [faster[0]] * 2
        assert [r["precision"] for r in ranks] == [faster[0]] * 2


def test_auto_compute_is_recorded_and_kept_on_resume(tmp_path, monkeypatch):
    import json

    import shardlm.hardware.probe as probe
    from shardlm.train.loop import train

    overrides = tiny_overrides(tmp_path, **{"precision.compute": "auto", "train.steps": 2,
                                            "checkpoint.every": 1, "run.name": "r"})
    monkeypatch.setattr(probe, "cpu_peak_flops", _probe_says("bf16"))
    train(build_run(load_config(overrides=overrides).validate()))
    run_dir = tmp_path / "runs" / "r"
    assert json.loads((run_dir / "config.json").read_text())["precision"]["compute"] == "bf16"
    manifest = json.loads((run_dir / "checkpoints" / "step-00000002" / "manifest.json").read_text())
    assert manifest["config"]["precision"]["compute"] == "bf16"
    # The probe now prefers fp32; the resumed run keeps what it was trained in.
    monkeypatch.setattr(probe, "cpu_peak_flops", _probe_says("fp32"))
    resumed = build_run(load_config(overrides={**overrides, "train.steps": 3}).validate())
    assert resumed.start_step == 2 and resumed.precision.name == "bf16"
    fresh = build_run(load_config(overrides={**overrides, "run.name": "s"}).validate())
    assert fresh.precision.name == "fp32"


# -- auto keeps what the run set ------------------------------------------------------------------

KEPT_CASES = [{"ep": 2}, {"zero_stage": 3}, {"tp": 2, "sequence_parallel": True}, {"cp": 2}, {"pp": 2},
              {"dp_replicate": 2}, {"ep": 2, "zero_stage": 2}]


def _decide(caplog, **parallel):
    """Resolution only (no processes): moe-tiny, 4 x A100 from the catalog (no probe)."""
    import logging

    import torch

    from shardlm.hardware.catalog import parse_cluster
    from shardlm.train.resolve import decide

    cfg = load_config(overrides={"model.preset": "moe-tiny", "parallel.strategy": "auto",
                                 "train.micro_batch": 4, "train.seq_len": 64, "precision.compute": "bf16",
                                 **{f"parallel.{k}": v for k, v in parallel.items()}})
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="shardlm"):
        resolved = decide(cfg, 4, torch.device("cpu"), hardware=parse_cluster("4xA100-80GB"))
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("strategy auto:")]
    assert len(said) == 1, said
    return resolved.parallel, said[0]


@pytest.mark.parametrize("kept", KEPT_CASES, ids=lambda kept: ",".join(f"{k}={v}" for k, v in kept.items()))
def test_auto_keeps_every_degree_the_run_set(caplog, kept):
    chosen, said = _decide(caplog, **kept)
    assert chosen.strategy == "manual"
    assert {key: getattr(chosen, key) for key in kept} == kept
    assert said.startswith("strategy auto: kept " + ", ".join(f"{k}={v}" for k, v in kept.items())
                           + " (set by you), chose "), said


def test_what_auto_keeps_is_not_what_it_would_choose(caplog):
    """Without them, auto's own choice here is ep 1 and plain data parallelism (so the kept
    cases above do test the keeping), and the log line says it kept nothing."""
    chosen, said = _decide(caplog)
    assert (chosen.ep, chosen.zero_stage, chosen.tp, chosen.cp, chosen.pp, chosen.dp_replicate) == (1, 0, 1, 1, 1, 1)
    assert said.startswith("strategy auto: chose plain DP"), said


def _auto_ep_run(rank: int, world_size: int, overrides: dict) -> dict:
    import shardlm.train.resolve as resolve
    from shardlm.hardware.catalog import parse_cluster

    # The planner's view of the machine from the catalog, not the CPU probe (seconds of
    # measuring): what is tested is that the kept ep reaches the run, not which plan wins here.
    measured = resolve.local_hardware
    resolve.local_hardware = lambda device, world_size, mmap_threshold=None: parse_cluster(f"{world_size}xA100-80GB")
    try:
        run = build_run(load_config(overrides=overrides).validate())
        train_step(run, 0)
    finally:
        resolve.local_hardware = measured
    return {"ep": run.cfg.parallel.ep, "mesh_ep": run.mesh.dims.ep,
            "all_to_all_ep": run.strategy.ledger.snapshot().get("all_to_all/ep", 0)}


def test_auto_with_ep_2_trains_expert_parallel_on_2_ranks(world):
    for rank in world["ep"]:
        assert rank["ep"] == rank["mesh_ep"] == 2
        assert rank["all_to_all_ep"] > 0  # tokens really went to the other rank's experts
