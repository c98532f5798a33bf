"""bench/common/, the benches' one toolkit: the arithmetic every bench table rests on (which
step a group of ranks takes, how repeats combine, in which order rounds run), the command lines
and JSONL reading of common.cli, without processes or timing."""

import os
import sys
from pathlib import Path

import pytest

BENCH = str(Path(__file__).resolve().parent.parent / "bench")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)  # as `python bench/x.py` has it: the benches import `common`

import common  # noqa: E402
from common import cli  # noqa: E402


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


def test_step_overrides_count_warmup_and_timed_steps_and_let_the_users_set_win():
    args = type("Args", (), {"preset": "gpt-tiny", "seq": 64, "warmup": 2, "steps": 3,
                             "set": ["train.micro_batch=4"]})()
    over = common.step_overrides(args, "/tmp/r", {"train.micro_batch": 2, "parallel.tp": 2})
    assert (over["train.steps"], over["train.seq_len"], over["model.preset"]) == (5, 64, "gpt-tiny")
    assert (over["train.micro_batch"], over["parallel.tp"], over["run.dir"]) == (4, 2, "/tmp/r")


def test_read_jsonl_skips_torn_lines_and_keeps_the_records_with_the_key(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert cli.read_jsonl(path) == []  # no file yet: a run killed before its first record
    path.write_text('{"step": 1, "loss": 2.5}\n{"step": 1, "val_loss": 3.0}\n\n{"step": 2, "lo')
    assert cli.read_jsonl(path, "loss") == [{"step": 1, "loss": 2.5}]
    assert len(cli.read_jsonl(path)) == 2


def test_train_argv_is_the_users_command_line():
    argv = cli.train_argv({"train.steps": 3}, "--resume", nproc=2, restarts=1)
    assert argv[1:] == ["-m", "shardlm", "train", "--nproc", "2", "--max-restarts", "1", "--train.steps=3",
                        "--resume"]
    assert cli.src_env(X="1")["PYTHONPATH"].split(os.pathsep)[0] == str(cli.REPO / "src")


@pytest.mark.parametrize("cores,ranks,threads", [(2, 2, 1), (16, 2, 8), (2, 4, 1)])
def test_threads_per_rank_split_the_cores(monkeypatch, cores, ranks, threads):
    monkeypatch.setattr(common, "cpu_cores", lambda: cores)
    assert common.threads_per_rank(ranks) == threads
