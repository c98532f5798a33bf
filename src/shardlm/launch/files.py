"""Writing a file so that a reader sees the old contents or the new, never a torn one."""

from __future__ import annotations

import os
from pathlib import Path


def atomic_write(path: Path, data: bytes | str, fsync: bool = False) -> None:
    """Write to a temporary file beside `path` (unique to this process), then rename it over
    `path`: the rename is atomic on POSIX, so a crash leaves the previous file whole. `fsync`
    makes the contents durable before the rename (checkpoints); caches skip it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.part")  # this writer's own: never shared
    payload = data.encode() if isinstance(data, str) else data
    try:
        with open(tmp, "wb") as f:
            f.write(payload)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, say: no half-written temporary file left behind
        tmp.unlink(missing_ok=True)
        raise
