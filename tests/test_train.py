"""The single-device loop: it learns, fp16 overflow is skipped, telemetry and CLI work."""

import json
import math

import torch

from conftest import tiny_overrides
from shardlm.cli.main import main
from shardlm.config.load import load_config
from shardlm.parallel.data.zero.optim import lr_at
from shardlm.models.precision import DynamicLossScaler
from shardlm.train.build import build_run
from shardlm.train.loop import train
from shardlm.train.step import train_step

JSONL_KEYS = {"step", "loss", "lr", "tokens_per_s", "mfu", "hfu", "peak_rss_bytes", "grad_norm"}


def test_loss_falls_on_default_corpus(tmp_path):
    cfg = load_config(overrides=tiny_overrides(
        tmp_path, train__steps=60, train__lr=3e-3, train__warmup_steps=5, train__eval_every=30))
    result = train(build_run(cfg.validate()))
    first, last = result.losses[0], sum(result.losses[-5:]) / 5
    assert math.isclose(first, math.log(cfg.model.vocab_size), rel_tol=0.05)  # untrained ≈ uniform
    assert last < first - 1.0, f"loss did not fall enough: {first:.3f} -> {last:.3f}"
    assert result.val_loss is not None and result.val_loss < first - 1.0
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 60 and JSONL_KEYS <= set(records[0])
    assert [r["step"] for r in records] == list(range(1, 61))
    assert sum("val_loss" in r for r in records) == 2  # eval_every=30 of 60 steps
    assert all(r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1.5 and r["peak_rss_bytes"] > 0 for r in records)


def test_hfu_counts_recomputation_mfu_does_not(tmp_path):
    """MFU: model FLOPs (PaLM appendix B); HFU adds what activation checkpointing recomputes:
    equal without it, larger by exactly flops_per_token's recompute ratio with 'full'."""
    from shardlm.models.flops import flops_per_token

    for mode in ("none", "full", "selective"):
        cfg = load_config(overrides=tiny_overrides(tmp_path / mode, train__steps=2,
                                                   activation__checkpoint=mode))
        result = train(build_run(cfg.validate()))
        records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
        ratio = (flops_per_token(cfg.model, cfg.train.seq_len, mode)
                 / flops_per_token(cfg.model, cfg.train.seq_len))
        assert ratio > 1 if mode == "full" else ratio == 1  # selective: no matmul FLOPs redone
        for r in records:
            assert math.isclose(r["hfu"], r["mfu"] * ratio, rel_tol=1e-12)
        assert math.isclose(result.hfu, result.mfu * ratio, rel_tol=1e-12)


def test_an_mfu_above_one_on_a_cpu_measures_the_peak_again(tmp_path, recwarn):
    """A cached CPU peak measured while other work shared the cores (planted: 1 MFLOP/s) makes
    MFU read above 100%: the run measures the peak again (once), keeps it, says so, and the
    records' MFU is against the new figure, which the probe cache now holds."""
    from shardlm.hardware.probe import cpu_peak_flops
    from shardlm.train import telemetry

    telemetry.remeasured_cpu_peak.cache_clear()
    run = build_run(load_config(overrides=tiny_overrides(tmp_path, train__steps=2)).validate())
    run.peak_flops_per_device = 1e6
    result = train(run)
    assert any("is above 100%" in str(w.message) for w in recwarn.list)
    peak = run.peak_flops_per_device
    assert peak > 1e6 and peak == cpu_peak_flops(run.precision.gemm, torch.get_num_threads())
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        assert math.isclose(r["mfu"], r["tokens_per_s"] * run.flops_per_token / peak, rel_tol=1e-9)


def test_same_seed_same_run(tmp_path):
    runs = [train(build_run(load_config(overrides=tiny_overrides(tmp_path / str(i), train__steps=5))))
            for i in range(2)]
    assert runs[0].losses == runs[1].losses


def test_fp16_overflow_skips_the_step_and_backs_off(tmp_path):
    cfg = load_config(overrides=tiny_overrides(
        tmp_path, precision__compute="fp16", precision__loss_scale_init=2.0**40))
    run = build_run(cfg.validate())
    before = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    loss, grad_norm, stepped, _, _ = train_step(run, 0)
    assert not stepped and not math.isfinite(grad_norm) and math.isfinite(loss)
    assert run.precision.scaler.scale == 2.0**39
    for n, p in run.model.named_parameters():
        assert torch.equal(p, before[n]), f"{n} changed on a skipped step"
    assert all(p.grad is None for p in run.model.parameters())
    for step in range(1, 40):  # the scale halves until gradients fit in fp16, then it steps
        if train_step(run, step)[2]:
            break
    else:
        raise AssertionError("fp16 never recovered from the overflow")
    assert run.precision.scaler.skipped_steps == step
    assert any(not torch.equal(p, before[n]) for n, p in run.model.named_parameters())


def test_scaler_grows_after_clean_steps():
    scaler = DynamicLossScaler(init_scale=8.0, growth_interval=3, backoff=0.5)
    assert [scaler.update(True) for _ in range(3)] == [True] * 3 and scaler.scale == 16.0
    assert scaler.update(False) is False and scaler.scale == 8.0
    restored = DynamicLossScaler(1.0, 3, 0.5)
    restored.load_state_dict(scaler.state_dict())
    assert restored.scale == 8.0 and restored.skipped_steps == 1


def test_lr_schedule_warmup_and_cosine():
    cfg = load_config(overrides={"train.steps": 101, "train.warmup_steps": 10, "train.lr": 1.0,
                                 "train.min_lr_ratio": 0.1}).train
    assert lr_at(0, cfg) == 0.1 and lr_at(9, cfg) == 1.0
    assert lr_at(10, cfg) == 1.0 and math.isclose(lr_at(100, cfg), 0.1)
    assert math.isclose(lr_at(55, cfg), 0.55)  # half-way down the cosine
    assert all(lr_at(s, cfg) >= lr_at(s + 1, cfg) for s in range(10, 100))


def test_cli_train_then_generate(tmp_path, capsys):
    args = ["train"] + [f"--{k}={v}" for k, v in tiny_overrides(tmp_path, train__sample_tokens=5).items()]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "done: loss" in out and "sample:" in out
    assert main(["generate", "--checkpoint", str(tmp_path / "runs"), "--prompt", "import os",
                 "--tokens", "8"]) == 0
    assert capsys.readouterr().out.startswith("import os")


def test_cli_reports_config_errors_before_work(tmp_path, capsys):
    assert main(["train", "--train.stesp=3", f"--run.dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "unknown config key 'train.stesp'" in err and "train.steps" in err
    assert not any(tmp_path.iterdir()), "nothing may be created for a bad config"


def _poisoned_run(tmp_path, mode: str):
    cfg = load_config(overrides=tiny_overrides(tmp_path, train__on_nonfinite=mode))
    run = build_run(cfg.validate())
    run.model.blocks[0].mlp.fc.weight.register_hook(lambda g: g * float("nan"))
    return run


def test_nonfinite_gradient_stops_by_default(tmp_path):
    run = _poisoned_run(tmp_path, "stop")
    try:
        train_step(run, 0)
    except FloatingPointError as e:
        assert "not finite" in str(e) and "train.on_nonfinite" in str(e)
    else:
        raise AssertionError("a NaN gradient must stop the run")


def test_nonfinite_gradient_skip_leaves_parameters(tmp_path):
    run = _poisoned_run(tmp_path, "skip")
    before = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    assert train_step(run, 0)[2] is False
    assert all(torch.equal(p, before[n]) for n, p in run.model.named_parameters())
    assert run.precision.scaler.skipped_steps == 1
    # skipped on the device (fused AdamW's found_inf): neither moments nor step counts moved
    state = run.strategy.optimizer.state.values()
    assert all(float(s["step"]) == 0 and not s["exp_avg"].any() for s in state)


def test_cli_diverged_run_exits_nonzero(tmp_path, capsys):
    args = ["train"] + [f"--{k}={v}" for k, v in tiny_overrides(tmp_path, train__lr=1e38,
                                                                    train__warmup_steps=0).items()]
    assert main(args) == 3
    assert "stopped: the gradient norm is not finite" in capsys.readouterr().err


def test_peak_rss_is_the_processs_own_not_its_parents():
    """peak_rss_bytes of a process started by a large one (a test session, a notebook, a study)
    is its own: getrusage's ru_maxrss would begin at the parent's resident set (fork + exec keeps
    the larger), here at least the 1 GiB this process holds; the child's own is ~100-300 MiB
    (python and torch imported)."""
    import subprocess
    import sys

    held = bytearray(1 << 30)
    held[::4096] = b"\1" * (len(held) // 4096)  # resident, page by page
    code = ("import resource; from shardlm.train.telemetry import peak_rss_bytes; "
            "print(peak_rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")
    ours, maxrss = map(int, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                           check=True).stdout.split())
    print(f"child's peak_rss_bytes {ours >> 20} MiB, its ru_maxrss {maxrss >> 20} MiB")
    assert ours < len(held) // 2, (ours, maxrss)
    del held
