"""Overlapped tensor parallelism (parallel.async_tp, parallel/tensor/async_tp.py) on 2 gloo ranks: the
same bits as blocking sequence parallelism (layers: outputs and every gradient; training: losses
and parameters after AdamW steps), the same bytes in the ledger (and the planner's formula), and
one process's results at the tensor-parallel tolerance. fp32 throughout. One spawned world runs
every check (tests/test_tensor_parallel.py checks blocking SP itself)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_overrides
from parity import assert_matches
from shardlm.config.load import load_config
from shardlm.errors import ConfigError
from shardlm.launch.spawn import run_ranks
from tp_cases import whole_params
from zero_cases import reference_case, train_cases

STEPS = 2


def _lora(rank: int) -> SimpleNamespace:
    """What tensor_layers' LoRA layers read from a models/lora.py LoRALinear (no dropout)."""
    return SimpleNamespace(rank=rank, alpha=2 * rank, scaling=2.0, dropout=torch.nn.Identity())


def _mlp(tp, lora: bool, frozen: bool, c: int, h: int, g: torch.Generator):
    """A column- then row-parallel MLP over `tp` (this rank's half of the hidden width), its
    weights cut from whole ones drawn alike on every rank."""
    from shardlm.models.placement import even_range
    from shardlm.parallel.tensor.layers import (ColumnParallelLinear, LoRAColumnParallelLinear,
                                                LoRARowParallelLinear, RowParallelLinear)

    lo, hi = even_range(h, tp.size, tp.rank)
    if lora:
        col, row = LoRAColumnParallelLinear(c, hi - lo, True, tp, _lora(2)), LoRARowParallelLinear(hi - lo, c, True, tp, _lora(2))
    else:
        col, row = ColumnParallelLinear(c, hi - lo, True, tp), RowParallelLinear(hi - lo, c, True, tp)
    whole = {"col.weight": (h, c), "col.bias": (h,), "row.weight": (c, h), "row.bias": (c,),
             "col.lora_A.weight": (2, c), "col.lora_B.weight": (h, 2), "row.lora_A.weight": (2, h),
             "row.lora_B.weight": (c, 2)}
    cut = {"col.weight": 0, "col.bias": 0, "col.lora_B.weight": 0, "row.weight": 1, "row.lora_A.weight": 1}
    with torch.no_grad():
        for prefix, layer in (("col", col), ("row", row)):
            for name, p in layer.named_parameters():
                value = torch.randn(whole[f"{prefix}.{name}"], generator=g)
                dim = cut.get(f"{prefix}.{name}")
                p.copy_(value if dim is None else value.narrow(dim, lo, hi - lo))
                if frozen and name in ("weight", "bias"):
                    p.requires_grad_(False)
    return col, row


def layer_case(rank: int, world: int, batch: int, t: int, lora: bool, frozen: bool) -> dict:
    """One MLP's forward and backward on this rank's t sequence rows, blocking then overlapped:
    outputs, gradients (input and every parameter) and the ledger of each."""
    import torch.distributed as dist

    from shardlm.comm.collectives import Comm, CommLedger
    from shardlm.parallel.tensor.regions import TPState

    ledger = CommLedger()
    tp = TPState(Comm(dist.group.WORLD, "tp", ledger), sequence_parallel=True)
    tp.sharded = True
    g = torch.Generator().manual_seed(1)
    c, h = 16, 24
    col, row = _mlp(tp, lora, frozen, c, h, g)
    x_whole = torch.randn(batch, world * t, c, generator=g)
    probe = torch.randn(batch, world * t, c, generator=g)
    out = {}
    for mode in (False, True):
        tp.async_tp = mode
        ledger.reset()
        x = x_whole[:, rank * t:(rank + 1) * t].clone().requires_grad_()
        y = row(F.gelu(col(x)))
        (y * probe[:, rank * t:(rank + 1) * t]).sum().backward()
        grads = {f"{p}.{n}": q.grad.clone() for p, m in (("col", col), ("row", row))
                 for n, q in m.named_parameters() if q.grad is not None}
        out[mode] = {"y": y.detach(), "x.grad": x.grad, **grads, "ledger": dict(ledger.bytes),
                     "calls": dict(ledger.calls)}
        for m in (col, row):
            m.zero_grad(set_to_none=True)
    return out


def _ranks(rank: int, world: int, layer_args: list, cases: list) -> dict:
    return {"layers": [layer_case(rank, world, *args) for args in layer_args],
            "train": train_cases(rank, world, cases)}


# (batch, rows per rank, LoRA, frozen base). Every piece's matmul has >= 64 rows: a BLAS computes
# a row of a product the same way whichever rows it multiplies with it only above a small size
# (MKL here: for a few rows it takes another kernel, and the pieces then differ from the whole
# matmul by rounding: docs/architecture.md, "Overlapped"). 65 rows: pieces of 33 and 32.
# Batch 1: F.linear's fused-bias path (its gathered input is contiguous).
LAYERS = [(2, 65, False, False), (1, 128, False, False), (2, 64, True, False), (2, 64, True, True)]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("async_tp")
    plain = tiny_overrides(tmp, train__steps=STEPS, train__micro_batch=4)  # pieces of 4 x 16 rows
    base = {**plain, "parallel.tp": 2, "parallel.sequence_parallel": True}
    lora = {**tiny_overrides(tmp, model__preset="llama-tiny", train__steps=STEPS, train__micro_batch=4, lora__rank=4),
            "parallel.tp": 2, "parallel.sequence_parallel": True}
    full = {**base, "activation.checkpoint": "full"}
    fp8 = {**base, "precision.compute": "fp8", "precision.fp8_emulate": True}
    qlora = {**lora, "lora.quantize": "nf4"}
    cases = [(base, STEPS, -1), ({**base, "parallel.async_tp": True}, STEPS, -1),
             (lora, STEPS, -1), ({**lora, "parallel.async_tp": True}, STEPS, -1),
             (full, STEPS, -1), ({**full, "parallel.async_tp": True}, STEPS, -1),
             ({**base, "parallel.async_tp": True, "train.compile": True}, STEPS, -1),
             (fp8, STEPS, -1), ({**fp8, "parallel.async_tp": True}, STEPS, -1),
             (qlora, STEPS, -1), ({**qlora, "parallel.async_tp": True}, STEPS, -1)]
    out = run_ranks(_ranks, 2, tmp, LAYERS, cases)
    return plain, out


@pytest.mark.parametrize("index", range(len(LAYERS)), ids=["gpt-mlp", "batch-1", "lora", "lora-frozen-base"])
def test_layers_same_bits_and_bytes_as_blocking(world, index):
    """Column- then row-parallel linears (LoRA's too, with a frozen base): the overlapped loops
    give the blocking version's output and gradients bit for bit, and its bytes by collective
    (only the calls differ: one per piece, 2 pieces per rank here)."""
    _, out = world
    for rank in range(2):
        blocking, overlapped = out[rank]["layers"][index][False], out[rank]["layers"][index][True]
        assert blocking.keys() == overlapped.keys()
        for key in blocking:
            if key in ("ledger", "calls"):
                continue
            assert torch.equal(blocking[key], overlapped[key]), (index, rank, key)
        assert overlapped["ledger"] == blocking["ledger"]
        assert set(blocking["ledger"]) >= {"all_gather/tp", "reduce_scatter/tp"}
        for op in ("all_gather/tp", "reduce_scatter/tp"):
            assert overlapped["calls"][op] == 2 * blocking["calls"][op]


@pytest.mark.parametrize("case, what", [(0, "gpt-tiny"), (2, "llama-tiny + LoRA"), (4, "gpt-tiny, recompute"),
                                       (9, "llama-tiny + QLoRA")])
def test_training_same_bits_as_blocking_and_one_process(world, case, what):
    """Training at tp = 2 + SP: the overlapped run's losses and parameters after AdamW steps are
    the blocking run's bit for bit, and its ledger's tensor-parallel bytes per step are the
    blocking run's, which are the planner's formula (planner/traffic.py tp_comm_bytes; with
    activation.checkpoint = 'full', the formula's async_tp term: one reduce-scatter more per
    block); against one process at tests/test_tensor_parallel.py's tolerance (1e-5)."""
    from shardlm.planner.traffic import tp_comm_bytes

    plain, out = world
    for rank in range(2):
        blocking, overlapped = out[rank]["train"][case], out[rank]["train"][case + 1]
        assert overlapped["losses"] == blocking["losses"], what
        assert overlapped["params"].keys() == blocking["params"].keys()
        for name, value in blocking["params"].items():
            assert torch.equal(overlapped["params"][name], value), (what, name)
        if case != 4:
            assert [c["tp"] for c in overlapped["comm_by_op"]] == [c["tp"] for c in blocking["comm_by_op"]]
    if case == 4:  # recomputation also repeats each block's last reduce-scatter (fused with the
        # matmul whose saved input backward needs: checkpoint's early stop comes after it)
        model = load_config(overrides=plain).validate().model
        for r, flag in ((case, False), (case + 1, True)):
            assert out[0]["train"][r]["comm_by_op"][-1]["tp"] == tp_comm_bytes(model, 4 * 64, 2, True, 4, "full",
                                                                               async_tp=flag)
    if case == 0:  # the formula and one process: the dense model
        model = load_config(overrides=plain).validate().model
        assert out[0]["train"][1]["comm_by_op"][-1]["tp"] == tp_comm_bytes(model, 4 * 64, 2, True, 4)
        ref = reference_case(plain, 1, STEPS)
        ranks = [out[r]["train"][1] for r in range(2)]
        assert_matches(ranks[0]["losses"], whole_params(ranks), ref, what, lr=1e-3)


def test_compiled_async_tp_matches_one_process(world):
    """train.compile with async TP: the decomposed linears are custom ops (one opaque node each
    in a block's graph, fullgraph: a break would fail the build), the rest of the block
    Inductor's code. Against one process at tests/test_compile.py's tolerance for compiled
    against eager and the tp tests' against one process, 1e-5 relative (fp32: Inductor's fused
    kernels may round a sum in another order, a few fp32 ulps, over 2 AdamW steps at lr 1e-3);
    the tensor-parallel bytes per step are the eager overlapped run's (the same pieces)."""
    plain, out = world
    ref = reference_case(plain, 1, STEPS)
    ranks = [out[r]["train"][6] for r in range(2)]
    assert_matches(ranks[0]["losses"], whole_params(ranks), ref, "tp 2 + SP, async, compiled", lr=1e-3)
    assert [c["tp"] for c in ranks[0]["comm_by_op"]] == [c["tp"] for c in out[0]["train"][1]["comm_by_op"]]


@pytest.mark.parametrize("overrides, words", [
    ({"parallel.tp": 2}, "parallel.sequence_parallel = true"),
    ({"parallel.tp": 1}, "parallel.tp > 1"),
    ({"parallel.tp": 2, "parallel.sequence_parallel": True, "precision.compute": "fp8",
      "precision.fp8_emulate": True, "lora.rank": 4}, "unrounded gathered input")])
def test_config_refuses_what_async_tp_cannot_do(tmp_path, overrides, words):
    with pytest.raises(ConfigError, match="parallel.async_tp") as info:
        load_config(overrides={**tiny_overrides(tmp_path), **overrides, "parallel.async_tp": True}).validate()
    assert words in str(info.value)


def test_config_accepts_async_tp_with_sequence_parallel(tmp_path):
    cfg = load_config(overrides={**tiny_overrides(tmp_path), "parallel.tp": 2, "parallel.sequence_parallel": True,
                                 "parallel.async_tp": True, "lora.rank": 4}).validate()
    assert cfg.parallel.async_tp


def test_planner_hides_the_tp_collectives_behind_their_matmuls():
    """The planner's time for async TP (planner/timing.py _async_tp_overlap): the tensor-parallel
    collectives' exposed time is a piece's latency per call + max(0, the rest - overlap x the
    matmuls they feed), so the predicted step is shorter than blocking SP's where the device
    overlaps (GPUs) and the bytes are the same; where nothing overlaps (Calibration.overlap = 0:
    a CPU, whose gloo threads need the matmuls' cores) it is no shorter."""
    from dataclasses import replace

    from shardlm.config.dims import ParallelDims
    from shardlm.hardware.catalog import CALIBRATION, parse_cluster
    from shardlm.planner.shapes import preset_model
    from shardlm.planner.timing import estimate_time
    from shardlm.planner.workload import Dtypes, Strategy, Workload

    # llama-7b: at llama-1b's size the tp pieces' extra latencies (tp all-gathers per call in
    # place of one) outweigh what hides, and the planner predicts async TP slower there
    w = Workload(preset_model("llama-7b"), 4096, 8)
    for cluster in (parse_cluster("8xA100-80GB"), parse_cluster("2x8xA100-80GB")):
        n = cluster.world_size
        blocking = Strategy(ParallelDims(1, n // 8, tp=8), 1, 1, 8 // (n // 8), dtypes=Dtypes("bf16"))
        times = [estimate_time(w, s, cluster) for s in (blocking, replace(blocking, async_tp=True))]
        tp = [next(c for c in t.comms if c.name == "tensor-parallel all-reduces") for t in times]
        assert tp[1].bytes == tp[0].bytes
        assert tp[1].exposed < tp[0].exposed == tp[0].seconds
        # one piece's latency per call (of the tp = 8 pieces' latencies) is never hidden
        assert tp[1].latency / 8 <= tp[1].exposed <= tp[1].seconds
        assert times[1].step < times[0].step
        still = replace(cluster, measured=replace(CALIBRATION["cuda"], overlap=0.0))
        assert estimate_time(w, replace(blocking, async_tp=True), still).step >= estimate_time(w, blocking, still).step


def test_fp8_async_tp_matches_blocking_fp8(world):
    """precision.compute = 'fp8' (emulated, tensorwise) with async TP (parallel/tensor/async_fp8.py):
    each sequence piece rounded at the whole tensor's amax (max-reduced over the group first), so
    the FP8 operands are the blocking matmul's bit for bit (rounding is element by element at one
    scale). The products are bf16 matmuls of the same rows, whose accumulation order a CPU's bf16
    kernel may choose by the rows' count (a piece's 64 or the whole 128): an output element then
    moves by one bf16 ulp (2^-8) where its fp32 sum lies within K·2^-24 of a rounding boundary
    (K <= 64 here: ~K·2^-16 = 1e-3 of the elements). Losses are asserted within 5e-6 relative for
    that: bit for bit measured on a Zen 3; a piece's own amax instead of the whole's (the mistake
    this guards) moved step 1's loss by 3.1e-5 (6.24435 vs 6.24416, measured). The ledger's tp bytes
    are the blocking run's plus the amaxes' max-reductions (one fp32 scalar per decomposed linear:
    the column's input forward, the row's output gradient backward)."""
    _, out = world
    for rank in range(2):
        blocking, overlapped = out[rank]["train"][7], out[rank]["train"][8]
        assert overlapped["losses"] == pytest.approx(blocking["losses"], rel=5e-6)
        assert overlapped["params"].keys() == blocking["params"].keys()
    assert out[0]["train"][7]["losses"] != out[0]["train"][0]["losses"]  # FP8 rounded something
    # 2 blocks x 4 decomposed linears, one fp32 amax each a step, an all_reduce counted 2x its bytes
    extra = [a["tp"] - b["tp"] for a, b in zip(out[0]["train"][8]["comm_by_op"], out[0]["train"][7]["comm_by_op"])]
    assert extra == [2 * 4 * 4 * 2] * STEPS
