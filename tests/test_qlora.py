"""QLoRA (lora.quantize, models/quant.py): the packed formats against bitsandbytes on the same
weights, the round-trip error within each format's bound, the quantised run starting as the
dequantised base model, training only the adapters, and ZeRO-3 on two ranks (the quantised base
sharded as bytes) matching one process; a checkpoint resumes.

Tolerance of the two-rank comparison: fp32, as tests/test_lora.py (1e-6 relative: the sharded
grad norm may differ in the last bit). Everything else is exact (torch.equal) or a stated bound.
"""

from __future__ import annotations

import os

import bitsandbytes.functional as bnb  # the `test` extra installs it: the reference formats
import pytest
import torch

from ckpt_cases import straight_and_resumed
from conftest import tiny_overrides
from lora_cases import lora_case
from parity import assert_matches
from qlora_cases import layout_case, qlora_cases
from shardlm.config.load import load_config
from shardlm.errors import ConfigError
from shardlm.models.lora import is_adapter
from shardlm.models.quant import ROW_PARALLEL, QuantizedLinearFn, quantizable, quantize_base, segments
from shardlm.models.quant_format import (ABSMAX_BLOCK, BLOCK, QuantFormat, dequantize, dequantize_torch,
                                         dynamic_map, format_bound, quantize, weight_of)
from shardlm.launch.spawn import run_ranks
from shardlm.train.build import build_run
from zero_cases import reference_case

SHAPES = [(7, 5), (96, 33), (128, 64), (2, 17000), (1100, 1000), (260, 4160)]
"""Odd sizes, partial blocks, > 256 blocks in a row, > CHUNK elements, whole blocks with a partial last group."""
STEPS = 4
FP32_SLACK = 2.0 ** -20
"""The fp32 arithmetic of scaling and of the product: a few ulps (2^-23) of the absmax."""


def _weight(shape, dtype=torch.float32):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))) * 0.02).to(dtype)


def _checked_rows(fmt: QuantFormat) -> list[int]:
    rows = fmt.rows[0]
    return list(range(rows)) if rows <= 8 else [0, 1, rows // 2, rows - 1]


def _parts(table: torch.Tensor, fmt: QuantFormat):
    """(offset (R,), phase (R,), absmax2 (R, G), absmax codes (R, nb), 4-bit codes) of an nf4 table."""
    at = fmt.codes_at
    def field(lo, hi, dtype):
        return table[:, lo:hi].reshape(-1).clone().view(dtype).view(table.shape[0], -1)
    return (field(0, 4, torch.float32).view(-1), field(4, 8, torch.int32).view(-1), field(8, at, torch.float32),
            table[:, at:at + fmt.blocks], table[:, at + fmt.blocks:])


def _against_bitsandbytes(w: torch.Tensor, table: torch.Tensor, fmt: QuantFormat) -> None:
    """`table` (ours, of the (R, K) weight `w`, K a multiple of 64, one tensor) against
    bitsandbytes' quantize_4bit of the same weight: the same 4-bit codes, offset and absmax2 (each
    row's groups), and dequantised values bit for bit bitsandbytes' dequantize_4bit. The 8-bit
    absmax codes are the nearest levels of the dynamic map (bitsandbytes' torch and CUDA rule:
    bucketize on midpoints); its CPU C kernel's binary search sometimes lands one level off,
    never nearer: with its codes replaced by ours, its dequantisation is ours bit for bit."""
    codes, state = bnb.quantize_4bit(w, blocksize=BLOCK, compress_statistics=True, quant_type="nf4")
    offset, phase, absmax2, absmax_codes, nibbles = _parts(table, fmt)
    assert torch.equal(nibbles.reshape(-1), codes.view(-1))
    assert torch.equal(offset, state.offset.expand(fmt.rows[0]))
    first = torch.arange(fmt.rows[0]) * fmt.blocks
    assert torch.equal(phase, (first % ABSMAX_BLOCK).int())
    group = (first // ABSMAX_BLOCK).unsqueeze(1) + (torch.arange(fmt.blocks) + phase.unsqueeze(1)) // ABSMAX_BLOCK
    assert torch.equal(torch.gather(absmax2, 1, group - group[:, :1]), state.state2.absmax[group])
    assert torch.equal(dynamic_map(), state.state2.code)
    absmax = w.float().view(-1, BLOCK).abs().amax(1)
    absmax2_of_block = state.state2.absmax.clamp(min=1e-38).repeat_interleave(ABSMAX_BLOCK)[:len(absmax)]
    scaled = (absmax - offset[0]) * (1.0 / absmax2_of_block)
    ours, theirs = absmax_codes.reshape(-1).long(), state.absmax.long()
    last = len(absmax) - len(absmax) % ABSMAX_BLOCK  # the partial last group: divided, as theirs
    if last < len(absmax):
        scaled[last:] = (absmax[last:] - offset[0]) / state.state2.absmax[-1].clamp(min=1e-38)
    distance = (scaled.clamp(-1, 1).unsqueeze(1) - dynamic_map()).abs()
    assert torch.equal(distance.gather(1, ours.unsqueeze(1)).view(-1), distance.amin(1))  # the nearest
    assert (ours != theirs).sum() <= max(2, 0.01 * len(ours))  # ~0.1% seen
    values = dequantize(table, fmt, torch.float32)
    if torch.equal(ours, theirs):
        assert torch.equal(values, bnb.dequantize_4bit(codes, state))
    state.absmax = absmax_codes.reshape(-1).clone()  # their dequantisation of our codes: bit for bit ours
    assert torch.equal(values, bnb.dequantize_4bit(codes, state))


@pytest.mark.parametrize("shape", SHAPES)
def test_nf4_equals_bitsandbytes(shape):
    """Rows of whole blocks: the weight's table is bitsandbytes' format of the whole tensor
    (_against_bitsandbytes). Rows with a partial block (bitsandbytes' blocks then run across rows,
    ours stop at a row's end: docs/finetuning.md): each row alone is bitsandbytes' format of it."""
    w = _weight(shape)
    fmt = QuantFormat("nf4", shape)
    table = quantize(w, "nf4")
    assert table.dtype == torch.uint8 and tuple(table.shape) == fmt.stored_shape
    assert table.numel() == fmt.nbytes
    if shape[1] % BLOCK == 0:
        _against_bitsandbytes(w, table, fmt)
    else:
        pad = fmt.blocks * BLOCK - shape[1]
        for row in _checked_rows(fmt):  # zeros do not move a block's absmax
            padded = torch.nn.functional.pad(w[row:row + 1], (0, pad))
            whole_blocks = QuantFormat("nf4", (1, fmt.blocks * BLOCK))
            _against_bitsandbytes(padded, quantize(padded, "nf4"), whole_blocks)
            alone = dequantize(quantize(w[row:row + 1], "nf4"), QuantFormat("nf4", (1, shape[1])), torch.float32)
            assert torch.equal(alone, dequantize(quantize(padded, "nf4"), whole_blocks, torch.float32)[:, :shape[1]])
    for dtype in (torch.float32, torch.bfloat16):  # their kernel (when installed) = our torch ops
        assert torch.equal(dequantize(table, fmt, dtype), dequantize_torch(table, fmt, dtype))


def test_fused_weights_are_quantised_per_checkpoint_tensor(tmp_path):
    """Our fused linears (attn.qkv = q, k, v; mlp.gate_up = gate, up) are double-quantised per
    tensor a LLaMA checkpoint holds, and at tp = 1 o_proj / down_proj's blocks run along the input
    as bitsandbytes': every dequantised weight of a QLoRA model is bitsandbytes' dequantize_4bit of
    the checkpoint's tensor (_against_bitsandbytes), the embeddings, norms and head untouched."""
    from shardlm.config.load import load_config
    from shardlm.models.decoder import build_model

    cfg = load_config(overrides={**_base(tmp_path), "model.n_kv_heads": 2}).validate()
    model = build_model(cfg.model, "cpu", seed=0)
    whole = {n: p.detach().clone() for n, p in model.named_parameters()}
    names = quantizable(model, ["attn.qkv", "attn.proj", "mlp.gate_up", "mlp.down"])
    state, _ = quantize_base(model, "nf4", names)
    q_rows = cfg.model.n_heads * (cfg.model.d_model // cfg.model.n_heads)
    kv_rows = cfg.model.n_kv_heads * (cfg.model.d_model // cfg.model.n_heads)
    qkv = QuantFormat("nf4", (q_rows + 2 * kv_rows, 1))
    assert segments(model, "blocks.0.attn.qkv", qkv) == (q_rows, kv_rows, kv_rows)
    assert state.layers == len(names) == 8
    for name in names:
        module, weight = model.get_submodule(name), whole[f"{name}.weight"]
        assert not module.quant.transposed
        cuts = segments(model, name, module.quant) or (weight.shape[0],)
        assert len(cuts) == {"qkv": 3, "gate_up": 2}.get(name.rsplit(".", 1)[1], 1), name
        lo = 0
        for rows in cuts:  # each checkpoint tensor's rows: its own table
            fmt = QuantFormat("nf4", (rows, weight.shape[1]))
            _against_bitsandbytes(weight[lo:lo + rows], module.weight_q[lo:lo + rows], fmt)
            lo += rows
    plain = {n for n, _ in model.named_parameters() if not n.endswith("_q")}
    assert plain >= {"tok_emb.weight", "head.weight", "norm_f.weight"}
    cut = build_model(cfg.model, "meta", seed=0)  # tp > 1: the row-parallel linears by columns
    quantize_base(cut, "nf4", names, columns=True)
    assert {n for n in names if cut.get_submodule(n).quant.transposed} == {
        n for n in names if n.endswith(tuple("." + p for p in ROW_PARALLEL))}


@pytest.mark.parametrize("shape", SHAPES)
def test_int8_equals_bitsandbytes(shape):
    w = _weight(shape)
    fmt = QuantFormat("int8", shape)
    table = quantize(w, "int8")
    codes, scales, _ = bnb.int8_vectorwise_quant(w)
    assert tuple(table.shape) == fmt.stored_shape
    assert torch.equal(table[:, 4:].view(torch.int8), codes)
    assert torch.equal(table[:, :4].clone().view(torch.float32).view(-1), scales)
    assert torch.equal(dequantize(table, fmt, torch.float32), bnb.int8_vectorwise_dequant(codes, scales))


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_transposed_tables_store_the_columns(kind):
    """A row-parallel linear's table (ROW_PARALLEL) is its transpose's: its rows are the
    weight's columns, so a tensor-parallel cut of the input takes whole rows of it."""
    w = _weight((96, 33))
    table = quantize(w, kind, transposed=True)
    assert torch.equal(table, quantize(w.t().contiguous(), kind))
    fmt = QuantFormat(kind, (96, 33), transposed=True)
    assert tuple(table.shape) == fmt.stored_shape == (33, fmt.row_nbytes)
    assert torch.equal(weight_of(table, fmt, torch.float32), dequantize(table, fmt, torch.float32).t())


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_dequantise_op_is_told_its_output_layout(kind):
    """shardlm::dequantize (a compiled block's one node for the dequantisation, train.compile):
    its fake gives the real output's shape, strides and dtype, which a compiled graph asserts
    (a row shorter than its blocks once came back as a strided slice and stopped the graph)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from shardlm.models.quant_format import dequantize_op

    for shape, transposed in (((32, 64), True), ((7, 5), False), ((64, 128), False)):
        table = quantize(_weight(shape), kind, transposed)
        real = dequantize_op(table, kind, list(shape), transposed, torch.bfloat16)
        with FakeTensorMode() as mode:
            fake = dequantize_op(mode.from_tensor(table), kind, list(shape), transposed, torch.bfloat16)
        assert (fake.shape, fake.stride(), fake.dtype) == (real.shape, real.stride(), real.dtype), shape
        fmt = QuantFormat(kind, shape, transposed)
        assert torch.equal(real, dequantize(table, fmt, torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_round_trip_within_the_format_bound(kind, dtype):
    """Per element |w - deq| <= absmax x (half the widest gap between levels); for nf4 plus the
    double quantisation's error on that absmax: absmax2 x (half the widest gap of the dynamic
    map), times the largest level (1); plus the fp32 arithmetic's rounding (FP32_SLACK x absmax).
    From a `dtype` weight."""
    shape = (1100, 1000)  # > CHUNK: quantised in two pieces
    w = _weight(shape, dtype)
    fmt = QuantFormat(kind, shape)
    table = quantize(w, kind)
    error = (w.float() - dequantize(table, fmt, torch.float32)).abs()
    if kind == "int8":
        bound = w.float().abs().amax(1, keepdim=True) * (format_bound(kind) + FP32_SLACK)
        ratio = error / bound
    else:
        pad = fmt.blocks * BLOCK - shape[1]
        absmax = torch.nn.functional.pad(w.float(), (0, pad)).view(shape[0], -1, BLOCK).abs().amax(2)
        levels = dynamic_map()
        dq_half_gap = float((levels[1:] - levels[:-1]).max()) / 2
        _, phase, absmax2, _, _ = _parts(table, fmt)
        absmax2 = torch.gather(absmax2, 1, (torch.arange(fmt.blocks) + phase.unsqueeze(1)) // ABSMAX_BLOCK)
        bound = absmax * (format_bound(kind) + FP32_SLACK) + absmax2 * dq_half_gap  # (rows, blocks)
        padded = torch.nn.functional.pad(error, (0, pad)).view(shape[0], -1, BLOCK)
        ratio = padded / bound.unsqueeze(2)
    assert float(ratio.max()) <= 1
    assert float(ratio.max()) > 0.5  # a bound some elements come near, not a loose one


def test_input_gradient_is_the_dequantised_layer_s():
    """Backward dequantises again: x's gradient equals a dense layer's on the dequantised weight."""
    shape = (48, 32)
    packed = quantize(_weight(shape), "nf4")
    dense = dequantize(packed, QuantFormat("nf4", shape), torch.float32).requires_grad_(True)
    x = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    y = QuantizedLinearFn.apply(x, packed, None, QuantFormat("nf4", shape))
    (y * y).sum().backward()
    grad, x.grad = x.grad, None
    y_ref = torch.nn.functional.linear(x, dense)
    (y_ref * y_ref).sum().backward()
    assert torch.equal(y, y_ref)
    torch.testing.assert_close(grad, x.grad, rtol=0, atol=0)


def _base(tmp_path, kind="nf4", **extra):
    return tiny_overrides(tmp_path, model__preset="llama-tiny", train__micro_batch=4, lora__rank=4,
                          lora__quantize=kind, train__lr=1e-2, train__seq_len=32, **extra)


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_starts_as_the_dequantised_base(tmp_path, kind):
    """B = 0: the quantised run's logits are, bit for bit, those of the plain model whose block
    linears hold the dequantised weights."""
    o = _base(tmp_path, kind)
    run = build_run(load_config(overrides={**o, "run.name": "q"}).validate())
    plain = build_run(load_config(overrides={**o, "lora.rank": 0, "lora.quantize": "none",
                                             "run.name": "p"}).validate())
    names = {n for n, _ in run.model.named_parameters() if n.endswith(".weight_q")}
    assert len(names) == 4 * 2  # qkv, proj, gate_up, down in each of llama-tiny's 2 blocks
    assert run.model.quant.layers == len(names)
    with torch.no_grad():
        for name, p in plain.model.named_parameters():
            if f"{name}_q" in names:
                layer = run.model.get_submodule(name.rpartition(".")[0])
                assert not layer.quant.transposed  # tp = 1: blocks along the input, as bitsandbytes'
                p.copy_(weight_of(layer.weight_q, layer.quant, torch.float32))
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(run.model(idx), plain.model(idx))


def test_trains_only_the_adapters(tmp_path):
    out = lora_case(_base(tmp_path, train__steps=20), 20)
    changed = {n for n in out["params"] if not torch.equal(out["params"][n], out["before"][n])}
    assert changed and all(is_adapter(n) for n in changed)
    assert any(n.endswith(".weight_q") for n in out["params"])
    losses = out["losses"]  # a random base: LoRA alone falls ~0.08 in these 20 steps
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.03, losses
    assert out["optim_elements"] == out["adapter_elements"] == out["trainable"]


def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="lora.quantize"):
        load_config(overrides={**_base(tmp_path), "lora.quantize": "nf3"}).validate()
    with pytest.raises(ConfigError, match="lora.rank"):
        load_config(overrides={**_base(tmp_path), "lora.rank": 0}).validate()
    with pytest.raises(ConfigError, match="lora.quantize_layout = 'rows'.*across each row's blocks"):
        load_config(overrides={**_base(tmp_path), "lora.quantize_layout": "rows", "parallel.tp": 2}).validate()
    load_config(overrides={**_base(tmp_path), "model.experts": 4}).validate()  # experts quantised


MOE = {"model.experts": 4, "model.top_k": 2}
LAYOUTS = {"tp=2": {"parallel.tp": 2}, "ep=2, MoE": {**MOE, "parallel.ep": 2}}
"""Run on 2 ranks beside the ZeRO cases for LAYOUT_STEPS, each against one process (sequence
parallelism: bench/compose.py tp_sp+qlora)."""
LAYOUT_STEPS = 2
LAYOUT_EPS = {"train.eps": 1e-4}
"""AdamW's eps for the layout cases and their references. LoRA's B starts at 0, so A's first
gradients are near zero, and Adam's update m/(√v + eps) is ~±lr whatever a gradient's size: with
eps 1e-8 the rounding of tp's reordered sums decided lr-sized steps of lora_A (5.4e-5 of its norm
on an AMD EPYC Zen 3, against the 1e-5 bound). With 1e-4 an update is at most lr·|g|/eps, so a
gradient's rounding stays a rounding of the update (tests/test_hf_families.py does the same)."""


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    from worlds import several

    tmp = tmp_path_factory.mktemp("qlora2")
    cases = [({**_base(tmp), "parallel.zero_stage": stage}, STEPS) for stage in (0, 3)]
    cases += [({**_base(tmp), **extra, **LAYOUT_EPS}, LAYOUT_STEPS) for extra in LAYOUTS.values()]
    # and, in the same world (worlds.several), test_checkpoint_resumes_at_stage_3's runs
    resume = [("qlora3", {**_base(tmp), "parallel.zero_stage": 3}, 2)]
    out, resumed = zip(*run_ranks(several, 2, tmp, [(qlora_cases, (cases,)), (straight_and_resumed, (resume,))]))
    saved = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # one rank's thread count (zero_cases.reference_case)
    try:  # tp: no data parallelism, the same batch in one process, ROW_PARALLEL stored by columns as tp = 2
        one = {"dense": layout_case({**_base(tmp), **LAYOUT_EPS, "run.name": "one", "lora.quantize_layout": "columns"},
                                    LAYOUT_STEPS)}
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE") if saved is None else os.environ.update(LOCAL_WORLD_SIZE=saved)
    one["moe"] = reference_case({**_base(tmp), **MOE, **LAYOUT_EPS, "run.name": "one-moe"}, 2, LAYOUT_STEPS)
    return out, reference_case(_base(tmp), 2, STEPS), one, resumed[0][0]  # rank 0's (straight, resumed)


@pytest.mark.parametrize("case", [0, 1])
def test_two_ranks_match_one_process(two_rank_runs, case):
    """ZeRO stage 0 (base replicated) and 3 (base sharded as bytes, gathered per unit)."""
    out, ref, _, _ = two_rank_runs
    for rank in (0, 1):
        got = out[rank][case]
        assert_matches(got["losses"], got["params"], ref, f"case {case} rank {rank}", tol=1e-6, lr=1e-2)
        assert all(torch.equal(got["params"][n], got["before"][n]) for n in got["params"] if not is_adapter(n))
        # each block's packed weights: one byte unit, whole (stage 0) or half per rank (stage 3)
        units = got["byte_units"]
        assert [name for name, *_ in units] == ["blocks.0[uint8]", "blocks.1[uint8]"]
        assert all(dtype == "torch.uint8" for _, dtype, _, _ in units)
        assert all(shard == (-(-total // 2) if case == 1 else total) for _, _, shard, total in units)
        # the ledger counts them as bytes, as the formula does
        assert got["state_bytes"]["params"] == pytest.approx(got["predicted"]["params"], rel=0.01)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tensor_and_expert_parallel_match_one_process(two_rank_runs, layout):
    """tp = 2: each rank holds whole stored rows of every
    byte table (a column-parallel weight's rows, a row-parallel weight's columns: models/quant.py
    ROW_PARALLEL), which put together are the one-process tables byte for byte, so the pieces
    dequantise to exactly its weights. ep = 2 with MoE: each rank's experts' tables. Losses and
    adapters within 1e-5 relative (tests/test_lora_tp.py: tp sums in another order)."""
    from tp_cases import whole_params

    out, _, one, _ = two_rank_runs
    index = 2 + list(LAYOUTS).index(layout)
    ranks = [out[rank][index] for rank in (0, 1)]
    ref = one["moe" if "ep" in layout else "dense"]
    tables = [n for n in ref["params"] if n.endswith("_q")]
    assert len(tables) == (2 * 4 if "ep" not in layout else 2 * 2 + 2 * 2)  # + each block's 2 expert tables
    cut = {n for n in ranks[0]["splits"] if n.endswith("_q")}
    assert cut == ({n for n in tables if ".experts." in n} if "ep" in layout else set(tables))
    for got in ranks:
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5), layout
    whole = whole_params(ranks)
    assert whole.keys() == ref["params"].keys()
    for name in tables:  # the same bytes: the same dequantised base
        assert torch.equal(whole[name], ref["params"][name]), name
    worst = max((float((whole[n] - v).norm() / v.norm().clamp_min(1e-12)), n)
                for n, v in ref["params"].items() if is_adapter(n))
    assert worst[0] <= 1e-5, (layout, worst)


def test_checkpoint_resumes_at_stage_3(two_rank_runs):
    # two_rank_runs' world ran straight_and_resumed of _base at stage 3: 4 steps saving at 2,
    # then a resume from step 2
    straight, resumed = two_rank_runs[3]
    assert resumed["start"] == 2
    assert resumed["losses"] == straight["losses"][2:]
    for name, value in straight["params"].items():
        assert torch.equal(resumed["params"][name], value), name
    _inference_uses_the_dequantised_base(straight["run_dir"])


def _inference_uses_the_dequantised_base(run_dir: str) -> None:
    """generate / export load a QLoRA run (checkpoint/weights.py load_for_inference) as plain
    weights holding the dequantised values: the same logits as the quantised layers give."""
    from safetensors.torch import load_file

    from shardlm.checkpoint.weights import WEIGHTS, load_for_inference, resolve_run_dir
    from shardlm.models.decoder import build_model
    from shardlm.models.lora import DEFAULT_TARGETS, apply_lora
    from shardlm.models.quant import quantizable, quantize_base

    model, _, cfg = load_for_inference(run_dir, torch.device("cpu"))
    assert not any(n.endswith(".weight_q") for n, _ in model.named_parameters())
    quantized = build_model(cfg.model, "cpu", seed=0)
    apply_lora(quantized, cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.targets, cfg.model.mlp)
    quantize_base(quantized, cfg.lora.quantize, quantizable(quantized, DEFAULT_TARGETS[cfg.model.mlp].split(",")))
    quantized.load_state_dict(load_file(str(resolve_run_dir(run_dir) / WEIGHTS)))
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(idx), quantized(idx))


def test_a_checkpoint_of_the_old_one_string_qlora_layout_is_named_as_such(tmp_path):
    """A checkpoint saved before QLoRA stored whole rows (weight_q as one 1-D byte string) is
    refused with the layout named, not as 'a different model'."""
    from shardlm.checkpoint.manifest import CheckpointError
    from shardlm.checkpoint.reader import CheckpointReader

    manifest = {"tensors": {"param/blocks.0.attn.qkv.weight_q": {"shape": [6144], "slices": []}},
                "files": {}}
    reader = CheckpointReader(tmp_path, manifest)
    with pytest.raises(CheckpointError, match="one byte string .* whole rows"):
        reader.entry("param/blocks.0.attn.qkv.weight_q", (96, 64))
    with pytest.raises(CheckpointError, match="different model"):
        reader.entry("param/blocks.0.attn.qkv.weight_q", (6145,))


def test_both_dequantisation_paths_give_the_same_bits(monkeypatch):
    """NF4 in fp32 on the CPU: bitsandbytes' kernel (used where installed: faster) and the torch
    ops (used without it; in eager products into one reusable buffer, quant_format.product_weight)
    give identical values, the buffer reused from one weight to the next."""
    import shardlm.models.quant_format as qf

    shapes = [(64, 256), (96, 128), (32, 64)]  # whole blocks (the kernel's case), the largest first
    tables = [quantize(_weight(shape), "nf4") for shape in shapes]
    fmts = [QuantFormat("nf4", shape) for shape in shapes]
    assert qf._kernel_takes(fmts[0], torch.float32)
    by_kernel = [qf.product_weight(t, f, torch.float32).clone() for t, f in zip(tables, fmts)]
    monkeypatch.setattr(qf, "_BNB", False)  # as without bitsandbytes
    assert not qf._kernel_takes(fmts[0], torch.float32)
    by_torch = [qf.product_weight(t, f, torch.float32) for t, f in zip(tables, fmts)]
    assert by_torch[0].data_ptr() == by_torch[1].data_ptr()  # the one scratch buffer
    by_torch = [qf.product_weight(t, f, torch.float32).clone() for t, f in zip(tables, fmts)]
    assert all(torch.equal(a, b) for a, b in zip(by_kernel, by_torch))
    assert all(torch.equal(a, dequantize_torch(t, f, torch.float32)) for a, t, f in zip(by_kernel, tables, fmts))
