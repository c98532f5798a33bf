"""Resumable, sharded checkpoints: every rank writes what it owns, any layout loads any layout.

On disk, `<run>/checkpoints/`:

    step-00000500/
      manifest.json            format, version, step, config, layout, the run's scalar state, each
                               rank's RNG, every file's size and SHA-256, every tensor's global
                               shape, dtype and which file holds which slice of it; and the
                               SHA-256 of all that (its digest: manifest.py)
      rank-00000.safetensors   the slices rank 0 owns, one flat tensor per slice
      rank-00001.safetensors
    latest                     {"step_dir": "step-00000500", "manifest_digest": "..."}

A slice is the elements [start, end) of a tensor flattened in row-major order — what a ZeRO
shard is. Tensor and pipeline parallelism will shard a tensor into a box first; the manifest
already records each slice's box (today always the whole tensor), and the reader refuses boxes
it cannot yet combine rather than misreading them.

Writing is crash-safe: each rank writes its file under a temporary name, fsyncs it and renames it
inside a temporary directory, then a small JSON note of what it wrote. Rank 0 waits for every
rank's note, writes the sealed manifest, renames the directory to step-N, and only then moves
`latest` and deletes checkpoints beyond `keep`. Nothing complete is ever deleted in place: a
directory to remove (an older save of the same step, one beyond `keep`) is first renamed to a
hidden name, then deleted; `latest` is moved off a directory before it is renamed aside. A crash
after any single filesystem operation thus leaves the newest published checkpoint whole and
`latest` naming a complete one (tests/test_checkpoint.py crashes the writer after each).
No collective is involved, so a save can run on a background thread while training continues
(asynchronous save).

Reading (reader.py) never unpickles: tensors come from safetensors (a JSON header and raw bytes), metadata
from JSON. The manifest is verified (digest, confined names, exact tiling: manifest.py) before
anything is read, and every file a rank reads from is checked against its SHA-256 first. A
rank that cannot read makes every rank raise (raise_on_every_rank), so a resume can try an older
checkpoint on all ranks at once (manifest.load_with_fallback).
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import logging
import os
import shutil
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from shardlm.checkpoint.manifest import (CHECKPOINTS, FORMAT, LATEST, MANIFEST, VERSION,
                                         CheckpointError, check_checkpoint, find_checkpoint,
                                         latest_in, latest_name, load_with_fallback,
                                         newest_usable, open_no_follow, parse_manifest,
                                         read_manifest, sealed, step_dir_name, step_dirs,
                                         write_latest)
from shardlm.launch.allocator import host_tensor
from shardlm.launch.files import atomic_write
from shardlm.launch.preflight import DiskError, disk_error

log = logging.getLogger("shardlm")

__all__ = ["CHECKPOINTS", "FORMAT", "LATEST", "MANIFEST", "VERSION", "CheckpointError",
           "CheckpointWriter", "SaveReport", "StateSlice", "find_checkpoint", "latest_in",
           "load_with_fallback", "newest_usable", "param_state", "parse_manifest", "read_manifest",
           "step_dir_name"]


@dataclass(frozen=True)
class StateSlice:
    """The part of one global tensor that this rank holds (or must fill, when loading)."""

    name: str
    """Global name, e.g. 'model/blocks.0.attn.qkv.weight' or 'optim/exp_avg/...'."""
    shape: tuple[int, ...]
    """The whole tensor's shape."""
    start: int
    end: int
    """Elements [start, end) of the tensor flattened row-major."""
    tensor: torch.Tensor
    """This rank's live 1-D view of those elements (end - start of them)."""
    snapshot: Callable[[], torch.Tensor] | None = None
    """For state that lives in a file (the nvme tier): a copy of `tensor` the next steps do not
    change, made on the same disk, so an asynchronous save does not copy it into memory."""


def param_state(name: str, shape: tuple[int, ...], start: int, end: int, master: torch.Tensor,
                optim_state: dict, local: slice = slice(None)) -> list[StateSlice]:
    """A parameter's checkpointed state — its master value and AdamW's two moments (or Muon's
    momentum buffer, train.optimizer = 'muon') — for the
    elements [start, end) that `master.view(-1)[local]` (and the moments' same slice) hold.
    A frozen parameter (empty `optim_state`) has its value only."""
    views = [("model", master)] + [(f"optim/{k}", optim_state[k]) for k in ("exp_avg", "exp_avg_sq", "momentum_buffer")
                                   if k in optim_state]
    return [StateSlice(f"{kind}/{name}", shape, start, end, t.detach().view(-1)[local])
            for kind, t in views]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
                       torch.float64: "F64", torch.int64: "I64", torch.int32: "I32",
                       torch.uint8: "U8", torch.bool: "BOOL"}
_PIECE_BYTES = 1 << 26
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG})
"""A checkpoint write failing with one of these is the disk's fault: a DiskError (exit 4)."""


def _safetensors_pieces(tensors: dict[str, torch.Tensor]) -> Iterator[memoryview]:
    """The bytes of a safetensors file: an 8-byte little-endian header length, a JSON header
    (dtype, shape and byte range of every tensor), the raw data — yielded in pieces."""
    header, offset = {}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data then starts 8-byte aligned
    yield memoryview(struct.pack("<Q", len(head)) + head)
    for t in tensors.values():
        flat = t.detach().reshape(-1)
        step = max(1, _PIECE_BYTES // t.element_size())
        for a in range(0, flat.numel(), step):
            piece = flat[a:a + step]
            piece = piece.to("cpu") if piece.device.type != "cpu" else piece.contiguous()
            # The bytes in place, by address: .numpy() would make the storage unresizable for
            # good, and ZeRO-3 frees a gathered buffer by resizing it (weights saved inside
            # full_parameters). `piece` stays alive here while the consumer writes it.
            yield memoryview((ctypes.c_char * (piece.numel() * piece.element_size()))
                             .from_address(piece.data_ptr())).cast("B")


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> tuple[int, str]:
    """Write a safetensors file piece by piece, straight from `tensors` (the library's save()
    first builds the whole file in memory: a second copy of everything a rank saves). Hashes
    while writing; fsync, then rename into place. Returns (bytes, SHA-256). Reading stays with
    the safetensors library, which also checks what this writes."""
    digest, size = hashlib.sha256(), 0
    part = path.with_name(path.name + ".part")
    try:
        with open(part, "wb") as f:
            for piece in _safetensors_pieces(tensors):
                f.write(piece)
                digest.update(piece)
                size += piece.nbytes
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, path)
    except BaseException:  # a full disk, say: the partial file goes, and its space with it
        part.unlink(missing_ok=True)
        raise
    return size, digest.hexdigest()


def _rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def _note_file(rank: int) -> str:
    return f"rank-{rank:05d}.json"


NOTE_QUIET_S = 5.0
"""After a signal during a save, how long rank 0 waits for missing notes with no change in the
save's directory before it gives up (CheckpointWriter._await_notes)."""


def _dir_state(path: Path) -> frozenset:
    """What changes in a directory while a rank writes there: names, sizes, times."""
    try:
        with os.scandir(path) as entries:
            return frozenset((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in entries)
    except FileNotFoundError:  # an entry renamed (a .part) between listing and stat
        return frozenset()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _sha256(path: Path) -> str:
    """The file's SHA-256, read without following a link (CheckpointError if it is one)."""
    with os.fdopen(open_no_follow(path), "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _remove(path: Path) -> None:
    """Delete a file, link or directory tree (a link itself, never what it points to)."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Writing


@dataclass
class SaveReport:
    step: int
    stall_s: float
    """Time the training loop waited: the previous save's finish (if still running) plus, for
    a synchronous save, all of it, or for an asynchronous one, the copy of this rank's state."""
    bytes: int
    """Bytes this rank writes."""
    write_s: float | None = None
    """Wall time of the write itself (known when it has finished)."""


class CheckpointWriter:
    """One per rank. `save` snapshots this rank's slices and writes them (in the background when
    asynchronous); rank 0 also assembles the manifest and publishes the checkpoint."""

    def __init__(self, root: Path, rank: int, world_size: int, keep: int, asynchronous: bool,
                 session: str, timeout_s: float, owner: str = ""):
        """`owner`: a prefix of `session` shared by this writer's earlier sessions only — with
        several writers in one `root` (parallel.fault_tolerant: whichever replica is the lowest
        live one), each sweeps its own leftovers, never another's save in flight; '' = all."""
        assert session.startswith(owner)
        self.root, self.rank, self.world_size, self.keep = root, rank, world_size, keep
        self.asynchronous, self.session, self.timeout_s = asynchronous, session, timeout_s
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last: SaveReport | None = None
        self._snapshots: dict[str, torch.Tensor] = {}
        self.interrupted: Callable[[], bool] = lambda: False
        """Set before a save by the trainer (launch.StopSignals.watch): True once a signal came
        during it, which bounds rank 0's wait for the other ranks' notes (_await_notes)."""
        if rank == 0:  # a crashed attempt's unfinished or half-deleted directories (the run
            # directory is locked: no other attempt runs now)
            for stale in [*self.root.glob(f".step-*.{owner}*.tmp"),
                          *self.root.glob(f".step-*.{owner}*.old")]:
                if f".{session}." not in stale.name:
                    _remove(stale)

    def _tmp_dir(self, step: int) -> Path:
        return self.root / f".{step_dir_name(step)}.{self.session}.tmp"

    def save(self, step: int, slices: list[StateSlice], writes: bool, state: dict[str, Any],
             rank_state: dict[str, Any], meta: dict[str, Any]) -> SaveReport:
        """Save this rank's part of checkpoint `step`. `writes`: whether this rank's slices go
        to disk (replicas of the same shard write once). `state` and `meta` (rank 0's are used)
        go to the manifest as they are; `rank_state` (JSON) is kept per rank."""
        start = time.perf_counter()
        self.wait()
        # Asynchronous: a snapshot on the CPU, since training goes on changing the originals —
        # into buffers kept from the last save (fresh memory is slow to fault in, and a save
        # would otherwise allocate the rank's whole state each time); state kept in files
        # (StateSlice.snapshot) is copied on its disk instead. Synchronous: written
        # straight from the live tensors, no copy.
        # A rank usually holds one slice per tensor, keyed by the tensor's name; a tensor-parallel
        # piece can make several runs of one tensor (placement.Split.runs): keyed name#start.
        counts: dict[str, int] = {}
        for s in slices:
            counts[s.name] = counts.get(s.name, 0) + 1
        keyed = {(s.name if counts[s.name] == 1 else f"{s.name}#{s.start}"): s for s in slices}
        if not writes:
            tensors = {}
        elif self.asynchronous:
            tensors = {k: s.snapshot() if s.snapshot is not None
                       else self._snapshot_buffer(k, s.tensor).copy_(s.tensor) for k, s in keyed.items()}
        else:
            tensors = {k: s.tensor.detach().to("cpu") for k, s in keyed.items()}
        entries = {k: {"name": s.name, "shape": list(s.shape), "start": s.start, "end": s.end,
                       "dtype": _dtype_name(s.tensor.dtype)} for k, s in keyed.items()} if writes else {}
        report = SaveReport(step, 0.0, sum(t.numel() * t.element_size() for t in tensors.values()))

        def job() -> None:
            began = time.perf_counter()
            self._write(step, tensors, entries, state, rank_state, meta)
            report.write_s = time.perf_counter() - began
            if self.rank == 0:
                log.info("checkpoint %s: published (rank 0 wrote %.1f MB in %.2f s)",
                         self.root / step_dir_name(step), report.bytes / 1e6, report.write_s)

        if self.asynchronous:
            self._error = None
            self._thread = threading.Thread(target=self._guarded, args=(job,), daemon=True,
                                            name=f"checkpoint-{step}")
            self._thread.start()
        else:
            job()
        report.stall_s = time.perf_counter() - start
        self.last = report
        return report

    def _snapshot_buffer(self, name: str, like: torch.Tensor) -> torch.Tensor:
        buffer = self._snapshots.get(name)
        if buffer is None or buffer.shape != like.shape or buffer.dtype != like.dtype:
            buffer = host_tensor(like.shape, like.dtype, pinned=like.device.type == "cuda")
            self._snapshots[name] = buffer
        return buffer

    def _guarded(self, job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as e:  # raised in the training thread by the next wait()
            self._error = e

    def wait(self) -> None:
        """Block until this rank's previous save (and, on rank 0, its publication) is done."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, DiskError):  # already the one message a user should see
                raise error
            raise CheckpointError(f"writing a checkpoint failed: {error}") from error

    def _write(self, step: int, tensors: dict[str, torch.Tensor], entries: dict, state: dict,
               rank_state: dict, meta: dict) -> None:
        tmp = self._tmp_dir(step)
        needed = sum(t.numel() * t.element_size() for t in tensors.values())
        target = tmp
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            note: dict[str, Any] = {"rank": self.rank, "file": None, "tensors": entries,
                                    "rank_state": rank_state}
            if tensors:
                target = tmp / _rank_file(self.rank)
                size, sha256 = write_safetensors(target, tensors)
                tensors.clear()
                note.update(file=_rank_file(self.rank), bytes=size, sha256=sha256)
            target = tmp / _note_file(self.rank)
            atomic_write(target, fsync=True, data=json.dumps(note).encode())
            if self.rank == 0:
                target = self.root
                self._publish(step, tmp, state, meta)
        except OSError as e:
            if e.errno not in DISK_ERRNOS:
                raise
            raise self._disk_error(step, tmp, Path(e.filename or target), e, needed) from None

    def _disk_error(self, step: int, tmp: Path, path: Path, error: OSError, needed: int):
        """A checkpoint write the disk refused (ENOSPC, EDQUOT, EROFS, EIO) as one DiskError:
        the file, the bytes this rank was writing and those free, what to do. This rank's
        files of the unfinished checkpoint are removed first (no `.part`, and their space back);
        `latest` still names the previous checkpoint, which is whole."""
        for mine in (tmp / _rank_file(self.rank), tmp / _note_file(self.rank)):
            mine.unlink(missing_ok=True)
        if self.rank == 0:  # the directory, if no other rank's file is in it (else: the next run)
            try:
                tmp.rmdir()
            except OSError:
                pass
        try:
            free = f"{shutil.disk_usage(self.root).free / 1e6:,.1f} MB free there"
        except OSError:
            free = "the free space unknown"
        detail = (f"this rank's part of checkpoint {step_dir_name(step)} is {needed / 1e6:,.1f} MB, "
                  f"{free}; this rank's files of the unfinished checkpoint were removed")
        return disk_error(f"checkpoint {step_dir_name(step)}: writing", path, error, detail)

    def _publish(self, step: int, tmp: Path, state: dict, meta: dict) -> None:
        """Rank 0: when every rank's note is there, write the manifest, rename, move latest."""
        notes = self._await_notes(tmp)
        manifest: dict[str, Any] = {"format": FORMAT, "version": VERSION, "step": step,
                                    **meta, "state": state, "files": {}, "tensors": {},
                                    "ranks": [n["rank_state"] for n in notes]}
        for note in notes:
            if note["file"] is not None:
                manifest["files"][note["file"]] = {"bytes": note["bytes"], "sha256": note["sha256"]}
            for key, e in note["tensors"].items():
                tensor = manifest["tensors"].setdefault(
                    e.get("name", key), {"shape": e["shape"], "dtype": e["dtype"], "slices": []})
                tensor["slices"].append({"file": note["file"], "key": key, "start": e["start"],
                                         "end": e["end"], "box": None})
        manifest = sealed(manifest)
        atomic_write(tmp / MANIFEST, fsync=True, data=json.dumps(manifest, indent=1).encode())
        for note in notes:
            (tmp / _note_file(note["rank"])).unlink()
        _fsync_dir(tmp)
        final = self.root / step_dir_name(step)
        aside = self._aside(final)
        if os.path.lexists(final):  # a previous attempt's save of the same step (maybe damaged)
            self._move_latest_off(final)
            _remove(aside)
            os.replace(final, aside)  # aside, not deleted: a crash now leaves it recoverable
        os.replace(tmp, final)
        _fsync_dir(self.root)
        write_latest(self.root, final, manifest["digest"])
        _fsync_dir(self.root)
        _remove(aside)
        self._rotate(final)

    def _aside(self, ckpt: Path) -> Path:
        """A hidden name for a directory on its way out (the constructor clears leftovers)."""
        return self.root / f".{ckpt.name}.{self.session}.old"

    def _move_latest_off(self, ckpt: Path) -> None:
        """Before `ckpt` is renamed aside: if `latest` names it, point it at the newest usable
        older checkpoint, or remove it (no `latest` is a fresh start, never a dangling one)."""
        if latest_name(self.root)[0] != ckpt.name:
            return
        for older in step_dirs(self.root):
            if older.name < ckpt.name:
                try:
                    manifest = check_checkpoint(older)
                except CheckpointError:
                    continue
                write_latest(self.root, older, manifest["digest"])
                _fsync_dir(self.root)
                return
        (self.root / LATEST).unlink()
        _fsync_dir(self.root)

    def _await_notes(self, tmp: Path) -> list[dict]:
        """Every rank's note, by rank. Bounded by timeout_s and, once a signal came during the
        save (`interrupted`: torchrun signals the survivors when a rank died), by NOTE_QUIET_S
        without any change in `tmp`: a rank still writing changes its files there, a dead one
        never will. So a rank killed mid-save ends the job in seconds (before: rank 0 waited
        here, ignoring the SIGTERM, until torch's SIGKILL 30 s later), while ranks all stopped
        by the user's signal still finish the save they were writing."""
        deadline = time.monotonic() + self.timeout_s
        seen, quiet_since = None, 0.0
        while True:
            missing = [r for r in range(self.world_size) if not (tmp / _note_file(r)).exists()]
            if not missing:
                return [json.loads((tmp / _note_file(r)).read_text()) for r in range(self.world_size)]
            now = time.monotonic()
            if now > deadline:
                raise CheckpointError(f"ranks {missing} did not finish writing {tmp} within "
                                      f"{self.timeout_s:g} s")
            if self.interrupted():
                state = _dir_state(tmp)
                if state != seen:
                    seen, quiet_since = state, now
                elif now - quiet_since > NOTE_QUIET_S:
                    raise CheckpointError(
                        f"ranks {missing} did not finish writing {tmp}: a signal came during the "
                        f"save (a rank died, or the job is being stopped) and nothing there changed "
                        f"for {NOTE_QUIET_S:g} s; this checkpoint is not published, the previous "
                        f"one stays latest")
            time.sleep(0.02)

    def _rotate(self, newest: Path) -> None:
        """Delete checkpoints beyond `keep` (by step; never the newest): renamed aside first, so
        a crash mid-delete never leaves a half-deleted step directory."""
        for old in step_dirs(self.root)[self.keep:]:
            if old != newest:
                aside = self._aside(old)
                _remove(aside)
                os.replace(old, aside)
                _remove(aside)


# ---------------------------------------------------------------------------------------------
# Reading
