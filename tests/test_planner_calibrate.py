"""`shardlm calibrate`: the model's own matmul shapes, timed best of N, cached per machine,
threads, torch and shape, load detected and reported. Timings are injected where a test checks
a decision (no test depends on this machine's speed)."""

import pytest

from conftest import private_cache
from shardlm.cli.main import main
from shardlm.config.dims import ParallelDims
from shardlm.hardware import probe
from shardlm.hardware.catalog import (CALIBRATION, LINKS, Cluster, Device, MatmulCurve, Node, intensity,
                                      local_cpu)
from shardlm.planner.workload import Dtypes, Strategy, Workload
from shardlm.planner.timing import estimate_time
from shardlm.planner.shapes import preset_model
from shardlm.planner.compute import model_flops_per_token
from shardlm.planner.workload import matmul_shapes


def test_the_model_s_own_shapes():
    m = preset_model("llama-7b")  # h 4096, 32 heads (no GQA), SwiGLU 11008, V 32000
    shapes = {name: (rows, k, n, count) for name, rows, k, n, count in matmul_shapes(m, 2048, tp=2)}
    assert shapes["qkv"] == (2048, 4096, 3 * 4096 // 2, 32)
    assert shapes["attention out"] == (2048, 4096 // 2, 4096, 32)
    assert shapes["mlp up (gate|up)"] == (2048, 4096, 2 * 11008 // 2, 32)
    assert shapes["mlp down"] == (2048, 11008 // 2, 4096, 32)
    assert shapes["head"] == (2048, 4096, 32000 // 2, 1)


def test_best_of_n_cached_and_load_reported(monkeypatch, tmp_path):
    # injected timings go to a cache of their own: the session's is read by every planner
    # prediction on this machine (local_cpu's curve), which fake points would change
    private_cache(monkeypatch, tmp_path)
    timings = iter([{"best_s": 1e-3, "median_s": 1.1e-3}, {"best_s": 1e-3, "median_s": 2e-3}])
    monkeypatch.setattr(probe, "_time_product", lambda *a: next(timings))
    monkeypatch.setattr(probe, "machine_load", lambda: (0.5, 2))
    quiet, spread = probe.matmul_curve([(64, 32, 16), (64, 32, 8)], "fp32", threads=1, again=True)
    assert quiet["flops_per_s"] == 2 * 64 * 32 * 16 / 1e-3 and not quiet["loaded"]
    assert spread["loaded"] and abs(spread["spread"] - 1.0) < 1e-9  # median 2x the best
    # cached: the same shape is not timed again (the iterator is spent: a timing would raise)
    assert probe.matmul_curve([(64, 32, 16)], "fp32", threads=1) == [quiet]
    monkeypatch.setattr(probe, "_time_product", lambda *a: {"best_s": 1e-3, "median_s": 1e-3})
    monkeypatch.setattr(probe, "machine_load", lambda: (5.0, 2))  # more runnable than cores
    assert probe.matmul_curve([(64, 32, 16)], "fp32", threads=1, again=True)[0]["loaded"]


def test_calibrate_prints_the_curve_and_the_planner_s_assumption(monkeypatch, capsys, tmp_path):
    private_cache(monkeypatch, tmp_path)  # injected timings: not the session's cache
    monkeypatch.setattr(probe, "_time_product", lambda *a: {"best_s": 1e-3, "median_s": 1e-3})
    monkeypatch.setattr(probe, "machine_load", lambda: (9.0, 2))
    monkeypatch.setattr(probe, "cpu_peak_flops", lambda precision, threads=None: 1e11)
    rates = {"elementwise": [[2**20, 5e10], [2**28, 2e10]], "fresh_bandwidth": 3e9, "adamw": [[2**18, 1e-9]],
             "op_seconds": 6e-6, "threads": 2, "load_average": 9.0}
    monkeypatch.setattr(probe, "memory_probe", lambda threads, again=False: rates)
    assert main(["calibrate", "--model", "gpt-tiny", "--seq", "64", "--repeats", "2", "--again"]) == 0
    out = capsys.readouterr().out
    assert ("memory probe (2 thread(s), load average 9.0 when measured): element-wise 50.0 GB/s at 1 MiB, 20.0 GB/s "
            "at 256 MiB; fresh pages 3.00 GB/s; fused AdamW 1.00 ns/param at 0.25 M; 6.0 us per dispatched op") in out
    for name in ("qkv", "attention out", "mlp up", "mlp down", "head"):
        assert f"  {name}" in out
    assert "FLOP-weighted" in out and "the planner's compute rate for this run" in out and "LOAD: 5 of 5 shapes" in out
    assert "the curve, tokens per micro-batch" in out and "64 -> " in out
    assert "in situ x " in out and "a measured forward + loss + backward of this model (1 x 64 tokens" in out
    assert "the planner's compute rate for this run" in out and "the curve's fit: rate = r_max" in out
    assert main(["calibrate", "--model", "gpt-tiny", "--tp", "3"]) == 2
    assert "--tp 3 does not divide" in capsys.readouterr().err


# The time model reads the calibration: a synthetic one is pinned here (no timing in these tests).

def _roofline(r_max: float, i_half: float, shapes) -> tuple:
    return tuple((m, k, n, r_max * intensity(m, k, n) / (intensity(m, k, n) + i_half)) for m, k, n in shapes)


def test_curve_keeps_measured_shapes_and_fits_the_rest():
    points = _roofline(1e11, 50.0, [(32, 256, 256), (128, 256, 1024), (512, 1024, 1024)])
    curve = MatmulCurve(points, "test")
    assert curve.rate(*points[1][:3]) == points[1][3]  # a measured shape: its measurement
    # 1/rate = 1/r_max + (i_half/r_max)/I is what the fit solves: a point on the roofline it
    # was not given comes back exactly
    (m, k, n, expected), = _roofline(1e11, 50.0, [(64, 512, 512)])
    assert curve.rate(m, k, n) == pytest.approx(expected, rel=1e-9)
    # never beyond what was measured: a huge product gets the fastest measured rate, a tiny one
    # the slowest
    assert curve.rate(8192, 8192, 8192) == max(p[3] for p in points)
    assert curve.rate(1, 8, 8) == min(p[3] for p in points)
    assert MatmulCurve(((64, 64, 64, 3e9),), "one point").rate(1024, 1024, 1024) == 3e9
    assert curve.scaled(0.5).rate(*points[0][:3]) == points[0][3] / 2
    assert "r_max 100.0 GFLOP/s, I_half 50" in curve.describe_fit()


def _cpu_cluster(curves: dict) -> Cluster:
    cpu = Device("cpu (test)", "cpu", 8e9, {"fp32": 2e11, "bf16": 1e11}, 1e10, 1.0, "test", curves=curves)
    node = Node(1, LINKS["eth-10"], LINKS["eth-10"], 1, LINKS["eth-10"], 16e9, 1e10, 2e9, "test")
    return Cluster(1, 1, cpu, node, CALIBRATION["cpu"])


def test_step_time_is_the_model_s_products_on_the_curve():
    m = preset_model("gpt-tiny")
    w = Workload(m, 64, 2)
    s = Strategy(ParallelDims(dp_shard=1), 0, 2, 1, "none", "none", "none", Dtypes("fp32"))
    curve = MatmulCurve(_roofline(8e10, 40.0, [(16, 64, 64), (128, 128, 512), (1024, 1024, 1024)]),
                        "calibrated: synthetic")
    t = estimate_time(w, s, _cpu_cluster({"fp32": curve}))
    assert t.calibration.startswith("calibrated: synthetic; no pass of this model measured")
    # every forward product and its two backward ones at the curve's rate for its own shape
    flops_sum = seconds = 0.0
    for _, r, k, n, count in matmul_shapes(m, 2 * 64):
        for shape in ((r, k, n), (r, n, k), (k, r, n)):
            flops_sum += 2 * r * k * n * count
            seconds += 2 * r * k * n * count / curve.rate(*shape)
    rate = flops_sum / seconds
    assert t.compute == pytest.approx(model_flops_per_token(w, count="kernel") * 2 * 64 / rate, rel=1e-12)
    # a machine measured twice as fast computes in half the time; no constant stands in between
    faster = estimate_time(w, s, _cpu_cluster({"fp32": curve.scaled(2)}))
    assert faster.compute == pytest.approx(t.compute / 2, rel=1e-12)
    # no curve for the precision: the device's stated efficiency, and the output says so
    plain = estimate_time(w, s, _cpu_cluster({}))
    assert plain.calibration.startswith("catalog: efficiency 1")


def test_local_cpu_reads_the_calibration_and_says_which(monkeypatch, capsys):
    entry = lambda m, k, n, rate, origin: {"m": m, "k": k, "n": n, "flops_per_s": rate, "origin": origin,  # noqa: E731
                                           "loaded": False}
    probe_only = [entry(64, 1024, 1024, 2e10, "probe"), entry(1024, 1024, 1024, 5e10, "probe")]
    measured = {"cpu": "test cpu", "cores": 2, "threads": 1, "peak": {"fp32": 6e10, "bf16": 1e10, "fp16": 1e9},
                "memory_bandwidth": 1e10, "gloo_in_step_bandwidth": 1e9, "gloo_in_step_latency": 1e-4, "baseline_rss": 2e8,
                "gloo_in_step_all_gather_factor": 1.0, "gloo_in_step_reduce_scatter_factor": 1.0, "gloo_in_step_send_recv_factor": 1.0,
                "curve": {"fp32": probe_only, "bf16": [], "fp16": []}}
    monkeypatch.setattr(probe, "measure_cpu", lambda n: measured)
    cluster = local_cpu(4)  # 4 ranks on 2 cores: each gets half of what the probe timed alone
    # bf16 measured slower than fp32: a bf16 run multiplies in fp32 GEMMs there (precision.
    # cpu_bf16_gemm = 'auto'), so bf16 is priced at fp32's curve and peak
    assert set(cluster.device.curves) == {"fp32", "bf16"}
    assert cluster.device.curves["fp32"].rate(64, 1024, 1024) == 1e10
    assert cluster.device.curves["bf16"].rate(64, 1024, 1024) == 1e10
    assert cluster.device.peak["bf16"] == cluster.device.peak["fp32"] == 3e10
    measured["peak"]["bf16"] = 9e10  # bf16 hardware: its own (here: no curve, the peak)
    assert set(local_cpu(4).device.curves) == {"fp32"} and local_cpu(4).device.peak["bf16"] == 4.5e10
    measured["peak"]["bf16"] = 1e10
    assert cluster.device.curves["fp32"].source.startswith("probe: 2 generic shape(s)")
    measured["curve"]["fp32"] = probe_only + [entry(128, 64, 192, 3e10, "calibrate")]
    assert local_cpu(1).device.curves["fp32"].source.startswith(
        "calibrated: 1 model shape(s) timed by `shardlm calibrate` + 2 probe shape(s), fp32, 1 thread(s) on test cpu")
    assert main(["estimate", "--model", "gpt-tiny", "--gpus", "1xcpu", "--seq", "64", "--precision", "fp32"]) == 0
    assert "compute rate from calibrated: 1 model shape(s)" in capsys.readouterr().out
