"""`shardlm` as a user runs it: a command line, the environment that finds this checkout's
source, a run's JSONL read back (torn lines skipped: a killed writer can leave half a line) and
the worker processes a launcher started (Linux /proc)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def src_env(**extra: str) -> dict[str, str]:
    """os.environ with this checkout's src/ first on PYTHONPATH, then `extra`."""
    path = os.pathsep.join(p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def flags(values: dict) -> list[str]:
    """Config overrides as `--key=value` flags."""
    return [f"--{k}={v}" for k, v in values.items()]


def train_argv(values: dict, *extra: str, nproc: int = 0, restarts: int | None = None,
               unbuffered: bool = False) -> list[str]:
    """`python -m shardlm train` (under --nproc when nproc > 0, with --max-restarts when given)
    with `values` as flags, then `extra`."""
    return [sys.executable, *(["-u"] if unbuffered else []), "-m", "shardlm", "train",
            *(["--nproc", str(nproc)] if nproc else []),
            *(["--max-restarts", str(restarts)] if restarts is not None else []), *flags(values), *extra]


def read_jsonl(path: str | Path, key: str | None = None) -> list[dict]:
    """A JSONL file's records (none if it does not exist), those holding `key` where given."""
    path = Path(path)
    records = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line torn by a kill, or a blank one
            continue
        if key is None or key in record:
            records.append(record)
    return records


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def rank_of(pid: int) -> int | None:
    """A worker's RANK (from its environment); None for another process or one gone."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None
