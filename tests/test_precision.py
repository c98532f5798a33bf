"""bf16 matmuls in fp32 GEMMs (precision.cpu_bf16_gemm = 'fp32', models/precision.fp32_gemm):
on a CPU without bf16 matmul hardware torch's bf16 GEMM is 5-30x slower than fp32's, so a bf16
run multiplies its bf16 operands in fp32 and rounds each result to bf16.

What must hold, and the tolerances, stated:
- The result is the exact product rounded once to bf16, up to the fp32 accumulation: a product of
  two bf16 values is exact in fp32 (8 + 8 significant bits), the sum of K of them in fp32 is off
  by at most K * 2^-24 * sum|x_k w_k| (the classical bound; K = 64 here), and the rounding to
  bf16 by half a bf16 ulp: bf16's unit roundoff, 2^-8 relative (8 significant bits). Checked against float64 on the same bf16 values, so
  the reference shares no kernel with what is tested.
- torch's own bf16 kernel computes the same to within that bound plus its own roundings (the
  bias may be added after a first rounding): apart by at most 4 unit roundoffs, 2^-6 relative.
- Gradients are bf16 and obey the same bound (their reductions are over 48 and 96 terms), also
  when a large weight is multiplied a block of rows at a time (the input's gradient summed over
  the blocks in fp32, rounded once).
- The kernels are in place only inside the context: autocast outside is torch's own again.
- A bf16 training run with it follows the native bf16 run to within bf16's noise over 3 steps
  (losses 1e-2 relative: bf16 rounds each activation by 2^-9, through 2 layers and AdamW).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_overrides
from shardlm.config.schema import PrecisionConfig
from shardlm.config.load import load_config
from shardlm.hardware.machine import cpu_bf16_gemm
from shardlm.models import precision
from shardlm.models.precision import build_precision, fp32_gemm, fp32_gemm_active, gemm
from shardlm.train.build import build_run
from shardlm.train.step import train_step

K = 64  # the reduction length of the products below


def _operands():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 32, K, generator=g).bfloat16().requires_grad_()
    w = torch.randn(48, K, generator=g).bfloat16().requires_grad_()
    b = torch.randn(48, generator=g).bfloat16().requires_grad_()
    return x, w, b


def _bound(a64: torch.Tensor, b64: torch.Tensor, exact: torch.Tensor, terms: int) -> torch.Tensor:
    """|error| allowed for a bf16-rounded fp32 sum of `terms` products: half a bf16 ulp of the
    result (2^-8 relative) plus the fp32 accumulation's terms * 2^-24 * sum |products|."""
    return exact.abs() * 2**-8 + terms * 2**-24 * (a64.abs() @ b64.abs()) + 1e-30


@pytest.fixture(params=["whole", "blocks"])
def blocks(request, monkeypatch):
    """Each product as one fp32 GEMM, or a weight of 48 rows in blocks of 5 (the last of 3), as a
    weight larger than precision.FP32_COPY_BYTES is multiplied."""
    if request.param == "blocks":
        monkeypatch.setattr(precision, "FP32_COPY_BYTES", 4 * K * 5)
    return request.param


def test_a_bf16_linear_is_the_exact_product_rounded_once(blocks):
    x, w, b = _operands()
    with torch.autocast("cpu", dtype=torch.bfloat16), fp32_gemm():
        y = F.linear(x, w, b)
    assert y.dtype == torch.bfloat16 and type(y.grad_fn).__name__ == "_Fp32GemmLinearBackward"
    x64, w64, b64 = x.double(), w.double(), b.double()
    exact = x64 @ w64.t() + b64
    assert ((y.double() - exact).abs() <= _bound(x64, w64.t(), exact, K) + b64.abs() * 2**-24).all()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # torch's own kernel: within 4 unit roundoffs
        native = F.linear(x, w, b)
    assert ((y.float() - native.float()).abs() <= exact.abs().float() * 2**-6 + 1e-6).all()


def test_its_gradients_are_bf16_and_exact_to_the_same_bound(blocks):
    x, w, b = _operands()
    g = torch.Generator().manual_seed(1)
    upstream = torch.randn(3, 32, 48, generator=g).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16), fp32_gemm():
        y = F.linear(x, w, b)
    y.backward(upstream)
    assert x.grad.dtype == w.grad.dtype == b.grad.dtype == torch.bfloat16
    u64, x64, w64 = upstream.double(), x.detach().double(), w.detach().double()
    exact_x = u64 @ w64  # (3, 32, K): sums of 48 products
    assert ((x.grad.double() - exact_x).abs() <= _bound(u64, w64, exact_x, 48)).all()
    rows_u, rows_x = u64.reshape(-1, 48), x64.reshape(-1, K)
    exact_w = rows_u.t() @ rows_x  # (48, K): sums of 96 products
    assert ((w.grad.double() - exact_w).abs() <= _bound(rows_u.t(), rows_x, exact_w, 96)).all()
    exact_b = rows_u.sum(0)
    assert ((b.grad.double() - exact_b).abs() <= exact_b.abs() * 2**-8 + 96 * 2**-24 * rows_u.abs().sum(0)).all()


def test_matmul_and_attention_go_through_fp32_too():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=g).bfloat16() for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16), fp32_gemm():
        scores = q @ k.transpose(-2, -1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert scores.dtype == out.dtype == torch.bfloat16
    exact = q.double() @ k.double().transpose(-2, -1)
    assert ((scores.double() - exact).abs() <= _bound(q.double(), k.double().transpose(-2, -1), exact, 8)).all()
    reference = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    # attention in fp32 then one rounding: 2^-8 of |out| <= max |v|, plus fp32's sums and exp
    assert (out.double() - reference).abs().max() <= v.double().abs().max() * (2**-8 + 16 * 2**-22)


def test_the_kernels_are_there_only_inside_the_context():
    x, w, _ = _operands()
    assert not fp32_gemm_active()
    with fp32_gemm():
        with fp32_gemm():  # nested: registered once, removed on the outermost exit
            assert fp32_gemm_active()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert type(F.linear(x, w).grad_fn).__name__ == "_Fp32GemmLinearBackward"
    assert not fp32_gemm_active()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert type(F.linear(x, w).grad_fn).__name__ != "_Fp32GemmLinearBackward"
    a, b2 = torch.ones(2, 3).bfloat16(), torch.ones(3, 2).bfloat16()
    assert torch.equal(gemm(a, b2, True), torch.full((2, 2), 3.0).bfloat16())  # small integers: exact


def test_auto_takes_fp32_gemms_only_where_bf16_is_slower():
    assert cpu_bf16_gemm({"fp32": 1e11, "bf16": 1e9}) == "fp32"  # AVX2 only: bf16 emulated
    assert cpu_bf16_gemm({"fp32": 1e11, "bf16": 3e11}) == "native"  # AMX / AVX-512-BF16
    cpu = torch.device("cpu")
    assert build_precision(PrecisionConfig(compute="bf16", cpu_bf16_gemm="fp32"), cpu).gemm == "fp32"
    assert build_precision(PrecisionConfig(compute="bf16", cpu_bf16_gemm="native"), cpu).gemm == "bf16"
    assert build_precision(PrecisionConfig(compute="fp32", cpu_bf16_gemm="fp32"), cpu).gemm == "fp32"


@pytest.mark.parametrize("quantize,checkpoint", [("none", "none"), ("nf4", "none"), ("none", "full")])
def test_a_bf16_run_in_fp32_gemms_follows_the_native_one(tmp_path, quantize, checkpoint):
    """LoRA (and QLoRA, whose backward multiplies outside autocast: quant.py asks gemm; and with
    full recomputation, which re-runs the forward inside backward) on gpt-tiny in bf16: 3 steps
    with cpu_bf16_gemm = fp32 against native; losses within 1e-2 relative."""
    losses = {}
    for mode in ("native", "fp32"):
        cfg = load_config(overrides=tiny_overrides(
            tmp_path / mode, precision__compute="bf16", precision__cpu_bf16_gemm=mode, lora__rank=4,
            lora__quantize=quantize, activation__checkpoint=checkpoint, train__steps=3, train__micro_batch=2, train__seq_len=32)).validate()
        run = build_run(cfg)
        assert run.cfg.precision.cpu_bf16_gemm == mode and run.precision.gemm == ("fp32" if mode == "fp32" else "bf16")
        losses[mode] = [train_step(run, step).loss for step in range(3)]
    for a, b in zip(losses["native"], losses["fp32"]):
        assert abs(a - b) <= 1e-2 * abs(a), losses


def test_auto_is_decided_from_the_measured_peaks_and_recorded(tmp_path, monkeypatch):
    from shardlm.hardware import probe
    from shardlm.train.resolve import decide

    cpu = torch.device("cpu")
    peaks = {"fp32": 1e11, "bf16": 1e9}
    monkeypatch.setattr(probe, "cpu_peak_flops", lambda p, threads=None: peaks[p])
    cfg = lambda **kw: load_config(overrides=tiny_overrides(tmp_path, **kw)).validate()  # noqa: E731
    assert decide(cfg(precision__compute="bf16"), 1, cpu).precision.cpu_bf16_gemm == "fp32"
    assert decide(cfg(precision__compute="fp8", precision__fp8_emulate=True), 1, cpu).precision.cpu_bf16_gemm == "fp32"
    assert decide(cfg(precision__compute="fp32"), 1, cpu).precision.cpu_bf16_gemm == "native"
    assert decide(cfg(precision__compute="bf16", train__compile=True), 1, cpu).precision.cpu_bf16_gemm == "native"
    assert decide(cfg(precision__compute="bf16", precision__cpu_bf16_gemm="native"), 1, cpu).precision.cpu_bf16_gemm == "native"
    peaks["bf16"] = 3e11  # AMX / AVX-512-BF16
    assert decide(cfg(precision__compute="bf16"), 1, cpu).precision.cpu_bf16_gemm == "native"
