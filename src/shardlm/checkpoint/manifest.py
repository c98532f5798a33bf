"""What makes a checkpoint directory trustworthy, checked before a byte of tensor data is read.

- The manifest seals itself: its `digest` is the SHA-256 of its canonical JSON (sorted keys, no
  whitespace) without that field. An edited manifest (`"step": 6` made 4) no longer matches.
- Its structure is checked: every file name is a plain name inside the checkpoint directory (no
  '/', no '..', no absolute path); every slice names a listed file and a key of its own; the
  slices of each tensor tile it exactly (sorted by start, each begins where the previous ended,
  from 0 to the tensor's size): no element is left at its initial value, none is read twice.
- A checkpoint's files are opened without following symbolic links (O_NOFOLLOW) and must be
  regular files, so nothing outside the directory is ever read through it.
- `latest` is a small JSON file, {"step_dir", "manifest_digest"}, renamed into place: it names a
  directory beside it, never a path, and reading it checks that directory's manifest digest.
  An old-style `latest` symlink is followed only to a step directory in the same checkpoints/.
- `newest_usable` chooses the checkpoint to resume: `latest`'s, or if that one is unusable, the
  newest older step directory that is. "Usable" is cheap to check — the manifest verifies and
  every file it lists is there at its recorded size; each file's SHA-256 is checked when it is
  read (reader.CheckpointReader), and a mismatch names the file. `load_with_fallback` closes
  the gap: a checkpoint that fails at load (a shard whose bytes changed but not its size) is
  rejected with its reason and the next usable one is loaded instead.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import stat
from pathlib import Path
from typing import Callable, TypeVar

from shardlm.errors import ConfigError
from shardlm.launch.files import atomic_write

log = logging.getLogger("shardlm")

FORMAT, VERSION = "shardlm-checkpoint", 2  # 2: the manifest carries its digest
MANIFEST, CHECKPOINTS, LATEST = "manifest.json", "checkpoints", "latest"
STEP_DIR = re.compile(r"^step-(\d{8})$")
# A plain file name: no '/', and no leading '.', so never '.', '..' or a hidden temporary.
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,254}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
DTYPES = ("float32", "bfloat16", "float16", "float64", "int64", "int32", "uint8", "bool")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used: missing, corrupt, or not matching this model."""


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def manifest_digest(manifest: dict) -> str:
    """SHA-256 of the manifest's canonical JSON, its own `digest` field left out."""
    body = {k: v for k, v in manifest.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def sealed(manifest: dict) -> dict:
    """The manifest with its digest."""
    return {**manifest, "digest": manifest_digest(manifest)}


def open_no_follow(path: Path) -> int:
    """A read-only descriptor of the regular file `path`, never through a symbolic link."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointError(f"{path} is a symbolic link: a checkpoint's files are read from "
                                  f"its own directory only, never through a link") from None
        raise CheckpointError(f"{path} cannot be read: {e}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{path} is not a regular file")
    return fd


def _read_no_follow(path: Path) -> bytes:
    with os.fdopen(open_no_follow(path), "rb") as f:
        return f.read()


def _is_int(value, low: int = 0) -> bool:
    return type(value) is int and value >= low


def _check_tiling(where: Path, name: str, entry: dict, files: dict, keys: set) -> None:
    """The slices of tensor `name` cover [0, numel) exactly once."""
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(_is_int(n) for n in shape):
        raise CheckpointError(f"{where}: tensor {name!r} has no valid shape ({shape!r})")
    if entry.get("dtype") not in DTYPES:
        raise CheckpointError(f"{where}: tensor {name!r} has dtype {entry.get('dtype')!r}, not one of {DTYPES}")
    numel = 1
    for n in shape:
        numel *= n
    slices = entry.get("slices")
    if not isinstance(slices, list):
        raise CheckpointError(f"{where}: tensor {name!r} has no list of slices")
    spans = []
    for piece in slices:
        if not isinstance(piece, dict):
            raise CheckpointError(f"{where}: a slice of {name!r} is not an object ({piece!r})")
        if piece.get("box") is not None:
            raise CheckpointError(f"{name!r} in {where.parent} is sharded by tensor/pipeline "
                                  f"parallelism, which this version cannot read")
        start, end, file, key = piece.get("start"), piece.get("end"), piece.get("file"), piece.get("key")
        if not (_is_int(start) and _is_int(end) and start < end <= numel):
            raise CheckpointError(f"{where}: a slice of {name!r} spans [{start!r}, {end!r}), not a "
                                  f"range inside its {numel} elements")
        if not isinstance(file, str) or file not in files:
            raise CheckpointError(f"{where}: a slice of {name!r} is in {file!r}, a file the "
                                  f"manifest does not list")
        if not isinstance(key, str) or (file, key) in keys:
            raise CheckpointError(f"{where}: a slice of {name!r} reuses the key {key!r} of {file}")
        keys.add((file, key))
        spans.append((start, end))
    at = 0
    for start, end in sorted(spans):
        if start < at:
            raise CheckpointError(f"{where}: slices of {name!r} overlap on elements [{start}, "
                                  f"{min(at, end)}): the checkpoint is inconsistent")
        if start > at:
            break
        at = end
    if at != numel:
        gap_end = next((s for s, _ in sorted(spans) if s > at), numel)
        raise CheckpointError(f"{where}: no slice holds elements [{at}, {gap_end}) of {name!r} "
                              f"({numel} elements): the checkpoint is incomplete")


def check_structure(where: Path, manifest: dict) -> None:
    """Everything the reader relies on, checked before it reads: field types, confined file
    names, and slices that tile every tensor."""
    kinds = {"step": int, "state": dict, "files": dict, "tensors": dict, "ranks": list,
             "layout": dict, "config": dict}
    wrong = [k for k, kind in kinds.items() if not isinstance(manifest.get(k), kind)
             or isinstance(manifest.get(k), bool)]
    if wrong:
        raise CheckpointError(f"{where} lacks valid field(s) {wrong}: not a complete manifest")
    if manifest["step"] < 0 or manifest["state"].get("step") != manifest["step"]:
        raise CheckpointError(f"{where}: step {manifest['step']!r} and the state's step "
                              f"{manifest['state'].get('step')!r} disagree")
    files = manifest["files"]
    for name, info in files.items():
        if not _PLAIN_NAME.match(name):
            raise CheckpointError(f"{where} lists the file {name!r}: a checkpoint's file names "
                                  f"are plain names inside its directory (no '/', no '..', no "
                                  f"absolute path, no leading '.')")
        if not (isinstance(info, dict) and _is_int(info.get("bytes"))
                and isinstance(info.get("sha256"), str) and _SHA256.match(info["sha256"])):
            raise CheckpointError(f"{where}: the entry of {name!r} needs bytes and a SHA-256 ({info!r})")
    keys: set = set()
    for name, entry in manifest["tensors"].items():
        if not isinstance(entry, dict):
            raise CheckpointError(f"{where}: tensor {name!r} is not described")
        _check_tiling(where, name, entry, files, keys)


def parse_manifest(ckpt: Path, text: str) -> dict:
    """The manifest of checkpoint `ckpt` from its text: format, version, own digest and
    structure checked; CheckpointError naming the file otherwise."""
    where = Path(ckpt) / MANIFEST
    try:
        manifest = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{where} is not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{where} is not a shardlm checkpoint manifest")
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"{where} has format version {manifest.get('version')!r}; "
                              f"this shardlm reads version {VERSION}")
    actual = manifest_digest(manifest)
    if manifest.get("digest") != actual:
        raise CheckpointError(f"{where} does not match its own digest (recorded "
                              f"{manifest.get('digest')!r}, computed {actual}): it was edited or "
                              f"damaged after it was written")
    check_structure(where, manifest)
    numbered = STEP_DIR.match(Path(ckpt).name)
    if numbered and int(numbered.group(1)) != manifest["step"]:
        raise CheckpointError(f"{where} records step {manifest['step']}, but its directory is "
                              f"{Path(ckpt).name}")
    return manifest


def read_manifest(ckpt: Path) -> dict:
    """parse_manifest of `ckpt/manifest.json`, read without following a link."""
    data = _read_no_follow(Path(ckpt) / MANIFEST)
    try:
        text = data.decode()
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{Path(ckpt) / MANIFEST} is not UTF-8 text ({e})") from None
    return parse_manifest(ckpt, text)


def check_checkpoint(ckpt: Path) -> dict:
    """The manifest of a usable checkpoint: a real directory, a manifest that verifies, every
    file it lists present (a regular file, not a link) at its recorded size. SHA-256s are
    checked when the files are read."""
    try:
        mode = os.lstat(ckpt).st_mode
    except FileNotFoundError:
        raise CheckpointError(f"{ckpt} does not exist") from None
    if stat.S_ISLNK(mode) or not stat.S_ISDIR(mode):
        raise CheckpointError(f"{ckpt} is not a directory (a link or a file)")
    if not os.path.lexists(ckpt / MANIFEST):
        raise CheckpointError(f"{ckpt} has no {MANIFEST} (an unfinished or damaged save)")
    manifest = read_manifest(ckpt)
    for name, info in manifest["files"].items():
        path = ckpt / name
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing") from None
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{path} is not a regular file (a link or a directory)")
        if st.st_size != info["bytes"]:
            raise CheckpointError(f"{path} has {st.st_size} bytes where the manifest records "
                                  f"{info['bytes']}: truncated or damaged")
    return manifest


# ---------------------------------------------------------------------------------------------
# latest, and the choice of a checkpoint


def write_latest(root: Path, ckpt: Path, digest: str) -> None:
    """Point `root/latest` at the step directory `ckpt` (in `root`), atomically."""
    assert ckpt.parent == root and STEP_DIR.match(ckpt.name), ckpt
    atomic_write(root / LATEST, json.dumps({"step_dir": ckpt.name, "manifest_digest": digest}) + "\n",
                 fsync=True)


def latest_name(root: Path) -> tuple[str | None, str | None]:
    """(the step directory `root/latest` names, the manifest digest it records) as written, or
    None for what it does not say. An old-style link counts only if it stays in `root`."""
    path = root / LATEST
    try:
        if os.path.islink(path):
            target = (root / os.readlink(path)).resolve()
            inside = target.parent == root.resolve() and STEP_DIR.match(target.name)
            return (target.name if inside else None), None
        pointer = json.loads(_read_no_follow(path).decode())
    except (OSError, CheckpointError, ValueError, RecursionError):
        return None, None
    if not isinstance(pointer, dict):
        return None, None
    name, digest = pointer.get("step_dir"), pointer.get("manifest_digest")
    return ((name if isinstance(name, str) and STEP_DIR.match(name) else None),
            (digest if isinstance(digest, str) else None))


def read_latest(root: Path) -> Path | None:
    """The checkpoint `root/latest` names, verified; None if there is no `latest`;
    CheckpointError saying why if it cannot be used."""
    path = root / LATEST
    if not os.path.lexists(path):
        return None
    name, digest = latest_name(root)
    if name is None:
        what = (f"a link to {os.readlink(path)!r}, outside {root}" if os.path.islink(path)
                else "not a pointer to a step directory beside it")
        raise CheckpointError(f"{path} is {what}: not followed")
    ckpt = root / name
    manifest = check_checkpoint(ckpt)
    if not os.path.islink(path) and manifest["digest"] != digest:
        raise CheckpointError(f"{path} names {name} with manifest digest {digest}, but that "
                              f"manifest's digest is {manifest['digest']}: replaced or edited "
                              f"after it was published")
    return ckpt


def step_dirs(root: Path) -> list[Path]:
    """The step-N entries of `root`, newest first (links and files included: they are reported
    as unusable, not skipped silently)."""
    try:
        names = [e.name for e in os.scandir(root) if STEP_DIR.match(e.name)]
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [root / n for n in sorted(names, reverse=True)]


def _check_unrejected(ckpt: Path, rejected: dict[Path, str]) -> None:
    """check_checkpoint, and refused if a load already found it unusable."""
    reason = rejected.get(ckpt.resolve())
    if reason is not None:
        raise CheckpointError(reason)
    check_checkpoint(ckpt)


def newest_usable(root: Path, rejected: dict[Path, str] | None = None) -> Path | None:
    """The checkpoint to resume from in `root` (a run's checkpoints/): `latest`'s if usable,
    else the newest usable one no newer than the one `latest` names, each one skipped logged
    with its reason. `rejected`: checkpoints (resolved) that failed when loaded, with why.
    None if `root` holds no checkpoint at all; CheckpointError if it holds some but none is
    usable — a run must not start from step 0 on top of them unasked."""
    rejected = rejected or {}
    candidates = step_dirs(root)
    if not candidates and not os.path.lexists(root / LATEST):
        return None
    problems = []
    try:
        chosen = read_latest(root)
        if chosen is not None:
            _check_unrejected(chosen, rejected)
    except CheckpointError as e:
        problems.append(str(e))
        chosen = None
    if chosen is None:
        named, _ = latest_name(root)
        for ckpt in candidates:
            if named is not None and ckpt.name > named:
                continue  # newer than what was last published: not this run's history
            try:
                _check_unrejected(ckpt, rejected)
            except CheckpointError as e:
                problems.append(str(e))
                continue
            chosen = ckpt
            break
    problems = list(dict.fromkeys(problems))  # latest's reason may be its directory's
    if chosen is None:
        listed = "".join(f"\n  - {p}" for p in problems) or f"\n  - {root} has no step directory"
        raise CheckpointError(
            f"{root} holds checkpoints, but none is usable:{listed}\nNot starting from step 0 "
            f"on top of them. To train afresh, set checkpoint.resume = 'never' (later saves "
            f"replace these) or use a new run.name; to resume, pass a checkpoint you trust as "
            f"checkpoint.resume = PATH")
    if problems:
        log.warning("unusable checkpoint(s) in %s:%s\nresuming from %s instead, the newest usable one",
                    root, "".join(f"\n  - {p}" for p in problems), chosen)
    return chosen.resolve()


def _looks_like_checkpoints(root: Path) -> bool:
    return root.is_dir() and (root.name == CHECKPOINTS or bool(step_dirs(root))
                              or os.path.lexists(root / LATEST) and not os.path.islink(root / LATEST))


def find_checkpoint(path: str | Path, rejected: dict[Path, str] | None = None) -> Path:
    """A usable checkpoint directory, from itself (checked, no fallback: it was named), a
    checkpoints/ directory, its `latest`, or a run directory (their newest usable one, see
    newest_usable; `rejected` as there)."""
    p = Path(path)
    if p.name == LATEST and os.path.lexists(p) and _looks_like_checkpoints(p.parent):
        return newest_usable(p.parent, rejected)  # not None: `latest` is there
    if os.path.lexists(p / MANIFEST):
        _check_unrejected(p, rejected or {})
        return p.resolve()
    for root in (p, p / CHECKPOINTS):
        if _looks_like_checkpoints(root):
            found = newest_usable(root, rejected)
            if found is not None:
                return found
    raise CheckpointError(f"no checkpoint at {str(path)!r}: expected a directory holding "
                          f"{MANIFEST}, or a run directory with {CHECKPOINTS}/")


def latest_in(run_dir: Path) -> Path | None:
    """The run directory's newest usable checkpoint, or None (when it has none, or none usable:
    then a warning says why)."""
    try:
        return newest_usable(Path(run_dir) / CHECKPOINTS)
    except CheckpointError as e:
        log.warning("%s", e)
        return None


Loaded = TypeVar("Loaded")


def load_with_fallback(first: Path, load: Callable[[Path], Loaded],
                       choose: Callable[[dict[Path, str]], Path | None]) -> tuple[Path, Loaded]:
    """(the checkpoint loaded, what `load` returned): `load(first)`; if that fails with a
    CheckpointError (a shard whose SHA-256 does not match: choosing checks only the manifest and
    file sizes; or a tensor this model has that the checkpoint lacks, which a damaged manifest
    and another model's checkpoint both look like), `first` is rejected with its reason and
    `choose(rejected)` names the next checkpoint to try (newest_usable / find_checkpoint with
    `rejected`: CheckpointError listing every reason when none is left, or when the one that
    failed was named explicitly). `load` must fail on every rank or on none
    (reader.load_slices does), and must fill everything it fills on success, so a failed
    attempt leaves nothing behind."""
    rejected: dict[Path, str] = {}
    source = first
    while True:
        try:
            return source, load(source)
        except CheckpointError as e:
            rejected[Path(source).resolve()] = str(e)  # choose's warning will report it
        source = choose(rejected)
        if source is None or Path(source).resolve() in rejected:  # choose honours rejected: a guard
            raise CheckpointError(f"no usable checkpoint left after {sorted(map(str, rejected))}")
