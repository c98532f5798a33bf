"""The disk the nvme tier streams through (parallel/data/zero/tiers/nvme.py), as the planner's local CPU
cluster needs it (hardware.catalog.local_cpu): the read + write bytes/s of 1, 2 and 4 ranks
streaming at once, since a drive may serve several streams faster in all than one (dd here: 1, 2
and 4 O_DIRECT writers reached 1.04, 1.36 and 1.39 GB/s in all) or not (this probe here, four
runs: 1.47-1.49, 1.43-1.68 and 1.32-1.69 GB/s read + write for 1, 2 and 4 streams), so N ranks
get 1/N of what N streams measured, not of one stream's rate. Measured only when asked (`shardlm calibrate --disk DIR`: it writes
~2 GB); hardware/probe.py caches it per machine. Measurements only; no torch.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import threading
import time
from pathlib import Path

BLOCK = 64 << 20
"""Bytes per read or write: zero.nvme_chunk_mb's default, the tier's chunk."""
STREAMS = (1, 2, 4)
"""Ranks streaming at once that calibrate measures; more saturate as 4 do (stream_rate)."""


def _open(path: Path):
    """A file opened for O_DIRECT where the file system allows it (as the tier opens its own:
    no page cache between the step and the drive), else buffered (writes then reach the drive
    by the fsync the timing includes)."""
    flags = os.O_RDWR | os.O_CREAT
    try:
        return os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o600)
    except OSError:
        return os.open(path, flags, 0o600)


def stream_bandwidth(directory: Path, streams: int, nbytes: int = 4 * BLOCK, block: int = BLOCK) -> float:
    """Read + write bytes/s of `streams` ranks' optimizer streams at once, in all: each reads
    `nbytes` of one file while writing `nbytes` to another in `block` pieces (the tier reads
    chunk k+1 while chunk k-1 is written), under a private temporary directory of `directory`
    that is removed after. The files read are written first, untimed."""
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory, prefix="shardlm-disk-") as tmp:
        source = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
        source.write(os.urandom(block))
        reads: list[int] = []
        writes: list[int] = []
        try:
            reads += [_open(Path(tmp) / f"read-{i}") for i in range(streams)]
            writes += [_open(Path(tmp) / f"write-{i}") for i in range(streams)]
            for fd in reads:
                for off in range(0, nbytes, block):
                    os.pwritev(fd, [source], off)
                os.fsync(fd)

            def read(fd: int) -> None:
                buf = mmap.mmap(-1, block)
                for off in range(0, nbytes, block):
                    os.preadv(fd, [buf], off)

            def write(fd: int) -> None:
                for off in range(0, nbytes, block):
                    os.pwritev(fd, [source], off)
                os.fsync(fd)

            threads = ([threading.Thread(target=read, args=(fd,)) for fd in reads]
                       + [threading.Thread(target=write, args=(fd,)) for fd in writes])
            start = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return 2 * streams * nbytes / (time.perf_counter() - start)
        finally:
            for fd in reads + writes:
                os.close(fd)


def stream_rate(measured: dict[int, float], ranks: int) -> float:
    """Read + write bytes/s in all when `ranks` ranks stream at once, from {streams: bytes/s}:
    linear between the measured stream counts, the largest's beyond it."""
    points = sorted(measured.items())
    if ranks <= points[0][0]:
        return points[0][1]
    for (n0, b0), (n1, b1) in zip(points, points[1:]):
        if ranks <= n1:
            return b0 + (b1 - b0) * (ranks - n0) / (n1 - n0)
    return points[-1][1]
