"""LoRA with tensor parallelism (parallel/tensor.py's LoRA layers): on 2 ranks with tp = 2 (and
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
from shardlm.config import load_config
from shardlm.models.lora import is_adapter
from shardlm.spawn import run_ranks
from shardlm.trainer import build_run, train

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
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("loratp")
    cases = [{**_base(tmp, preset, f"tp{i}"), "parallel.tp": 2, **extra}
             for i, (preset, extra) in enumerate(CASES.values())]
    cases.append({**_base(tmp, "gpt-tiny", "ep"), **MOE, "parallel.ep": 2, "parallel.zero_stage": 3})
    out = run_ranks(lora_train_cases, 2, tmp, cases)
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
