"""`shardlm study`: the largest-batch search against a synthetic memory model (exact), resuming,
every study's --quick report and plots with an injected runner (fast), and max-batch and
zero-sweep --quick for real (each point a `shardlm train` run on 2 gloo ranks)."""

import json
import math

import pytest

from shardlm.cli.main import main
from shardlm.errors import ConfigError
from shardlm.studies import NAMES, run_study
from shardlm.studies.points import MiB, Point, PointStore, largest_fitting, summarise
from shardlm.studies.report import PNG_SIGNATURE
from shardlm.studies.specs import QUICK, STRATEGIES


def _memory(base: float, per: float, cap: float):
    return lambda b: base + per * b <= cap


@pytest.mark.parametrize("base,per,cap,limit", [
    (400, 5, 425, 64), (400, 5, 399, 64), (400, 5, 405, 64), (400, 5, 1e9, 64), (0, 3, 100, 7),
    (10, 1, 200, 1000), (10, 7.5, 97.5, 33), (0, 1, 1, 1), (0, 1, 0.5, 1), (100, 0.01, 100.37, 4096)])
def test_search_finds_the_boundary_of_a_synthetic_memory_model(base, per, cap, limit):
    fits = _memory(base, per, cap)
    best, probes = largest_fitting(fits, limit)
    exact = max(0, min(limit, math.floor((cap - base) / per)))
    assert best == exact
    assert len(probes) == len(set(probes))  # no point is probed twice
    assert len(probes) <= 2 * math.ceil(math.log2(limit + 1)) + 1  # exponential then bisection
    doubling = [p for p in probes if p & (p - 1) == 0]
    assert probes[:len(doubling)] == doubling  # powers of two first


def test_search_rejects_a_limit_below_one():
    with pytest.raises(ValueError, match="limit 0"):
        largest_fitting(lambda b: True, 0)


BASE_MIB, PER_SEQUENCE_MIB, STAGE_SAVING_MIB = 400.0, 10.0, 8.0


def synthetic(point: Point, out) -> dict:
    """A runner whose peak memory is a known line in the micro-batch, falling with the stage."""
    o = dict(point.overrides)
    stage, b = o.get("parallel.zero_stage", 0), o["train.micro_batch"]
    peak = (BASE_MIB - STAGE_SAVING_MIB * stage + PER_SEQUENCE_MIB * b) * MiB
    records = [{"tokens_per_s": 1000.0 * point.ranks, "mfu": 0.01, "hfu": 0.01, "step_time_s": 0.1,
                "peak_rss_bytes": peak, "model_state_bytes": (4 - stage) * MiB, "comm_bytes": 2 * MiB,
                "loss": 6.0}] * 3
    synthetic.calls.append(point.key)
    return summarise(records)


synthetic.calls = []


def _check_pngs(out, names):
    import matplotlib.image

    for name in names:
        path = out / f"{name}.png"
        assert path.read_bytes()[:8] == PNG_SIGNATURE, name
        assert matplotlib.image.imread(path).ndim == 3
        assert path.stat().st_size < 150_000


def test_max_batch_study_finds_the_synthetic_boundary_and_resumes(tmp_path):
    cap = 415.0  # with the synthetic model: DDP 1, ZeRO-1 2, the quick limit
    synthetic.calls.clear()
    report = run_study("max-batch", tmp_path, quick=True, cap_mib=cap, runner=synthetic)
    first = len(synthetic.calls)
    assert first > 0 and report.exists()
    series = json.loads((tmp_path / "plots.json").read_text())
    measured = dict(series["max_batch"][f"measured here (cap {cap:g} MiB)"])
    limit = QUICK["max-batch"].max_batch
    for key in QUICK["max-batch"].strategies:
        stage = STRATEGIES[key].stage
        exact = min(limit, math.floor((cap - BASE_MIB + STAGE_SAVING_MIB * stage) / PER_SEQUENCE_MIB))
        assert measured[STRATEGIES[key].label] == exact
    assert measured[STRATEGIES["ddp"].label] < measured[STRATEGIES["zero3"].label]
    assert set(series["memory_vs_batch"]) == {STRATEGIES[k].label for k in QUICK["max-batch"].strategies}
    _check_pngs(tmp_path, ["max_batch", "memory_vs_batch"])
    # A rerun takes every finished point from points.jsonl and writes the same report.
    text = report.read_text()
    run_study("max-batch", tmp_path, quick=True, cap_mib=cap, runner=synthetic)
    assert len(synthetic.calls) == first
    assert report.read_text() == text


def test_failed_points_are_retried_and_finished_ones_kept(tmp_path):
    calls = []

    def flaky(point, out):
        calls.append(point.key)
        return {"error": "exit status 1: boom"} if len(calls) == 1 else synthetic(point, out)

    store = PointStore(tmp_path, flaky)
    a = Point.make("a", 2, {"train.micro_batch": 1})
    assert "error" in store.measure(a)
    assert "error" not in store.measure(a)
    again = PointStore(tmp_path, flaky)
    assert "error" not in again.measure(a)
    assert len(calls) == 2 and again.ran == 0


@pytest.mark.parametrize("name", NAMES)
def test_every_quick_study_writes_its_report_and_plots(tmp_path, name):
    report = run_study(name, tmp_path, quick=True, runner=synthetic)
    text = report.read_text()
    assert "## Measured points" in text and "shardlm train " in text
    series = json.loads((tmp_path / "plots.json").read_text())
    assert series and all(series.values()), f"an empty plot: {[k for k, v in series.items() if not v]}"
    _check_pngs(tmp_path, series)
    for name_ in series:
        assert f"({name_}.png)" in text
    assert (tmp_path / "predicted.jsonl").read_text().strip()
    rows = [json.loads(line) for line in (tmp_path / "points.jsonl").read_text().splitlines()]
    assert rows and all("shardlm train " in r["command"] for r in rows)


def test_scaling_series_cover_the_ranks_and_1024_devices(tmp_path):
    run_study("scaling", tmp_path, quick=True, runner=synthetic)
    series = json.loads((tmp_path / "plots.json").read_text())
    assert [x for x, _ in series["scaling_measured"]["weak"]] == [1, 2]
    assert [x for x, _ in series["scaling_throughput"]["strong"]] == list(QUICK["scaling"].predicted_ranks)
    assert max(QUICK["scaling"].predicted_ranks) == 1024


def test_one_core_per_rank(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {3, 0, 2, 1}, raising=False)
    one = Point.make("a", 1, {"train.micro_batch": 1})
    assert one.cores == [0] and one.command.startswith("taskset -c 0 shardlm train ")
    assert Point.make("a", 2, {}).command.startswith("taskset -c 0,1 shardlm train ")
    four = Point.make("a", 4, {})
    assert four.cores is None and four.command.startswith("shardlm train ") and "--nproc 4" in four.command


def test_bad_options_are_refused_early(tmp_path):
    with pytest.raises(ConfigError, match="unknown study"):
        run_study("nope", tmp_path)
    with pytest.raises(ConfigError, match="predicts a GPU"):
        run_study("max-batch", tmp_path, quick=True, gpus="2xcpu", runner=synthetic)
    with pytest.raises(ConfigError, match="--cap-mib"):
        run_study("max-batch", tmp_path, quick=True, cap_mib=-1, runner=synthetic)


# ---------------------------------------------------------------------------------------------
# For real: each point a `shardlm train` run


def test_zero_sweep_quick_for_real(tmp_path, capsys):
    out = tmp_path / "zs"
    assert main(["study", "zero-sweep", "--quick", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "points.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and not [r for r in rows if "error" in r["result"]]
    assert len(list((out / "raw").glob("*.jsonl"))) == 4
    series = json.loads((out / "plots.json").read_text())
    states = dict(series["sweep_measured_states"]["gpt-tiny, 2 rank(s)"])
    # The byte ledger on 2 ranks: each stage shards more (ZeRO table: 16, 4 + 12/2, 2 + 14/2, 16/2 for
    # mixed precision; here fp32, K = 8: 16, 8 + 8/2, 4 + 12/2, 16/2 bytes per parameter).
    assert states[0] > states[1] > states[2] > states[3]
    assert states[0] / states[3] == pytest.approx(2, rel=0.02)
    _check_pngs(out, series)
    assert "| gpt-tiny | 2 | 3 |" in (out / "report.md").read_text()


def test_max_batch_quick_for_real(tmp_path):
    out = tmp_path / "mb"
    assert main(["study", "max-batch", "--quick", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "points.jsonl").read_text().splitlines()]
    assert rows and not [r for r in rows if "error" in r["result"]]
    series = json.loads((out / "plots.json").read_text())
    assert set(dict(series["memory_vs_batch"])) == {STRATEGIES[k].label for k in QUICK["max-batch"].strategies}
    for label, pts in series["memory_vs_batch"].items():
        assert all(p > 0 for _, p in pts), label
    _check_pngs(out, series)
    text = (out / "report.md").read_text()
    assert "largest b (measured)" in text and "--nproc 2" in text
