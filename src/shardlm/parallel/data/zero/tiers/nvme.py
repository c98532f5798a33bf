"""The nvme tier (ZeRO-Infinity, Rajbhandari et al. 2021): optimizer state and stage-3
parameter shards in files under zero.nvme_path.

    NvmeTier    fp32 masters and AdamW moments in three files, the step streamed in chunks
                through a fixed ring of aligned buffers: read chunk k+1 while updating chunk k
                while writing chunk k-1, so host memory stays `nvme_buffers` chunks whatever the
                model's size, and the disk is busy in both directions while the CPU computes
    FileParams  each stage-3 parameter shard in a file, in memory only while it is needed

Both keep their files in a PrivateDir: a subdirectory of the rank's directory under
zero.nvme_path that one tier of one run creates exclusively and holds locked for its life, so
runs sharing zero.nvme_path never touch each other's files; a dead run's is removed by the next.
A failed read or write is a DiskError naming the file (ENOSPC, EROFS, ...), not a raw OSError.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import secrets
import shutil
import socket
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from shardlm.config.schema import TrainConfig
from shardlm.launch.preflight import disk_error
from shardlm.parallel.data.zero.tiers.memory import TierStats

log = logging.getLogger("shardlm")

ALIGN = 4096
"""O_DIRECT needs buffer addresses, file offsets and lengths aligned to the logical block."""


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class _AlignedBuffer:
    """Page-aligned host memory (an anonymous mapping) seen as a tensor."""

    def __init__(self, nbytes: int, dtype: torch.dtype):
        self._map = mmap.mmap(-1, _aligned(nbytes))
        self.tensor = torch.frombuffer(self._map, dtype=dtype)


class _File:
    """A state file read and written with O_DIRECT where the file system allows it (no page
    cache: the bandwidth is the disk's, and host memory is ours alone to account)."""

    def __init__(self, path: Path):
        self.path = path
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC  # new, in our private directory
        try:
            try:
                self.fd = os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o600)
                self.direct = hasattr(os, "O_DIRECT")
            except OSError as e:  # e.g. tmpfs: buffered I/O, the page cache then holds what we wrote
                if e.errno != errno.EINVAL:
                    raise
                self.fd = os.open(path, flags, 0o600)
                self.direct = False
        except OSError as e:
            raise disk_error("nvme offload: creating", path, e) from None

    def read(self, offset: int, buffer: _AlignedBuffer, nbytes: int) -> int:
        view = memoryview(buffer._map)[:_aligned(nbytes)]
        try:
            return os.preadv(self.fd, [view], offset)
        except OSError as e:
            raise disk_error("nvme offload: reading", self.path, e) from None

    def write(self, offset: int, buffer: _AlignedBuffer, nbytes: int) -> int:
        view = memoryview(buffer._map)[:_aligned(nbytes)]
        try:
            written = os.pwritev(self.fd, [view], offset)
        except OSError as e:
            raise disk_error("nvme offload: writing", self.path, e) from None
        if written != len(view):
            raise disk_error("nvme offload: writing", self.path, _short_write())
        return written

    def truncate(self, nbytes: int) -> None:
        try:
            os.ftruncate(self.fd, nbytes)
        except OSError as e:
            raise disk_error("nvme offload: sizing", self.path, e) from None

    def close(self) -> None:
        os.close(self.fd)
        self.path.unlink(missing_ok=True)


class PrivateDir:
    """A subdirectory of `parent` that belongs to this object alone, for its life.

    `<parent>/<kind>-<pid>-<random>/` is created exclusively (mkdir without exist_ok) after its
    lock file `<parent>/<kind>-<pid>-<random>.lock` was created exclusively and flock'ed; the
    lock is held until `remove()` (or the process's exit, however it exits). Before claiming,
    the directories of dead owners (a lock nobody holds) are removed: what a killed run left.
    The lock file sits beside the directory, not in it, so that a cleaner can take the lock of
    a directory it is about to delete, and the owner checks after locking that its lock file is
    still the one on disk (a cleaner may have taken and removed it in between)."""

    def __init__(self, parent: Path, kind: str):
        try:
            parent.mkdir(parents=True, exist_ok=True)
            remove_dead_dirs(parent)
            self.lock_path, self._fd = self._claim(parent, kind)
            self.path = self.lock_path.with_suffix("")
            self.path.mkdir(mode=0o700)  # exclusive: never an existing directory
        except OSError as e:
            raise disk_error("nvme offload: creating a private directory in", parent, e) from None

    @staticmethod
    def _claim(parent: Path, kind: str) -> tuple[Path, int]:
        while True:
            lock = parent / f"{kind}-{os.getpid()}-{secrets.token_hex(4)}.lock"
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            except FileExistsError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
                    return lock, fd
            except (BlockingIOError, FileNotFoundError):  # a cleaner took it: draw another
                pass
            os.close(fd)

    def remove(self) -> None:
        """The owner's exit: the directory, then its lock file, then the lock."""
        if self._fd is None:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        self.lock_path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None


def remove_dead_dirs(parent: Path) -> list[Path]:
    """Remove every PrivateDir under `parent` whose lock nobody holds (its owner died without
    cleaning up); a live owner's lock keeps its directory. Returns the directories removed."""
    removed = []
    for lock in parent.glob("*.lock"):
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
        except OSError:  # gone meanwhile
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.stat(lock).st_ino != os.fstat(fd).st_ino:
                continue  # another cleaner removed it and someone made a new one
            directory = lock.with_suffix("")
            shutil.rmtree(directory, ignore_errors=True)
            lock.unlink(missing_ok=True)
            removed.append(directory)
        except (BlockingIOError, FileNotFoundError):  # alive, or already cleaned
            pass
        finally:
            os.close(fd)
    if removed:
        log.info("nvme offload: removed %d directories of dead runs under %s", len(removed), parent)
    return removed


def _short_write() -> OSError:
    # A write that stops short of its length is how some file systems say "full".
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@dataclass
class _Segment:
    target: torch.Tensor
    decay: bool
    offset: int
    """Element offset in each state file (ALIGN-aligned in bytes)."""
    numel: int


@dataclass
class _Slot:
    """One ring position: a chunk's master and both moments, plus its gradient in fp32."""

    master: _AlignedBuffer
    exp_avg: _AlignedBuffer
    exp_avg_sq: _AlignedBuffer
    grad: torch.Tensor
    pending_write: Future | None = None


class StreamedAdamW:
    """The part of torch's Optimizer interface the loop and checkpoints use — param_groups
    (lr, betas, eps, weight_decay) and a step counter — for state that is not in memory."""

    def __init__(self, train: TrainConfig):
        common = dict(lr=train.lr, betas=(train.beta1, train.beta2), eps=train.eps, params=[])
        self.param_groups = [{**common, "weight_decay": train.weight_decay},
                             {**common, "weight_decay": 0.0}]
        self.state = {0: {"step": torch.zeros((), dtype=torch.float32)}}


class NvmeTier:
    """Masters and moments in three files (master, exp_avg, exp_avg_sq) on `directory`."""

    name = "nvme"

    def __init__(self, directory: Path, master_dtype: torch.dtype, chunk_bytes: int, buffers: int):
        self.private = PrivateDir(directory, "optimizer")
        self.directory, self.master_dtype = self.private.path, master_dtype
        self.itemsize = torch.empty((), dtype=master_dtype).element_size()
        self.chunk = max(ALIGN, chunk_bytes // ALIGN * ALIGN) // self.itemsize  # elements
        self.files = {k: _File(self.directory / f"{k}.bin") for k in ("master", "exp_avg", "exp_avg_sq")}
        self.segments: list[_Segment] = []
        self.size = 0  # elements per file, with alignment padding
        self.n_buffers = max(3, buffers)
        self.slots: list[_Slot] = []
        self._mapped: dict[str, torch.Tensor] | None = None
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="nvme-read")
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="nvme-write")
        self.stats = TierStats()
        # The files are scratch space: gone when the tier is (or the process ends normally).
        self.close = weakref.finalize(self, _close_files, self.private, list(self.files.values()),
                                      self.reader, self.writer)
        """Stop the I/O threads, delete the files and this tier's directory (once; also when
        the tier is collected or the process exits)."""

    @property
    def direct_io(self) -> bool:
        return self.files["master"].direct

    def _slot(self, i: int) -> _Slot:
        if not self.slots:
            nbytes = self.chunk * self.itemsize
            self.slots = [_Slot(*(_AlignedBuffer(nbytes, self.master_dtype) for _ in range(3)),
                                grad=torch.empty(self.chunk, dtype=self.master_dtype))
                          for _ in range(self.n_buffers)]
        return self.slots[i % self.n_buffers]

    def add(self, target: torch.Tensor, initial: torch.Tensor, decay: bool) -> None:
        """Write the segment's initial master to its file, chunk by chunk (the moments start
        as zeros: the files' holes, see build_optimizer)."""
        segment = _Segment(target, decay, self.size, target.numel())
        self.segments.append(segment)
        self.size += _aligned(segment.numel * self.itemsize) // self.itemsize
        slot = self._slot(0)
        for start in range(0, segment.numel, self.chunk):
            n = min(self.chunk, segment.numel - start)
            slot.master.tensor[:n].copy_(initial[start:start + n])
            self.files["master"].write((segment.offset + start) * self.itemsize, slot.master,
                                       n * self.itemsize)

    def build_optimizer(self, train: TrainConfig) -> None:
        for f in self.files.values():  # sparse: unwritten ranges read as zeros
            f.truncate(self.size * self.itemsize)
        self.optimizer = StreamedAdamW(train)
        log.info("nvme offload: %.1f MB of optimizer state in %s (%s I/O), %d buffers of %.1f MB",
                 3 * self.size * self.itemsize / 1e6, self.directory,
                 "direct" if self.direct_io else "buffered", self.n_buffers,
                 3 * self.chunk * self.itemsize / 1e6)

    def _chunks(self) -> list[tuple[_Segment, int, int]]:
        return [(seg, a, min(a + self.chunk, seg.numel))
                for seg in self.segments for a in range(0, seg.numel, self.chunk)]

    def _io(self, op: str, slot: _Slot, seg: _Segment, a: int, b: int) -> int:
        at, nbytes = (seg.offset + a) * self.itemsize, (b - a) * self.itemsize
        for key in ("master", "exp_avg", "exp_avg_sq"):
            getattr(self.files[key], op)(at, getattr(slot, key), nbytes)
        return 3 * _aligned(nbytes)

    def step(self, grads: list[torch.Tensor]) -> None:
        """AdamW over every chunk: read ahead one chunk, write behind, compute in between."""
        start = time.perf_counter()
        stats = TierStats()
        step_count = self.optimizer.state[0]["step"]
        step_count += 1
        grad_of = {id(seg): g for seg, g in zip(self.segments, grads)}
        chunks = self._chunks()
        reads: dict[int, Future] = {}

        def submit_read(k: int) -> None:
            slot = self._slot(k)
            if slot.pending_write is not None:  # the ring wrapped: that write must land first
                waited = time.perf_counter()
                stats.write_bytes += slot.pending_write.result()
                stats.io_wait_s += time.perf_counter() - waited
                slot.pending_write = None
            reads[k] = self.reader.submit(self._io, "read", slot, *chunks[k])

        if chunks:
            submit_read(0)
        for k, (seg, a, b) in enumerate(chunks):
            if k + 1 < len(chunks):
                submit_read(k + 1)
            waited = time.perf_counter()
            stats.read_bytes += reads.pop(k).result()
            stats.io_wait_s += time.perf_counter() - waited
            slot, n = self._slot(k), b - a
            group = self.optimizer.param_groups[0 if seg.decay else 1]
            grad = slot.grad[:n]
            grad.copy_(grad_of[id(seg)][a:b])
            master = slot.master.tensor[:n]
            torch._fused_adamw_([master], [grad], [slot.exp_avg.tensor[:n]], [slot.exp_avg_sq.tensor[:n]],
                                [], [step_count], lr=group["lr"], beta1=group["betas"][0],
                                beta2=group["betas"][1], weight_decay=group["weight_decay"],
                                eps=group["eps"], amsgrad=False, maximize=False)
            seg.target[a:b].copy_(master)
            slot.pending_write = self.writer.submit(self._io, "write", slot, seg, a, b)
        waited = time.perf_counter()
        for slot in self.slots:
            if slot.pending_write is not None:
                stats.write_bytes += slot.pending_write.result()
                slot.pending_write = None
        stats.io_wait_s += time.perf_counter() - waited
        stats.step_s = time.perf_counter() - start
        self.stats = stats

    def mapped(self) -> dict[str, torch.Tensor]:
        """Each whole file as one file-backed tensor (shared mappings: a checkpoint reads them
        through the page cache, a load writes through it; the step's direct I/O sees both).
        Mapped once, so every segment_state view shares its file's storage (DiskSnapshot finds
        a view's file by it)."""
        if self._mapped is None:
            self._mapped = {k: torch.from_file(str(f.path), shared=True, size=self.size, dtype=self.master_dtype)
                            for k, f in self.files.items()}
        return self._mapped

    def segment_state(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The segment's state as file-backed tensors (views of `mapped`)."""
        seg, maps = self.segments[i], self.mapped()
        return tuple(maps[k][seg.offset:seg.offset + seg.numel] for k in ("master", "exp_avg", "exp_avg_sq"))

    def snapshot(self) -> "DiskSnapshot":
        return DiskSnapshot(self)

    def refresh_targets(self) -> None:
        for i, seg in enumerate(self.segments):
            seg.target.copy_(self.segment_state(i)[0])

    def held_bytes(self) -> dict[str, int]:
        return {"nvme": 3 * self.size * self.itemsize}


class DiskSnapshot:
    """The tier's files as they are at the first `view_of`, copied beside them on the same disk
    (snapshot-*.bin, replacing the last save's): an asynchronous checkpoint writes from the
    copy while the next steps change the originals, so this rank's optimizer state never needs
    room in memory. The training thread pays one file copy (the checkpoint writer calls
    view_of before it returns; the previous save has finished by then), the disk twice the
    files' room (cli/main.py's preflight counts it)."""

    def __init__(self, tier: NvmeTier):
        self.tier = tier
        self.copies: dict[str, torch.Tensor] | None = None

    def _copy(self) -> dict[str, torch.Tensor]:
        copies = {}
        for key, f in self.tier.files.items():
            target = self.tier.directory / f"snapshot-{key}.bin"
            partial = target.with_suffix(".part")
            try:
                shutil.copyfile(f.path, partial)  # the kernel's copy (sendfile): not through us
                os.replace(partial, target)  # a mapping of the last snapshot keeps its own file
            except OSError as e:
                raise disk_error("nvme offload: snapshotting the optimizer state for an "
                                 "asynchronous checkpoint in", self.tier.directory, e) from None
            copies[key] = torch.from_file(str(target), shared=False, size=self.tier.size,
                                          dtype=self.tier.master_dtype)
        return copies

    def view_of(self, live: torch.Tensor) -> torch.Tensor:
        """`live` (a 1-D view of one of the tier's mapped files) as it is in the snapshot."""
        if self.copies is None:
            self.copies = self._copy()
        for key, whole in self.tier.mapped().items():
            if live.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr():
                assert live.dim() == 1 and live.stride() == (1,), "a 1-D slice of a tier file"
                start = live.storage_offset()
                return self.copies[key][start:start + live.numel()]
        raise AssertionError("not a view of this tier's files")

    def holds(self, tensor: torch.Tensor) -> bool:
        ptr = tensor.untyped_storage().data_ptr()
        return any(ptr == whole.untyped_storage().data_ptr() for whole in self.tier.mapped().values())


def _close_files(private: PrivateDir, files: list[_File], *pools: ThreadPoolExecutor) -> None:
    for pool in pools:
        pool.shutdown()
    for f in files:
        f.close()
    private.remove()


# ---------------------------------------------------------------------------------------------
# Parameter shards (stage 3): `zero.offload_params` = 'nvme'
