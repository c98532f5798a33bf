"""FP8 training (precision.compute = 'fp8', models/fp8.py): the CPU emulation's numerics.

Tolerances, measured and stated:
- quantise / dequantise: round-to-nearest in a format with m mantissa bits errs by at most half
  an ulp, 2^-(m+1) relative in the normal range: 2^-4 for E4M3, 2^-3 for E5M2 (the issue's
  bounds, 2^-3 and 2^-2, with a factor 2 to spare); the worst case seen is that half ulp over
  1 + half an ulp (a midpoint just above a power of two), as it must be.
- the loss curve: gpt-tiny at d_model 32, LOSS_STEPS steps, fp8 (each recipe) against bf16 —
  the mean of the last 10 losses within LOSS_TOLERANCE (measured: see docs/computation.md).
- ZeRO-3 on 2 ranks against one process (ZeRO-3 too: the same bf16 parameters with an fp32
  master; the ranks' micro-batches as its accumulation steps). Each micro-batch is quantised
  alone, so the first step is identical — loss and overflow / underflow counts (summed over the
  ranks) equal. After it the bf16 gradient sums differ in the last bit (two ranks' reduce-
  scatter vs one process's accumulation), and FP8 turns a last-bit change that crosses a
  rounding boundary into a whole FP8 step (6% in E4M3): after 3 steps at lr 3e-3, losses agree
  to 5e-6 relative, parameters to 1.2e-2 relative (measured; held at ZERO3_TOLERANCE = 2e-2, as
  tests/test_zero.py holds bf16), the attention key bias held to lr per step
  (parity.assert_matches says why).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import tiny_overrides
from fp8_cases import fp8_case, fp8_cases
from parity import assert_matches, rel
from shardlm.config.schema import PrecisionConfig
from shardlm.config.load import load_config
from shardlm.errors import ConfigError
from shardlm.launch.runtime import cpu_cores
from shardlm.models.fp8 import (E4M3, E5M2, EPS, FP8_HISTORY, Fp8Linear, Fp8Quantiser, Fp8Stats,
                                amax, apply_fp8, check_fp8_device, quantise)
from shardlm.launch.spawn import run_ranks
from shardlm.train.build import build_run
from shardlm.train.loop import train

LOSS_STEPS = 150
LOSS_TOLERANCE = 0.05
"""|mean of the last 10 fp8 losses - bf16's| after LOSS_STEPS steps (nats)."""
ZERO3_TOLERANCE = 2e-2
"""fp8 ZeRO-3, 2 ranks vs 1 process, after 3 steps: relative, losses and parameters."""


def _tiny(tmp_path, compute: str = "fp8", recipe: str = "tensorwise", **extra) -> dict:
    fp8 = {"precision.fp8_emulate": True, "precision.fp8_recipe": recipe} if compute == "fp8" else {}
    return {**tiny_overrides(tmp_path, model__d_model=32, model__n_heads=2, train__seq_len=16,
                             train__micro_batch=8, precision__compute=compute, train__lr=3e-3), **fp8,
            **{k.replace("__", "."): v for k, v in extra.items()}}


def _normal_range(fmt, n: int = 20_000) -> torch.Tensor:
    """Log-uniform magnitudes over the format's normal range, both signs (fp32)."""
    smallest = torch.finfo(fmt.dtype).smallest_normal
    logs = torch.empty(n, dtype=torch.float64).uniform_(math.log2(smallest), math.log2(fmt.max))
    signs = torch.randint(0, 2, (n,)) * 2 - 1
    return (2.0 ** logs * signs).float().view(100, -1)


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_round_trip_error_within_half_an_ulp(fmt):
    torch.manual_seed(0)
    x = _normal_range(fmt)
    out, counts = quantise(x, fmt, torch.tensor(1.0), out_dtype=torch.float32)
    worst = float(((out - x).abs() / x.abs()).max())
    half_ulp = 2.0 ** -(fmt.mantissa_bits + 1)  # 2^-4 (E4M3), 2^-3 (E5M2)
    # The worst case is a midpoint just above a power of two: half an ulp over 1 + half an ulp.
    assert 0.99 * half_ulp / (1 + half_ulp) <= worst <= half_ulp, (fmt.name, worst, half_ulp)
    assert counts.tolist() == [0, 0]  # nothing clamped, nothing lost


def test_zeros_stay_zero_and_are_not_underflows():
    x = torch.tensor([[0.0, -0.0, 1.0, 0.0]])
    out, counts = quantise(x, E4M3, E4M3.max / amax(x, None), out_dtype=torch.float32)
    assert out.tolist() == [[0.0, 0.0, 1.0, 0.0]]
    assert counts.tolist() == [0, 0]
    zeros = torch.zeros(3, 5)  # an all-zero tensor: the amax floor keeps the scale finite
    out, counts = quantise(zeros, E5M2, E5M2.max / amax(zeros, None).clamp_min(EPS), out_dtype=torch.float32)
    assert torch.equal(out, zeros) and counts.tolist() == [0, 0]


@pytest.mark.parametrize("fmt, big", [(E4M3, 1000.0), (E5M2, 1e5)], ids=["e4m3", "e5m2"])
def test_overflow_clamps_to_the_max_and_is_counted(fmt, big):
    # 450 (E4M3) rounds to 448 by itself: not an overflow; `big` is clamped.
    x = torch.tensor([[big, -big, 450.0, 1.0]])
    out, counts = quantise(x, fmt, torch.tensor(1.0), out_dtype=torch.float32)
    assert out[0, :2].tolist() == [fmt.max, -fmt.max]
    assert counts.tolist() == [2, 0]
    # A fixed (delayed) scale would clamp an infinity to the max: it becomes NaN instead.
    out, counts = quantise(torch.tensor([[math.inf, 1.0]]), fmt, torch.tensor(1.0), fixed_scale=True)
    assert math.isnan(out[0, 0]) and counts[0] == 1


@pytest.mark.parametrize("fmt, tiny", [(E4M3, 2.0 ** -11), (E5M2, 2.0 ** -18)], ids=["e4m3", "e5m2"])
def test_underflow_rounds_to_zero_and_is_counted(fmt, tiny):
    # Below half the smallest subnormal (2^-9 for E4M3, 2^-16 for E5M2) a value rounds to 0.
    x = torch.tensor([[tiny, -tiny, 1.0]])
    out, counts = quantise(x, fmt, torch.tensor(1.0), out_dtype=torch.float32)
    assert out[0, :2].tolist() == [0.0, 0.0]
    assert counts.tolist() == [0, 2]


def test_blockwise_tiles_keep_small_rows_that_tensorwise_loses():
    """One large row beside small ones: a per-tensor scale pushes the small ones under E4M3's
    smallest subnormal, 1 x 8 tiles give them a scale of their own (DeepSeek-V3's reason)."""
    x = torch.full((4, 16), 1e-3)
    x[0] = 1e4
    tensor_out, tensor_counts = quantise(x, E4M3, E4M3.max / amax(x, None), out_dtype=torch.float32)
    tile = (1, 8)
    block_out, block_counts = quantise(x, E4M3, E4M3.max / amax(x, tile), tile, out_dtype=torch.float32)
    assert tensor_counts.tolist() == [0, 48] and float(tensor_out[1:].abs().max()) == 0.0
    assert block_counts.tolist() == [0, 0] and torch.allclose(block_out, x, rtol=2.0 ** -4)


def _layer(recipe: str = "tensorwise", block: int = 128):
    torch.manual_seed(0)
    linear = torch.nn.Linear(32, 48)
    return linear, Fp8Linear.from_linear(linear, Fp8Quantiser(recipe, block, Fp8Stats()))


def test_swapped_layer_holds_the_same_parameters():
    linear, layer = _layer()
    assert layer.weight is linear.weight and layer.bias is linear.bias
    assert [n for n, _ in layer.named_parameters()] == ["weight", "bias"]
    x = torch.randn(4, 8, 32)  # (B, T, in)
    with torch.no_grad():
        assert rel(layer(x).float(), linear(x)) < 0.05  # E4M3 inputs and weights: a few percent


def test_gradients_flow_in_e5m2():
    """The backward's matmuls take the output gradient rounded through E5M2 (not E4M3, not
    unrounded), the forward's E4M3 input and weight: computed by hand here, bit for bit."""
    linear, layer = _layer()
    x = torch.randn(64, 32, requires_grad=True)
    grad_out = torch.randn(64, 48) * torch.logspace(-3, 3, 48)  # wide range: formats differ
    layer(x).backward(grad_out.bfloat16())

    def rounded(t, fmt):
        return quantise(t, fmt, fmt.max / amax(t, None).clamp_min(EPS))[0]

    xq, wq = rounded(x.detach(), E4M3), rounded(linear.weight.detach(), E4M3)
    g = grad_out.bfloat16()
    expected_w = (rounded(g, E5M2).t() @ xq).float()
    assert torch.equal(layer.weight.grad, expected_w)
    assert torch.equal(x.grad, (rounded(g, E5M2) @ wq).float())
    assert not torch.equal(layer.weight.grad, (rounded(g, E4M3).t() @ xq).float())
    assert torch.equal(layer.bias.grad, g.float().sum(0))


def test_delayed_scale_comes_from_past_steps():
    """'delayed': the first step scales by the tensor's own amax; from then on by the history's
    max, fixed within a step — so a tensor 4x larger than any before overflows, and is counted."""
    linear, layer = _layer("delayed")
    quantiser, stats = layer.fp8, layer.fp8.stats
    x = torch.randn(16, 32)
    layer(x.requires_grad_()).sum().backward()
    assert stats.totals(x.device).view(3, 3)[0].tolist() == [0, 0, x.numel()]  # current scaling on the first step
    quantiser.roll()
    assert float(quantiser.delayed["input"].scale) == pytest.approx(E4M3.max / float(x.detach().abs().max()))
    stats.reset()
    layer((4 * x).requires_grad_()).sum().backward()
    assert stats.totals(x.device).view(3, 3)[0, 0] > 0  # the input overflowed the delayed scale
    assert quantiser.delayed["input"].history.shape == (FP8_HISTORY,)


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "blockwise"])
def test_each_recipe_trains_and_reports_overflow_and_underflow(tmp_path, recipe):
    block = {"precision.fp8_block": 16} if recipe == "blockwise" else {}
    run = build_run(load_config(overrides=_tiny(tmp_path, recipe=recipe, train__steps=4, **block)).validate())
    assert run.precision.name == "fp8" and run.precision.dtype == torch.bfloat16
    assert sum(isinstance(m, Fp8Linear) for m in run.model.modules()) == 8  # 4 per block
    assert type(run.model.head) is torch.nn.Linear  # the LM head stays out
    result = train(run)
    assert all(math.isfinite(loss) for loss in result.losses)
    for record in _metrics(result.run_dir):
        assert 0.0 <= record["fp8_overflow"] < 1e-2 and 0.0 <= record["fp8_underflow"] < 1e-2
        assert set(record["fp8_underflow_by_tensor"]) == {"input", "weight", "grad_output"}
        if recipe != "delayed":  # scaled by their own amax: nothing can exceed the max
            assert record["fp8_overflow"] == 0.0


def test_loss_tracks_bf16(tmp_path, monkeypatch):
    """The same run in bf16 and in emulated fp8 (tensorwise): the curves stay together."""
    # One thread (init_runtime gives each of LOCAL_WORLD_SIZE ranks its share of the cores): a
    # model this small only loses time to synchronising threads on a busy machine.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cpu_cores()))
    bf16 = fp8_case(_tiny(tmp_path, "bf16", train__steps=LOSS_STEPS), LOSS_STEPS)["losses"]
    fp8 = fp8_case(_tiny(tmp_path, train__steps=LOSS_STEPS), LOSS_STEPS)["losses"]
    assert bf16[-1] < bf16[0] - 0.5  # it learned something: the comparison means something
    tail = sum(fp8[-10:]) / 10 - sum(bf16[-10:]) / 10
    print(f"fp8 - bf16, mean of the last 10 losses after {LOSS_STEPS} steps: {tail:+.4f}")
    assert abs(tail) <= LOSS_TOLERANCE, (tail, fp8[-10:], bf16[-10:])


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_recomputes_the_same_rounding(tmp_path, mode):
    """Recomputation rounds as the first forward did (delayed scaling's scale is fixed within a
    step): the same losses and parameters, bit for bit."""
    base = fp8_case(_tiny(tmp_path, recipe="delayed", train__steps=3), 3)
    got = fp8_case(_tiny(tmp_path, recipe="delayed", train__steps=3, activation__checkpoint=mode), 3)
    assert got["losses"] == base["losses"]
    assert all(torch.equal(got["params"][n], v) for n, v in base["params"].items())


ZERO3_STEPS = 3


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One spawn of 2 ranks for both distributed tests: ZeRO-3 training and the tp linears."""
    tmp_path = tmp_path_factory.mktemp("fp8_ranks")
    overrides = _tiny(tmp_path, train__steps=ZERO3_STEPS, parallel__zero_stage=3)
    return overrides, run_ranks(fp8_cases, 2, tmp_path, [(overrides, ZERO3_STEPS)], True)


def test_zero3_two_ranks_match_one_process(two_ranks, monkeypatch):
    steps = ZERO3_STEPS
    overrides, ((rank0, _), (rank1, _)) = two_ranks
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # one rank's thread count (zero_cases.reference_case)
    ref = fp8_case({**overrides, "train.grad_accum": 2}, steps)
    got = rank0[0]
    # The first step starts from the same parameters: the same loss, and the same counts once
    # the ranks' are summed (rank 0's alone would be about half of them).
    assert got["losses"][0] == ref["losses"][0] and got["records"][0] == ref["records"][0]
    assert got["records"][0]["fp8_underflow"] > 0.0
    assert_matches(got["losses"], got["params"], ref, "fp8 ZeRO-3", tol=ZERO3_TOLERANCE, d_model=32, lr=3e-3)
    assert all(torch.equal(rank1[0]["params"][n], v) for n, v in got["params"].items())


def test_tensor_parallel_linears_round_as_one_process(two_ranks):
    """fp8 column- then row-parallel linears on 2 ranks (with and without sequence parallelism)
    against one process's two Fp8Linears: every piece each rank rounds — input, weight, output
    gradient — holds the bits of one process's rounded whole (the amaxes of the cut tensors
    are the max over the group); outputs and gradients, whose partial sums add up in another
    order, within 1e-2 relative (bf16 matmuls)."""
    for _, result in two_ranks[1]:
        for sp, case in result.items():
            one, tp = case["one"], case["tp"]
            (lo, hi), (t_lo, t_hi) = tp["rows"], tp["seq"]
            (col_one, row_one), (col, row) = one["seen"], tp["seen"]
            # input, weights, row's grad_output: pieces of the same values, rounded at the same
            # amax (the max over the group is the whole's max): exact. col's grad_output and
            # row's input are matmul outputs, a piece of the columns here and all of them there:
            # each element is the same dot product over the same d = 32 features in the same
            # order whichever columns share the call (no CPU kernel splits a 32-term reduction;
            # the calls differ in N only), then the same bf16 and E4M3 / E5M2 roundings.
            assert torch.equal(col["input"], col_one["input"]), sp  # whole (gathered under sp)
            assert torch.equal(col["weight"], col_one["weight"][lo:hi])
            assert torch.equal(col["grad_output"], col_one["grad_output"][:, lo:hi])
            assert torch.equal(row["input"], row_one["input"][:, lo:hi])
            assert torch.equal(row["weight"], row_one["weight"][:, lo:hi])
            assert torch.equal(row["grad_output"], row_one["grad_output"])  # whole (all-gathered under sp)
            assert rel(tp["y"], one["y"][:, t_lo:t_hi]) < 1e-2
            assert rel(tp["x_grad"], one["x_grad"][:, t_lo:t_hi]) < 1e-2
            assert rel(tp["w_grads"][0], one["w_grads"][0][lo:hi]) < 1e-2
            assert rel(tp["w_grads"][1], one["w_grads"][1][:, lo:hi]) < 1e-2


@pytest.mark.parametrize("extra", [{"model__experts": 4, "model__top_k": 2}, {"lora__quantize": "nf4"}],
                         ids=["lora-moe", "qlora"])
def test_lora_bases_and_every_expert_multiply_in_fp8(tmp_path, extra):
    """LoRA on a MoE model, and QLoRA (nf4), under fp8 ('delayed', whose per-tensor history
    shows which quantisers ran): after a step every quantiser has rounded something — each
    frozen base's (QLoRA's dequantised from its bytes), each expert's — while LoRA's adapters
    stay plain linears in the compute dtype."""
    from shardlm.models.decoder import build_model
    from shardlm.models.lora import DEFAULT_TARGETS, LoRALinear, apply_lora
    from shardlm.models.moe import Experts
    from shardlm.models.quant import quantizable, quantize_base

    cfg = load_config(overrides=_tiny(tmp_path, recipe="delayed", lora__rank=4, **extra)).validate()
    model = build_model(cfg.model, "cpu", seed=0)
    apply_lora(model, cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.targets, cfg.model.mlp)
    if cfg.lora.quantize != "none":
        quantize_base(model, cfg.lora.quantize, quantizable(model, DEFAULT_TARGETS[cfg.model.mlp].split(",")))
    state = apply_fp8(model, cfg.precision, torch.device("cpu"))
    ids = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(ids).float().square().mean().backward()
    state.begin_step()  # delayed scaling: each quantiser that rounded has an amax history now
    bases = [m for m in model.modules() if isinstance(m, LoRALinear)]
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    assert bases and all(b.fp8 is not None for b in bases)
    assert all(b.quant is not None for b in bases) == ("lora__quantize" in extra)
    assert bool(experts) == ("model__experts" in extra)
    assert not any(isinstance(m, Fp8Linear) for b in bases for m in (b.lora_A, b.lora_B))
    assert len(state.quantisers) == len(bases) + sum(2 * len(e.fp8) for e in experts)
    unused = [q for q in state.quantisers if q.delayed["input"].history is None]
    assert not unused, f"{len(unused)} of {len(state.quantisers)} quantisers never rounded"


def test_an_fp8_block_traces_as_one_graph():
    """train.compile with the emulation: Dynamo traces an fp8 block (llama-tiny) whole — no
    graph break — the counts leaving the matmul as a gradient, not as Python state (a break
    would also be an error at the first compiled step: blocks compile with fullgraph)."""
    import torch._dynamo

    from shardlm.config.model import ModelConfig
    from shardlm.models.decoder import build_model
    from shardlm.config.presets import get_preset

    model = build_model(ModelConfig(**{**get_preset("llama-tiny"), "preset": "llama-tiny"}), "cpu", seed=0)
    apply_fp8(model, PrecisionConfig(compute="fp8", fp8_emulate=True), torch.device("cpu"))
    x = torch.randn(2, 16, model.cfg.d_model, requires_grad=True)  # (B, T, C)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model.blocks[0].forward)(x, (model.rope_cos[:16], model.rope_sin[:16]))
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def test_the_planner_keeps_fp8_and_times_it_at_the_fp8_peak():
    """parallel.strategy = 'auto' with fp8: the plan runs precision.compute = 'fp8'; on H100s
    (an fp8 peak in the catalog) the blocks' linears are timed at it, so the best plan is faster
    than bf16's; on A100s (none: fp8 there is the emulation's bf16 matmuls) the same as bf16."""
    from shardlm.hardware.catalog import parse_cluster
    from shardlm.planner.search import default_dtypes, plan_for_run

    model = load_config(overrides={"model.preset": "llama-7b"}).model
    speed = {}
    for gpus in ("8xH100-80GB", "8xA100-80GB"):
        cluster = parse_cluster(gpus)
        for compute in ("bf16", "fp8"):
            best = plan_for_run(model, 8, cluster, (1, 8, 4096), dtypes=default_dtypes(cluster, compute))[0]
            assert best.overrides()["precision.compute"] == compute
            speed[gpus, compute] = best.timing.tokens_per_s
    assert 1.2 < speed["8xH100-80GB", "fp8"] / speed["8xH100-80GB", "bf16"] < 2.0
    assert speed["8xA100-80GB", "fp8"] == speed["8xA100-80GB", "bf16"]


def test_fp8_without_fp8_hardware_errors_unless_emulated(tmp_path):
    cfg = _tiny(tmp_path, **{"precision.fp8_emulate": False, "run.device": "cpu"})
    with pytest.raises(ConfigError, match="precision.fp8_emulate = true"):
        load_config(overrides=cfg).validate()
    auto = PrecisionConfig(compute="fp8")  # run.device = 'auto': found where the device is known
    with pytest.raises(ConfigError, match="needs FP8 hardware.*fp8_emulate = true"):
        check_fp8_device(auto, torch.device("cpu"))
    check_fp8_device(PrecisionConfig(compute="fp8", fp8_emulate=True), torch.device("cpu"))


def test_fp8_is_checked_before_ranks_spawn(tmp_path, monkeypatch):
    """`shardlm train --nproc 2` with run.device = 'auto' on a machine whose device has no FP8
    (the CPU, pinned here so that a GPU machine runs the same test): refused in the launcher."""
    from shardlm.launch import runtime as launch
    from shardlm.cli.train import preflight

    monkeypatch.setattr(launch, "pick_device", lambda preference, local_rank=0, local_world=1: torch.device("cpu"))
    cfg = load_config(overrides=_tiny(tmp_path, **{"precision.fp8_emulate": False, "run.device": "auto"})).validate()
    with pytest.raises(ConfigError, match="needs FP8 hardware"):
        preflight(cfg, 2)


ON_HARDWARE = {"precision.fp8_emulate": False, "run.device": "cuda"}


@pytest.mark.parametrize("overrides, named", [
    ({"parallel.tp": 2, "precision.fp8_recipe": "blockwise"}, "blockwise tiles would straddle"),
    ({"parallel.tp": 2, "model.n_kv_heads": 1}, "more ranks than the 1 key/value heads"),
    ({"parallel.tp": 2, **ON_HARDWARE}, "torchao does not convert our tensor-parallel linears"),
    ({"lora.rank": 4, **ON_HARDWARE}, "torchao would convert LoRA's adapters"),
    ({"model.experts": 4, **ON_HARDWARE}, "torchao does not convert the experts"),
    ({"train.compile": True, "precision.fp8_recipe": "delayed"}, "'delayed' scaling's amax history"),
], ids=["tp-blockwise", "tp-over-kv-heads", "tp-torchao", "lora-torchao", "experts-torchao", "compile"])
def test_unsupported_compositions_are_refused_by_name(tmp_path, overrides, named):
    with pytest.raises(ConfigError, match="does not compose yet with") as caught:
        load_config(overrides={**_tiny(tmp_path), **overrides}).validate()
    assert named in str(caught.value)


def test_torchao_fp8_composes_with_compile(tmp_path):
    """On FP8 hardware (torchao's float8, fp8_emulate off) train.compile is allowed: torchao
    recommends it, and tests/test_cuda.py checks compiled = eager there."""
    load_config(overrides=_tiny(tmp_path, **{"precision.fp8_emulate": False, "train.compile": True,
                                             "run.device": "cuda"})).validate()


def test_fp8_keys_without_fp8_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="has no effect with precision.compute = 'bf16'"):
        load_config(overrides=_tiny(tmp_path, "bf16", **{"precision.fp8_recipe": "delayed"})).validate()


def test_a_model_not_ours_is_refused_by_name():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    with pytest.raises(ConfigError, match="a Sequential is not converted yet"):
        apply_fp8(model, PrecisionConfig(compute="fp8", fp8_emulate=True), torch.device("cpu"))
