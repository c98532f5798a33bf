"""Every run owns its run directory: a new run gets a new one (unique name, created exclusively),
and a directory is locked by its run's rank 0 for the run's life, so a second run pointed at it
stops with the holder's pid instead of writing into it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import tiny_overrides
from shardlm.config.load import load_config
from shardlm.errors import ConfigError
from shardlm.launch.runtime import Runtime
from shardlm.launch.run_dir import RUN_LOCK, lock_run_dir, release_run_dir
from shardlm.train.build import make_run_dir

ONE_PROCESS = Runtime(0, 1, 0, 1, torch.device("cpu"), None)


def _cfg(tmp_path, **extra):
    return load_config(overrides=tiny_overrides(tmp_path, **extra)).validate()


def _train(tmp_path, *extra: str, **overrides) -> subprocess.Popen:
    args = [f"--{k}={v}" for k, v in tiny_overrides(tmp_path, **overrides).items()]
    return subprocess.Popen([sys.executable, "-m", "shardlm", "train", *args, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _run_dirs(tmp_path) -> list[Path]:
    runs = tmp_path / "runs"
    return sorted(d for d in runs.iterdir() if d.is_dir() and not d.is_symlink())


def test_unnamed_runs_in_the_same_second_get_their_own_directories(tmp_path, monkeypatch):
    monkeypatch.setattr(time, "strftime", lambda *_: "20250101-120000")  # the same second
    cfg = _cfg(tmp_path)
    first, second = make_run_dir(cfg.run, ONE_PROCESS), make_run_dir(cfg.run, ONE_PROCESS)
    assert first != second and first.is_dir() and second.is_dir()
    assert first.name.startswith("20250101-120000-") and second.name.startswith("20250101-120000-")
    for run_dir in (first, second):
        assert (run_dir / RUN_LOCK).read_text().startswith(f"pid {os.getpid()} ")
        release_run_dir(run_dir)


def test_named_directory_may_exist_and_is_reentrant_in_one_process(tmp_path):
    cfg = _cfg(tmp_path, run__name="again")
    (tmp_path / "runs" / "again").mkdir(parents=True)  # a run to resume
    assert make_run_dir(cfg.run, ONE_PROCESS) == make_run_dir(cfg.run, ONE_PROCESS)  # one process: its own
    release_run_dir(Path(cfg.run.dir) / "again")


def test_second_run_on_a_locked_directory_names_the_holder(tmp_path):
    first = _train(tmp_path, train__steps=100_000, run__name="shared")
    try:
        metrics = tmp_path / "runs" / "shared" / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while not (metrics.exists() and metrics.read_text().strip()):  # training: it holds the dir
            assert first.poll() is None, first.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the first run did not start training"
            time.sleep(0.1)
        second = _train(tmp_path, train__steps=2, run__name="shared")
        _, err = second.communicate(timeout=240)
        assert second.returncode == 2, err[-3000:]
        assert f"is in use by another run (pid {first.pid} on " in err
        assert "choose another run.name" in err
    finally:
        first.kill()
        first.communicate()
    # The lock died with its holder: the directory is free again.
    lock_run_dir(tmp_path / "runs" / "shared")
    release_run_dir(tmp_path / "runs" / "shared")


def test_unnamed_runs_started_together_get_different_directories(tmp_path):
    procs = [_train(tmp_path, train__steps=1) for _ in range(2)]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
    dirs = _run_dirs(tmp_path)
    assert len(dirs) == 2, dirs
    assert all((d / "metrics.jsonl").read_text().count("\n") == 1 for d in dirs)


def ranks_make_run_dir(rank: int, world_size: int, overrides: dict) -> str:
    from shardlm.launch.runtime import init_runtime

    try:
        return str(make_run_dir(load_config(overrides=overrides).run, init_runtime("cpu")))
    except ConfigError as e:
        return f"ConfigError: {e}"


def test_ranks_share_rank_0s_directory_and_its_error(tmp_path):
    from shardlm.launch.spawn import run_ranks
    from worlds import several

    unnamed = tiny_overrides(tmp_path)
    held = tiny_overrides(tmp_path, run__name="held")
    (tmp_path / "runs" / "held").mkdir(parents=True)
    lock_run_dir(tmp_path / "runs" / "held")  # this process holds it: rank 0 must not get it
    try:  # both in one spawned world (tests/worlds.py): the ranks' start-up paid once
        ranks = run_ranks(several, 2, tmp_path, [(ranks_make_run_dir, (unnamed,)),
                                                 (ranks_make_run_dir, (held,))])
    finally:
        release_run_dir(tmp_path / "runs" / "held")
    out = [rank[0] for rank in ranks]
    assert out[0] == out[1] and Path(out[0]).is_dir(), out
    out = [rank[1] for rank in ranks]  # no rank may hang: both hear
    for text in out:
        assert text.startswith("ConfigError: ") and f"(pid {os.getpid()} on " in text, out


def test_run_dir_that_cannot_be_created_is_a_config_error(tmp_path):
    (tmp_path / "file").write_text("")
    cfg = load_config(overrides={"run.dir": str(tmp_path / "file")})
    with pytest.raises(ConfigError, match="cannot create the run directory under"):
        make_run_dir(cfg.run, ONE_PROCESS)
