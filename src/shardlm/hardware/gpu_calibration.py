"""A GPU's matmul curve for the planner: what `shardlm calibrate --device cuda` measured on this
machine (hardware/probe.py matmul_curve, cached under the name torch gives the GPU, e.g. 'NVIDIA
H100 80GB HBM3'), read for the catalog device of that GPU (catalog.device_for_gpu_name). The
time model then prices the compute at the measured curve, as it does a CPU's, instead of the
catalog's efficiency (planner/compute.py compute_rate, planner/memory_bound.py). Read only:
nothing is measured here, and neither a GPU nor torch is needed to read it (hardware/probe_cache.py)."""

from __future__ import annotations

import functools
import os

from shardlm.hardware import probe_cache
from shardlm.hardware.catalog import Device, device_for_gpu_name
from shardlm.hardware.curves import MatmulCurve, measured_curve

GPU_THREADS = 1
"""The thread count `shardlm calibrate --device cuda` caches its entries under."""


def cached_gpu_curves() -> dict[str, dict[str, list[dict]]]:
    """Every matmul_curve entry the probe cache holds under a name other than this CPU's, for
    this torch version at GPU_THREADS: {the GPU's name: {precision: entries}}."""
    out: dict[str, dict[str, list[dict]]] = {}
    this_cpu, torch_version = probe_cache.cpu_name(), _public(probe_cache.torch_version())
    for key, value in sorted(probe_cache.read_table(probe_cache.cache_path()).items()):
        parts = key.split("|", 5)  # v<version>|<machine>|torch <version>|threads=<n>|<precision>|mm MxKxN
        if (len(parts) == 6 and parts[0] == f"v{probe_cache.VERSION}" and parts[1] != this_cpu
                and _public(parts[2]) == f"torch {torch_version}" and parts[3] == f"threads={GPU_THREADS}"
                and parts[5].startswith("mm ") and probe_cache.plausible(value)):
            out.setdefault(parts[1], {}).setdefault(parts[4], []).append(value)
    return out


def _public(version: str) -> str:
    """A torch version without its local label: calibrate writes torch.__version__
    ('2.11.0+cu130'), while the planner, which imports no torch, reads the installed
    distribution's, which an image may record without it ('2.11.0': seen on an H200, where the
    calibration was then never read)."""
    return version.split("+", 1)[0]


def device_curves(device: Device) -> dict[str, MatmulCurve]:
    """The device's measured curves: its own (a CPU's), else for a catalog GPU those calibrated
    here on a GPU of that catalog entry (of several, the one with the most points), else {}."""
    if device.curves or device.kind not in ("cuda", "rocm"):
        return device.curves
    try:
        stamp = os.stat(probe_cache.cache_path()).st_mtime_ns
    except OSError:
        return {}
    return _calibrated(device.name, stamp)


@functools.lru_cache(maxsize=32)
def _calibrated(catalog_name: str, stamp: int) -> dict[str, MatmulCurve]:
    # memoised per cache file version (`stamp`): a search asks thousands of times
    found = {name: curves for name, curves in cached_gpu_curves().items()
             if getattr(device_for_gpu_name(name), "name", None) == catalog_name}
    if not found:
        return {}
    name, curves = max(found.items(), key=lambda item: sum(len(points) for points in item[1].values()))
    return {p: measured_curve(points, f"{p} on {name}") for p, points in curves.items() if points}
