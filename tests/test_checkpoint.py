"""Sharded checkpoints: exact resume, resharding, crash safety, corruption, no unpickling.

Tolerances, stated:
- resume at the same layout: bitwise — losses and parameters after resuming equal the
  uninterrupted run's exactly, fp32 and bf16, ZeRO stages 0-3, synchronous and asynchronous.
- resume at another layout (4 ranks stage 3 -> 2 ranks stage 1, 1 rank stage 0, the same
  global batch): the state loads exactly, but the gradient sums then run in another order
  (ranks become accumulation steps), so losses agree to 1e-5 relative, not to the bit.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ckpt_cases import checkpoint_of, straight_and_resumed, train_ranks, train_run
from conftest import tiny_overrides
from shardlm.checkpoint.sharded import (CHECKPOINTS, MANIFEST, CheckpointError, CheckpointReader,
                                        find_checkpoint, parse_manifest)
from shardlm.config import load_config
from shardlm.spawn import run_ranks
from shardlm.trainer import build_run, load_checkpoint, save_checkpoint

N = 2  # steps before the checkpoint, and after it


def _base(tmp_path, **extra) -> dict:
    return tiny_overrides(tmp_path, **{"model__preset": "llama-tiny", "train__micro_batch": 4,
                                       "train__eval_batches": 1, **extra})


def _assert_same(straight: dict, resumed: dict, what: str) -> None:
    assert resumed["start"] == N, what
    assert resumed["losses"] == straight["losses"][N:], what
    for name, value in straight["params"].items():
        assert torch.equal(value, resumed["params"][name]), f"{what}: {name} differs"


def test_resume_is_bitwise_one_process(tmp_path):
    (straight, resumed), = straight_and_resumed(0, 1, [("local", _base(tmp_path), N)])
    _assert_same(straight, resumed, "one process")


def test_resume_is_bitwise_every_stage_and_precision(tmp_path):
    cases = [(f"s{stage}-{prec}-{'async' if stage % 2 else 'sync'}",
              _base(tmp_path, parallel__zero_stage=stage, precision__compute=prec,
                    checkpoint__async=bool(stage % 2)), N)
             for stage in range(4) for prec in ("fp32", "bf16")]
    ranks = run_ranks(straight_and_resumed, 2, tmp_path, cases, timeout=600)
    for rank_result in ranks:
        for (name, _, _), (straight, resumed) in zip(cases, rank_result):
            _assert_same(straight, resumed, name)


def test_reshard_stage3_on_4_ranks_to_2_ranks_stage1_and_1_rank(tmp_path):
    base = _base(tmp_path, train__micro_batch=2, train__steps=2 * N)
    saved = run_ranks(train_ranks, 4, tmp_path, {**base, "parallel.zero_stage": 3,
                                                 "checkpoint.every": N, "run.name": "four"},
                      timeout=300)[0]
    ckpt = checkpoint_of(saved["run_dir"], N)
    manifest = parse_manifest(Path(ckpt), (Path(ckpt) / MANIFEST).read_text())
    assert manifest["layout"]["world_size"] == 4 and len(manifest["files"]) == 4
    two = run_ranks(train_ranks, 2, tmp_path, {
        **base, "parallel.zero_stage": 1, "train.grad_accum": 2, "run.name": "two",
        "checkpoint.resume": ckpt, "checkpoint.readers": "one"}, timeout=300)[0]
    one = train_run({**base, "train.grad_accum": 4, "run.name": "one", "checkpoint.resume": ckpt})
    expected = torch.tensor(saved["losses"][N:])
    for result in (two, one):
        assert result["start"] == N
        torch.testing.assert_close(torch.tensor(result["losses"]), expected, rtol=1e-5, atol=0)
        for name, value in saved["params"].items():
            torch.testing.assert_close(result["params"][name], value, rtol=1e-4, atol=1e-6)


def test_hybrid_layout_loads_in_one_process(tmp_path):
    """2 replicas x 2 shards at stage 2: only the first replica group writes, and its shards
    are the whole state."""
    base = _base(tmp_path, train__micro_batch=2, train__steps=2 * N)
    saved = run_ranks(train_ranks, 4, tmp_path, {
        **base, "parallel.zero_stage": 2, "parallel.dp_replicate": 2, "parallel.dp_shard": 2,
        "checkpoint.every": N, "run.name": "hybrid"}, timeout=300)[0]
    ckpt = Path(checkpoint_of(saved["run_dir"], N))
    assert sorted(p.name for p in ckpt.glob("*.safetensors")) == ["rank-00000.safetensors",
                                                                  "rank-00001.safetensors"]
    one = train_run({**base, "train.grad_accum": 4, "run.name": "one", "checkpoint.resume": str(ckpt)})
    torch.testing.assert_close(torch.tensor(one["losses"]), torch.tensor(saved["losses"][N:]),
                               rtol=1e-5, atol=0)


def _saved_run(tmp_path, **extra):
    run = build_run(load_config(overrides=_base(tmp_path, run__name="src", **extra)).validate())
    save_checkpoint(run, 1)
    return Path(checkpoint_of(str(run.run_dir), 1))


def test_flipped_byte_names_file_and_checksum(tmp_path):
    ckpt = _saved_run(tmp_path)
    shard = ckpt / "rank-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    run = build_run(load_config(overrides=_base(tmp_path, run__name="dst")).validate())
    with pytest.raises(CheckpointError, match=r"rank-00000\.safetensors is corrupt: its SHA-256 is [0-9a-f]{64}"):
        load_checkpoint(run, ckpt)


class _Payload:
    """Unpickling this runs a shell command that creates a marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_crafted_pickle_executes_nothing(tmp_path):
    ckpt = _saved_run(tmp_path)
    marker = tmp_path / "pwned"
    evil = pickle.dumps(_Payload(marker))
    for name in ("rank-00000.safetensors",):  # with a matching checksum, so the reader opens it
        (ckpt / name).write_bytes(evil)
    manifest = json.loads((ckpt / MANIFEST).read_text())
    import hashlib
    manifest["files"]["rank-00000.safetensors"] = {"bytes": len(evil),
                                                   "sha256": hashlib.sha256(evil).hexdigest()}
    (ckpt / MANIFEST).write_text(json.dumps(manifest))
    run = build_run(load_config(overrides=_base(tmp_path, run__name="dst")).validate())
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_checkpoint(run, ckpt)
    assert not marker.exists()
    # And nothing in the package can unpickle: no torch.load, pickle.load(s) or allow_pickle.
    src = Path(__file__).parents[1] / "src" / "shardlm"
    for path in src.rglob("*.py"):
        text = path.read_text()
        for needle in ("torch.load(", "pickle.load", "allow_pickle=True"):
            assert needle not in text, f"{path} uses {needle}"


def test_shape_mismatch_is_a_clear_error(tmp_path):
    ckpt = _saved_run(tmp_path)
    run = build_run(load_config(overrides=_base(tmp_path, run__name="dst", model__d_model=96,
                                                model__n_heads=3, model__n_kv_heads=3)).validate())
    with pytest.raises(CheckpointError, match="saved from a different model"):
        load_checkpoint(run, ckpt)


_DIE_MID_SAVE = textwrap.dedent("""
    import json, os, signal, sys
    from shardlm.checkpoint import sharded
    from shardlm.config import load_config
    from shardlm.trainer import build_run, train

    overrides, point = json.loads(sys.argv[1]), sys.argv[2]
    write, publish = sharded.write_safetensors, sharded.point_latest

    def write_then_die(path, tensors):
        if point == "data" and "step-00000003" in path.parent.name:
            data = b"".join(bytes(p) for p in sharded._safetensors_pieces(tensors))
            with open(path.with_name(path.name + ".part"), "wb") as f:  # half, then the kill
                f.write(data[:len(data) // 2])
                f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return write(path, tensors)

    def publish_then_die(path):
        if point == "latest" and path.name == "step-00000003":
            os.kill(os.getpid(), signal.SIGKILL)
        publish(path)

    sharded.write_safetensors, sharded.point_latest = write_then_die, publish_then_die
    train(build_run(load_config(overrides=overrides).validate()))
""")


@pytest.mark.parametrize("point", ["data", "latest"])
def test_sigkill_mid_save_leaves_latest_loadable(tmp_path, point):
    overrides = _base(tmp_path, run__name="killed", train__steps=4, checkpoint__every=1,
                      checkpoint__async=point == "data")
    proc = subprocess.run([sys.executable, "-c", _DIE_MID_SAVE, json.dumps(overrides), point],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    run_dir = tmp_path / "runs" / "killed"
    latest = find_checkpoint(run_dir)
    assert latest.name == "step-00000002"
    manifest = parse_manifest(latest, (latest / MANIFEST).read_text())
    CheckpointReader(latest, manifest).verify_all()
    if point == "data":  # the unfinished directory is there, and ignored
        assert list((run_dir / CHECKPOINTS).glob(".step-00000003.*.tmp"))
    # Running the same run again resumes from step 2 and clears the debris.
    resumed = train_run({**overrides, "checkpoint.every": 0})
    assert resumed["start"] == 2 and len(resumed["losses"]) == 2
    assert not list((run_dir / CHECKPOINTS).glob(".*.tmp"))
