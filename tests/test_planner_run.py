"""Prediction beside measurement: a training run's first JSONL record carries the planner's
prediction for that run under "predicted", and the end of the run prints measured / predicted
(one tiny 1-process run)."""

import json

from conftest import tiny_overrides
from shardlm.config.load import load_config
from shardlm.hardware.catalog import local_cpu
from shardlm.planner.search import run_prediction
from shardlm.train.build import build_run
from shardlm.train.loop import train


def test_first_record_carries_the_prediction_and_the_end_compares(tmp_path, capsys):
    cfg = load_config(overrides=tiny_overrides(tmp_path, train__steps=3)).validate()
    result = train(build_run(cfg))
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3
    predicted = records[0]["predicted"]
    assert set(predicted) >= {"step_time_s", "tokens_per_s", "peak_bytes_per_rank", "comm_bytes"}
    assert predicted["step_time_s"] > 0 and predicted["peak_bytes_per_rank"] > 0
    assert predicted["comm_bytes"] == 0  # one process: no collective
    assert predicted["calibration"].startswith(("probe: ", "calibrated: "))  # this CPU's measured curve
    assert predicted == json.loads(json.dumps(run_prediction(cfg, lambda: local_cpu(1))))  # the planner's own
    assert all("predicted" not in r for r in records[1:])  # the first record only; no key renamed
    assert {"step", "loss", "tokens_per_s", "step_time_s", "peak_rss_bytes"} <= set(records[0])
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("measured / predicted"))
    assert "step" in line and "peak per rank" in line and "MiB" in line
    # the pass a local CPU's prediction lacked is named in the record and on the end line
    assert "calibrate_command" in predicted
    if predicted["calibrate_command"]:
        assert predicted["calibrate_command"].startswith("shardlm calibrate --model ")
        assert f"`{predicted['calibrate_command']}` times it" in line


def test_a_run_the_planner_cannot_describe_still_trains(tmp_path):
    def unknown():
        raise ValueError("no such hardware")

    assert run_prediction(load_config(overrides=tiny_overrides(tmp_path)), unknown) == {
        "unavailable": "ValueError: no such hardware"}


def test_the_summary_compares_like_with_like(monkeypatch):
    """A CPU's process RSS against the whole predicted peak; a GPU's allocator reserve against
    the peak less the runtime reserve (the CUDA context the allocator does not see); the median
    step after the first against the predicted step."""
    import torch

    from shardlm.train import telemetry
    predicted = {"step_time_s": 2.0, "peak_bytes_per_rank": 11 * 2**30, "runtime_reserve_bytes": 2**30,
                 "hardware": "8 x H100-80GB"}
    monkeypatch.setattr(telemetry, "peak_rss_bytes", lambda: 11 * 2**30)
    line = telemetry.prediction_summary(predicted, [3.0, 1.0, 5.0], torch.device("cpu"))
    assert "step 3 / 2 s = 1.50" in line and "(process RSS) 11,264 / 11,264 MiB = 1.00" in line
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 5 * 2**30)
    line = telemetry.prediction_summary(predicted, [3.0], torch.device("cuda"))
    assert "(allocator reserved) 5,120 / 10,240 MiB = 0.50" in line
    assert "no prediction" in telemetry.prediction_summary({"unavailable": "x"}, [1.0], torch.device("cpu"))
