"""LoRA with tensor parallelism (parallel/tensor/decoder.py's LoRA layers): on 2 ranks with tp = 2 (and
with sequence parallelism), the losses, the adapters after training and the PEFT adapter the
run writes (checkpoint/peft_adapter.py, from whole_parameters) match one process. And LoRA with
expert parallelism (ep = 2, ZeRO-3): the experts ep replaces stay frozen, as in one process.

Tolerance: fp32, 1e-5 relative. Tensor parallelism changes the order of sums (a row-parallel
matmul adds two half-width partial products, LoRA's too; the replicated factor's gradient is
two partial sums), so bitwise equality is not expected; tests/test_tensor_parallel.py's bound.
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_overrides
from shardlm.checkpoint.peft_adapter import ADAPTER_DIR, ADAPTER_WEIGHTS
from shardlm.config.load import load_config
from shardlm.models.lora import is_adapter
from shardlm.launch.spawn import run_ranks
from shardlm.train.build import build_run
from shardlm.train.loop import train

STEPS = 3
CASES = {"tp=2 gpt": ("gpt-tiny", {}),
         "tp=2 gpt, sequence parallel": ("gpt-tiny", {"parallel.sequence_parallel": True}),
         "tp=2 llama (GQA, SwiGLU)": ("llama-tiny", {})}
MOE = {"model.experts": 4, "model.top_k": 2}


def _base(tmp, preset: str, name: str) -> dict:
    return tiny_overrides(tmp, model__preset=preset, lora__rank=4, train__lr=1e-2,
                          train__steps=STEPS, run__name=name)


def lora_train_case(overrides: dict) -> dict:
    """Train (train(): the final weights and the PEFT adapter written); the losses, this rank's
    adapter pieces with their Splits, and the adapter file's tensors (rank 0; none for a GPT
    mixture of experts, which has no transformers class to adapt)."""
    run = build_run(load_config(overrides=overrides).validate())
    result = train(run)
    with run.strategy.full_parameters():
        params = {n: p.detach().float().cpu().clone() for n, p in run.model.named_parameters()
                  if is_adapter(n)}
    tp = getattr(run.model, "tp", None)
    adapter = run.run_dir / ADAPTER_DIR / ADAPTER_WEIGHTS
    return {"losses": result.losses, "params": params,
            "splits": dict(tp.splits) if tp is not None else {},
            "peft": load_file(str(adapter)) if run.runtime.rank == 0 and adapter.exists() else None}


def lora_train_cases(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    torch.manual_seed(0)
    return [lora_train_case(o) for o in cases]


@pytest.fixture(scope="module")
def two_rank_world(tmp_path_factory):
    """The parity cases (runs) and test_lora_layers_cut_as_megatron_with_one_reduction's layers,
    in one spawned world (worlds.several), not one each."""
    from worlds import several

    tmp = tmp_path_factory.mktemp("loratp")
    cases = [{**_base(tmp, preset, f"tp{i}"), "parallel.tp": 2, **extra}
             for i, (preset, extra) in enumerate(CASES.values())]
    cases.append({**_base(tmp, "gpt-tiny", "ep"), **MOE, "parallel.ep": 2, "parallel.zero_stage": 3})
    return run_ranks(several, 2, tmp, [(lora_train_cases, (cases,)), (lora_layers_cases, ())])


@pytest.fixture(scope="module")
def runs(two_rank_world, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("loratp-ref")
    out = [rank[0] for rank in two_rank_world]
    saved = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # one rank's thread count (zero_cases.reference_case)
    try:
        refs = {p: lora_train_case(_base(tmp, p, f"one-{p}")) for p in ("gpt-tiny", "llama-tiny")}
        # ep: 2 data-parallel ranks' micro-batches as accumulation steps, the same global batch
        refs["ep"] = lora_train_case({**_base(tmp, "gpt-tiny", "one-ep"), **MOE, "train.grad_accum": 2})
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE") if saved is None else os.environ.update(LOCAL_WORLD_SIZE=saved)
    return out, refs


def _whole(ranks: list[dict]) -> dict[str, torch.Tensor]:
    from tp_cases import whole_params

    return whole_params(ranks)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@pytest.mark.parametrize("case", range(len(CASES)), ids=list(CASES))
def test_lora_tp_matches_one_process(runs, case):
    out, refs = runs
    what = list(CASES)[case]
    ref = refs[CASES[what][0]]
    ranks = [out[r][case] for r in range(2)]
    cut = {n for n in ranks[0]["splits"] if is_adapter(n)}
    assert any("lora_B" in n for n in cut) and any("lora_A" in n for n in cut), what  # both layouts
    for got in ranks:
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5), what
    whole = _whole(ranks)
    assert whole.keys() == ref["params"].keys()
    worst = max((_rel(whole[n], v), n) for n, v in ref["params"].items())
    assert worst[0] <= 1e-5, (what, worst)
    assert any(float(v.abs().max()) > 0 for n, v in ref["params"].items() if "lora_B" in n)  # trained
    # the PEFT adapter of the tp run (whole_parameters) is the one-process run's
    peft, ref_peft = ranks[0]["peft"], ref["peft"]
    assert peft.keys() == ref_peft.keys() and peft  # (PEFT names: fused q/k/v apart)
    worst = max((_rel(peft[n], v), n) for n, v in ref_peft.items())
    assert worst[0] <= 1e-5, (what, worst)


def test_lora_ep_keeps_the_experts_frozen(runs):
    """ep's new expert parameters used to train (a new nn.Parameter does): the adapters then
    followed another trajectory, and the gradient norm was 13% high at step 1 (bench/compose.py
    ep+lora). Now both ranks' losses and adapters match one process."""
    out, refs = runs
    ref = refs["ep"]
    for rank in (0, 1):
        got = out[rank][len(CASES)]
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        assert got["params"].keys() == ref["params"].keys()  # adapters are replicated under ep
        worst = max((_rel(got["params"][n], v), n) for n, v in ref["params"].items())
        assert worst[0] <= 1e-5, worst


def lora_layers_cases(rank: int, world_size: int) -> list[dict]:
    return [lora_layers_case(rank, sequence_parallel) for sequence_parallel in (False, True)]


def lora_layers_case(rank: int, sequence_parallel: bool) -> dict:
    """A LoRA column-parallel then row-parallel pair (d 8 -> 12 -> 8, rank 2, B random) against
    the two LoRALinears it cuts: outputs, the input's and every factor's gradient (this rank's
    piece), and the tp bytes of the forward and of the backward."""
    import torch.distributed as dist

    from shardlm.comm.collectives import Comm, CommLedger
    from shardlm.models.lora import LoRALinear
    from shardlm.parallel.tensor.decoder import _column, _row
    from shardlm.parallel.tensor.regions import TPState
    from shardlm.models.placement import even_range

    torch.manual_seed(0)
    d, h, r, tokens = 8, 12, 2, 4
    col, row = LoRALinear(torch.nn.Linear(d, h), r, 4.0, 0.0), LoRALinear(torch.nn.Linear(h, d), r, 4.0, 0.0)
    for layer in (col, row):
        torch.nn.init.normal_(layer.lora_B.weight)
    x = torch.randn(2, tokens, d, requires_grad=True)
    row(col(x)).square().sum().backward()
    ledger = CommLedger()
    tp = TPState(Comm(dist.group.WORLD, "tp", ledger, None), sequence_parallel)
    tp.sharded = sequence_parallel
    lo, hi = even_range(h, 2, rank)
    with torch.device("meta"):
        cut_col, cut_row = _column(d, hi - lo, True, tp, col), _row(row, "down", (lo, hi), tp)
    cut_col.to_empty(device="cpu")
    cut_row.to_empty(device="cpu")
    with torch.no_grad():
        for mine, whole, piece in ((cut_col, col, lambda t: t[lo:hi]), (cut_row, row, lambda t: t[:, lo:hi])):
            mine.weight.copy_(piece(whole.weight))
            mine.bias.copy_(whole.bias[lo:hi] if mine is cut_col else whole.bias)
        cut_col.lora_A.weight.copy_(col.lora_A.weight)
        cut_col.lora_B.weight.copy_(col.lora_B.weight[lo:hi])
        cut_row.lora_A.weight.copy_(row.lora_A.weight[:, lo:hi])
        cut_row.lora_B.weight.copy_(row.lora_B.weight)
    seq = slice(rank * tokens // 2, (rank + 1) * tokens // 2) if sequence_parallel else slice(None)
    mine_x = x.detach()[:, seq].clone().requires_grad_()
    y = cut_row(cut_col(mine_x))
    forward = dict(ledger.bytes)
    y.square().sum().backward()
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    return {"forward": forward, "all": dict(ledger.bytes), "errors": {
        "y": rel(y.detach(), row(col(x)).detach()[:, seq]), "x": rel(mine_x.grad, x.grad[:, seq]),
        "col A": rel(cut_col.lora_A.weight.grad, col.lora_A.weight.grad),
        "col B": rel(cut_col.lora_B.weight.grad, col.lora_B.weight.grad[lo:hi]),
        "row A": rel(cut_row.lora_A.weight.grad, row.lora_A.weight.grad[:, lo:hi]),
        "row B": rel(cut_row.lora_B.weight.grad, row.lora_B.weight.grad)}}


def test_lora_layers_cut_as_megatron_with_one_reduction(two_rank_world):
    """The cut layers equal the whole ones (fp32, 1e-6), and the forward's tp traffic is the
    base's one reduction of the output (an all-reduce, or with sequence parallelism a
    reduce-scatter after the input's all-gather): the LoRA update's partial sum rides in it.
    Backward adds only the whole factors' gradient all-reduces (A of the column layer, B of the
    row one). Both modes in one spawn."""
    out = [rank[1] for rank in two_rank_world]  # lora_layers_cases, in the shared world
    numel = 2 * 4 * 8 * 4  # (B, T, d) fp32 bytes of the output / input
    factors = 2 * (2 * 8 * 4) * 2  # A (2, 8) and B (8, 2) fp32, all-reduces counted x2
    for plain, sequence_parallel in out:
        for got in (plain, sequence_parallel):
            assert max(got["errors"].values()) <= 1e-6, got["errors"]
        assert plain["forward"] == {"all_reduce/tp": 2 * numel}, plain["forward"]
        assert sequence_parallel["forward"] == {"all_gather/tp": numel, "reduce_scatter/tp": numel}
        # the base's own: plain f's all-reduce of x's gradient; sequence-parallel, the row
        # layer's replicated bias (synced: its tokens differ by rank), 8 fp32
        for got, base in ((plain, 2 * numel), (sequence_parallel, 2 * 8 * 4)):
            backward = got["all"]["all_reduce/tp"] - got["forward"].get("all_reduce/tp", 0)
            assert backward == factors + base, got
