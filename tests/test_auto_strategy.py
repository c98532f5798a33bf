"""parallel.strategy = 'auto': the run trains with the planner's best plan, the same on every
rank, and keeps the configured global batch."""

from __future__ import annotations

from conftest import tiny_overrides
from shardlm.config import flatten, load_config
from shardlm.planner.search import default_dtypes, plan_for_run
from shardlm.planner.hardware import local_cpu
from shardlm.spawn import run_ranks
from shardlm.trainer import build_run, train_step


def _auto_run(rank: int, world_size: int, overrides: dict) -> dict:
    run = build_run(load_config(overrides=overrides).validate())
    loss = train_step(run, 0).loss
    return {"config": flatten(run.cfg.to_dict()), "global_batch": run.train_loader.global_batch,
            "loss": loss}


def test_auto_takes_the_best_plan_on_every_rank(tmp_path):
    overrides = tiny_overrides(tmp_path, **{"parallel.strategy": "auto", "train.micro_batch": 4,
                                            "precision.compute": "fp32"})
    ranks = run_ranks(_auto_run, 2, tmp_path, overrides, timeout=300)
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
