"""Disk checks before a run starts, the one error a disk fault during a run becomes, and the
removal of what dead writers left behind (docs/reliability.md, Disks).

Everything here works on paths and byte counts: the caller (cli) knows the config and the
model's size. Found before training, a read-only `checkpoints/` costs nothing; found at the
first save it costs the training done until then.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import uuid
from pathlib import Path

from shardlm.errors import ConfigError

PART = re.compile(r"\.(\d+)\.part$")
"""files.atomic_write's temporary name: `<name>.<writer pid>.part`."""


DISK_EXIT = 4
"""The exit status of a run stopped by a DiskError (`shardlm train`, and its launcher)."""


class DiskError(OSError):
    """A write or read of the run's files failed on the disk (ENOSPC, EROFS, EIO, ...): what
    failed and where, in one message. The run stops; its last checkpoint is intact. An
    OSError (its `errno` the original's), so code that handles one still does."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


def disk_error(what: str, path: Path | str, error: OSError, detail: str = "") -> DiskError:
    """`error` (raised by `what` on `path`) as the one message a user sees, e.g. "nvme offload:
    writing '/x/master.bin' failed: No space left on device (ENOSPC). ...". `detail`, if
    given, follows the error (e.g. the bytes needed and free)."""
    code = error.errno or errno.EIO
    name = errno.errorcode.get(code, str(code))
    hint = {errno.ENOSPC: "free space on that disk or point the run elsewhere",
            errno.EDQUOT: "free space within your quota or point the run elsewhere",
            errno.EROFS: "the file system is read-only: remount it or point the run elsewhere"}
    return DiskError(code, f"{what} {str(path)!r} failed: {error.strerror or os.strerror(code)} "
                           f"({name}){'; ' + detail if detail else ''}. The run stops here; its last checkpoint is intact and the "
                           f"run can resume from it once the disk is fixed "
                           f"({hint.get(code, 'check the disk')})")


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists on this machine (a zombie counts as alive)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def remove_stale_parts(directory: Path) -> list[Path]:
    """Delete the `.part` files under `directory` (at any depth: checkpoints/ and the step
    directories being written in it too) whose writer, the pid in the name, is no longer
    alive: what a writer killed mid-write left. A live writer's are kept. Returns what was
    removed. Call it only on a directory this process owns (its lock held), before the run's
    other ranks write there."""
    removed = []
    for root, _, files in os.walk(directory):  # nothing if it is missing; symlinks not followed
        for name in files:
            match = PART.search(name)
            if match and not pid_alive(int(match.group(1))):
                path = Path(root) / name
                try:
                    path.unlink()
                    removed.append(path)
                except FileNotFoundError:  # another cleaner was first
                    pass
    return removed


def _existing_ancestor(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _probe_write(directory: Path) -> None:
    """Create, write and delete a small file in `directory`: what a run will do there (the mode
    bits say yes to root on a read-only mount)."""
    probe = directory / f".shardlm-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, b"probe")
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)


def check_writable(path: Path, what: str) -> None:
    """`path` (a directory, made later if missing) can be written: probed in it if it exists,
    else in the nearest existing ancestor it would be created in. ConfigError naming `what`,
    where, and why."""
    path = Path(path)
    target = path if path.exists() else _existing_ancestor(path)
    if not target.is_dir():
        raise ConfigError(f"{what} {str(path)!r} cannot be created: {str(target)!r} is not a "
                          f"directory")
    try:
        _probe_write(target)
    except OSError as e:
        where = "" if target == path else f" (it would be created in {str(target)!r})"
        raise ConfigError(f"{what} {str(path)!r} is not writable{where}: {e.strerror or e} "
                          f"({errno.errorcode.get(e.errno or 0, e.errno)})") from None


def check_free_space(path: Path, needed: int, what: str) -> None:
    """At least `needed` bytes free on the file system of `path` (or of where it would be made)."""
    free = shutil.disk_usage(_existing_ancestor(Path(path))).free
    if free < needed:
        raise ConfigError(f"{what} {str(path)!r} needs {needed:,} bytes ({needed / 2**30:.2f} GiB) "
                          f"but its file system has {free:,} bytes ({free / 2**30:.2f} GiB) free: "
                          f"free some space, point it at a larger disk, or use more ranks (each "
                          f"holds 1/N of the sharded state)")


def nvme_bytes(params_per_rank: int, master_itemsize: int, param_itemsize: int,
               offload_params: bool) -> int:
    """Bytes one rank's offload files take: master + two AdamW moments per parameter of its
    shard (12 bytes in fp32: the K of ZeRO's formulas), plus the parameter shard itself when
    it is offloaded too. Segments are padded to 4 KiB: a little more, never less."""
    return params_per_rank * (3 * master_itemsize + (param_itemsize if offload_params else 0))


def check_run_disks(run_dir: Path, checkpoints: Path, nvme_dir: Path | None = None,
                    nvme_needed: int = 0) -> None:
    """Before training: the run directory and its checkpoints/ are writable, and so is the
    NVMe offload path, with room for the offload files of this machine's ranks."""
    check_writable(run_dir, "the run directory")
    check_writable(checkpoints, "the checkpoint directory")
    if nvme_dir is not None:
        check_writable(nvme_dir, "zero.nvme_path")
        check_free_space(nvme_dir, nvme_needed, "zero.nvme_path")
