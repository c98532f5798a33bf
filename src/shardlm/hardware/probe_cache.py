"""The probe cache's format, readable without torch: where it is (`<shardlm cache>/
hardware_probe.json`, or $SHARDLM_PROBE_CACHE), how an entry is keyed ('v<VERSION>|<machine>|torch <version>|<what>'),
which entries are plausible. hardware/probe.py measures and writes it; the planner reads a
GPU's calibrated curve from it (hardware/gpu_calibration.py) without importing torch, so that
`shardlm plan` and `estimate` stay pure arithmetic."""

from __future__ import annotations

import importlib.metadata
import math
import os
import platform
import sys
from pathlib import Path

from shardlm.launch.cache_files import cache_root, read_json_cache

VERSION = 7
"""Bumped when what is measured changes: older entries are ignored."""


PROBE_CACHE_ENV = "SHARDLM_PROBE_CACHE"
"""Names the probe's cache file where it is set: a file of its own, apart from the rest of the
shardlm cache. The test suite's workers (tests/conftest.py) each build tokens in a cache of their
own but share one probe file, so the machine is measured once a run, not once a worker."""


def cache_path() -> Path:
    """The probe's cache file: $SHARDLM_PROBE_CACHE where set, else `<shardlm cache>/
    hardware_probe.json` (launch/cache_files.py cache_root)."""
    named = os.environ.get(PROBE_CACHE_ENV)
    return Path(named).expanduser() if named else cache_root() / "hardware_probe.json"


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), part of every cache key."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def torch_version() -> str:
    """torch.__version__, read from the installed distribution where torch is not imported."""
    torch = sys.modules.get("torch")
    return torch.__version__ if torch is not None else importlib.metadata.version("torch")


def plausible(entry: object) -> bool:
    """What a measurement writes: a finite number, or a non-empty table of them."""
    if isinstance(entry, dict):
        return bool(entry)
    return isinstance(entry, (int, float)) and not isinstance(entry, bool) and math.isfinite(entry)


def _check_table(value: object) -> str:
    return "" if isinstance(value, dict) else f"a JSON {type(value).__name__}, not an object of entries"


def read_table(path: Path) -> dict:
    """The whole cache at `path`, as on disk now ({} where there is none, or it was damaged:
    moved aside with a warning, launch/cache_files.py)."""
    table = read_json_cache(path, _check_table, "hardware probe cache")
    return table if isinstance(table, dict) else {}
