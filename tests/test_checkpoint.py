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
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ckpt_cases import (base_overrides, checkpoint_of, load_synthetic, same_state,
                        straight_and_resumed, synthetic_save, synthetic_state, train_ranks,
                        train_run)
from shardlm.checkpoint.manifest import (LATEST, check_checkpoint, newest_usable, read_latest,
                                         sealed, step_dirs)
from shardlm.checkpoint.sharded import (CHECKPOINTS, MANIFEST, CheckpointError, find_checkpoint, parse_manifest, read_manifest)
from shardlm.checkpoint.reader import CheckpointReader
from shardlm.config.load import load_config
from shardlm.launch.spawn import run_ranks
from shardlm.train.build import build_run
from shardlm.train.checkpointing import load_checkpoint, save_checkpoint
from worlds import several

N = 2  # steps before the checkpoint, and after it


def _assert_same(straight: dict, resumed: dict, what: str) -> None:
    assert resumed["start"] == N, what
    assert resumed["losses"] == straight["losses"][N:], what
    for name, value in straight["params"].items():
        assert torch.equal(value, resumed["params"][name]), f"{what}: {name} differs"


def test_resume_is_bitwise_one_process(tmp_path):
    (straight, resumed), = straight_and_resumed(0, 1, [("local", base_overrides(tmp_path), N)])
    _assert_same(straight, resumed, "one process")


def _resume_cases(tmp_path) -> list[tuple[str, dict, int]]:
    return [(f"s{stage}-{prec}-{'async' if stage % 2 else 'sync'}",
             base_overrides(tmp_path, parallel__zero_stage=stage, precision__compute=prec,
                            checkpoint__async=bool(stage % 2)), N)
            for stage in range(4) for prec in ("fp32", "bf16")]


def _resharded_base(tmp_path) -> dict:
    return base_overrides(tmp_path, train__micro_batch=2, train__steps=2 * N)


@pytest.fixture(scope="module")
def four_rank_saves(tmp_path_factory) -> dict[str, dict]:
    """This file's two 4-rank runs, each saving at step N, in one spawned world
    (tests/worlds.py) instead of one each: ZeRO-3 ("four") and 2 replicas x 2 shards at stage 2
    ("hybrid"). Rank 0's train_run result of each, by name."""
    tmp = tmp_path_factory.mktemp("four-ranks")
    base = _resharded_base(tmp)
    runs = {"four": {**base, "parallel.zero_stage": 3, "checkpoint.every": N, "run.name": "four"},
            "hybrid": {**base, "parallel.zero_stage": 2, "parallel.dp_replicate": 2,
                       "parallel.dp_shard": 2, "checkpoint.every": N, "run.name": "hybrid"}}
    rank0 = run_ranks(several, 4, tmp, [(train_ranks, (o,)) for o in runs.values()], timeout=600)[0]
    return dict(zip(runs, rank0))


@pytest.fixture(scope="module")
def two_rank_world(tmp_path_factory, four_rank_saves) -> dict:
    """This file's 2-rank runs in one spawned world: the bitwise resume cases (straight and
    resumed, every stage and precision), then the ZeRO-3 4-rank checkpoint resumed at ZeRO-1
    on 2 ranks through one reader."""
    tmp = tmp_path_factory.mktemp("two-ranks")
    cases = _resume_cases(tmp)
    resharded = {**_resharded_base(tmp), "parallel.zero_stage": 1, "train.grad_accum": 2,
                 "run.name": "two", "checkpoint.readers": "one",
                 "checkpoint.resume": checkpoint_of(four_rank_saves["four"]["run_dir"], N)}
    out = run_ranks(several, 2, tmp, [(straight_and_resumed, (cases,)), (train_ranks, (resharded,))],
                    timeout=600)
    return {"cases": cases, "resumed": [rank[0] for rank in out], "two": out[0][1]}


def test_resume_is_bitwise_every_stage_and_precision(two_rank_world):
    cases = two_rank_world["cases"]
    for rank_result in two_rank_world["resumed"]:
        for (name, _, _), (straight, resumed) in zip(cases, rank_result):
            _assert_same(straight, resumed, name)


def test_reshard_stage3_on_4_ranks_to_2_ranks_stage1_and_1_rank(tmp_path, four_rank_saves, two_rank_world):
    base = _resharded_base(tmp_path)
    saved = four_rank_saves["four"]  # 4 ranks, ZeRO-3, saved at step N
    ckpt = checkpoint_of(saved["run_dir"], N)
    manifest = parse_manifest(Path(ckpt), (Path(ckpt) / MANIFEST).read_text())
    assert manifest["layout"]["world_size"] == 4 and len(manifest["files"]) == 4
    two = two_rank_world["two"]  # resumed from it at ZeRO-1 on 2 ranks, one reader
    one = train_run({**base, "train.grad_accum": 4, "run.name": "one", "checkpoint.resume": ckpt})
    expected = torch.tensor(saved["losses"][N:])
    for result in (two, one):
        assert result["start"] == N
        torch.testing.assert_close(torch.tensor(result["losses"]), expected, rtol=1e-5, atol=0)
        for name, value in saved["params"].items():
            torch.testing.assert_close(result["params"][name], value, rtol=1e-4, atol=1e-6)


def test_hybrid_layout_loads_in_one_process(tmp_path, four_rank_saves):
    """2 replicas x 2 shards at stage 2: only the first replica group writes, and its shards
    are the whole state."""
    base = _resharded_base(tmp_path)
    saved = four_rank_saves["hybrid"]
    ckpt = Path(checkpoint_of(saved["run_dir"], N))
    assert sorted(p.name for p in ckpt.glob("*.safetensors")) == ["rank-00000.safetensors",
                                                                  "rank-00001.safetensors"]
    one = train_run({**base, "train.grad_accum": 4, "run.name": "one", "checkpoint.resume": str(ckpt)})
    torch.testing.assert_close(torch.tensor(one["losses"]), torch.tensor(saved["losses"][N:]),
                               rtol=1e-5, atol=0)


def _saved_run(tmp_path, **extra):
    run = build_run(load_config(overrides=base_overrides(tmp_path, run__name="src", **extra)).validate())
    save_checkpoint(run, 1)
    return Path(checkpoint_of(str(run.run_dir), 1))


def test_flipped_byte_names_file_and_checksum(tmp_path):
    ckpt = _saved_run(tmp_path)
    shard = ckpt / "rank-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    run = build_run(load_config(overrides=base_overrides(tmp_path, run__name="dst")).validate())
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
    (ckpt / MANIFEST).write_text(json.dumps(sealed(manifest)))  # a consistent, sealed manifest
    run = build_run(load_config(overrides=base_overrides(tmp_path, run__name="dst")).validate())
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
    run = build_run(load_config(overrides=base_overrides(tmp_path, run__name="dst", model__d_model=96,
                                                model__n_heads=3, model__n_kv_heads=3)).validate())
    with pytest.raises(CheckpointError, match="saved from a different model"):
        load_checkpoint(run, ckpt)


_DIE_MID_SAVE = textwrap.dedent("""
    import json, os, signal, sys
    from shardlm.checkpoint import sharded
    from shardlm.config.load import load_config
    from shardlm.train.build import build_run
    from shardlm.train.loop import train

    overrides, point = json.loads(sys.argv[1]), sys.argv[2]
    write, publish = sharded.write_safetensors, sharded.write_latest

    def write_then_die(path, tensors):
        if point == "data" and "step-00000003" in path.parent.name:
            data = b"".join(bytes(p) for p in sharded._safetensors_pieces(tensors))
            with open(path.with_name(path.name + ".part"), "wb") as f:  # half, then the kill
                f.write(data[:len(data) // 2])
                f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return write(path, tensors)

    def publish_then_die(root, path, digest):
        if point == "latest" and path.name == "step-00000003":
            os.kill(os.getpid(), signal.SIGKILL)
        publish(root, path, digest)

    sharded.write_safetensors, sharded.write_latest = write_then_die, publish_then_die
    train(build_run(load_config(overrides=overrides).validate()))
""")


@pytest.mark.parametrize("point", ["data", "latest"])
def test_sigkill_mid_save_leaves_latest_loadable(tmp_path, point):
    overrides = base_overrides(tmp_path, run__name="killed", train__steps=4, checkpoint__every=1,
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


# -- checkpoints you can trust (issue 12) -------------------------------------------------------
# On synthetic checkpoints (tests/ckpt_cases.py): the real writer and reader, two ranks' files,
# five small tensors, no model: milliseconds each.


def _manifest_of(ckpt: Path) -> dict:
    return json.loads((ckpt / MANIFEST).read_text())


def _rewrite(ckpt: Path, manifest: dict) -> None:
    """Write a manifest as a consistent writer would have: sealed with its own digest."""
    (ckpt / MANIFEST).write_text(json.dumps(sealed(manifest), indent=1))


def test_edited_step_is_refused_by_the_manifest_digest(tmp_path, caplog):
    root = tmp_path / CHECKPOINTS
    for step in (4, 6):
        synthetic_save(root, step)
    ckpt = root / "step-00000006"
    text = (ckpt / MANIFEST).read_text()
    assert '"step": 6' in text and '"digest": "' in text
    (ckpt / MANIFEST).write_text(text.replace('"step": 6', '"step": 4', 1))
    with pytest.raises(CheckpointError, match=r"step-00000006/manifest\.json does not match its own digest"):
        read_manifest(ckpt)
    with pytest.raises(CheckpointError, match="does not match its own digest"):
        find_checkpoint(ckpt)  # named explicitly: refused, no fallback
    # Through the run directory: reported, and the newest usable checkpoint is taken instead.
    assert find_checkpoint(tmp_path) == root.resolve() / "step-00000004"
    assert "step-00000006/manifest.json does not match its own digest" in caplog.text
    assert "resuming from" in caplog.text and "step-00000004" in caplog.text


def test_latest_is_a_file_naming_step_and_digest_and_stays_in_its_directory(tmp_path, caplog):
    root, other = tmp_path / "run" / CHECKPOINTS, tmp_path / "other" / CHECKPOINTS
    for step in (1, 2):
        synthetic_save(root, step)
    synthetic_save(other, 7)
    latest = root / LATEST
    assert latest.is_file() and not latest.is_symlink()
    pointer = json.loads(latest.read_text())
    assert pointer == {"step_dir": "step-00000002",
                       "manifest_digest": _manifest_of(root / "step-00000002")["digest"]}
    assert read_latest(root) == root / "step-00000002"
    # `checkpoints/latest` itself names a checkpoint (as when it was a link), and a runs-level
    # `latest` link to a run directory still leads to that run's checkpoints.
    assert find_checkpoint(latest) == root.resolve() / "step-00000002"
    (tmp_path / LATEST).symlink_to("run")
    assert find_checkpoint(tmp_path / LATEST) == root.resolve() / "step-00000002"

    hostile = ["../../other/checkpoints/step-00000007", str(other / "step-00000007"), "step-00000002/..",
               "..", ""]
    for name in hostile:
        latest.write_text(json.dumps({"step_dir": name, "manifest_digest": pointer["manifest_digest"]}))
        with pytest.raises(CheckpointError, match="not a pointer to a step directory beside it"):
            read_latest(root)
        assert find_checkpoint(tmp_path / "run") == root.resolve() / "step-00000002"
    latest.write_text(json.dumps({**pointer, "manifest_digest": "0" * 64}))
    with pytest.raises(CheckpointError, match="replaced or edited after it was published"):
        read_latest(root)

    # Old-style links: followed inside the same checkpoints/ only.
    latest.unlink()
    latest.symlink_to("step-00000001")
    assert read_latest(root) == root / "step-00000001"
    assert find_checkpoint(tmp_path / "run") == root.resolve() / "step-00000001"
    assert find_checkpoint(latest) == root.resolve() / "step-00000001"
    latest.unlink()
    latest.symlink_to(other / "step-00000007")
    caplog.clear()
    with pytest.raises(CheckpointError, match="outside"):
        read_latest(root)
    assert find_checkpoint(tmp_path / "run") == root.resolve() / "step-00000002"  # never other's
    assert find_checkpoint(latest) == root.resolve() / "step-00000002"
    assert "outside" in caplog.text
    # The next save replaces the link with a file naming the new checkpoint.
    synthetic_save(root, 3, session="t")
    assert not latest.is_symlink() and read_latest(root) == root / "step-00000003"


def test_slices_must_tile_every_tensor_before_any_data_is_read(tmp_path):
    root = tmp_path / CHECKPOINTS
    synthetic_save(root, 1)
    ckpt = root / "step-00000001"
    good = _manifest_of(ckpt)
    for f in good["files"]:  # no data at all: the manifest alone must be refused
        (ckpt / f).unlink()
    head = good["tensors"]["model/head"]["slices"]  # 30 elements: [0, 15) rank 0, [15, 30) rank 1
    assert [(s["start"], s["end"]) for s in head] == [(0, 15), (15, 30)]
    cases = {
        "overlap on elements \\[10, 15\\)": [dict(head[0]), {**head[1], "start": 10}],
        "no slice holds elements \\[15, 30\\)": [dict(head[0])],
        "no slice holds elements \\[12, 15\\)": [{**head[0], "end": 12}, dict(head[1])],
        "no slice holds elements \\[0, 3\\)": [{**head[0], "start": 3}, dict(head[1])],
        "not a range inside its 30 elements": [dict(head[0]), {**head[1], "end": 31}],
        "reuses the key": [dict(head[0]), {**head[1], "key": head[0]["key"], "file": head[0]["file"]}],
    }
    for message, slices in cases.items():
        manifest = json.loads(json.dumps(good))
        manifest["tensors"]["model/head"]["slices"] = slices
        _rewrite(ckpt, manifest)
        with pytest.raises(CheckpointError, match=message):
            read_manifest(ckpt)


def test_file_names_are_confined_and_links_are_not_followed(tmp_path):
    root = tmp_path / CHECKPOINTS
    synthetic_save(root, 1)
    ckpt = root / "step-00000001"
    good = _manifest_of(ckpt)
    shard = "rank-00001.safetensors"
    outside = tmp_path / "x.safetensors"
    outside.write_bytes((ckpt / shard).read_bytes())  # identical bytes: its SHA-256 matches
    for hostile in ["../x.safetensors", str(outside), "sub/x", "..", ".hidden"]:
        manifest = json.loads(json.dumps(good).replace(shard, hostile.replace("\\", "\\\\")))
        _rewrite(ckpt, manifest)
        with pytest.raises(CheckpointError, match="plain names inside its directory"):
            read_manifest(ckpt)
    _rewrite(ckpt, good)
    assert same_state(load_synthetic(ckpt)[1], 1)
    (ckpt / shard).unlink()
    (ckpt / shard).symlink_to(outside)
    with pytest.raises(CheckpointError, match="not a regular file"):
        check_checkpoint(ckpt)
    with pytest.raises(CheckpointError, match="is a symbolic link"):
        load_synthetic(ckpt)
    (ckpt / shard).unlink()
    (ckpt / shard).write_bytes(outside.read_bytes())
    moved = tmp_path / "manifest.json"
    (ckpt / MANIFEST).rename(moved)
    (ckpt / MANIFEST).symlink_to(moved)
    with pytest.raises(CheckpointError, match="is a symbolic link"):
        read_manifest(ckpt)


class _Crash(BaseException):
    """A simulated crash: not an Exception, so no handler on the way swallows it."""


_FS_OPS = [(os, "replace"), (os, "rename"), (os, "unlink"), (os, "rmdir"), (os, "mkdir"),
           (os, "fsync"), (os, "symlink")]


def _crash_at(monkeypatch, k: int) -> list[str]:
    """Make the k-th filesystem operation from now raise _Crash (before it happens: the state
    is then exactly "after operation k - 1"); returns the log of operations seen."""
    seen: list[str] = []
    for module, name in _FS_OPS:
        real = getattr(module, name)

        def op(*args, _real=real, _name=name, **kwargs):
            seen.append(f"{_name}{args[:2]}")
            if len(seen) == k:
                raise _Crash(seen[-1])
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, op)
    return seen


def _assert_recoverable(root: Path, allowed: dict[int, list[int]]) -> Path:
    """`latest`, if there, names a complete checkpoint; every visible step directory is usable
    and holds exactly what was saved; the checkpoint a resume takes is the newest published."""
    if os.path.lexists(root / LATEST):
        assert read_latest(root) is not None
    for ckpt in step_dirs(root):
        manifest, values = load_synthetic(ckpt)
        assert any(same_state(values, v) for v in allowed[manifest["step"]]), ckpt
        CheckpointReader(ckpt, manifest).verify_all()
    chosen = newest_usable(root)
    assert chosen is not None
    return chosen


@pytest.mark.parametrize("scenario", ["next step", "same step again"])
def test_publish_survives_a_crash_after_every_operation(tmp_path, monkeypatch, scenario):
    """Step 4 after steps 1-3 (keep 3: step 1 is rotated out), or step 3 saved again with new
    values (the older save of the same step is swapped out while `latest` names it). The
    writer is stopped before each of its filesystem operations in turn; after every one, the
    newest published checkpoint is loadable and `latest` does not dangle; a new writer then
    saves again and everything is clean."""
    base = tmp_path / "base"
    for step in (1, 2, 3):
        synthetic_save(base, step, keep=3)
    step, seed = (4, 4) if scenario == "next step" else (3, 33)
    allowed = {1: [1], 2: [2], 3: [3, 33], 4: [4]}
    values = synthetic_state(seed)
    k, finished = 0, False
    while not finished:
        k += 1
        root = tmp_path / f"crash-{k}"
        shutil.copytree(base, root, symlinks=True)
        with monkeypatch.context() as patch:
            seen = _crash_at(patch, k)
            try:
                synthetic_save(root, step, world_size=2, keep=3, session=f"crash{k}", values=values)
                finished = True
            except _Crash:
                pass
        chosen = _assert_recoverable(root, allowed)
        published = read_latest(root)
        if finished:
            assert published.name == f"step-{step:08d}" and same_state(load_synthetic(published)[1], seed)
            kept = (2, 3, 4) if step == 4 else (1, 2, 3)
            assert sorted(p.name for p in root.iterdir()) == [LATEST] + [f"step-{s:08d}" for s in kept]
        else:  # the previous checkpoint or the new one (while step 3 is swapped: step 2)
            assert chosen.name in {"next step": ("step-00000003", "step-00000004"),
                                   "same step again": ("step-00000002", "step-00000003")}[scenario]
        # What a restarted run would do: a new writer clears the debris and saves again.
        synthetic_save(root, step, keep=3, session=f"again{k}", values=values)
        assert not [p.name for p in root.iterdir() if p.name.startswith(".")], (seen, k)
        assert same_state(load_synthetic(find_checkpoint(root))[1], seed)
    assert k > 20, seen  # every rank file, note, the manifest, renames, latest, the rotation
    print(f"{scenario}: crashed before each of {k - 1} filesystem operations")
