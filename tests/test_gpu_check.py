"""The GPU check's CPU side: `bench/gpu_check.sh OUT --tiny --device cpu` runs the whole lane's
script (the cuda tests, which skip here, and every benchmark row) and its report lists each
entry; and `shardlm calibrate --device cuda` feeds the planner's GPU compute rate
(hardware/gpu_calibration.py), checked with injected timings under a GPU's name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from shardlm.cli.main import main
from shardlm.hardware import probe
from shardlm.hardware.catalog import find_device
from shardlm.hardware.gpu_calibration import device_curves

ROOT = Path(__file__).resolve().parent.parent
GPU = "NVIDIA H100 80GB HBM3"  # what torch.cuda.get_device_name says on an H100 SXM


def test_calibrate_on_a_gpu_feeds_the_planner_s_compute_rate(monkeypatch, tmp_path, capsys):
    """`shardlm calibrate --device cuda` on an H100 (its timings injected: every product at
    600 TFLOP/s, 61% of the catalog's 989) caches its curve under the GPU's name; the planner,
    on a machine without the GPU, then prices an H100 cluster at that curve (the estimate names
    it), and leaves the A100's catalog efficiency alone."""
    monkeypatch.setenv("SHARDLM_CACHE", str(tmp_path))  # injected timings: not the session's cache
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
