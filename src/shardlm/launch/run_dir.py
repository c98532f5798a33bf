"""A run's directory and its ownership: rank 0 creates it under a unique name (or the one the
user gave) and holds an flock on its `.lock` for the whole run, so a second run cannot write into
it; every rank receives rank 0's directory or its error (docs/reliability.md)."""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import socket
import time
from pathlib import Path

from shardlm.errors import ConfigError
from shardlm.launch.preflight import remove_stale_parts
from shardlm.launch.runtime import Runtime, broadcast_text, is_restart

log = logging.getLogger("shardlm")


RUN_LOCK = ".lock"
"""The lock file in a run directory: flock'ed by the rank 0 that writes there, holding its pid."""


_held_run_locks: dict[Path, int] = {}
"""Run directories this process holds the lock of (resolved path -> the lock file's fd). Held
until the process exits; a second run of the same process in the same directory (a resume in
a notebook, a test) reuses it."""


def unique_run_name() -> str:
    """A new run's directory name: the time to the second, then a random suffix, because runs
    started in the same second must not share a directory (e.g. 20250101-120000-3f9a1c)."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def lock_run_dir(run_dir: Path, wait_s: float = 0.0) -> None:
    """Take `run_dir`'s advisory lock (flock on RUN_LOCK, our pid written in it) for the life of
    this process, or raise ConfigError naming the process that holds it. `wait_s`: how long to
    wait for a holder that is exiting (a restarted gang's rank 0 waits for the dead one's)."""
    key = run_dir.resolve()
    if key in _held_run_locks:
        return
    try:
        fd = os.open(run_dir / RUN_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise ConfigError(f"cannot open the run directory's lock file {str(run_dir / RUN_LOCK)!r}: "
                          f"{e.strerror or e}") from None
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() < deadline:
                time.sleep(0.1)
                continue
            holder = _lock_holder(fd)
            os.close(fd)
            raise ConfigError(
                f"run directory {str(run_dir)!r} is in use by another run ({holder}; lock file "
                f"{run_dir / RUN_LOCK}): wait for it to finish, stop it, or choose another "
                f"run.name") from None
        except OSError as e:  # e.g. a file system without locks
            os.close(fd)
            raise ConfigError(f"cannot lock the run directory {str(run_dir)!r}: "
                              f"{e.strerror or e}") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    _held_run_locks[key] = fd


def _lock_holder(fd: int) -> str:
    # The holder writes its pid just after it takes the lock: give it a moment.
    for _ in range(20):
        text = os.pread(fd, 256, 0).decode(errors="replace").strip()
        if text:
            return text
        time.sleep(0.05)
    return "pid unknown"


def release_run_dir(run_dir: Path) -> None:
    """Give up `run_dir`'s lock before this process exits (exiting releases it anyway)."""
    fd = _held_run_locks.pop(run_dir.resolve(), None)
    if fd is not None:
        os.close(fd)


def create_run_dir(parent: Path, name: str = "", wait_s: float = 0.0) -> Path:
    """The run's directory under `parent`, created and locked by this process. Without `name`,
    a new unique one, created exclusively (never one that exists); with `name`, it may exist
    (that is how a run is resumed), but no other live run may hold it."""
    try:
        if name:
            run_dir = parent / name
            run_dir.mkdir(parents=True, exist_ok=True)
        else:
            parent.mkdir(parents=True, exist_ok=True)
            while True:
                run_dir = parent / unique_run_name()
                try:
                    run_dir.mkdir()
                    break
                except FileExistsError:  # 1 in 16M in the same second: draw again
                    continue
    except OSError as e:
        raise ConfigError(f"cannot create the run directory under {str(parent)!r} "
                          f"(run.dir): {e.strerror or e}") from None
    lock_run_dir(run_dir, wait_s)
    # Ours now, and no rank of this run has written yet: what killed writers left goes.
    for part in remove_stale_parts(run_dir):
        log.info("removed %s (left by a writer that died)", part)
    return run_dir


def claim_run_dir(parent: str, name: str, runtime: Runtime) -> Path:
    """Every rank's run directory: rank 0 creates and locks it (create_run_dir) and every rank
    receives rank 0's directory — or its error, raised on every rank, so that no rank waits in a
    collective for a rank 0 that gave up. A restarted gang's rank 0 waits up to a minute for the
    previous rank 0 to have exited and released the lock."""
    outcome, failure = None, None
    if runtime.is_main:
        try:
            outcome = "dir:" + str(create_run_dir(Path(parent), name, 60.0 if is_restart() else 0.0))
        except Exception as e:  # whatever it is, the other ranks must hear of it
            outcome, failure = f"error:{e}", e
    kind, _, text = broadcast_text(outcome, runtime).partition(":")
    if failure is not None:
        raise failure
    if kind != "dir":
        raise ConfigError(f"rank 0 could not make the run directory: {text}")
    return Path(text)
