"""The GPU check's CPU side: `bench/gpu_check.sh OUT --tiny --device cpu` runs the whole lane's
script (the cuda tests, which skip here, and every benchmark row) and its report lists each
entry; and `shardlm calibrate --device cuda` feeds the planner's GPU compute rate
(hardware/gpu_calibration.py), checked with injected timings under a GPU's name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import private_cache
from shardlm.cli.main import main
from shardlm.hardware import gpu_calibration, probe, probe_cache
from shardlm.hardware.catalog import find_device
from shardlm.hardware.gpu_calibration import device_curves

ROOT = Path(__file__).resolve().parent.parent
GPU = "NVIDIA H100 80GB HBM3"  # what torch.cuda.get_device_name says on an H100 SXM


def test_calibrate_on_a_gpu_feeds_the_planner_s_compute_rate(monkeypatch, tmp_path, capsys):
    """`shardlm calibrate --device cuda` on an H100 (its timings injected: every product at
    600 TFLOP/s, 61% of the catalog's 989) caches its curve under the GPU's name; the planner,
    on a machine without the GPU, then prices an H100 cluster at that curve (the estimate names
    it), and leaves the A100's catalog efficiency alone."""
    private_cache(monkeypatch, tmp_path)  # injected timings: not the session's cache
    rate = 600e12
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: True)
        m.setattr(torch.cuda, "get_device_name", lambda device=None: GPU)
        m.setattr(probe, "_time_product", lambda mm, k, n, *a, **kw: {"best_s": 2 * mm * k * n / rate,
                                                                        "median_s": 2 * mm * k * n / rate})
        m.setattr(probe, "machine_load", lambda: (0.1, 2))
        assert main(["calibrate", "--model", "llama-1b", "--device", "cuda", "--precision", "bf16",
                     "--seq", "2048", "--micro-batch", "4"]) == 0
    assert f"on {GPU}" in capsys.readouterr().out
    curves = device_curves(find_device("H100-80GB"))
    assert set(curves) == {"bf16"} and GPU in curves["bf16"].source
    assert abs(curves["bf16"].rate(8192, 2048, 2048) / rate - 1) < 1e-9
    assert device_curves(find_device("A100-80GB")) == {}
    assert main(["estimate", "--model", "llama-1b", "--gpus", "1xH100-80GB", "--seq", "2048",
                 "--precision", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "compute rate from calibrated:" in out and f"bf16 on {GPU}" in out, out
    # Where torch is not imported the planner reads the installed distribution's version, which
    # an image may record without torch.__version__'s local label (an H200's: '2.11.0' against
    # '2.11.0+cu130'): the calibration is still this torch's.
    label = "" if "+" in torch.__version__ else "+local"
    monkeypatch.setattr(probe_cache, "torch_version", lambda: torch.__version__.split("+")[0] + label)
    gpu_calibration._calibrated.cache_clear()
    assert GPU in device_curves(find_device("H100-80GB"))["bf16"].source


def test_a_gpu_run_finds_its_gpu_in_the_planner_s_catalog(monkeypatch):
    """The runtime's view of a GPU machine for the planner (train/resolve.py local_hardware):
    torch's name for the GPU ('NVIDIA H200') mapped to the catalog's entry — on an H200 the
    name itself went to the cluster parser and every run's prediction was lost — and a GPU the
    catalog lacks is an error that names it and lists what the catalog has."""
    from shardlm.errors import ConfigError
    from shardlm.train.resolve import local_hardware

    names = {"NVIDIA H200": "H200-141GB", GPU: "H100-80GB", "NVIDIA A100-SXM4-80GB": "A100-80GB"}
    for name, entry in names.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        cluster = local_hardware(torch.device("cuda", 0), 2)
        assert (cluster.device.name, cluster.world_size) == (entry, 2), name
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Imaginary GPU X1")
    with pytest.raises(ConfigError, match="'Imaginary GPU X1' matches no GPU of the planner's catalog .*H200-141GB"):
        local_hardware(torch.device("cuda", 0), 1)


def _cuda_tests(source: str) -> list[str]:
    """The test functions a file marks `cuda`: all of them under a module-level pytestmark,
    else those whose decorators name the mark (test_watchdog.py's `needs_cuda`)."""
    import ast

    body = ast.parse(source).body
    whole = any(isinstance(node, ast.Assign) and ast.unparse(node) == "pytestmark = pytest.mark.cuda"
                for node in body)
    return [f.name for f in body if isinstance(f, ast.FunctionDef) and f.name.startswith("test_")
            and (whole or "cuda" in ast.unparse(f.decorator_list))]


def test_the_gpu_check_runs_its_whole_lane_in_the_cpu_smoke_mode(tmp_path):
    """`bash bench/gpu_check.sh OUT --tiny --device cpu` (the CI smoke of the GPU check): exit 0,
    and gpu_check.json / .md list every `cuda` test of the files that mark them (tests/test_cuda.py,
    test_cuda_kernels.py, test_watchdog.py's NCCL pair: skipped here, no CUDA device) and every
    benchmark row — the training rows and the long-context hop rows timed, the compiled ones
    listed as not run on a CPU. ~35 s of CPU on 2 cores (one child
    process for every row; llama-tiny, seq 64, 1 + 1 steps)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    out = tmp_path / "out"
    proc = subprocess.run(["bash", "bench/gpu_check.sh", str(out), "--tiny", "--device", "cpu",
                           "--warmup", "1", "--timed", "1",
                           "--micro-batch", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    markdown = (out / "gpu_check.md").read_text()
    lane = gpu_check.lane_files(ROOT / "tests")
    assert {p.name for p in lane} == {"test_cuda.py", "test_cuda_kernels.py", "test_watchdog.py"}
    tests = [name for p in lane for name in _cuda_tests(p.read_text())]
    cases = report["tests"]["cases"]
    for name in tests:
        ran = [case for case in cases if case.split("[")[0] == name]
        assert ran and all(cases[c] == "skipped: no CUDA device" for c in ran), name
        assert f"`{name}" in markdown
    rows = {row["name"]: row for row in report["bench"]}
    assert list(rows) == list(gpu_check.CONFIGS)
    for name, (loop, extra) in gpu_check.CONFIGS.items():
        assert f"| {name} |" in markdown
        if extra.get("train.compile"):
            assert "not_run" in rows[name], name
        else:
            assert rows[name]["tokens_per_s"] > 0 and "error" not in rows[name], rows[name]
    assert {"cp-hop-32k", "cp-hop-32k-math", "shardlm+compile"} <= set(rows)
