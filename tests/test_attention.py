"""Attention backends and document masking for packed rows (models/attention.py, data/packed.py).

The key claim: a row packing several examples gives each example exactly the losses it gets
alone — attention never crosses an example boundary and positions restart at 0 per example —
with every backend, under activation checkpointing, compiled blocks, and ZeRO-3 on 2 ranks.
CPU, fp32 throughout (each test pins it).
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_overrides
from memory_ledger import StorageLedger
from parity import assert_matches
from shardlm.config.load import load_config
from shardlm.data.loader import build_dataset
from shardlm.data.loader import _windows
from shardlm.data.sft import LOSS, START
from shardlm.errors import ConfigError
from shardlm.models.decoder import build_model
from shardlm.models.attention import attend, configure, prepare
from shardlm.data.packed import PackedTokens, positions_from_starts
from shardlm.parallel.blocks.activation import apply_ac
from shardlm.planner.activations import ActivationDtypes, block_activation
from shardlm.planner.shapes import preset_model
from shardlm.launch.spawn import run_ranks
from test_sft_data import CHATS, SEQ, _build, _write
from zero_cases import reference_case, train_cases

LENGTHS = (7, 12, 9)  # three examples packed into one row of 32 tokens (4 of padding)
ROW = 32


def _model(preset: str, attention: str = "auto") -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(dataclasses.replace(preset_model(preset), attention=attention)).float()


def _examples(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (1, n), generator=g) for n in LENGTHS]


def _packed(examples: list[torch.Tensor], vocab: int) -> PackedTokens:
    pad = ROW - sum(e.shape[1] for e in examples)
    row = torch.cat([*examples, torch.full((1, pad), vocab - 1)], dim=1)  # (1, ROW)
    starts = torch.zeros(1, ROW, dtype=torch.bool)
    starts[0, np.cumsum([0, *LENGTHS])] = True  # each example, and the padding, a document
    return PackedTokens(row, positions_from_starts(starts))


def _token_losses(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each next-token prediction inside one example: (T - 1,)."""
    return F.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="none")


@pytest.mark.parametrize("preset", ["gpt-tiny", "llama-tiny"])  # learned positions / RoPE + GQA
@pytest.mark.parametrize("attention", ["auto", "sdpa", "per_document", "math"])
def test_packed_row_gives_each_example_its_own_losses(preset, attention):
    model = _model(preset, attention)
    examples = _examples(model.cfg.vocab_size)
    packed = _packed(examples, model.cfg.vocab_size)
    logits = model(packed)  # (1, ROW, V)
    plain = model(packed.ids)  # the same row without document masking
    at = 0
    for i, ids in enumerate(examples):
        n = ids.shape[1]
        alone = _token_losses(model(ids), ids)
        together = _token_losses(logits[:, at:at + n], ids)
        assert torch.allclose(together, alone, atol=1e-6, rtol=0), (i, (together - alone).abs().max())
        if i:  # the test can fail: unmasked, a later example sees the earlier ones
            assert (_token_losses(plain[:, at:at + n], ids) - alone).abs().max() > 1e-3
        at += n


@pytest.mark.parametrize("preset", ["gpt-tiny", "llama-tiny"])
def test_positions_restart_at_each_document(preset):
    """An example at offset k of a row gives the logits it gives at offset 0, alone."""
    model = _model(preset, "sdpa")
    vocab = model.cfg.vocab_size
    example = torch.randint(0, vocab, (1, 10), generator=torch.Generator().manual_seed(2))
    alone = model(example)
    for k in (1, 5, 17):
        row = torch.cat([torch.randint(0, vocab, (1, k)), example], dim=1)
        starts = torch.zeros_like(row, dtype=torch.bool)
        starts[0, k] = True
        packed = PackedTokens(row, positions_from_starts(starts))
        assert packed.positions[0, k:].tolist() == list(range(10))
        assert torch.allclose(model(packed)[:, k:], alone, atol=1e-6, rtol=0), k


def _qkv(heads: int, kv_heads: int, requires_grad: bool = True):
    g = torch.Generator().manual_seed(3)
    shapes = [(2, heads, 24, 8), (2, kv_heads, 24, 8), (2, kv_heads, 24, 8)]
    return [torch.randn(s, generator=g, dtype=torch.float32).requires_grad_(requires_grad) for s in shapes]


def _positions() -> torch.Tensor:
    starts = torch.zeros(2, 24, dtype=torch.bool)
    starts[0, [5, 6, 15]] = True  # documents of 5, 1, 9 and 9 tokens; row 1: one document
    return positions_from_starts(starts)


@pytest.mark.parametrize("kv_heads", [4, 2, "2 repeated"])  # multi-head, grouped-query (CUDA's way)
@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("backend", ["sdpa", "per_document"])
def test_backends_equal_math_with_gradients(backend, documents, kv_heads, monkeypatch):
    """'2 repeated': the kv heads repeated to the query heads before SDPA, as on CUDA where its
    fused kernel would not broadcast them (attention.kernel_takes_grouped_kv)."""
    if kv_heads == "2 repeated":
        from shardlm.models import attention

        monkeypatch.setattr(attention, "kernel_takes_grouped_kv", lambda *a: False)
        kv_heads = 2
    positions = _positions() if documents else None
    outs = {}
    for name in ("math", backend):
        q, k, v = _qkv(4, kv_heads)
        mask = prepare(name, positions, 24, q.device, torch.float32)
        out = attend(q, k, v, mask)
        out.backward(torch.ones_like(out))
        outs[name] = [out.detach(), q.grad, k.grad, v.grad]
    for got, ref in zip(outs[backend], outs["math"]):
        assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5), (got - ref).abs().max()


@pytest.mark.parametrize("length", [64, 512])
def test_short_half_precision_attention_runs_in_fp32_on_the_cpu(length):
    """bf16 SDPA of at most CPU_HALF_IN_FP32_MAX_LEN positions, when it will be differentiated,
    is the fp32 kernel's output cast back, under autocast too (which would cast the inputs down again); gradients reach q, k, v
    in bf16. Longer: the half kernel, as torch runs it. Bit for bit: the same kernel on the same
    inputs in one process, either way."""
    from shardlm.models.attention import sdpa
    from shardlm.models.flops import CPU_HALF_IN_FP32_MAX_LEN

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, length, 16, generator=gen).bfloat16().requires_grad_()
               for h in (4, 2, 2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = sdpa(q, k, v, True, is_causal=True)
    short = length <= CPU_HALF_IN_FP32_MAX_LEN
    a, b, c = (t.detach().float() if short else t.detach() for t in (q, k, v))
    expect = F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True).bfloat16()
    assert out.dtype == torch.bfloat16 and torch.equal(out, expect)
    out.sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.bfloat16 for t in (q, k, v))
    with torch.no_grad():  # no backward to pay for: the half kernel, as torch runs it
        half = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        assert torch.equal(sdpa(q, k, v, True, is_causal=True), half)


def test_which_sdpa_calls_broadcast_grouped_kv_heads():
    """CUDA's flash attention broadcasts grouped kv heads (bf16 / fp16, no mask); its
    memory-efficient and cuDNN kernels do not, so fp32 or masked calls repeat the heads rather
    than fall to SDPA's math kernel (measured on an H200); the CPU's kernels broadcast them."""
    from shardlm.models.attention import kernel_takes_grouped_kv as takes

    assert takes("cuda", torch.bfloat16, False) and takes("cuda", torch.float16, False)
    assert not takes("cuda", torch.float32, False) and not takes("cuda", torch.bfloat16, True)
    assert all(takes("cpu", dtype, masked) for dtype in (torch.float32, torch.bfloat16) for masked in (False, True))


@pytest.mark.parametrize("documents", [False, True])
def test_flex_forward_equals_math(documents):
    """Our block mask for FlexAttention, forward only (torch 2.13 has no CPU backward for it):
    torch's eager flex_attention (its reference implementation, the same maths as the compiled
    kernel) with our BlockMask equals our math path; and the compiled kernel, what
    attend() runs, equals it too at head_dim 32. Not at 8 or 16: torch 2.13's compiled CPU flex
    kernel is wrong there on an AVX2-only CPU (AMD EPYC Zen 3: off by up to 1.8, or NaN; right
    at 32 and 64) — CPU training refuses 'flex' anyway (config rules), CUDA compiles another
    kernel (tests/test_cuda.py)."""
    from torch.nn.attention.flex_attention import flex_attention

    positions = _positions() if documents else None
    q, k, v = _qkv(4, 2, requires_grad=False)
    ref = attend(q, k, v, prepare("math", positions, 24, q.device, torch.float32))
    mask = prepare("flex", positions, 24, q.device, torch.float32)
    eager = flex_attention(q, k, v, block_mask=mask.data, enable_gqa=True)
    assert torch.allclose(eager, ref, atol=1e-5, rtol=1e-5), (eager - ref).abs().max()
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, h, 24, 32, generator=g) for h in (4, 2, 2))
    ref = attend(q, k, v, prepare("math", positions, 24, q.device, torch.float32))
    got = attend(q, k, v, mask)
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5), (got - ref).abs().max()


def test_loader_positions_text_and_packed_rows():
    seq, eot = 8, 0
    # text windows: a document starts after each end-of-text token (and at the window's start)
    stream = np.array([5, 6, 0, 7, 8, 9, 0, 0, 3], dtype=np.uint16)
    x, y = _windows(stream, np.array([0]), seq, document_end=eot)
    assert x.positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]
    assert y.tolist() == [stream[1:].tolist()]
    # packed SFT rows: the packer's START bits, not the end token (which ends every chat turn)
    tokens = np.array([4, 0, 5, 0, 6, 7, 0, 0, 0], dtype=np.uint16)  # 2 examples, 1 padding
    mask = np.array([START, LOSS, LOSS, LOSS, START, LOSS, LOSS, START, 0], dtype=np.uint8)
    x, y = _windows(tokens, np.array([0]), seq, mask, document_end=eot)
    assert x.positions.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0]]
    assert y.tolist() == [[0, 5, 0, -100, 7, 0, -100, -100]]


def test_chat_rows_restart_positions_at_examples_not_turns(tmp_path):
    ds = _build(tmp_path, "chat", CHATS, repeat=3)
    tokens = np.concatenate([ds.train, ds.val])
    mask = np.concatenate([ds.train_mask, ds.val_mask])
    x, _ = _windows(tokens, np.arange(len(tokens) // (SEQ + 1)), SEQ, mask, document_end=ds.eot_id)
    ids, positions = x.ids, x.positions
    assert (positions == 0).sum() < (ids == ds.eot_id).sum()  # <end> closes every turn
    examples = 0
    for r, c in (positions == 0).nonzero().tolist():
        if (ids[r, c:] == ds.eot_id).all():  # the row's padding: a document of its own
            continue
        examples += 1
        text = ds.tokenizer.decode(ids[r, c:c + 4].tolist(), skip_special_tokens=False)
        assert text.startswith("<|"), text  # a role header: where an example begins
    assert examples == ds.meta["n_examples"]


def test_refused_compositions_say_why():
    def errors(**overrides) -> str:
        with pytest.raises(ConfigError) as err:
            load_config(overrides=overrides).validate()
        return str(err.value)

    assert "the ring runs its own per-block kernel" in errors(**{"model.attention": "math", "parallel.cp": 2})
    # context parallelism keeps the whole sequence's document positions (tests/test_context_parallel.py)
    load_config(overrides={"data.document_mask": "on", "parallel.cp": 2}).validate()
    # tensor parallelism keeps whole sequences: the mask rides along (bench/compose.py tp+doc_mask)
    load_config(overrides={"data.document_mask": "on", "parallel.tp": 2}).validate()
    assert "cannot be one graph" in errors(**{"model.attention": "per_document", "train.compile": "true"})
    assert "choose one of" in errors(**{"model.attention": "flash"})
    load_config(overrides={"data.document_mask": "on", "parallel.pp": 2, "model.n_layers": 4}).validate()
    model = _model("gpt-tiny")
    with pytest.raises(ConfigError, match="no CPU backward"):
        configure(model, "flex", torch.device("cpu"), documents=True, compiled=False)
    with pytest.raises(ConfigError, match="data.document_mask = 'off'"):
        configure(torch.nn.Linear(2, 2), "auto", torch.device("cpu"), documents=True, compiled=False)
    assert "'per_document'" in configure(model, "auto", torch.device("cpu"), documents=True, compiled=False)
    assert "'sdpa'" in configure(model, "auto", torch.device("cpu"), documents=True, compiled=True)


def _loss_and_grads(model, packed) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    logits = model(packed)
    loss = F.cross_entropy(logits[0, :-1], packed.ids[0, 1:])
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_carries_the_mask(mode):
    model = _model("llama-tiny", "per_document")
    packed = _packed(_examples(model.cfg.vocab_size), model.cfg.vocab_size)
    ref_loss, ref_grads = _loss_and_grads(model, packed)
    checkpointed = apply_ac(copy.deepcopy(model), mode)
    loss, grads = _loss_and_grads(checkpointed, packed)
    assert torch.equal(loss, ref_loss)
    assert all(torch.allclose(a, b, atol=1e-7, rtol=1e-6) for a, b in zip(grads, ref_grads))


def test_compiled_blocks_carry_the_mask():
    from shardlm.parallel.blocks.compile import apply_compile

    model = _model("gpt-tiny", "sdpa")  # what 'auto' runs when the blocks are compiled
    packed = _packed(_examples(model.cfg.vocab_size), model.cfg.vocab_size)
    ref_loss, ref_grads = _loss_and_grads(model, packed)
    compiled = apply_compile(copy.deepcopy(model), True)  # fullgraph: a graph break fails here
    loss, grads = _loss_and_grads(compiled, packed)
    assert torch.allclose(loss, ref_loss, atol=1e-6, rtol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6, rtol=1e-5) for a, b in zip(grads, ref_grads))


def test_zero3_two_ranks_match_one_process_on_packed_chat(tmp_path):
    """ZeRO-3's gather hooks and full activation checkpointing's recomputation around blocks
    that take the document mask: 2 ranks equal one process within 1e-5."""
    src = _write(tmp_path / "chat.jsonl", CHATS, repeat=12)
    overrides = tiny_overrides(tmp_path, model__preset="llama-tiny", data__source=str(src),
                               data__format="chat", data__max_bytes=0, data__val_fraction=0.2,
                               data__cache_dir=str(tmp_path / "cache"), train__seq_len=64,
                               train__micro_batch=2, train__steps=3, model__vocab_size=300,
                               **{"parallel.zero_stage": 3, "activation.checkpoint": "full"})
    (two, _) = run_ranks(train_cases, 2, tmp_path, [(overrides, 3, -1)])
    ref = reference_case(overrides, 2, 3)
    assert_matches(two[0]["losses"], two[0]["params"], ref, "zero-3 packed chat", tol=1e-5)
    # the rows do pack several examples, and masking them changes the run (the test can fail)
    data = load_config(overrides=overrides).data
    ds = build_dataset(data, 300, seq_len=64)
    starts = (np.asarray(ds.train_mask).reshape(-1, 65) & START).astype(bool).sum(axis=1)
    assert (starts >= 3).sum() >= 5, starts  # rows of two examples and their padding, or more
    unmasked = reference_case({**overrides, "data.document_mask": "off"}, 2, 3)
    assert abs(unmasked["losses"][-1] - ref["losses"][-1]) > 1e-4


# -- the planner's activation formula per backend, against what autograd keeps ----------------


@pytest.mark.parametrize("mode", ["none", "selective"])
@pytest.mark.parametrize("attention", ["sdpa", "per_document", "math"])
@pytest.mark.parametrize("shape", [{"preset": "gpt-tiny"}, {"preset": "llama-tiny"},
                                   {"preset": "gpt-tiny", "n_kv_heads": 1}])  # MHA, RoPE+GQA, GQA
def test_activation_formula_per_backend_at_two_lengths(attention, shape, mode):
    """One block's saved bytes (fp32, b = 2) at s = 32 and 64 equal block_activation's, which
    charges the s² probabilities to 'math' only (the mask, built once per forward, is not a
    block's)."""
    fields = {k: v for k, v in shape.items() if k != "preset"}
    cfg = dataclasses.replace(preset_model(shape["preset"]), attention=attention, **fields)
    torch.manual_seed(0)
    model = apply_ac(build_model(cfg).float(), mode)
    b = 2
    for s in (32, 64):
        x0 = torch.randn(b, s, cfg.d_model, dtype=torch.float32, requires_grad=True)
        rope = (model.rope_cos[:s], model.rope_sin[:s]) if cfg.position == "rope" else None
        mask = model._attention_mask(None, s, x0)
        with StorageLedger(exclude=(*model.parameters(), *model.buffers(), x0)) as ledger:
            y = model.blocks[0](x0, rope) if mask is None else model.blocks[0](x0, rope, mask=mask)
        # saved for backward, but for the block's output; + the block input x0 (made outside)
        measured = ledger.live_bytes() - y.untyped_storage().nbytes() + 4 * cfg.d_model * b * s
        formula, _ = block_activation(cfg, ActivationDtypes(4, 4, False), mode, seq=s)
        assert measured == pytest.approx(formula * b * s, abs=64), (s, measured / (b * s), formula)
        del y


@pytest.mark.parametrize("attention", ["sdpa", "math"])
def test_peak_of_forward_and_backward_is_the_formula_at_two_lengths(attention):
    """The whole forward + loss + backward (fp32, b = 1): planner.activations.activation_peak bounds
    the measured peak from above by at most 15% at s = 128 and 512; 'math' grows with s²."""
    from shardlm.config.model import ModelConfig
    from shardlm.planner.activations import activation_peak
    from memory_ledger import decoder_peak_bytes

    cfg = ModelConfig(vocab_size=512, n_layers=2, n_heads=4, d_model=64, max_seq_len=512, attention=attention)
    torch.manual_seed(0)
    model = build_model(cfg).float()
    peaks = []
    for s in (128, 512):
        measured = decoder_peak_bytes(model, 1, s)
        predicted = activation_peak(cfg, s, 1, cfg.n_layers, 1, ActivationDtypes(4, 4, False), "none", 1,
                                    False, True, (0, 1, 1.0)).bytes
        assert measured <= predicted <= 1.15 * measured, (s, measured, predicted)
        peaks.append(measured)
    assert (peaks[1] / peaks[0] > 6) == (attention == "math"), peaks  # 4x tokens; s² on top for math
