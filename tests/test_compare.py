"""`shardlm compare RUN_A RUN_B`: two runs' JSONL side by side; exit status 0 when the losses
match within the tolerance, 1 from the step where they diverge, 2 for a path without a log."""

from __future__ import annotations

import json

import pytest

from conftest import tiny_overrides
from shardlm.cli.main import main
from shardlm.studies.compare import compare_runs, read_run
from shardlm.config.load import load_config
from shardlm.train.build import build_run
from shardlm.train.loop import train


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three 3-step gpt-tiny runs in one process: two alike (same seed), one with another lr."""
    root = tmp_path_factory.mktemp("compare")
    out = {}
    for name, lr in (("a", 1e-3), ("same", 1e-3), ("other_lr", 3e-3)):
        cfg = load_config(overrides=tiny_overrides(root, **{"run.name": name, "train.steps": 3,
                                                            "train.warmup_steps": 0, "train.lr": lr,
                                                            "train.micro_batch": 2, "train.seq_len": 32,
                                                            "train.eval_batches": 1}))
        out[name] = train(build_run(cfg.validate())).run_dir
    return out


def test_two_runs_with_the_same_seed_match(runs, capsys):
    assert main(["compare", str(runs["a"]), str(runs["same"])]) == 0
    text = capsys.readouterr().out
    assert "MATCH: every step's loss within the tolerance" in text and "steps compared: 3" in text
    for column in ("loss A", "grad_norm B", "tok/s A", "mem MiB B"):
        assert column in text


def test_another_lr_diverges_where_it_should(runs, capsys):
    """Step 1's loss is the initial weights' (no update yet): equal. The lr first acts on the
    weights that step 2's loss sees: that is where the runs part."""
    a, b = read_run(runs["a"]), read_run(runs["other_lr"])
    assert a.steps[1]["loss"] == b.steps[1]["loss"] and a.steps[2]["loss"] != b.steps[2]["loss"]
    assert main(["compare", str(runs["a"]), str(runs["other_lr"])]) == 1
    text = capsys.readouterr().out
    assert "DIVERGED at step 2" in text and "2 of 3 steps beyond the tolerance: 2, 3" in text
    row = next(line for line in text.splitlines() if line.lstrip().startswith("2 "))
    assert row.endswith("FIRST DIVERGENCE")
    # A tolerance wide enough to take the difference in: they match.
    wide = abs(a.steps[3]["loss"] - b.steps[3]["loss"]) + abs(a.steps[2]["loss"] - b.steps[2]["loss"])
    assert main(["compare", str(runs["a"]), str(runs["other_lr"]), "--atol", str(wide)]) == 0


def test_a_path_without_a_log_is_a_clear_error(runs, tmp_path, capsys):
    assert main(["compare", str(tmp_path), str(runs["a"])]) == 2
    assert f"shardlm: error: RUN_A {str(tmp_path)!r} has no metrics.jsonl: not a run directory" in \
        capsys.readouterr().err
    assert main(["compare", str(runs["a"]), str(tmp_path / "nowhere")]) == 2
    assert "RUN_B" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\nnot json\n')
    assert main(["compare", str(tmp_path), str(runs["a"])]) == 2
    assert "metrics.jsonl:2: not JSON" in capsys.readouterr().err


def _log(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return read_run(path)


def test_resumed_steps_nulls_and_missing_steps(tmp_path):
    """A resume logs steps again (the last counts); a null (non-finite) loss matches only a null;
    steps one run did not log make the runs differ even where every common loss matches."""
    a = _log(tmp_path / "a.jsonl", [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 9.0},
                                     {"step": 2, "loss": 2.5}, {"step": 3, "loss": None}])
    b = _log(tmp_path / "b.jsonl", [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.5},
                                     {"step": 3, "loss": None}])
    assert a.repeated == 1 and compare_runs(a, b).match
    c = _log(tmp_path / "c.jsonl", [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.5}, {"step": 3, "loss": 1.0}])
    assert compare_runs(a, c).diverged == [3]
    short = _log(tmp_path / "d.jsonl", [{"step": 1, "loss": 3.0}])
    result = compare_runs(a, short)
    assert not result.diverged and result.only_a == [2, 3] and not result.match


def test_a_record_cut_off_by_a_kill_is_ended_on_resume_and_skipped(tmp_path, caplog):
    """A rank SIGKILLed inside its write leaves a record's first bytes without a newline (seen in
    CI: a fault-tolerance test's replica killed with the whole job). The resumed run's MetricsLog
    ends that line before appending, so its own records stay whole lines, and compare skips the
    cut-off one (and says so) instead of refusing the log."""
    from shardlm.train.telemetry import MetricsLog

    path = tmp_path / "metrics.jsonl"
    whole = json.dumps({"step": 1, "loss": 3.0}) + "\n"
    path.write_text(whole + json.dumps({"step": 2, "loss": 2.5, "note": "x" * 50})[:30])
    with caplog.at_level("WARNING", logger="shardlm"):
        log = MetricsLog(path)
    log.write({"step": 2, "loss": 2.5})
    log.close()
    assert "its last record was cut off" in caplog.text
    lines = path.read_text().splitlines()
    assert len(lines) == 3 and lines[0] == whole.strip() and json.loads(lines[2]) == {"step": 2, "loss": 2.5}
    run = read_run(path)
    assert run.cut_off == 1 and sorted(run.steps) == [1, 2] and run.repeated == 0
    MetricsLog(path).close()  # a log that ends whole gets no extra line
    assert len(path.read_text().splitlines()) == 3
