"""bench/common.py, the benches' one toolkit: the arithmetic every bench table rests on (which
step a group of ranks takes, how repeats combine, in which order rounds run), without
processes or timing."""

import importlib.util
import sys
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location(
    "bench_common", Path(__file__).resolve().parent.parent / "bench" / "common.py")
common = importlib.util.module_from_spec(spec)
spec.loader.exec_module(common)


def test_timed_steps_times_only_the_steps_after_warmup_and_calls_after_on_every_step():
    seen = []
    out = common.timed_steps(lambda s: float(s), 2, 3, lambda s, seconds: seen.append(s))
    assert out["losses"] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert len(out["seconds"]) == len(out["cpu"]) == 3
    assert seen == [0, 1, 2, 3, 4]


def test_summarize_takes_the_slowest_ranks_median_and_the_highest_memory():
    ranks = [{"seconds": [1.0, 3.0, 2.0], "cpu": [1.0, 1.0, 1.0], "losses": [5.0, 4.0], "rss": 10, "setup_rss": 7,
              "ledgers": [{"all_reduce/dp": 8}, {"all_reduce/dp": 8}]},
             {"seconds": [4.0, 4.0, 9.0], "cpu": [2.0, 2.0, 2.0], "losses": [5.0, 4.0], "rss": 30, "setup_rss": 6}]
    m = common.summarize(ranks, tokens_per_step=100)
    assert m["step_s"] == 4.0 and m["tok_s"] == 25.0  # rank 1's median, not the mean or the max step
    assert (m["cpu_s"], m["rss"], m["setup_rss"]) == (2.0, 30, 7)
    assert (m["first"], m["last"], m["ledger"], m["ledger_steady"]) == (5.0, 4.0, {"all_reduce/dp": 8}, True)
    assert common.summarize([{"seconds": [1.0], "losses": [1.0]}], 1)["ledger"] is None  # a torch side


def test_combine_reports_the_median_speed_its_range_and_whether_the_losses_repeated():
    runs = [{"tok_s": s, "first": 5.0, "last": 4.0, "ledger": None, "rss": r} for s, r in ((30, 1), (10, 3), (20, 2))]
    m = common.combine(runs)
    assert (m["tok_s"], m["tok_s_range"], m["rss"], m["repeatable"]) == (20, (10, 30), 3, True)
    assert common.speed_text(m) == "20 (10-30)"
    assert not common.combine([*runs, {**runs[0], "last": 4.5}])["repeatable"]


def test_rounds_rotate_the_case_order_so_load_hits_every_case_alike(capsys):
    calls = []

    def measure(key):
        calls.append(key)
        return {"tok_s": 1.0, "first": 2.0, "last": 1.0}

    runs = common.rounds(["a", "b", "c"], 3, measure)
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert {k: len(v) for k, v in runs.items()} == {"a": 3, "b": 3, "c": 3}
    assert capsys.readouterr().out.count("round ") == 9


def test_ledger_by_group_and_the_table_it_prints():
    ledger = {"all_gather/dp": 3 * common.MiB, "reduce_scatter/dp": common.MiB, "all_reduce/tp": common.MiB}
    assert common.by_group(ledger) == {"dp": 4 * common.MiB, "tp": common.MiB}
    assert common.ledger_text(ledger, steady=False) == "dp 4.00, tp 1.00 (varies by step)"
    assert common.ledger_text(None) == "– (not shardlm)"
    assert common.table(("case", "tok/s"), [["x", 1]]).splitlines() == ["| case | tok/s |", "|---|---|", "| x | 1 |"]


def test_run_overrides_let_the_users_set_win_typed(monkeypatch):
    over = common.run_overrides("/tmp/r", ["precision.compute=bf16", "model.d_model=512"])
    assert over["precision.compute"] == "bf16" and over["model.d_model"] == 512
    assert over["run.dir"] == "/tmp/r" and over["train.eval_every"] == 0
    monkeypatch.setattr(sys, "argv", ["bench/bench_tp.py", "--cases", "tp,torch-tp"])
    assert common.reproduce() == "Reproduce: PYTHONPATH=src python bench/bench_tp.py --cases tp,torch-tp"


@pytest.mark.parametrize("cores,ranks,threads", [(2, 2, 1), (16, 2, 8), (2, 4, 1)])
def test_threads_per_rank_split_the_cores(monkeypatch, cores, ranks, threads):
    monkeypatch.setattr(common, "cpu_cores", lambda: cores)
    assert common.threads_per_rank(ranks) == threads
