"""A hung rank is reported by the collective watchdog and the run exits non-zero in time."""

import time

import pytest

from conftest import tiny_overrides
from shardlm.config import load_config
from shardlm.comm.watchdog import EXIT_CODE
from shardlm.spawn import run_ranks
from shardlm.trainer import build_run, train_step

TIMEOUT = 3.0


def _rank_one_hangs(rank: int, world_size: int, overrides: dict) -> None:
    run = build_run(load_config(overrides=overrides).validate())
    if rank == 1:
        time.sleep(120)  # a hung rank: never joins the step's collectives
    train_step(run, 0)


def test_hung_rank_is_reported_and_the_run_exits(tmp_path, capfd):
    overrides = tiny_overrides(tmp_path, parallel__zero_stage=3,
                               parallel__collective_timeout_s=TIMEOUT)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=f"rank 0 exited with code {EXIT_CODE}"):
        run_ranks(_rank_one_hangs, 2, tmp_path, overrides)
    assert time.monotonic() - start < TIMEOUT + 30  # start-up included; not gloo's 30 minutes
    report = capfd.readouterr().err
    assert "shardlm watchdog: rank 0: all_gather on group dp_shard" in report
    assert "has not finished after" in report and "bytes" in report
