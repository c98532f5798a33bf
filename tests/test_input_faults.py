"""Faults of part B (issue 25): a disk that fills up during a checkpoint write, a resume from a
run directory whose newest checkpoint has a corrupted shard, and inputs refused before the run
directory exists (an invalid tokenizer.json, a LoRA rank larger than its layer, binary files
posing as text). Disk faults are injected in-process (no disk is filled)."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import tiny_overrides
from shardlm.cli import main as cli
from shardlm.checkpoint import sharded
from shardlm.checkpoint.manifest import CHECKPOINTS, LATEST


def _args(overrides: dict) -> list[str]:
    return ["train", *[f"--{k}={v}" for k, v in overrides.items()]]


class _FillingFile:
    """A file whose writes stop with ENOSPC after `room` bytes: the disk fills mid-write."""

    def __init__(self, f, room: int, code: int):
        self._f, self._room, self._code = f, room, code

    def write(self, data) -> int:
        n = memoryview(data).nbytes
        if n > self._room:
            self._f.write(memoryview(data)[:self._room])  # what fitted is on disk
            self._f.flush()
            raise OSError(self._code, os.strerror(self._code))
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
            f = _FillingFile(f, room=1000, code=code)
        return f

    monkeypatch.setattr(sharded, "open", filling_open, raising=False)


@pytest.mark.parametrize("mode, code", [("sync", "ENOSPC"), ("async", "ENOSPC"), ("sync", "EDQUOT")])
def test_disk_full_during_a_checkpoint_write_is_one_message_exit_4(tmp_path, monkeypatch, capsys,
                                                                    mode, code):
    """Before: an `OSError: [Errno 28]` traceback, exit 1, a `.part` file left behind."""
    overrides = tiny_overrides(tmp_path, train__steps=4, checkpoint__every=2, run__name="full",
                               checkpoint__async=str(mode == "async").lower())
    run_dir = tmp_path / "runs" / "full"
    checkpoints = run_dir / CHECKPOINTS
    _disk_fills_after_first_checkpoint(monkeypatch, checkpoints, getattr(errno, code))
    status = cli.main(_args(overrides))
    err = capsys.readouterr().err
    assert status == 4, err
    assert "Traceback" not in err and err.count("shardlm: stopped:") == 1, err
    assert "checkpoint step-00000004: writing" in err and "rank-00000.safetensors" in err
    assert f"{os.strerror(getattr(errno, code))} ({code})" in err
    assert " MB free there" in err and "this rank's part of checkpoint step-00000004 is" in err
    assert ("free space within your quota" if code == "EDQUOT" else "free space on that disk") in err
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


@pytest.fixture(scope="module")
def trained_with_two_checkpoints(tmp_path_factory) -> Path:
    """A finished 4-step run with checkpoints at steps 2 and 4, step 4's shard corrupted: trained
    once for this file's tests, each of which resumes (and so writes) in a copy of its own."""
    root = tmp_path_factory.mktemp("two-checkpoints")
    overrides = tiny_overrides(root, train__steps=4, checkpoint__every=2, run__name="bad")
    assert cli.main(_args(overrides)) == 0
    run_dir = root / "runs" / "bad"
    _flip_a_byte(run_dir / CHECKPOINTS / "step-00000004" / "rank-00000.safetensors")
    return run_dir


@pytest.fixture
def two_checkpoints(tmp_path, trained_with_two_checkpoints) -> tuple[dict, Path]:
    """That run copied under this test's tmp_path, with the overrides that name it there."""
    overrides = tiny_overrides(tmp_path, train__steps=4, checkpoint__every=2, run__name="bad")
    run_dir = tmp_path / "runs" / "bad"
    shutil.copytree(trained_with_two_checkpoints, run_dir, symlinks=True)
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


# -- inputs refused before the run directory exists --------------------------------------------


@pytest.mark.parametrize("damage", ["garbage", "truncated", "not_a_tokenizer"])
def test_invalid_hf_tokenizer_is_named_before_the_run_dir(tmp_path, capsys, damage):
    """Before: a bare `Exception: expected value at line 1 column 1` from the tokenizers library,
    after the run directory was made."""
    pytest.importorskip("transformers")
    from test_hf_path import make_hf_dir, overrides

    hf_dir, _ = make_hf_dir(tmp_path, "gpt2")
    path = hf_dir / "tokenizer.json"
    good = path.read_text()
    path.write_text({"garbage": "\x00\x01 not json", "truncated": good[:len(good) // 2],
                     "not_a_tokenizer": json.dumps({"hello": "world"})}[damage])
    values = overrides(tmp_path, hf_dir, run__name="tok")
    assert cli.main(_args(values)) == 2
    err = capsys.readouterr().err
    assert f"its tokenizer {str(path)!r}" in err and "is not a tokenizer" in err, err
    assert "Traceback" not in err and err.count("shardlm: error:") == 1
    assert not (tmp_path / "runs" / "tok").exists()


def test_lora_rank_larger_than_its_layers_is_refused_before_the_run_dir(tmp_path, capsys):
    """gpt-tiny's d_model is 64: rank 65 was accepted (adapters of rank 65 on 64-wide layers)."""
    base = tiny_overrides(tmp_path, run__name="lora", train__steps=1)
    assert cli.main(_args({**base, "lora.rank": 65})) == 2
    err = capsys.readouterr().err
    assert "lora.rank = 65 is larger than the layers it adapts" in err, err
    assert "blocks.*.attn.qkv (64 -> 192, so at most rank 64)" in err
    assert "blocks.*.mlp.fc (64 -> 256, so at most rank 64)" in err
    assert "set lora.rank <= 64" in err and "Traceback" not in err
    assert not (tmp_path / "runs" / "lora").exists()
    # only the layers it adapts count: on the MLP's 256-wide side alone ... still 64 in; and
    # rank 64 (the full rank of a 64-wide layer) is allowed
    assert cli.main(_args({**base, "lora.rank": 64})) == 0
    capsys.readouterr()


def test_lora_rank_check_in_apply_lora_names_the_layer():
    """The same check where adapters are made (a model given through the Python API)."""
    from torch import nn

    from shardlm.errors import ConfigError
    from shardlm.models.lora import apply_lora

    model = nn.Sequential()
    model.add_module("wide", nn.Linear(32, 48))
    model.add_module("narrow", nn.Linear(48, 8))
    with pytest.raises(ConfigError, match=r"narrow \(48 -> 8, so at most rank 8\). .* lora.rank <= 8"):
        apply_lora(model, 16, 16.0, 0.0, "wide,narrow", "gelu")
    assert apply_lora(model, 8, 16.0, 0.0, "wide,narrow", "gelu").rank == 8


def test_binary_files_named_txt_are_refused_before_the_run_dir(tmp_path, capsys):
    """Before: files of random bytes named .txt trained without a word (as U+FFFD soup)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("def f(x):\n    return x + 1\n" * 4000)
    (corpus / "b.txt").write_bytes(os.urandom(50_000))
    base = tiny_overrides(tmp_path, run__name="bin", train__steps=1, data__source=str(corpus),
                          data__cache_dir=str(tmp_path / "cache"))
    assert cli.main(_args(base)) == 2
    err = capsys.readouterr().err
    assert f"data.source file {str(corpus / 'b.txt')!r} is not UTF-8 text" in err, err
    assert "of its first 50,000 bytes are invalid UTF-8 or control characters" in err
    assert "Traceback" not in err
    assert not (tmp_path / "runs" / "bin").exists()
    # UTF-16 text is not UTF-8 text either
    (corpus / "b.txt").write_text("hello world, " * 2000, encoding="utf-16")
    assert cli.main(_args(base)) == 2
    assert "b.txt' is not UTF-8 text" in capsys.readouterr().err


def test_text_with_a_few_odd_bytes_still_trains(tmp_path, capsys):
    """UTF-8 text with stray bytes (a Latin-1 é, a NUL, a cut multi-byte character, a BOM) and a
    Latin-1 file with many accents are text: they train, as before."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    text = "def café(x):\n    return x + 1  # naïve, ünïcode: ✓ → λ\n" * 3000
    odd = bytearray(("\ufeff" + text).encode())
    for at in range(500, len(odd), 20_000):  # a stray byte every 20 KB
        odd[at:at] = b"\xe9" if at % 3 else b"\x00"
    (corpus / "odd.txt").write_bytes(bytes(odd[:-2]))  # ends inside the "λ"
    (corpus / "latin1.md").write_bytes(("Crème brûlée à la française, déjà vu. " * 2000).encode("latin-1"))
    base = tiny_overrides(tmp_path, run__name="odd", train__steps=1, data__source=str(corpus),
                          data__cache_dir=str(tmp_path / "cache"))
    assert cli.main(_args(base)) == 0, capsys.readouterr().err
    assert (tmp_path / "runs" / "odd").is_dir()


def test_the_stdlib_corpus_reads_as_text():
    """The default corpus, every file, scores far below the limit (all 0 on CPython 3.11)."""
    from shardlm.data.corpus import (NOT_TEXT_LIMIT, SNIFF_BYTES, _STDLIB_SKIP, _walk,
                                     not_text_fraction, stdlib_root)

    files = _walk(stdlib_root(), (".py",), _STDLIB_SKIP)
    assert len(files) > 100
    worst = max(not_text_fraction(p.read_bytes()[:SNIFF_BYTES])[0] for p in files)
    assert worst < NOT_TEXT_LIMIT / 10, worst
    assert not_text_fraction(os.urandom(SNIFF_BYTES))[0] > 1.5 * NOT_TEXT_LIMIT
