"""`shardlm calibrate`: the model's own matmul shapes, timed best of N, cached per machine,
threads, torch and shape, load detected and reported. Timings are injected where a test checks
a decision (no test depends on this machine's speed)."""

from shardlm.cli import main
from shardlm.hardware import probe
from shardlm.planner.shapes import preset_model
from shardlm.planner.workload import matmul_shapes


def test_the_model_s_own_shapes():
    m = preset_model("llama-7b")  # h 4096, 32 heads (no GQA), SwiGLU 11008, V 32000
    shapes = {name: (rows, k, n, count) for name, rows, k, n, count in matmul_shapes(m, 2048, tp=2)}
    assert shapes["qkv"] == (2048, 4096, 3 * 4096 // 2, 32)
    assert shapes["attention out"] == (2048, 4096 // 2, 4096, 32)
    assert shapes["mlp up (gate|up)"] == (2048, 4096, 2 * 11008 // 2, 32)
    assert shapes["mlp down"] == (2048, 11008 // 2, 4096, 32)
    assert shapes["head"] == (2048, 4096, 32000 // 2, 1)


def test_best_of_n_cached_and_load_reported(monkeypatch):
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


def test_calibrate_prints_the_curve_and_the_planner_s_assumption(monkeypatch, capsys):
    monkeypatch.setattr(probe, "_time_product", lambda *a: {"best_s": 1e-3, "median_s": 1e-3})
    monkeypatch.setattr(probe, "machine_load", lambda: (9.0, 2))
    monkeypatch.setattr(probe, "cpu_peak_flops", lambda precision, threads=None: 1e11)
    assert main(["calibrate", "--model", "gpt-tiny", "--seq", "64", "--repeats", "2", "--again"]) == 0
    out = capsys.readouterr().out
    for name in ("qkv", "attention out", "mlp up", "mlp down", "head"):
        assert f"  {name}" in out
    assert "FLOP-weighted" in out and "the planner's compute rate for this run" in out and "LOAD: 5 of 5 shapes" in out
    assert "the curve, tokens per micro-batch" in out and "64 -> " in out
    assert main(["calibrate", "--model", "gpt-tiny", "--tp", "3"]) == 2
    assert "--tp 3 does not divide" in capsys.readouterr().err
