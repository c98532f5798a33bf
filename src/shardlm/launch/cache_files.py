"""The files shardlm keeps for itself (the machine probe's table, the token caches' meta.json)
and the files a user hands it by name: written whole or not at all, read defensively.

A cache is a convenience: a damaged one (cut short by a crash or a full disk, garbage, the wrong
shape) never blocks a run. `read_json_cache` moves it aside as `NAME.damaged-<time>` with one
warning naming it, and answers None: the caller measures or builds again and writes a fresh one
with `write_json_cache` (a temporary file beside it, fsynced, renamed over it). A file the user
names (a checkpoint's chat template, its tokenizer) is the opposite: it decides what a run does,
so `read_named_file` makes one that exists by name but cannot be read a ConfigError naming it and
what to do, never a silent fallback. docs/reliability.md, Damaged inputs."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from shardlm.errors import ConfigError
from shardlm.launch.files import atomic_write


def cache_root(configured: str = "") -> Path:
    """Per-user cache (tokenizers, token shards, the CPU FLOP probe): the configured path, else
    $SHARDLM_CACHE, else ~/.cache/shardlm."""
    return Path(configured or os.environ.get("SHARDLM_CACHE") or "~/.cache/shardlm").expanduser()


log = logging.getLogger("shardlm")


@contextlib.contextmanager
def file_lock(path: Path, optional: bool = False) -> Iterator[bool]:
    """Exclusive flock on `path` (created where absent): of several processes building or
    measuring the same entry, one does, the rest wait (the kernel releases it when its holder
    dies, killed or not). `optional`: where the lock file cannot be created (a read-only cache
    directory), go on unlocked, as every process did before the lock (yields False)."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "a+")
    except OSError:
        if not optional:
            raise
        yield False
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def move_aside(path: Path, why: str, what: str = "cache") -> Path | None:
    """Rename a damaged `path` (a file or a directory) to `<path>.damaged-<time>` beside it and
    say so in one warning; it is kept for a post-mortem, not read again. None (and no warning)
    when another process moved or replaced it first."""
    path = Path(path)
    aside = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return None
    except OSError as e:  # a read-only cache directory: rebuilt in memory, said once
        log.warning("shardlm: %s %s is damaged (%s) and cannot be moved aside (%s): remove it; "
                    "measuring / building again", what, path, why, e.strerror or e)
        return None
    log.warning("shardlm: %s %s is damaged (%s): moved aside to %s; measuring / building again",
                what, path, why, aside.name)
    return aside


def read_json_cache(path: Path, check: Callable[[object], str] | None = None,
                    what: str = "cache") -> object | None:
    """The JSON value in `path`, or None when there is none: absent, or damaged — not UTF-8,
    not JSON (cut short, garbage), or refused by `check` (which returns what is wrong, '' when
    nothing is) — in which case it is moved aside (move_aside) first. Never raises for the
    file's contents; an unreadable file (permissions) is treated as damaged too."""
    path = Path(path)
    try:
        before = os.stat(path)
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("shardlm: %s %s cannot be read (%s): ignored; measuring / building again",
                    what, path, e.strerror or e)
        return None
    why = ""
    try:
        value = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        why = f"not UTF-8 text at byte {e.start} of {len(raw):,}"
    except json.JSONDecodeError as e:
        why = ("empty" if not raw.strip() else
               f"not JSON at line {e.lineno} column {e.colno} of {len(raw):,} bytes: {e.msg}")
    else:
        why = check(value) if check is not None else ""
        if not why:
            return value
    # Another process may have replaced the damaged file with a good one since it was read (it
    # measured too): move aside only the file read here.
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return None
    if (now.st_ino, now.st_mtime_ns, now.st_size) == (before.st_ino, before.st_mtime_ns, before.st_size):
        move_aside(path, why, what)
    return None


def write_json_cache(path: Path, value: object, what: str = "cache") -> bool:
    """Write `value` as JSON to `path` atomically (a reader sees the old file or the new, never
    a torn one; fsynced first, so a crash right after leaves it whole). A cache that cannot be
    written (a full or read-only disk) is a warning, not an error: the run goes on with the value
    in memory. Returns whether it was written."""
    try:
        atomic_write(Path(path), json.dumps(value, indent=1), fsync=True)
        return True
    except OSError as e:
        log.warning("shardlm: %s %s could not be written (%s): continuing without it",
                    what, path, e.strerror or e)
        return False


def read_named_file(path: Path, what: str, fix: str) -> str | None:
    """The UTF-8 text of a file a run is told to use by its name (`what` says whose it is), or
    None when no such name exists at all. A name that exists but cannot be read — a dangling
    link (a hub snapshot missing its blob), no permission, a directory, bytes that are not UTF-8
    — is a ConfigError naming the file, the reason and `fix`, never silently absent: the caller's
    fallback (our default chat template, say) would change the run without a word."""
    path = Path(path)
    if not os.path.lexists(path):
        return None
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:  # the name is there, what it points to is not
        target = os.readlink(path) if path.is_symlink() else "?"
        reason = f"is a link to {target!r}, which does not exist (a download that lost its blob?)"
    except PermissionError:
        reason = "cannot be read: permission denied (chmod a+r, or run as its owner)"
    except IsADirectoryError:
        reason = "is a directory, not a file"
    except UnicodeDecodeError as e:
        reason = f"is not UTF-8 text (byte {e.start}: {e.reason})"
    except OSError as e:
        reason = f"cannot be read: {e.strerror or e}"
    raise ConfigError(f"{what} {str(path)!r} {reason}; {fix}")


def read_named_json(path: Path, what: str, fix: str) -> object | None:
    """read_named_file, parsed as JSON: None where no such name exists; a file that exists but
    cannot be read, or is not JSON, is a ConfigError naming it, the line and `fix`."""
    text = read_named_file(path, what, fix)
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{what} {str(path)!r} is not JSON (line {e.lineno}, column {e.colno}: "
                          f"{e.msg}; {len(text.encode()):,} bytes, cut short or damaged?); {fix}") from None
