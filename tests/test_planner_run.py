"""Prediction beside measurement: a training run's first JSONL record carries the planner's
prediction for that run under "predicted", and the end of the run prints measured / predicted
(one tiny 1-process run)."""

import json

from conftest import tiny_overrides
from shardlm.config import load_config
from shardlm.hardware.catalog import local_cpu
from shardlm.planner.search import run_prediction
from shardlm.trainer import build_run, train


def test_first_record_carries_the_prediction_and_the_end_compares(tmp_path, capsys):
    cfg = load_config(overrides=tiny_overrides(tmp_path, train__steps=3)).validate()
    result = train(build_run(cfg))
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3
    predicted = records[0]["predicted"]
    assert set(predicted) >= {"step_time_s", "tokens_per_s", "peak_bytes_per_rank", "comm_bytes"}
    assert predicted["step_time_s"] > 0 and predicted["peak_bytes_per_rank"] > 0
    assert predicted["comm_bytes"] == 0  # one process: no collective
    assert predicted == json.loads(json.dumps(run_prediction(cfg, lambda: local_cpu(1))))  # the planner's own
    assert all("predicted" not in r for r in records[1:])  # the first record only; no key renamed
    assert {"step", "loss", "tokens_per_s", "step_time_s", "peak_rss_bytes"} <= set(records[0])
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("measured / predicted"))
    assert "step" in line and "peak per rank" in line and "MiB" in line


def test_a_run_the_planner_cannot_describe_still_trains(tmp_path):
    def unknown():
        raise ValueError("no such hardware")

    assert run_prediction(load_config(overrides=tiny_overrides(tmp_path)), unknown) == {
        "unavailable": "ValueError: no such hardware"}
