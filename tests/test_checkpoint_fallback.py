"""Resuming from the newest usable checkpoint: a damaged one is skipped with the reason, none
usable is an error (never a fresh start), another model's checkpoints are refused, and the ranks
agree on which checkpoint they load (split from test_checkpoint.py)."""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

import pytest

from ckpt_cases import base_overrides, checkpoint_of, ranks_agree_on_resume, synthetic_save, train_run
from shardlm.checkpoint.manifest import step_dirs
from shardlm.checkpoint.sharded import CHECKPOINTS, MANIFEST, CheckpointError
from shardlm.config.load import load_config
from shardlm.launch.spawn import run_ranks
from shardlm.train.build import build_run


def _damage(ckpt: Path, how: str) -> str:
    """Damage checkpoint `ckpt`; returns what the warning must say."""
    shard = ckpt / "rank-00000.safetensors"
    if how == "digest":
        text = (ckpt / MANIFEST).read_text()
        (ckpt / MANIFEST).write_text(text.replace('"step": 3', '"step": 2', 1))
        return "step-00000003/manifest.json does not match its own digest"
    if how == "manifest":
        (ckpt / MANIFEST).unlink()
        return "step-00000003 has no manifest.json"
    if how == "missing shard":
        shard.unlink()
        return "step-00000003/rank-00000.safetensors is missing"
    if how == "flipped shard":  # its size intact: found only when loaded, by its SHA-256
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x10
        shard.write_bytes(bytes(data))
        return "step-00000003/rank-00000.safetensors is corrupt: its SHA-256 is"
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    return f"rank-00000.safetensors has {len(data) - 100} bytes where the manifest records {len(data)}"


@pytest.fixture(scope="module")
def three_checkpoints(tmp_path_factory):
    """A run that saved steps 1, 2 and 3."""
    tmp_path = tmp_path_factory.mktemp("three")
    result = train_run(base_overrides(tmp_path, run__name="src", train__steps=3, checkpoint__every=1))
    return Path(result["run_dir"])


def _build(tmp_path, run_dir: Path, **extra):
    return build_run(load_config(overrides=base_overrides(tmp_path, run__dir=str(run_dir.parent),
                                                 run__name=run_dir.name, train__steps=3,
                                                 **extra)).validate())


@pytest.mark.parametrize("how", ["digest", "manifest", "missing shard", "short shard", "flipped shard"])
def test_resume_falls_back_to_the_newest_usable_checkpoint(tmp_path, three_checkpoints, caplog,
                                                           monkeypatch, how):
    run_dir = tmp_path / "runs" / "damaged"
    shutil.copytree(three_checkpoints, run_dir, symlinks=True)
    message = _damage(run_dir / CHECKPOINTS / "step-00000003", how)
    caplog.set_level(logging.INFO, logger="shardlm")
    # checkpoint.resume = "auto" (the run's own directory)
    assert _build(tmp_path, run_dir).start_step == 2
    assert message in caplog.text and "resuming from" in caplog.text
    assert f"resumed from {run_dir.resolve() / CHECKPOINTS / 'step-00000002'}" in caplog.text
    # an explicit run directory, resumed into another run
    caplog.clear()
    assert _build(tmp_path, tmp_path / "runs" / "other", checkpoint__resume=str(run_dir)).start_step == 2
    assert message in caplog.text
    # a restarted worker (torchrun --max-restarts): its run's newest usable, not the explicit path
    caplog.clear()
    monkeypatch.setattr("shardlm.train.checkpointing.is_restart", lambda: True)
    run = _build(tmp_path, run_dir, checkpoint__resume=checkpoint_of(str(run_dir), 1))
    assert run.start_step == 2 and message in caplog.text


def test_no_usable_checkpoint_is_an_error_not_a_fresh_start(tmp_path, three_checkpoints):
    run_dir = tmp_path / "runs" / "broken"
    shutil.copytree(three_checkpoints, run_dir, symlinks=True)
    for ckpt in step_dirs(run_dir / CHECKPOINTS):
        (ckpt / MANIFEST).unlink()
    before = sorted(p.name for p in (run_dir / CHECKPOINTS).iterdir())
    with pytest.raises(CheckpointError, match=r"none is usable(.|\n)*has no manifest\.json(.|\n)*"
                                              r"checkpoint\.resume = 'never'(.|\n)*new run\.name"):
        _build(tmp_path, run_dir)
    assert sorted(p.name for p in (run_dir / CHECKPOINTS).iterdir()) == before
    assert _build(tmp_path, run_dir, checkpoint__resume="never").start_step == 0  # when told to


def test_another_models_checkpoints_are_each_refused_with_the_reason(tmp_path, three_checkpoints):
    """A checkpoint lacking a tensor of this model fails at load, and the older ones are tried
    (a damaged manifest looks the same); when none fits, the error lists why for each."""
    with pytest.raises(CheckpointError, match=r"none is usable(.|\n)*step-00000003: .* has shape"
                                              r"(.|\n)*step-00000001: .* different model"):
        _build(tmp_path, tmp_path / "runs" / "wider", checkpoint__resume=str(three_checkpoints),
               model__d_model=96, model__n_heads=3, model__n_kv_heads=3)


def test_ranks_agree_on_the_checkpoint_and_on_a_failed_load(tmp_path):
    """2 ranks: rank 0 chooses the checkpoint for all (rank 1, made to see none usable, still
    takes rank 0's); a shard only rank 1 reads (readers = all) or only rank 0 (one) is corrupt:
    both ranks raise, naming the file, instead of one training on (or waiting in a collective);
    the older checkpoint then loads exactly on both."""
    run_dir = tmp_path / "run"
    for step in (1, 2, 3):
        synthetic_save(run_dir / CHECKPOINTS, step)
    shard = run_dir / CHECKPOINTS / "step-00000003" / "rank-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01  # the last byte of tensor data: the size and header intact
    shard.write_bytes(bytes(data))
    results = run_ranks(ranks_agree_on_resume, 2, tmp_path, str(run_dir), timeout=180)
    step3 = str((run_dir / CHECKPOINTS / "step-00000003").resolve())
    for rank, out in enumerate(results):
        assert out["choice"] == step3, (rank, out)  # the cheap check passes: its size is intact
        for readers in ("all", "one"):
            assert re.match(r"error: .*rank-00001\.safetensors is corrupt: its SHA-256",
                            out[f"{readers} 3"]), (rank, readers, out)
            assert out[f"{readers} 2"] == "loaded", (rank, readers, out)
