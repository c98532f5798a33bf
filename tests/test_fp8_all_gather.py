"""precision.fp8_all_gather (parallel/data/zero/fp8_gather.py): ZeRO-3 gathers the FP8 linears' weights in E4M3.

What is held, and why it can be exact:
- Bitwise against the same run without it (ZeRO-3 on 2 ranks, fp8 emulated, bf16 shards, fp32
  master): with tensorwise scaling the scale is E4M3.max / amax of the whole weight, and the
  amax of the shards' amaxes (all-reduce max) is that amax exactly; rounding x * scale is
  element by element, so each rank rounding its shard gives the bits of rounding the gathered
  weight. Both round the same bf16 values (the shard as stored: the fp32 master rounded to bf16,
  then to E4M3 — a double rounding, in both runs alike): losses, fp8 overflow / underflow
  figures, parameters and an evaluation are equal, bit for bit. The option makes the weights a
  unit of their own, so the shards and fused AdamW's segments are cut elsewhere; AdamW's vector
  loop and scalar tail round differently (FMA), but at d_model 32 every parameter and every
  unit's shard, with or without the option, is a multiple of 16 floats (AVX-512's vector), so
  no element is in a tail on either side; a sum of two ranks' gradients has no order.
  Gradient clipping is off in this comparison (train.grad_clip = 0): the weights form a unit of
  their own, so each rank holds other slices of the gradient, and the gradient norm's per-rank
  partial norms (in the bf16 reduce dtype) round differently (0.2% here); where clipping acts,
  its coefficient then differs. The norm is held to 1e-2.
- Against one process (ZeRO-3 on one rank without the option, the ranks' micro-batches as its
  accumulation steps): bench/compose.py's fp8 tolerance, 5e-2 relative; the first step's loss
  and fp8 figures equal.
- The ledger: per step, two gathers (forward, backward) of every unit; the [fp8] units at 1
  byte per element, so the all-gather bytes are the bf16 gather's less 2 x the FP8 weights'
  elements; one all_reduce(max) of 4 bytes per weight per unit and forward (counted 2x); the
  reduce-scatter unchanged. The planner's ZeRO-3 all-gather bytes are the ledger's.
"""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_overrides
from fp8_gather_cases import gather_case, gather_cases
from parity import assert_matches, rel
from shardlm.config.load import load_config
from shardlm.errors import ConfigError
from shardlm.hardware.catalog import parse_cluster
from shardlm.launch.spawn import run_ranks
from shardlm.models.fp8 import E4M3, EPS, amax, dequantise, quantise, round_to_fp8
from shardlm.planner.search import config_strategy
from shardlm.planner.timing import estimate_time

STEPS = 3
ONE_PROCESS_TOLERANCE = 5e-2
"""bench/compose.py's fp8 tolerance (TOLERANCE['fp8']): relative, losses and parameters."""


def _overrides(tmp_path, **extra) -> dict:
    return {**tiny_overrides(tmp_path, model__d_model=32, model__n_heads=2, train__seq_len=16,
                             train__micro_batch=8, precision__compute="fp8", train__lr=3e-3,
                             train__steps=STEPS, train__grad_clip=0.0, parallel__zero_stage=3),
            "precision.fp8_emulate": True, **{k.replace("__", "."): v for k, v in extra.items()}}


GATHER = {"precision.fp8_all_gather": True}
RECOMPUTED = {"activation.checkpoint": "full", "train.grad_accum": 2, "train.micro_batch": 4}
"""Recomputed forwards inside backward and two micro-steps (2 steps): the backward gathers
reuse the forward's scales, each micro-step's forward gathers again."""


TP = {"parallel.tp": 2}
"""Both ranks one tp group (ZeRO-3 over a shard group of one): each weight a tp piece."""
LORA = {"lora.rank": 4}
"""LoRA's frozen base gathered in E4M3 (the "[fp8 frozen]" units), the adapters in bf16."""
COMPILED = {"train.compile": True}
"""Each block compiled (2 steps): its layers read the gathered bytes as graph inputs."""


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One spawn: without and with fp8_all_gather, plain, RECOMPUTED, TP, LORA and COMPILED."""
    tmp_path = tmp_path_factory.mktemp("fp8_gather")
    plain, recomputed = _overrides(tmp_path), _overrides(tmp_path, **RECOMPUTED)
    cases = [(plain, STEPS), ({**plain, **GATHER}, STEPS), (recomputed, 2), ({**recomputed, **GATHER}, 2)]
    cases += [(case, STEPS) for extra in (TP, LORA) for case in ({**plain, **extra}, {**plain, **extra, **GATHER})]
    cases += [({**plain, **COMPILED}, 2), ({**plain, **COMPILED, **GATHER}, 2)]
    return plain, run_ranks(gather_cases, 2, tmp_path, cases)


def test_pieces_rounded_at_the_whole_amax_are_the_whole_weight_rounded():
    """The invariant the gather rests on, without processes: cut a weight anywhere (a shard
    boundary inside it), scale every piece by the max of the pieces' amaxes, round each alone,
    and the pieces are the bits (and the counts) of rounding the whole weight."""
    torch.manual_seed(0)
    weight = (torch.randn(48, 40) * torch.logspace(-6, 1, 40)).bfloat16()  # (out, in): some underflow
    whole, whole_counts = quantise(weight, E4M3, E4M3.max / amax(weight, None).clamp_min(EPS))
    flat = weight.reshape(-1)
    pieces = [flat[:700], flat[700:1333], flat[1333:]]  # (n,) each: three ranks' shards of it
    scale = E4M3.max / torch.stack([p.abs().amax().float() for p in pieces]).amax().clamp_min(EPS)
    rounded = [round_to_fp8(p, E4M3, scale) for p in pieces]
    assert torch.equal(dequantise(torch.cat([q for q, _ in rounded]), scale).view_as(whole), whole)
    assert torch.equal(sum(c for _, c in rounded), whole_counts) and whole_counts[1] > 0


@pytest.mark.parametrize("pair", [0, 1, 2, 3, 4], ids=["plain", "recomputed+accumulated", "tp", "lora", "compiled"])
def test_the_fp8_gather_holds_the_bits_of_the_bf16_gather(two_ranks, pair):
    """tp: the weights' amaxes are reduced over the shard group, then over the tp group (each
    weight a piece of one process's): the max the tp layer's own quantiser takes when it rounds
    its piece itself, so the same scale and bits. LoRA: the frozen base, rounded at its whole
    amax on each rank, is the bits the base's quantiser rounds itself; its adapters' unit is the
    same with and without the option, so AdamW steps the same segments. Compiled: the same
    Inductor code on both sides, the gathered weight's E4M3 values (dequantised in the graph)
    equal to those the layer rounds itself in it (the [fp8] unit's bf16 buffer is not gathered
    in training: the graph reads the E4M3 bytes)."""
    _, (rank0, rank1) = two_ranks
    off, on = rank0[2 * pair], rank0[2 * pair + 1]
    assert on["losses"] == off["losses"] and on["records"] == off["records"] and on["eval"] == off["eval"]
    assert on["records"][0]["fp8_underflow_by_tensor"]["weight"] > 0  # the weights' counts are there
    assert all(torch.equal(on["params"][n], v) for n, v in off["params"].items())
    for theirs in ([rank1[2 * pair], rank1[2 * pair + 1]] if pair == 2 else [rank1[2 * pair + 1]]):
        # rank 1's own tp pieces (under tp full_parameters is this rank's pieces), or the whole model
        assert all(torch.equal(theirs["params"][n], v) for n, v in rank1[2 * pair + 1]["params"].items())
        assert pair == 2 or all(torch.equal(theirs["params"][n], v) for n, v in on["params"].items())
    assert on["norms"] == pytest.approx(off["norms"], rel=1e-2)  # partial norms in bf16 (module doc)
    fp8_units = [name for name, _, _, fp8 in on["units"] if fp8]
    assert fp8_units == [f"blocks.{i}[fp8 frozen]" if pair == 3 else f"blocks.{i}[fp8]" for i in (0, 1)]


def test_two_ranks_match_one_process(two_ranks, monkeypatch):
    plain, (rank0, _) = two_ranks
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # one rank's thread count (zero_cases.reference_case)
    ref = gather_case({**plain, "train.grad_accum": 2}, STEPS)
    got = rank0[1]
    assert got["losses"][0] == ref["losses"][0] and got["records"][0] == ref["records"][0]
    assert_matches(got["losses"], got["params"], ref, "fp8 all-gather", tol=ONE_PROCESS_TOLERANCE,
                   d_model=32, lr=3e-3)
    assert rel(torch.tensor(got["norms"]), torch.tensor(ref["norms"])) <= ONE_PROCESS_TOLERANCE


@pytest.mark.parametrize("pair", [2, 3], ids=["tp", "lora"])
def test_tp_and_lora_match_one_process(two_ranks, monkeypatch, pair):
    """With fp8_all_gather against one process without it (ZeRO-3 on one rank, tp = 1; for LoRA
    the data-parallel ranks' micro-batches as its accumulation steps): bench/compose.py's fp8
    tolerance, 5e-2 relative, as the plain case (the same derivation: fp8's emulated rounding of
    sums taken in another order). tp's ranks see the same batch: one micro-batch; each holds
    its tp pieces of the parameters, so for tp the losses and gradient norms are compared (as
    bench/compose.py compares every pair), for LoRA the parameters too."""
    plain, (rank0, _) = two_ranks
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # one rank's thread count (zero_cases.reference_case)
    extra = LORA if pair == 3 else {}
    ref = gather_case({**plain, **extra, "train.grad_accum": 1 if pair == 2 else 2}, STEPS)
    got = rank0[2 * pair + 1]
    if pair == 3:
        assert_matches(got["losses"], got["params"], ref, "fp8 all-gather lora", tol=ONE_PROCESS_TOLERANCE,
                       d_model=32, lr=3e-3)
    assert rel(torch.tensor(got["losses"]), torch.tensor(ref["losses"])) <= ONE_PROCESS_TOLERANCE
    assert rel(torch.tensor(got["norms"]), torch.tensor(ref["norms"])) <= ONE_PROCESS_TOLERANCE


def _weights(units: list) -> tuple[int, int]:
    """(elements, weights) of the units gathered in fp8."""
    return (sum(padded for _, padded, _, fp8 in units if fp8), sum(n for _, _, n, fp8 in units if fp8))


def test_the_ledger_counts_one_byte_per_fp8_weight_element(two_ranks):
    _, (rank0, _) = two_ranks
    off, on = rank0[0], rank0[1]
    elements, weights = _weights(on["units"])
    assert [u[0] for u in on["units"]] == ["root", "blocks.0", "blocks.0[fp8]", "blocks.1", "blocks.1[fp8]"]
    # no padding in either layout here: the fp8 units hold exactly the blocks' linear weights
    assert sum(p for _, p, _, _ in off["units"]) == sum(p for _, p, _, _ in on["units"])
    gathers = 2  # forward and backward (reshard_after_forward), one micro-step
    for ledger_off, ledger_on in zip(off["ledgers"], on["ledgers"]):
        assert ledger_off["all_gather/dp_shard"] == gathers * 2 * sum(p for _, p, _, _ in off["units"])
        assert ledger_on["all_gather/dp_shard"] == gathers * sum(p * (1 if fp8 else 2) for _, p, _, fp8 in on["units"])
        assert ledger_on["all_gather/dp_shard"] == ledger_off["all_gather/dp_shard"] - gathers * elements  # halved
        assert ledger_on["all_reduce/dp_shard"] == 2 * 4 * weights  # one amax all-reduce per forward
        assert ledger_on["reduce_scatter/dp_shard"] == ledger_off["reduce_scatter/dp_shard"]
        assert "all_reduce/dp_shard" not in ledger_off


def test_the_planner_gathers_the_ledger_bytes(two_ranks):
    plain, (rank0, _) = two_ranks
    cluster = parse_cluster("1x2xA100-80GB")
    for overrides, got in ((plain, rank0[0]), ({**plain, **GATHER}, rank0[1])):
        w, s = config_strategy(load_config(overrides=overrides).validate(), cluster)
        planned = {c.name: c.bytes for c in estimate_time(w, s, cluster).comms}
        assert planned["all-gather parameters"] == got["ledgers"][-1]["all_gather/dp_shard"]
        assert planned["reduce-scatter gradients"] == got["ledgers"][-1]["reduce_scatter/dp_shard"]
    # memory: a gathered block holds its FP8 linears' weights at 1 byte, the rest at the
    # compute dtype's e (the current block and the prefetched next; on a GPU, no gloo copy)
    from shardlm.planner.memory import estimate_memory
    from shardlm.planner.traffic import fp8_gathered_elements

    held = []
    for overrides in (plain, {**plain, **GATHER}):
        w, s = config_strategy(load_config(overrides=overrides).validate(), cluster)
        memory = estimate_memory(w, s, cluster)
        held.append(next(part.bytes for item in memory.items for part in getattr(item, "parts", None) or []
                         if part.name == "gathered parameters"))
    e = s.dtypes.param_bytes
    assert held[0] - held[1] == 2 * (e - 1) * fp8_gathered_elements(w.model) / w.model.n_layers > 0


@pytest.mark.parametrize("change, named", [
    ({"precision.compute": "bf16", "precision.fp8_emulate": False}, "precision.compute = 'fp8'"),
    ({"precision.fp8_recipe": "delayed"}, "precision.fp8_recipe = 'tensorwise'"),
    ({"precision.fp8_emulate": False, "run.device": "cuda"}, "precision.fp8_emulate = true"),
    ({"parallel.zero_stage": 2}, "parallel.zero_stage = 3"),
    ({"lora.rank": 4, "lora.quantize": "nf4"}, "half a byte per element"),
], ids=["no-fp8", "delayed", "torchao", "stage-2", "qlora"])
def test_what_does_not_compose_is_refused_by_name(tmp_path, change, named):
    with pytest.raises(ConfigError, match="precision.fp8_all_gather") as error:
        load_config(overrides={**_overrides(tmp_path), **GATHER, **change}).validate()
    assert named in str(error.value)
