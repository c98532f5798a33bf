"""Experiment tracking (TensorBoard, W&B offline, MLflow file store), profiler traces and the
per-step time split: each tracker's files are read back by that tracker's own reader and hold
exactly the JSONL's scalars and the resolved config."""

import json
import math
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import tiny_overrides
from tracking_cases import train_runs
from shardlm.train import loop as trainer
from shardlm.config.load import load_config
from shardlm.config.fields import profile_step_numbers
from shardlm.errors import ConfigError
from shardlm.launch.spawn import run_ranks
from shardlm.train.tracking import flat_config, open_trackers, scalars
from shardlm.train.build import build_run
from shardlm.train.loop import train

TIME_KEYS = ("time_forward_s", "time_backward_s", "time_comm_wait_s", "time_optimizer_s", "time_other_s")


def tiny(tmp_path: Path, **extra) -> dict:
    return tiny_overrides(tmp_path, **{"train__steps": 3, "train__seq_len": 32, "train__micro_batch": 4,
                                       "train__eval_batches": 1, **extra})


def run_and_read(tmp_path: Path, **extra) -> tuple[Path, list[dict], object]:
    run = build_run(load_config(overrides=tiny(tmp_path, **extra)).validate())
    result = train(run)
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    return result.run_dir, records, run.cfg  # resolved ('auto' decided): what the trackers receive


def expected_scalars(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """key -> [(step, value)] of every JSONL record, as the trackers must hold them."""
    out: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        for key, value in scalars(record).items():
            out.setdefault(key, []).append((record["step"], value))
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_time_s", *TIME_KEYS} <= set(out)
    return out


def test_scalars_flatten_the_record():
    record = {"step": 3, "loss": 2.5, "skipped": False, "val_loss": None, "comm_bytes_by_op": {"all_gather/dp": 8},
              "pp_bubble_by_stage": [0.25, 0.5], "note": "text"}
    assert scalars(record) == {"loss": 2.5, "skipped": 0.0, "comm_bytes_by_op/all_gather/dp": 8.0,
                               "pp_bubble_by_stage/0": 0.25, "pp_bubble_by_stage/1": 0.5}


def test_tensorboard_holds_the_jsonl_scalars_and_the_config(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    run_dir, records, cfg = run_and_read(tmp_path, run__tracker="tensorboard")
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    expected = expected_scalars(records)
    assert set(events.Tags()["scalars"]) == set(expected)
    for key, points in expected.items():  # TensorBoard keeps float32
        assert [(e.step, e.value) for e in events.Scalars(key)] == [
            (step, float(np.float32(value))) for step, value in points], key
    start = plugin_data_pb2.HParamsPluginData.FromString(
        events.PluginTagToContent("hparams")["_hparams_/session_start_info"]).session_start_info
    assert start.hparams["model.d_model"].number_value == cfg.model.d_model
    assert start.hparams["run.tracker"].string_value == "tensorboard"
    assert len(start.hparams) == len(flat_config(cfg.to_dict()))


def test_mlflow_file_store_holds_the_jsonl_scalars_and_the_config(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # what the tracker sets for its store
    run_dir, records, cfg = run_and_read(tmp_path, run__tracker="mlflow")
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    [run] = client.search_runs([client.get_experiment_by_name("shardlm").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == run_dir.name
    expected = expected_scalars(records)
    assert set(run.data.metrics) == set(expected)
    for key, points in expected.items():  # doubles: exact
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        assert history == points, key
    assert run.data.params == {k: str(v) for k, v in flat_config(cfg.to_dict()).items()}


def wandb_records(path: Path):
    """The records of a W&B run file (LevelDB's log format: 32 KiB blocks of chunks, each with a
    7-byte header: crc32, length, type FULL 1 / FIRST 2 / MIDDLE 3 / LAST 4), after its 7-byte
    ':W&B' header; each record a wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2

    data, pos, parts = path.read_bytes(), 7, []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header: padding
            pos += 32768 - pos % 32768
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        parts.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):
            yield wandb_internal_pb2.Record.FromString(b"".join(parts))
            parts = []


def test_wandb_offline_run_holds_the_jsonl_scalars_and_the_config(tmp_path, monkeypatch):
    for name in ("WANDB_API_KEY", "WANDB_PROJECT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")  # never the network
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):  # not the user's home
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    run_dir, records, cfg = run_and_read(tmp_path, run__tracker="wandb")
    [run_file] = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    history, config = {}, {}
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[row.pop("_step")] = {k: v for k, v in row.items() if not k.startswith("_")}
        elif kind in ("run", "config"):  # the config given at init, then its updates
            updates = record.run.config.update if kind == "run" else record.config.update
            config.update({item.key: json.loads(item.value_json) for item in updates})
    logged = {}
    for step, row in history.items():
        for key, value in row.items():
            logged.setdefault(key, []).append((step, value))
    assert logged == expected_scalars(records)
    assert config["model"]["d_model"] == cfg.model.d_model and config["run"]["tracker"] == "wandb"


@pytest.mark.parametrize("name", ["tensorboard", "wandb", "mlflow"])
def test_a_missing_tracker_package_is_a_config_error_naming_the_install(tmp_path, monkeypatch, name):
    # As if not installed: importing it (or any part of it, or torch's tensorboard) fails.
    packages = (name, "torch.utils.tensorboard") if name == "tensorboard" else (name,)
    for module in [m for m in list(sys.modules) if m.startswith(tuple(p + "." for p in packages))] + list(packages):
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ConfigError, match=rf'needs the {name} package.*pip install "shardlm\[{name}\]"'):
        load_config(overrides=tiny(tmp_path, run__tracker=f"{name}")).validate()
    with pytest.raises(ConfigError, match=rf'pip install "shardlm\[{name}\]"'):
        open_trackers(name, tmp_path)  # past validate (a broken install): the same advice


def test_unknown_tracker_and_bad_profile_steps_are_config_errors(tmp_path):
    with pytest.raises(ConfigError) as error:
        load_config(overrides=tiny(tmp_path, run__tracker="tensorboard,neptune", run__profile_steps="2-9")).validate()
    assert "unknown tracker 'neptune'" in str(error.value)
    assert "step(s) [4, 5, 6, 7, 8, 9] beyond train.steps = 3" in str(error.value)
    for bad in ("x", "3-1", "0", "1-"):
        with pytest.raises(ValueError):
            profile_step_numbers(bad)
    assert profile_step_numbers("5-7") == [5, 6, 7] and profile_step_numbers("6, 5") == [5, 6]
    assert profile_step_numbers("2,4-5,4") == [2, 4, 5] and profile_step_numbers("") == []


def test_a_crash_keeps_what_the_trackers_logged(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    real = trainer.train_step

    def crash_on_step_3(run, step, **kwargs):
        if step == 2:
            raise RuntimeError("injected crash")
        return real(run, step, **kwargs)

    monkeypatch.setattr(trainer, "train_step", crash_on_step_3)
    run = build_run(load_config(overrides=tiny(tmp_path, run__tracker="tensorboard,mlflow",
                                               run__profile_steps="2-3")).validate())
    with pytest.raises(RuntimeError, match="injected crash"):
        train(run)
    events = EventAccumulator(str(run.run_dir / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2]
    client = MlflowClient(tracking_uri=(run.run_dir / "mlruns").as_uri())
    [mlflow_run] = client.search_runs([client.get_experiment_by_name("shardlm").experiment_id])
    assert mlflow_run.info.status == "FAILED"
    assert [m.step for m in client.get_metric_history(mlflow_run.info.run_id, "loss")] == [1, 2]
    trace = json.loads((run.run_dir / "profile" / "steps-2-3-rank-00000.json").read_text())
    assert any(e.get("name") == "step 2" for e in trace["traceEvents"])  # what step 2 recorded


def test_profile_steps_write_chrome_traces_and_the_time_split_adds_up(tmp_path):
    run_dir, records, _ = run_and_read(tmp_path, run__profile_steps="1,3")
    traces = sorted((run_dir / "profile").iterdir())
    assert [p.name for p in traces] == ["steps-1-1-rank-00000.json", "steps-3-3-rank-00000.json"]
    for path, step in zip(traces, (1, 3)):
        events = json.loads(path.read_text())["traceEvents"]
        names = {e.get("name") for e in events}
        assert f"step {step}" in names and {"forward", "backward", "optimizer"} <= names
        assert any(e.get("ph") == "X" and e.get("dur", 0) > 0 for e in events)
    for record in records:
        times = [record[k] for k in TIME_KEYS]
        assert all(t >= 0 for t in times) and record["time_forward_s"] > 0 and record["time_backward_s"] > 0
        assert record["time_optimizer_s"] > 0
        assert math.fsum(times[:4]) <= record["step_time_s"]
        assert math.isclose(math.fsum(times), record["step_time_s"], rel_tol=1e-9)
        assert record["time_comm_wait_s"] == 0  # one process: nothing to wait for


def test_time_split_off_leaves_the_keys_out(tmp_path):
    _, records, _ = run_and_read(tmp_path, run__time_split="off")
    assert not any(k in r for r in records for k in TIME_KEYS)


def test_two_ranks_rank_0_tracks_every_rank_profiles_and_waits_are_timed(tmp_path):
    """ZeRO-2 data parallel and a 2-stage pipeline: one set of tracker files (rank 0), a trace
    per rank, and the communication waits measured (> 0) inside a split that adds up."""
    base = tiny(tmp_path, train__micro_batch=2, run__profile_steps="2", run__tracker="tensorboard")
    runs = [{**base, "parallel.zero_stage": 2, "run.name": "zero2"},
            {**base, "parallel.pp": 2, "train.grad_accum": 2, "run.name": "pp2"}]
    out = run_ranks(train_runs, 2, tmp_path, runs)
    for result in out[0]:
        run_dir = Path(result["run_dir"])
        assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 1
        assert sorted(p.name for p in (run_dir / "profile").iterdir()) == [
            "steps-2-2-rank-00000.json", "steps-2-2-rank-00001.json"]
        for record in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()):
            times = [record[k] for k in TIME_KEYS]
            assert all(t >= 0 for t in times) and record["time_comm_wait_s"] > 0, (run_dir.name, record)
            assert record["time_forward_s"] > 0 and record["time_backward_s"] > 0
            assert math.fsum(times[:4]) <= record["step_time_s"]
            assert math.isclose(math.fsum(times), record["step_time_s"], rel_tol=1e-9)


def test_step_times_take_nested_phases_and_waits_out(monkeypatch):
    """The arithmetic on a fake clock: a pipeline-like backward phase holding a forward and a
    communication wait counts only its own time; the rest of the step is 'other'."""
    import types

    from shardlm.train import tracking
    now = [0.0]
    monkeypatch.setattr(tracking.time, "perf_counter", lambda: now[0])
    ledger = types.SimpleNamespace(wait_s=0.0, synchronize=None)
    times = tracking.StepTimes(ledger, enabled=True)
    times.start()
    with times.phase("backward"):
        now[0] += 1.0  # backward's own
        with times.phase("forward"):
            now[0] += 2.0
            now[0] += 0.5  # a wait inside the forward
            ledger.wait_s += 0.5
        now[0] += 0.25  # a wait inside the backward
        ledger.wait_s += 0.25
    with times.phase("optimizer"):
        now[0] += 0.125
    now[0] += 0.0625  # in no phase
    times.stop()
    assert times.record(now[0]) == {"time_forward_s": 2.0, "time_backward_s": 1.0, "time_optimizer_s": 0.125,
                                    "time_comm_wait_s": 0.75, "time_other_s": 0.0625}
    assert tracking.StepTimes(None, enabled=False).record(1.0) == {}


def test_wandb_runs_offline_unless_told_a_mode_or_given_a_key(tmp_path, monkeypatch):
    import types

    from shardlm.train.tracking import WandbTracker

    calls = []
    fake = types.SimpleNamespace(init=lambda **kwargs: calls.append(kwargs), Settings=lambda **kwargs: kwargs)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    env = {"wandb_project": "p", "mlflow_uri": "", "mlflow_experiment": "shardlm"}
    WandbTracker(tmp_path, {**env, "wandb_configured": False})
    WandbTracker(tmp_path, {**env, "wandb_configured": True})
    assert [c["mode"] for c in calls] == ["offline", None]  # None: wandb reads WANDB_MODE itself
    assert all(c["dir"] == str(tmp_path) and c["project"] == "p" for c in calls)
