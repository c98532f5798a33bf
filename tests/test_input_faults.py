"""Faults of part B (issue 25): a disk that fills up during a checkpoint write, a resume from a
run directory whose newest checkpoint has a corrupted shard, and inputs refused before the run
directory exists (an invalid tokenizer.json, a LoRA rank larger than its layer, binary files
posing as text). Disk faults are injected in-process (no disk is filled)."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from conftest import tiny_overrides
from shardlm import cli
from shardlm.checkpoint import sharded
from shardlm.checkpoint.manifest import CHECKPOINTS, LATEST


def _args(overrides: dict) -> list[str]:
    return ["train", *[f"--{k}={v}" for k, v in overrides.items()]]


class _FillingFile:
    """A file whose writes stop with ENOSPC after `room` bytes: the disk fills mid-write."""

    def __init__(self, f, room: int):
        self._f, self._room = f, room

    def write(self, data) -> int:
        n = memoryview(data).nbytes
        if n > self._room:
            self._f.write(memoryview(data)[:self._room])  # what fitted is on disk
            self._f.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._room -= n
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)


def _disk_fills_after_first_checkpoint(monkeypatch, checkpoints: Path, code: int = errno.ENOSPC):
    """sharded.py's open: after `latest` exists, a shard's write runs out of room mid-file."""
    real = open

    def filling_open(path, mode="r", *args, **kwargs):
        f = real(path, mode, *args, **kwargs)
        if "w" in mode and (checkpoints / LATEST).exists():
            f = _FillingFile(f, room=1000)
            if code != errno.ENOSPC:
                f.write = lambda data: (_ for _ in ()).throw(OSError(code, os.strerror(code)))
        return f

    monkeypatch.setattr(sharded, "open", filling_open, raising=False)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_disk_full_during_a_checkpoint_write_is_one_message_exit_4(tmp_path, monkeypatch, capsys, mode):
    """Before: an `OSError: [Errno 28]` traceback, exit 1, a `.part` file left behind."""
    overrides = tiny_overrides(tmp_path, train__steps=4, checkpoint__every=2, run__name="full",
                               checkpoint__async=str(mode == "async").lower())
    run_dir = tmp_path / "runs" / "full"
    checkpoints = run_dir / CHECKPOINTS
    _disk_fills_after_first_checkpoint(monkeypatch, checkpoints)
    code = cli.main(_args(overrides))
    err = capsys.readouterr().err
    assert code == 4, err
    assert "Traceback" not in err and err.count("shardlm: stopped:") == 1, err
    assert "checkpoint step-00000004: writing" in err and "rank-00000.safetensors" in err
    assert "No space left on device (ENOSPC)" in err
    assert " MB free there" in err and "this rank's part of checkpoint step-00000004 is" in err
    assert "free space on that disk" in err  # what to do
    assert "Last checkpoint:" in err and "step-00000002" in err
    assert f"shardlm train --resume {run_dir}" in err
    assert not [p for p in run_dir.rglob("*") if p.name.endswith(".part")]
    assert json.loads((checkpoints / LATEST).read_text())["step_dir"] == "step-00000002"
    assert not (checkpoints / "step-00000004").exists()
    # and the run resumes from it once the disk has room again
    monkeypatch.undo()
    assert cli.main(_args({**overrides, "checkpoint.resume": "auto"})) == 0
    assert json.loads((checkpoints / LATEST).read_text())["step_dir"] == "step-00000004"


_FSYNC_FAILS = '''
import errno, os
_real_fsync, _latest = os.fsync, os.environ["SHARDLM_TEST_FULL_AFTER"]
def _fsync(fd):
    name = os.readlink(f"/proc/self/fd/{fd}") if isinstance(fd, int) else ""
    if name.endswith(".safetensors.part") and os.path.exists(_latest):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return _real_fsync(fd)
os.fsync = _fsync
'''


def test_disk_full_during_a_two_rank_checkpoint_write_exits_4(tmp_path, monkeypatch, capfd):
    """Both ranks' shard writes fail (the disk is shared): `shardlm train --nproc 2` exits 4,
    each rank says why once, no `.part` is left and `latest` stays on the previous checkpoint.
    The fault is injected into the workers by a sitecustomize (os.fsync raises ENOSPC for a
    shard once the first checkpoint is published)."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(_FSYNC_FAILS)
    run_dir = tmp_path / "runs" / "full2"
    checkpoints = run_dir / CHECKPOINTS
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hooks), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("SHARDLM_TEST_FULL_AFTER", str(checkpoints / LATEST))
    overrides = tiny_overrides(tmp_path, train__steps=4, checkpoint__every=2, run__name="full2")
    code = cli.main(["train", "--nproc", "2", *_args(overrides)[1:]])
    out, err = capfd.readouterr()
    text = out + err
    assert code == 4, text
    assert "No space left on device (ENOSPC)" in text and "Traceback" not in text, text
    assert "checkpoint step-00000004: writing" in text
    assert not [p for p in run_dir.rglob("*") if p.name.endswith(".part")]
    assert json.loads((checkpoints / LATEST).read_text())["step_dir"] == "step-00000002"
    assert not (checkpoints / "step-00000004").exists()


# -- --resume RUN_DIR falls back past a corrupted shard ------------------------------------------


def _flip_a_byte(path: Path) -> None:
    """One bit of the file's last byte flipped: same size, so only its SHA-256 tells."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture
def two_checkpoints(tmp_path) -> tuple[dict, Path]:
    """A finished 4-step run with checkpoints at steps 2 and 4, step 4's shard corrupted."""
    overrides = tiny_overrides(tmp_path, train__steps=4, checkpoint__every=2, run__name="bad")
    assert cli.main(_args(overrides)) == 0
    run_dir = tmp_path / "runs" / "bad"
    _flip_a_byte(run_dir / CHECKPOINTS / "step-00000004" / "rank-00000.safetensors")
    return overrides, run_dir


@pytest.mark.parametrize("how", ["run_dir", "checkpoints", "latest", "no_path"])
def test_resume_run_dir_with_a_corrupted_shard_falls_back(two_checkpoints, capsys, caplog, how):
    """Before: `--resume RUN_DIR` pinned the checkpoint `latest` named, and its bad shard ended the
    run with an error; auto-resume fell back. Now both fall back, saying which was rejected and why."""
    overrides, run_dir = two_checkpoints
    capsys.readouterr()
    given = {"run_dir": [str(run_dir)], "checkpoints": [str(run_dir / CHECKPOINTS)],
             "latest": [str(run_dir / CHECKPOINTS / LATEST)], "no_path": []}[how]
    args = ["train", "--resume", *given,
            *[f"--{k}={v}" for k, v in overrides.items() if k not in ("run.name", "train.steps")],
            "--train.steps=5"]
    with caplog.at_level("INFO", logger="shardlm"):
        assert cli.main(args) == 0, capsys.readouterr().err
    text = caplog.text
    assert "step-00000004" in text and "rank-00000.safetensors is corrupt" in text, text
    assert f"resuming from {run_dir / CHECKPOINTS / 'step-00000002'}" in text, text
    assert f"resumed from {run_dir / CHECKPOINTS / 'step-00000002'} (step 2" in text, text
    records = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r][-3:] == [3, 4, 5]


def test_resume_of_a_named_checkpoint_with_a_corrupted_shard_is_refused(two_checkpoints, capsys):
    """A checkpoint directory named explicitly is the one asked for: refused, no fallback."""
    overrides, run_dir = two_checkpoints
    bad = run_dir / CHECKPOINTS / "step-00000004"
    args = ["train", "--resume", str(bad),
            *[f"--{k}={v}" for k, v in overrides.items() if k != "train.steps"], "--train.steps=5"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "rank-00000.safetensors is corrupt" in err and "Traceback" not in err
