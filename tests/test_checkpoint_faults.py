"""Fuzzed checkpoints: each damaged checkpoint is refused (CheckpointError) or recovered from
the older good one — never loaded silently wrong.

One tiny run directory is saved once per module (two ranks' files, five tensors, steps 1 and
2: tests/ckpt_cases.py, the real writer); each case copies it, damages step 2 (or `latest`) in
one seeded way, then does what a resume does: choose the checkpoint (newest_usable: `latest`,
else the newest usable older one), read every tensor whole with the real reader, and if that
fails, reject it and load the next usable one (load_with_fallback, as train.build.build_run does).
A load that succeeds must return exactly the tensors and step of the checkpoint it chose; while
step 1 is whole, nothing may be refused (step 1 must be recovered). The counts are printed
(pytest -s) for docs/reliability.md.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

import pytest

from ckpt_cases import load_synthetic, same_state, synthetic_save, synthetic_state
from shardlm.checkpoint.manifest import CHECKPOINTS, LATEST, MANIFEST, CheckpointError, sealed
from shardlm.checkpoint.sharded import load_with_fallback, newest_usable

SEED = 20240612
STEP = "step-00000002"
FILES = ["rank-00000.safetensors", "rank-00001.safetensors"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("fuzz") / "run"
    for step in (1, 2):
        synthetic_save(run_dir / CHECKPOINTS, step)
    return run_dir


# -- the damages: each takes (checkpoint directory, scratch directory, rng) -------------------


def _flip(path: Path, rng: random.Random) -> None:
    data = bytearray(path.read_bytes())
    data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))


def _truncate(path: Path, rng: random.Random) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:rng.randrange(len(data))])


def _manifest(ckpt: Path) -> dict:
    return json.loads((ckpt / MANIFEST).read_text())


def _write(ckpt: Path, manifest: dict, seal: bool) -> None:
    """seal: as a consistent (buggy or hostile) writer would, with a matching digest."""
    (ckpt / MANIFEST).write_text(json.dumps(sealed(manifest) if seal else manifest, indent=1))


# What a sealed edit may touch: the fields the reader checks (where the files are, their sizes
# and hashes, the tensors and their slices, the step). A sealed manifest with other contents
# changed (the scalar state, the RNG, the config) is a different, consistent checkpoint: no
# reader can tell it from a genuine one, so those fields are only edited without resealing.
STRUCTURAL = ("format", "version", "step", "files", "tensors")


def _paths(node, prefix=()):
    """Every (path of keys) inside a JSON tree, for deleting or editing one field."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield prefix + (k,)
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield prefix + (i,)
            yield from _paths(v, prefix + (i,))


def _parent(manifest: dict, path: tuple):
    node = manifest
    for k in path[:-1]:
        node = node[k]
    return node


def flip_shard(ckpt, scratch, rng):
    _flip(ckpt / rng.choice(FILES), rng)


def flip_manifest(ckpt, scratch, rng):
    _flip(ckpt / MANIFEST, rng)


def truncate_shard(ckpt, scratch, rng):
    _truncate(ckpt / rng.choice(FILES), rng)


def truncate_manifest(ckpt, scratch, rng):
    _truncate(ckpt / MANIFEST, rng)


def delete_field(ckpt, scratch, rng):
    manifest = _manifest(ckpt)
    path = rng.choice([p for p in _paths(manifest) if p != ("digest",)])
    parent = _parent(manifest, path)
    del parent[path[-1]]
    _write(ckpt, manifest, seal=path[0] in STRUCTURAL and rng.random() < 0.5)


_EDITS = [0, -1, 1, 7, 10**12, "x", None, [], {}, True, 2.5]


def edit_field(ckpt, scratch, rng):
    manifest = _manifest(ckpt)
    path = rng.choice([p for p in _paths(manifest) if p != ("digest",)
                       and not isinstance(_parent(manifest, p)[p[-1]], (dict, list))])
    parent = _parent(manifest, path)
    old = parent[path[-1]]
    parent[path[-1]] = rng.choice([e for e in _EDITS if e != old or type(e) is not type(old)])
    _write(ckpt, manifest, seal=path[0] in STRUCTURAL and rng.random() < 0.5)


def edit_step(ckpt, scratch, rng):  # "step": 2 made 1 (the "step": 6 made 4)
    text = (ckpt / MANIFEST).read_text()
    (ckpt / MANIFEST).write_text(text.replace('"step": 2', '"step": 1'))


def _slices(manifest, rng):
    name = rng.choice(sorted(manifest["tensors"]))
    return name, manifest["tensors"][name]["slices"]


def overlap_slices(ckpt, scratch, rng):
    manifest = _manifest(ckpt)
    name, slices = _slices(manifest, rng)
    if rng.random() < 0.5:  # the second begins inside the first
        slices[1]["start"] -= rng.randint(1, slices[0]["end"] - slices[0]["start"])
    else:  # a duplicate of one slice, under the other file's key
        other = dict(slices[0], file=slices[1]["file"], key=slices[0]["key"] + "#dup")
        slices.append(other)
    _write(ckpt, manifest, seal=True)


def missing_slice(ckpt, scratch, rng):
    manifest = _manifest(ckpt)
    name, slices = _slices(manifest, rng)
    if rng.random() < 0.5:
        slices.pop(rng.randrange(len(slices)))
    else:  # a gap: one slice made shorter
        piece = rng.choice([s for s in slices if s["end"] - s["start"] > 1])
        piece["end"] -= rng.randint(1, piece["end"] - piece["start"] - 1)
    _write(ckpt, manifest, seal=True)


def hostile_name(ckpt, scratch, rng):
    """A file name that leaves the directory, pointing at an identical copy placed there."""
    victim = rng.choice(FILES)
    target = rng.choice(["../x.safetensors", "../../x.safetensors", str(scratch / "x.safetensors"),
                         "sub/../x.safetensors", "..", ".x.safetensors", "/etc/hostname"])
    placed = (ckpt / target) if not target.startswith("/") else Path(target)
    if not target.startswith("/etc") and target not in ("..",):
        placed.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ckpt / victim, placed)
    manifest = json.loads(json.dumps(_manifest(ckpt)).replace(victim, target))
    _write(ckpt, manifest, seal=True)


def symlink_out(ckpt, scratch, rng):
    """A file, the manifest, the whole step directory, or `latest` replaced by a link to an
    identical copy outside (or to another run's checkpoint)."""
    choice = rng.choice(["shard", "manifest", "directory", "latest"])
    if choice == "directory":
        copy = scratch / "copied-step"
        shutil.copytree(ckpt, copy)
        shutil.rmtree(ckpt)
        ckpt.symlink_to(copy, target_is_directory=True)
        return
    if choice == "latest":
        other = scratch / "other" / CHECKPOINTS
        synthetic_save(other, 2, session="other", values=synthetic_state(99))  # followed = wrong
        (ckpt.parent / LATEST).unlink()
        (ckpt.parent / LATEST).symlink_to(other / STEP)
        return
    name = rng.choice(FILES) if choice == "shard" else MANIFEST
    copy = scratch / f"copied-{name}"
    shutil.copyfile(ckpt / name, copy)
    (ckpt / name).unlink()
    (ckpt / name).symlink_to(copy)


def delete_file(ckpt, scratch, rng):
    (ckpt / rng.choice(FILES + [MANIFEST])).unlink()


def damage_latest(ckpt, scratch, rng):
    latest = ckpt.parent / LATEST
    pointer = json.loads(latest.read_text())
    latest.write_text(rng.choice([
        json.dumps({**pointer, "step_dir": "../../other/checkpoints/" + STEP}),
        json.dumps({**pointer, "step_dir": str(ckpt)}),
        json.dumps({**pointer, "manifest_digest": "0" * 64}),
        json.dumps({**pointer, "step_dir": "step-00000009"}),
        "garbage", "", "[]"]))


def older_also_broken(ckpt, scratch, rng):
    """Both checkpoints damaged, each in its own way: nothing to recover from, so refused."""
    for damaged in (ckpt.parent / "step-00000001", ckpt):
        rng.choice([flip_shard, flip_manifest, truncate_shard, truncate_manifest, delete_file])(
            damaged, scratch, rng)


DAMAGES = {  # name: (function, cases)
    "bit flip in a shard": (flip_shard, 20), "bit flip in the manifest": (flip_manifest, 15),
    "truncated shard": (truncate_shard, 8), "truncated manifest": (truncate_manifest, 5),
    "deleted manifest field": (delete_field, 12), "edited manifest field": (edit_field, 12),
    "edited step": (edit_step, 1), "overlapping slices": (overlap_slices, 8),
    "missing slice": (missing_slice, 8), "hostile file name": (hostile_name, 8),
    "symlink out of the directory": (symlink_out, 8), "deleted file": (delete_file, 4),
    "damaged latest": (damage_latest, 7), "older one broken too": (older_also_broken, 24),
}


def _outcome(run_dir: Path) -> tuple[str, str]:
    """('refused' | 'recovered' | 'intact' | 'silent', detail) of resuming from `run_dir`."""
    root = run_dir / CHECKPOINTS
    try:
        ckpt, (manifest, values) = load_with_fallback(
            newest_usable(root), load_synthetic, lambda rejected: newest_usable(root, rejected))
    except CheckpointError as e:
        return "refused", str(e).splitlines()[0]
    step = int(ckpt.name.removeprefix("step-"))
    exact = (same_state(values, step) and manifest["step"] == step
             and manifest["state"] == {"step": step, "marker": f"state of {step}"})
    if not exact:
        return "silent", f"loaded {ckpt.name} with values or state that differ from what was saved"
    return ("recovered" if step == 1 else "intact"), ckpt.name


def test_fuzzed_checkpoints_are_refused_or_recovered_never_loaded_wrong(saved, tmp_path, seed=SEED):
    rng = random.Random(seed)
    counts = {"refused": 0, "recovered": 0, "intact": 0, "silent": 0}
    silent, refused_needlessly, began, n = [], [], time.perf_counter(), 0
    by_damage = {}
    for what, (damage, cases) in DAMAGES.items():
        by_damage[what] = {}
        for i in range(cases):
            scratch = tmp_path / f"{n}"
            run_dir = scratch / "run"
            shutil.copytree(saved, run_dir, symlinks=True)
            damage(run_dir / CHECKPOINTS / STEP, scratch, rng)
            try:
                outcome, detail = _outcome(run_dir)
            except Exception as e:  # anything but CheckpointError escaping is a failure too
                outcome, detail = "silent", f"{type(e).__name__}: {e}"
            counts[outcome] += 1
            by_damage[what][outcome] = by_damage[what].get(outcome, 0) + 1
            if outcome == "silent":
                silent.append(f"{what} #{i}: {detail}")
            if outcome == "refused" and damage is not older_also_broken:  # step 1 was there, whole
                refused_needlessly.append(f"{what} #{i}: {detail}")
            n += 1
    seconds = time.perf_counter() - began
    print(f"\n{n} fuzzed checkpoints (seed {seed}) in {seconds:.1f} s: {counts['refused']} refused, "
          f"{counts['recovered']} recovered from the older checkpoint, {counts['intact']} loaded "
          f"exactly as saved (the damage changed nothing the reader uses), {counts['silent']} "
          f"loaded silently wrong")
    for what, outcomes in by_damage.items():
        print(f"  {what}: " + ", ".join(f"{v} {k}" for k, v in sorted(outcomes.items())))
    assert n >= 100
    assert not silent, "\n".join(silent)
    assert not refused_needlessly, "\n".join(refused_needlessly)  # the older one was usable
    assert counts["refused"] >= 20 and counts["recovered"] >= 50  # the suite exercises both paths
    assert seconds < 60
