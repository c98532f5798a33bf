"""What bench_checkpoint.py measures a checkpoint against and with: the disk's own limits (write +
fsync with 1 and 2 writers, cold and warm reads, SHA-256 and memory copies), a Probe timing the
phases of shardlm's save and load, and the CPU time other processes take meanwhile."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

import torch

from common import MiB

MB = 1e6


class OtherCpu:
    """CPU seconds other processes took since the last call (what contaminates a phase)."""

    def __init__(self):
        self.last = cpu_seconds()

    def __call__(self) -> str:
        now = cpu_seconds()
        machine, own = (a - b for a, b in zip(now, self.last))
        self.last = now
        return f"other processes used {machine - own:.0f} CPU s"


def cpu_seconds() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine, CPU seconds of this process and its finished
    children): their difference over the run is what other processes took from it."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    busy = sum(fields[i] for i in (0, 1, 2, 5, 6)) / os.sysconf("SC_CLK_TCK")  # user nice system irq softirq
    t = os.times()
    return busy, t.user + t.system + t.children_user + t.children_system


# -- the disk ---------------------------------------------------------------------------------


def drop_cache(path: Path) -> None:
    """Evict a (clean, fsync'ed) file's pages from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _write_fsync(path: Path, chunk: bytes, nbytes: int, start: threading.Barrier) -> None:
    start.wait()
    with open(path, "wb") as f:
        f.writelines(chunk for _ in range(nbytes // len(chunk)))
        f.flush()
        os.fsync(f.fileno())


def write_mb_s(directory: Path, writers: int, nbytes: int, chunk: bytes) -> float:
    """Aggregate MB/s of `writers` threads each writing `nbytes` then fsync'ing."""
    paths = [directory / f"disk-test-{i}.bin" for i in range(writers)]
    start = threading.Barrier(writers + 1)
    threads = [threading.Thread(target=_write_fsync, args=(p, chunk, nbytes, start)) for p in paths]
    for t in threads:
        t.start()
    start.wait()
    began = time.perf_counter()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - began
    for p in paths:
        p.unlink()
    return writers * nbytes / seconds / MB


def disk_limits(directory: Path, mib: int) -> dict:
    chunk = os.urandom(64 * MiB)
    nbytes = mib * MiB // len(chunk) * len(chunk)
    out = {"mib": nbytes // MiB}
    for writers in (1, 2):
        runs = [write_mb_s(directory, writers, nbytes, chunk) for _ in range(3)]
        out[f"write{writers}"] = (runs[0], max(runs))
    path = directory / "disk-test-read.bin"
    _write_fsync(path, chunk, nbytes, threading.Barrier(1))
    for label in ("cold", "warm"):
        if label == "cold":
            drop_cache(path)
        began = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while f.read(16 * MiB):
                pass
        out[f"read_{label}"] = nbytes / (time.perf_counter() - began) / MB
    path.unlink()
    data = chunk * (nbytes // len(chunk))
    began = time.perf_counter()
    hashlib.sha256(data).hexdigest()
    out["sha256"] = nbytes / (time.perf_counter() - began) / MB
    del data
    source = torch.ones(nbytes // 4)
    began = time.perf_counter()
    copied = source.clone()  # new memory, first touched by the copy: what the async snapshot does
    out["fresh_copy"] = nbytes / (time.perf_counter() - began) / MB
    began = time.perf_counter()
    copied.copy_(source)  # the same copy into memory already touched
    out["touched_copy"] = nbytes / (time.perf_counter() - began) / MB
    del copied
    # A guest kernel with free page reporting (virtio-balloon) hands freed memory back to the
    # host after ~2 s; touching it again then costs a host fault per page. A training process
    # allocates its snapshot long after it last freed that much.
    time.sleep(5)
    began = time.perf_counter()
    copied = source.clone()
    out["idle_copy"] = nbytes / (time.perf_counter() - began) / MB
    del copied
    return out


# -- probes around the checkpoint code (timing only; the calls are passed through unchanged) --


class Probe:
    """Times the phases of shardlm's save (the rank file: producing its pieces, write, SHA-256,
    fsync) and the SHA-256 verification inside its load, by wrapping the module-level names
    shardlm.checkpoint.sharded calls. The calls themselves pass through unchanged."""

    def __init__(self):
        from shardlm.checkpoint import reader as checkpoint_reader
        from shardlm.checkpoint import sharded

        self.events: list[tuple[str, str, float, int]] = []  # (kind, file, seconds, bytes)
        record = self.events.append
        inside = threading.local()  # set while the rank file is written (fsyncs are counted then)
        real_file, real_pieces, real_sha_file = (sharded.write_safetensors, sharded._safetensors_pieces,
                                                 sharded._sha256)

        def write_safetensors(path, tensors):
            inside.on = True
            began = time.perf_counter()
            try:
                size, digest = real_file(path, tensors)
            finally:
                inside.on = False
            record(("file", Path(path).name, time.perf_counter() - began, size))
            return size, digest

        def pieces(tensors):
            source = real_pieces(tensors)
            while True:
                began = time.perf_counter()
                piece = next(source, None)
                if piece is None:
                    return
                record(("pieces", "", time.perf_counter() - began, piece.nbytes))
                yield piece

        def sha_file(path):
            began = time.perf_counter()
            digest = real_sha_file(path)
            record(("verify", Path(path).name, time.perf_counter() - began, Path(path).stat().st_size))
            return digest

        class TimedDigest:
            def __init__(self, digest):
                self.digest = digest

            def update(self, data):
                began = time.perf_counter()
                self.digest.update(data)
                record(("sha256", "", time.perf_counter() - began, memoryview(data).nbytes))

            def __getattr__(self, name):
                return getattr(self.digest, name)

        class TimedHashlib:  # sharded.hashlib: the digest computed while the rank file is written
            def __getattr__(self, name):
                return getattr(hashlib, name)

            @staticmethod
            def sha256(*args):
                return TimedDigest(hashlib.sha256(*args))

        class TimedOs:  # sharded.os: the rank file's fsync
            def __getattr__(self, name):
                return getattr(os, name)

            @staticmethod
            def fsync(fd):
                began = time.perf_counter()
                os.fsync(fd)
                if getattr(inside, "on", False):
                    record(("fsync", "", time.perf_counter() - began, 0))

        real_read_range = checkpoint_reader.CheckpointReader.read_range

        def read_range(reader, *args, **kwargs):  # includes the first use's verification
            began = time.perf_counter()
            real_read_range(reader, *args, **kwargs)
            record(("read", "", time.perf_counter() - began, 0))

        sharded.write_safetensors, sharded._safetensors_pieces, sharded._sha256 = (
            write_safetensors, pieces, sha_file)
        checkpoint_reader._sha256 = sha_file  # the reader's verification: the same wrapper
        checkpoint_reader.CheckpointReader.read_range = read_range
        sharded.hashlib, sharded.os = TimedHashlib(), TimedOs()

    def reset(self) -> None:
        self.events.clear()

    def total(self, kind: str) -> float:
        return sum(s for k, _, s, _ in self.events if k == kind)

    def files(self, kind: str) -> list[tuple[str, int]]:
        return [(f, n) for k, f, _, n in self.events if k == kind]


def save_phases(probe: Probe) -> dict:
    phases = {k: probe.total(k) for k in ("file", "pieces", "sha256", "fsync")}
    phases["write"] = phases["file"] - phases["pieces"] - phases["sha256"] - phases["fsync"]
    return phases
