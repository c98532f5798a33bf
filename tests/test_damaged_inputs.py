"""Damaged caches and files (issue 46): a damaged cache never blocks a run — moved aside with one
warning, measured or built again — and a damaged file the user names never silently changes it
— an error naming the file and what to do; a dead rank is one line at any world size.

Before: a truncated hardware_probe.json ended every `shardlm train` / `calibrate` with a
JSONDecodeError traceback until the user found and deleted it; a dangling chat_template.jinja
trained on our default template, exit 0; `shardlm compare` on a metrics.jsonl of binary garbage
was a UnicodeDecodeError traceback; random bytes named .parquet were a pyarrow traceback; a rank
killed in a 4-rank ZeRO-3 run printed torch's elastic failure report and the survivors'
tracebacks (195 lines). The probe's collectives (two spawned ranks, ~1 min here) and its timed
loops (matmuls, element-wise passes, AdamW over 16M parameters, 256 MiB copies: ~10 s of CPU per
thread count) are stubbed: what is under test is the cache file, not the measurement; the
cache's own code (read, move aside, measure what is missing, write) runs as it is."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import private_cache, tiny_overrides
from shardlm.cli import main as cli
from shardlm.errors import ConfigError
from shardlm.hardware import probe


def _args(overrides: dict) -> list[str]:
    return ["train", *[f"--{k}={v}" for k, v in overrides.items()]]


def _stub_collectives(monkeypatch) -> None:
    """gloo_probe and in_step_probe spawn ranks for a minute; their figures here are stand-ins.
    So are the timed loops' (each a plausible finite rate, so every entry is cached as measured
    and a process reading the cache measures nothing again)."""
    monkeypatch.setattr(probe, "gloo_probe", lambda: {"gloo_latency": 1e-4, "gloo_bandwidth": 1e9,
                                                      "baseline_rss": 3e8})
    monkeypatch.setattr(probe, "in_step_probe", lambda n, latency, bandwidth: {
        "gloo_in_step_latency": latency, "gloo_in_step_bandwidth": bandwidth})
    flops = 1.5e10
    monkeypatch.setattr(probe, "_time_matmul", lambda dtype, seconds=0.5: flops)
    monkeypatch.setattr(probe, "_time_product", lambda m, k, n, *a, **kw: {"best_s": 2 * m * k * n / flops,
                                                                          "median_s": 2 * m * k * n / flops})
    for name, value in (("_memory_bandwidth", 2e10), ("_elementwise_bandwidth", 1e10),
                        ("_fresh_bandwidth", 5e9), ("_adamw_seconds_per_param", 1e-9), ("_op_seconds", 5e-6)):
        monkeypatch.setattr(probe, name, lambda *a, _value=value, **kw: _value)


def _damaged_warnings(caplog, path: Path) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and str(path) in r.getMessage() and "damaged" in r.getMessage()]


# -- 1. caches: moved aside, measured / built again ---------------------------------------------


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "not_a_table", "bad_entry"])
def test_a_damaged_probe_cache_is_moved_aside_and_measured_again(tmp_path, monkeypatch, caplog, damage):
    path = tmp_path / "hardware_probe.json"
    monkeypatch.setattr(probe, "_cache_path", lambda: path)
    monkeypatch.setattr(probe, "_time_matmul", lambda dtype: 1.5e10)
    key = f"v{probe._VERSION}|{probe.cpu_name()}|torch {probe.torch.__version__}|threads=1|matmul fp32"
    good = json.dumps({key: 2.5e10, "v1|old|entry": {"x": 1}}, indent=1)
    path.write_bytes({"truncated": good[:len(good) // 2].encode(), "garbage": os.urandom(300),
                      "empty": b"", "not_a_table": b"[1, 2, 3]",
                      "bad_entry": json.dumps({key: "fast"}).encode()}[damage])
    with caplog.at_level(logging.WARNING, logger="shardlm"):
        assert probe.cpu_peak_flops("fp32", 1) == 1.5e10  # measured again, not read
        assert probe.cpu_peak_flops("fp32", 1) == 1.5e10  # and now cached
    warnings = _damaged_warnings(caplog, path)
    aside = list(tmp_path.glob("hardware_probe.json.damaged-*"))
    if damage == "bad_entry":  # a whole JSON table, one entry the wrong shape: that entry again
        assert not warnings and not aside
    else:
        assert len(warnings) == 1 and "moved aside" in warnings[0], caplog.text
        assert len(aside) == 1
    assert json.loads(path.read_text()) == {key: 1.5e10}  # a valid cache left behind
    assert not list(tmp_path.glob("*.part"))


def test_a_run_with_a_truncated_probe_cache_trains_and_leaves_a_valid_cache(tmp_path, monkeypatch,
                                                                            session_cache, caplog, capsys):
    """The issue's done-when: before, a JSONDecodeError traceback before any run directory."""
    cache = tmp_path / "cache"
    cache.mkdir()
    private_cache(monkeypatch, cache)
    _stub_collectives(monkeypatch)
    whole = json.dumps({f"v{probe._VERSION}|{probe.cpu_name()}|torch {probe.torch.__version__}|"
                        f"threads={n}|matmul {p}": 1e10 for n in (1, 2) for p in probe.DTYPES}, indent=1)
    (cache / "hardware_probe.json").write_text(whole[:len(whole) // 3])  # a crash mid-write
    overrides = tiny_overrides(tmp_path, run__name="probe", train__steps=1,
                               data__cache_dir=str(session_cache))  # the session's tokens
    with caplog.at_level(logging.WARNING, logger="shardlm"):
        assert cli.main(_args(overrides)) == 0, capsys.readouterr().err
    assert "Traceback" not in capsys.readouterr().err
    assert len(_damaged_warnings(caplog, cache / "hardware_probe.json")) == 1, caplog.text
    table = json.loads((cache / "hardware_probe.json").read_text())
    assert any(key.endswith("|machine") for key in table) and any(key.endswith("|matmul fp32") for key in table)
    assert len(list(cache.glob("hardware_probe.json.damaged-*"))) == 1
    assert (tmp_path / "runs" / "probe" / "metrics.jsonl").is_file()


def _measure_slowly(calls: Path, barrier) -> None:
    """One process of the test below: wait for the other, then read the entry (a slow measure)."""
    def measure() -> float:
        with open(calls, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(2.0)  # the other process reads the table meanwhile: it misses the entry too
        return 1.5e10

    barrier.wait()
    assert probe._cached("threads=1|slow entry", measure) == 1.5e10


def test_two_processes_missing_one_probe_entry_measure_it_once(tmp_path, monkeypatch):
    """The probe's lock (hardware/probe.py _measuring): of two processes that miss one entry at
    once (the suite's xdist workers share a probe file), one measures and the other waits, then
    reads what it wrote. Without the lock both measure (two lines in `calls`). Forked: nothing
    re-imported, no torch op in the children."""
    import multiprocessing

    cache = private_cache(monkeypatch, tmp_path / "cache")
    calls = tmp_path / "calls"
    fork = multiprocessing.get_context("fork")
    barrier = fork.Barrier(2)
    procs = [fork.Process(target=_measure_slowly, args=(calls, barrier)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert len(calls.read_text().split()) == 1, calls.read_text()
    assert list(json.loads((cache / "hardware_probe.json").read_text()).values()) == [1.5e10]


@pytest.mark.parametrize("damage", ["tokens_cut", "meta_garbage", "tokenizer_cut"])
def test_a_damaged_token_cache_entry_is_rebuilt(tmp_path, caplog, damage):
    from shardlm.config.schema import DataConfig
    from shardlm.data.loader import build_dataset

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 800)
    cfg = DataConfig(source=str(corpus), cache_dir=str(tmp_path / "cache"), val_fraction=0.1)
    first = build_dataset(cfg, 300)
    entry, expected = first.cache_dir, (first.train.tolist(), first.val.tolist())
    del first  # its memmap of tokens.bin, cut short below in place
    target = {"tokens_cut": "tokens.bin", "meta_garbage": "meta.json", "tokenizer_cut": "tokenizer.json"}[damage]
    data = (entry / target).read_bytes()
    (entry / target).write_bytes(b"\x00\xff garbage" if damage == "meta_garbage" else data[:len(data) // 2])
    with caplog.at_level(logging.WARNING, logger="shardlm"):
        again = build_dataset(cfg, 300)
    assert len(_damaged_warnings(caplog, entry / target)) == 1, caplog.text
    assert (again.train.tolist(), again.val.tolist()) == expected
    assert len(list(entry.glob(f"{target}.damaged-*"))) == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shardlm"):
        build_dataset(cfg, 300)  # whole again: read, not rebuilt
    assert not caplog.records


# -- 2. a checkpoint file that exists by name but cannot be read --------------------------------


def test_a_dangling_chat_template_is_an_error_not_our_default(tmp_path, capsys):
    from test_hf_path import WORDS, make_hf_dir, overrides

    hf_dir, _ = make_hf_dir(tmp_path, "gpt2")
    chats = tmp_path / "chat.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"{WORDS[i]} {WORDS[i + 1]}"},
                                                      {"role": "assistant", "content": WORDS[i + 2]}]}) + "\n"
                             for i in range(40)))
    (hf_dir / "chat_template.jinja").symlink_to(tmp_path / "blobs" / "missing")  # a hub snapshot
    values = overrides(tmp_path, hf_dir, run__name="chat", data__format="chat", data__source=str(chats))
    assert cli.main(_args(values)) == 2
    err = capsys.readouterr().err
    assert f"its chat template {str(hf_dir / 'chat_template.jinja')!r} is a link to" in err, err
    assert "which does not exist" in err and "download the checkpoint's tokenizer files again" in err
    assert "Traceback" not in err and not (tmp_path / "runs" / "chat").exists()


@pytest.mark.parametrize("damage", ["dangling", "directory", "not_utf8"])
def test_unreadable_checkpoint_files_are_named(tmp_path, damage):
    from shardlm.data.sft import find_chat_template
    from shardlm.data.tokenizer import hf_tokenizer

    for name in ("chat_template.jinja", "tokenizer_config.json", "tokenizer.json"):
        root = tmp_path / damage / name
        root.mkdir(parents=True)
        if damage == "dangling":
            (root / name).symlink_to(root / "gone")
        elif damage == "directory":
            (root / name).mkdir()
        else:
            (root / name).write_bytes(b"\xff\xfe{\x00")
        reason = {"dangling": "is a link to .*, which does not exist", "directory": "is a directory",
                  "not_utf8": "is not UTF-8 text"}[damage]
        with pytest.raises(ConfigError, match=f"{name}' {reason}"):
            if name == "tokenizer.json":
                hf_tokenizer(root, 100)
            else:
                find_chat_template(root)


def test_the_default_template_is_said_when_the_checkpoint_has_none(tmp_path, caplog):
    from tokenizers import Tokenizer, models

    from shardlm.config.schema import DataConfig
    from shardlm.data.sft import check_chat_template

    chats = tmp_path / "chat.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "a"},
                                              {"role": "assistant", "content": "b"}]}) + "\n")
    (tmp_path / "model").mkdir()
    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<unk>": 2}, unk_token="<unk>"))
    with caplog.at_level(logging.WARNING, logger="shardlm"):
        assert check_chat_template(DataConfig(source=str(chats), format="chat"), str(tmp_path / "model"), tok) is None
    assert "has no chat template" in caplog.text and "shardlm's default" in caplog.text


# -- 3. run files read defensively ----------------------------------------------------------------


def test_compare_names_the_line_of_binary_garbage(tmp_path, capsys):
    good = tmp_path / "a.jsonl"
    good.write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    bad = tmp_path / "b.jsonl"
    bad.write_bytes(good.read_bytes() + b"\x93\xff\x00binary\n")
    assert cli.main(["compare", str(good), str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:2: not UTF-8 text" in err and "Traceback" not in err, err


# -- 5. data sources sniffed by content -----------------------------------------------------------


@pytest.mark.parametrize("name", ["blob.jsonl", "blob.parquet", "blob.arrow", "blob.md"])
def test_binary_data_under_any_accepted_name_is_refused(tmp_path, name):
    from shardlm.config.schema import DataConfig
    from shardlm.data.corpus import check_text_files

    (tmp_path / name).write_bytes(os.urandom(20_000))
    with pytest.raises(ConfigError, match=f"{name}' is not (UTF-8 text|a \\.(parquet|arrow) table)"):
        check_text_files(DataConfig(source=str(tmp_path / name)))


def test_real_tables_pass_the_sniff(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    from shardlm.config.schema import DataConfig
    from shardlm.data.corpus import check_text_files

    pq.write_table(pa.table({"text": ["a", "b"]}), tmp_path / "t.parquet")
    datasets.Dataset.from_list([{"text": "a"}]).save_to_disk(str(tmp_path / "saved"))  # Arrow stream
    for source in (tmp_path / "t.parquet", tmp_path / "saved"):
        check_text_files(DataConfig(source=str(source)))


# -- 4. a dead rank: one line, at any world size ------------------------------------------------


def test_a_rank_killed_in_a_four_rank_zero3_run_is_one_line(tmp_path, monkeypatch, session_cache):
    from test_faults import _chaos

    chaos = _chaos()

    cache = tmp_path / "cache"
    private_cache(monkeypatch, cache)  # the workers read the probe written here
    _stub_collectives(monkeypatch)
    probe.measure_cpu(4)  # the launcher's and rank 0's reading of it, cached: nothing spawned
    run_dir = tmp_path / "runs" / "dead"
    values = tiny_overrides(tmp_path, run__name="dead", train__steps=1000, checkpoint__every=2,
                            train__log_every=1, data__cache_dir=str(session_cache))
    command = [sys.executable, "-m", "shardlm", "train", "--nproc", "4", "--parallel.zero_stage=3",
               *_args(values)[1:]]
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert chaos._wait_for(lambda: (run_dir / "checkpoints" / "latest").exists(), launcher, 300, 0.05)
        victim = next(w for w in chaos.children(launcher.pid) if chaos.rank_of(w) == 3)
        os.kill(victim, signal.SIGKILL)
        out, _ = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    text = out.decode(errors="replace")
    assert launcher.returncode == 1, text
    lines = [line for line in text.splitlines() if "rank 3" in line and "SIGKILL" in line]
    assert len(lines) == 1, text
    assert lines[0].startswith("shardlm: rank 3 was killed by SIGKILL after step ")
    assert f"last checkpoint: {run_dir / 'checkpoints'}/step-" in lines[0]
    assert f"resume with: shardlm train --resume {run_dir}" in lines[0]
    assert f"(detail: {run_dir / 'launcher.log'})" in lines[0]
    for noise in ("Traceback", "[rank", "Root Cause", "FAILED", "closing signal", "exitcode"):
        assert noise not in text, (noise, text)
    detail = (run_dir / "launcher.log").read_text()
    assert "Root Cause" in detail and "SIGKILL" in detail and "Traceback" in detail


def test_the_dead_rank_is_the_one_killed_not_the_ones_torchrun_stopped():
    """torchrun SIGTERMs the survivors once a rank died: a survivor that dies of it is not news."""
    from types import SimpleNamespace as Failure

    from shardlm.launch.failures import dead_rank, failure_line

    assert dead_rank({0: Failure(exitcode=1, timestamp=5), 1: Failure(exitcode=-15, timestamp=5),
                      3: Failure(exitcode=-9, timestamp=5)})[0] == 3
    assert dead_rank({0: Failure(exitcode=-15, timestamp=5), 2: Failure(exitcode=-15, timestamp=4)})[0] == 2
    assert dead_rank({0: Failure(exitcode=4, timestamp=5), 1: Failure(exitcode=-15, timestamp=5)}) is None
    assert dead_rank({0: Failure(exitcode=2, timestamp=5), 1: Failure(exitcode=1, timestamp=4)}) is None
    assert (failure_line(3, -9, None, None)
            == "rank 3 was killed by SIGKILL; resume with: shardlm train --resume <run directory>")


def test_the_relay_holds_a_ranks_traceback_and_passes_the_rest(capfd):
    from shardlm.launch.relay import StderrRelay

    with StderrRelay() as relay:
        os.write(2, b"step 1\n[rank1]: Traceback (most recent call last):\n[rank0]:[W gloo] a warning\n"
                    b"[rank1]:   File \"x.py\"\n[rank1]: RuntimeError: Connection reset by peer\nbar 3/6\r")
        time.sleep(0.3)
    err = capfd.readouterr().err
    assert err == "step 1\n[rank0]:[W gloo] a warning\nbar 3/6\r", err
    assert relay.held() == {1: "[rank1]: Traceback (most recent call last):\n[rank1]:   File \"x.py\"\n"
                                "[rank1]: RuntimeError: Connection reset by peer\n"}
    relay.show_held()  # a job that ended otherwise: the traceback is the news
    assert "RuntimeError: Connection reset by peer" in capfd.readouterr().err


@pytest.mark.parametrize("name, damage", [("config.json", b'{"model": {"pres'),
                                          ("tokenizer.json", b"\x00\x01binary\xff"),
                                          ("model.safetensors", b"\x00\x01")])
def test_a_damaged_run_file_is_named_by_eval_and_export(tmp_path, name, damage):
    """A run directory whose config.json is cut short, or whose tokenizer.json or weights are
    garbage: load_for_inference (what eval, export, generate and chat read) names the file, no traceback."""
    from shardlm.checkpoint.weights import CONFIG, TOKENIZER, WEIGHTS, load_for_inference
    from shardlm.config.load import load_config

    run = tmp_path / "run"
    run.mkdir()
    (run / CONFIG).write_text(json.dumps(load_config(overrides={"model.preset": "gpt-tiny"}).to_dict()))
    from tokenizers import Tokenizer, models
    Tokenizer(models.BPE()).save(str(run / TOKENIZER))
    (run / WEIGHTS).write_bytes(b"")
    (run / name).write_bytes(damage)
    assert name in (CONFIG, TOKENIZER, WEIGHTS)
    with pytest.raises(ConfigError, match=name.replace(".", r"\.")):
        load_for_inference(run, __import__("torch").device("cpu"))
