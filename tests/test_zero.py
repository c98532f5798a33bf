"""The ZeRO engine against single-process training, on real gloo ranks.

Reference: the same config in one process (the plain local strategy: fp32 parameters, torch's
fused AdamW), the same global batch (micro_batch × grad_accum × ranks), the same per-process
thread count (zero_cases.reference_case).

Tolerances, measured and stated:
- fp32, 2 ranks, no accumulation: bitwise — each rank's backward computes exactly one
  micro-batch of the reference at the same thread count, and a sum of two gradients does not
  depend on order. For llama-tiny at every stage, with train.grad_clip = 0 (see
  test_two_ranks_fp32_bitwise_llama); for gpt-tiny at stage 0. Fused AdamW runs over this rank's
  segments (runs of parameters back to back) where the reference runs it per tensor; its
  vector loop and its scalar tail round differently (FMA or not: exp_avg_sq's last bit,
  measured on AVX2), so this holds because every parameter of these presets is a multiple of
  64 elements: every tensor, segment and shard starts and ends on a multiple of 16 floats (the
  widest vector, AVX-512), no element falls in a tail on either side (asserted below).
- sharded (stages 1-3), the global gradient norm is summed from per-shard partial norms and can
  differ from torch's clip_grad_norm_ in the last bits (a sum of squares over ~1.4e5 fp32
  terms in another order; the norm a few eps = 1.2e-7 relative); with clipping active that
  coefficient scales every gradient alike, and AdamW's update m / (√v + eps) does not see a
  common scale (|g| ≫ eps = 1e-8) beyond its own rounding: the updates differ by an ulp or so,
  ~1e-10 per step at lr 1e-3. For gpt-tiny that is ≤ 1e-6 relative everywhere but the attention *key*
  bias: its gradient is zero in exact arithmetic (softmax ignores a shift shared by a whole
  row), so what Adam sees there is rounding noise, normalised into full-size steps — any ulp
  changes it. It is left out, and said so.
- more addends (accumulation, 4 ranks) change the summation order: ≤ 1e-6 relative.
- bf16: the engine keeps bf16 parameters and gradients with an fp32 master (what the ZeRO
  formulas assume), the reference fp32 parameters under autocast: loss ≤ 2e-3 absolute,
  parameters ≤ 2e-2 relative after 5 steps.
"""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_overrides
from shardlm.launch.spawn import run_ranks
from shardlm.parallel.data.zero.partition import comm_bytes_per_step, model_state_bytes
from zero_cases import reference_case, train_cases

STEPS = 5


def _base(tmp_path, preset="llama-tiny", **extra):
    return tiny_overrides(tmp_path, model__preset=preset, train__micro_batch=4, **extra)


def _reference(overrides: dict, world: int, grad_accum: int) -> dict:
    return reference_case({**overrides, "train.grad_accum": grad_accum}, world, STEPS)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _key_bias_free(name: str, t: torch.Tensor, d_model: int) -> torch.Tensor:
    if name.endswith("attn.qkv.bias"):  # [q | k | v]: drop k (see module docstring)
        return torch.cat([t[:d_model], t[2 * d_model:]])
    return t


def _fp16_overflow(tmp) -> dict:
    """ZeRO-2 in fp16 at a loss scale of 1024; trained with rank 1's first gradients poisoned."""
    return {**_base(tmp), "parallel.zero_stage": 2, "precision.compute": "fp16",
            "precision.loss_scale_init": 1024.0}


# The bitwise llama-tiny cases clip nothing. Sharded (stages 1-3), the global gradient norm is
# the shards' squares summed over the group: the same number as the reference's per-tensor
# norms, summed in another partition and order, so its last bits can differ, and where the
# norm exceeds train.grad_clip its coefficient scales every gradient (the cause of test_muon's
# failure on AMD EPYC). llama-tiny's norm stays at 0.73-0.85 under the default grad_clip = 1 in
# these 5 steps (measured), so the coefficient is exactly 1 on both sides already; grad_clip = 0
# makes that hold by construction (no multiplication on either side) instead of by the data.
# Clipping across shards is tested on gpt-tiny, whose norm (1.03-1.37) does cross it.
NO_CLIP = {"llama-tiny": {"train__grad_clip": 0.0}, "gpt-tiny": {}}


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero2")
    cases = []
    for preset in ("llama-tiny", "gpt-tiny"):
        for stage in range(4):
            cases.append(({**_base(tmp, preset, **NO_CLIP[preset]), "parallel.zero_stage": stage}, STEPS, -1))
    for stage in (2, 3):  # gradient accumulation: no communication on the inner micro-step
        cases.append(({**_base(tmp), "parallel.zero_stage": stage, "train.grad_accum": 2}, STEPS, -1))
    for stage in range(4):
        cases.append(({**_base(tmp), "parallel.zero_stage": stage, "precision.compute": "bf16"},
                      STEPS, -1))
    cases.append(({**_base(tmp, **NO_CLIP["llama-tiny"]), "parallel.zero_stage": 3, "activation.checkpoint": "full"},
                  STEPS, -1))
    cases.append(({**_base(tmp), "parallel.zero_stage": 2, "precision.compute": "bf16",
                   "precision.master": "bf16"}, STEPS, -1))
    cases.append((_fp16_overflow(tmp), 3, 1))  # last: test_fp16_overflow_on_one_rank_skips_everywhere
    out = run_ranks(train_cases, 2, tmp, cases)
    refs = {
        "llama-tiny": _reference(_base(tmp, **NO_CLIP["llama-tiny"]), 2, 1),
        "gpt-tiny": _reference(_base(tmp, "gpt-tiny"), 2, 1),
        "accum": _reference(_base(tmp), 2, 2),
        "bf16": _reference({**_base(tmp), "precision.compute": "bf16"}, 2, 1),
    }
    return out, refs


@pytest.mark.parametrize("stage", range(4))
def test_two_ranks_fp32_bitwise_llama(two_rank_runs, stage):
    """Bitwise by construction (module docstring): the same backward per micro-batch, a sum of
    two, no clipping, and fused AdamW over the same vector / tail split of every element."""
    (rank0, rank1), refs = two_rank_runs
    ref, got = refs["llama-tiny"], rank0[stage]
    # no AdamW tail (docstring): each tensor a multiple of 32 floats, so each unit's half too
    assert all(v.numel() % 32 == 0 for v in ref["params"].values())
    assert got["losses"] == ref["losses"]
    for name, value in ref["params"].items():
        assert torch.equal(got["params"][name], value), name
        assert torch.equal(rank1[stage]["params"][name], value), name  # ranks agree


@pytest.mark.parametrize("stage", range(4))
def test_two_ranks_fp32_gpt(two_rank_runs, stage):
    (rank0, _), refs = two_rank_runs
    ref, got = refs["gpt-tiny"], rank0[4 + stage]
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-6)
    if stage == 0:  # whole gradients on every rank: the same per-tensor norms and clip coefficient
        assert all(torch.equal(got["params"][n], v) for n, v in ref["params"].items())
    for name, value in ref["params"].items():
        a, b = (_key_bias_free(name, t, 64) for t in (got["params"][name], value))
        assert _rel(a, b) <= 1e-6, name


@pytest.mark.parametrize("case, stage", [(8, 2), (9, 3)])
def test_gradient_accumulation(two_rank_runs, case, stage):
    (rank0, _), refs = two_rank_runs
    ref, got = refs["accum"], rank0[case]
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-6)
    assert max(_rel(got["params"][n], v) for n, v in ref["params"].items()) <= 1e-6
    psi = got["padded"]  # gathers repeat per micro-step at stage 3; nothing else does
    assert got["comm"][-1] == comm_bytes_per_step(psi, stage, 4, 4, micro_steps=2)


@pytest.mark.parametrize("stage", range(4))
def test_two_ranks_bf16_within_tolerance(two_rank_runs, stage):
    (rank0, _), refs = two_rank_runs
    ref, got = refs["bf16"], rank0[10 + stage]
    assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"])) <= 2e-3
    assert max(_rel(got["params"][n], v) for n, v in ref["params"].items()) <= 2e-2


@pytest.mark.parametrize("stage", range(4))
def test_model_state_bytes_match_zero_formula(two_rank_runs, stage):
    """bf16 parameters and gradients, fp32 master + Adam moments: the ZeRO paper's K = 12."""
    (rank0, _), _ = two_rank_runs
    got = rank0[10 + stage]
    exact = model_state_bytes(got["padded"], 2, stage, 2, 2, 12)  # with padding, exact
    optimizer_padding = 12 * (got["padded"] - got["numel"]) // 2 if stage else 0
    assert got["state"]["params"] == exact["params"]
    assert got["state"]["grads"] == exact["grads"]
    assert abs(got["state"]["optimizer"] - exact["optimizer"]) <= optimizer_padding
    paper = sum(model_state_bytes(got["numel"], 2, stage, 2, 2, 12).values())
    assert abs(sum(got["state"].values()) - paper) <= 0.02 * paper  # 16Ψ, 4Ψ+12Ψ/N, ...


@pytest.mark.parametrize("stage", range(4))
def test_comm_bytes_match_zero_formula(two_rank_runs, stage):
    (rank0, _), _ = two_rank_runs
    got = rank0[10 + stage]
    assert got["comm"][-1] == comm_bytes_per_step(got["padded"], stage, 2, 2)
    paper = comm_bytes_per_step(got["numel"], stage, 2, 2)  # 2Ψ stages 0-2, 3Ψ stage 3
    assert abs(got["comm"][-1] - paper) <= 0.02 * paper


def test_stage3_with_activation_checkpointing_is_bitwise(two_rank_runs):
    """Recomputation inside backward re-runs a unit's forward while it is gathered; the
    stage-3 hooks must neither free it then nor change a bit (bitwise for the reasons of
    test_two_ranks_fp32_bitwise_llama: no clipping, no AdamW tail, the same kernels)."""
    (rank0, _), refs = two_rank_runs
    got, ref = rank0[14], refs["llama-tiny"]
    assert got["losses"] == ref["losses"]
    assert all(torch.equal(got["params"][n], v) for n, v in ref["params"].items())


def test_pure_bf16_master(two_rank_runs):
    """FSDP's "pure bf16": no fp32 master, Adam moments in bf16 — K = 4 bytes per parameter."""
    (rank0, _), refs = two_rank_runs
    got = rank0[15]
    exact = model_state_bytes(got["padded"], 2, 2, 2, 2, 4)
    assert got["state"]["params"] == exact["params"] and got["state"]["grads"] == exact["grads"]
    assert abs(got["state"]["optimizer"] - exact["optimizer"]) <= 4 * (got["padded"] - got["numel"])
    assert max(abs(a - b) for a, b in zip(got["losses"], refs["bf16"]["losses"])) <= 2e-2


def test_fp16_overflow_on_one_rank_skips_everywhere(two_rank_runs):
    (rank0, rank1), _ = two_rank_runs
    r0, r1 = rank0[-1], rank1[-1]  # _fp16_overflow, 3 steps, rank 1 poisoned in the first
    assert r0["stepped"] == r1["stepped"] == [False, True, True]
    assert r0["scale"][0] == r1["scale"][0] == 512.0
    for name in r0["params"]:
        assert torch.equal(r0["params"][name], r1["params"][name])


def test_four_ranks_stage3_and_hybrid(tmp_path):
    cases = [({**_base(tmp_path), "parallel.zero_stage": 3}, STEPS, -1)]
    for stage in (1, 2, 3):
        cases.append(({**_base(tmp_path), "parallel.zero_stage": stage,
                       "parallel.dp_replicate": 2, "parallel.dp_shard": 2}, STEPS, -1))
    out = run_ranks(train_cases, 4, tmp_path, cases)
    ref = _reference(_base(tmp_path), 4, 1)
    for index, got in enumerate(out[0]):
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-6), index
        assert max(_rel(got["params"][n], v) for n, v in ref["params"].items()) <= 1e-6, index
    hybrid = out[0][3]  # stage 3 sharded over 2, replicated over 2
    assert hybrid["state"]["params"] * 2 == hybrid["padded"] * 4
    assert hybrid["comm"][-1] == comm_bytes_per_step(hybrid["padded"], 3, 4, 4, shard_world=2,
                                                     dp_replicate=2)
