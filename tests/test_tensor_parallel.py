"""Tensor (and sequence) parallelism on real gloo ranks against one process: same seed, same
global batch, every precision pinned to fp32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_overrides
from shardlm.launch.spawn import run_ranks
from tp_cases import tp_world, whole_params
from worlds import several
from zero_cases import reference_case, train_cases

STEPS = 3
VOCABS = [(16, False), (17, False), (17, True)]
LEDGER_CASES = [("gpt-tiny", False, "none"), ("gpt-tiny", True, "full"), ("gpt-tiny", False, "selective"),
                ("llama-tiny", True, "none"), ("moe-tiny", False, "none"), ("moe-tiny", True, "full")]


def _ledger_overrides(tmp, preset: str, sp: bool, recompute: str) -> dict:
    return {**tiny_overrides(tmp, model__preset=preset, train__micro_batch=4, train__grad_accum=2),
            "parallel.tp": 2, "parallel.sequence_parallel": sp, "activation.checkpoint": recompute}


def _mqa_base(tmp) -> dict:
    """llama-tiny with n_kv_heads = 1 < tp = 2 (test_tp_beyond_the_key_value_heads)."""
    return tiny_overrides(tmp, model__preset="llama-tiny", model__n_kv_heads=1, train__steps=2 * STEPS)


CKPT_N = 2
"""test_checkpoints_load_across_tensor_parallel_layouts: steps before each checkpoint."""


def _ckpt_base(tmp) -> dict:
    return tiny_overrides(tmp, model__preset="llama-tiny", train__micro_batch=4, train__steps=2 * CKPT_N)


def _zero3_base(tmp) -> dict:
    return tiny_overrides(tmp, model__preset="llama-tiny", train__micro_batch=4)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """Every 4-rank run of this file in one spawned world (tests/worlds.py): dp_shard 2 x tp 2
    at ZeRO-3 for the parity test, and at ZeRO-3 saving every CKPT_N steps for the checkpoint
    test; then that checkpoint resumed in one process (saving at 2 CKPT_N, for the way back),
    which the 2-rank world below resumes from in turn."""
    from ckpt_cases import checkpoint_of, train_ranks, train_run

    tmp = tmp_path_factory.mktemp("tp-layouts")
    zero3 = {**_zero3_base(tmp), "parallel.tp": 2, "parallel.zero_stage": 3, "parallel.sequence_parallel": True}
    saving = {**_ckpt_base(tmp), "parallel.tp": 2, "parallel.zero_stage": 3, "checkpoint.every": CKPT_N,
              "run.name": "dp2tp2"}
    out = run_ranks(several, 4, tmp, [(train_cases, ([(zero3, STEPS, -1)],)), (train_ranks, (saving,))],
                    timeout=600)
    saved = out[0][1]
    one = train_run({**_ckpt_base(tmp), "train.grad_accum": 2, "run.name": "one",
                     "checkpoint.resume": checkpoint_of(saved["run_dir"], CKPT_N), "checkpoint.every": CKPT_N})
    return {"zero3": [rank[0][0] for rank in out], "saved": saved, "one": one, "tmp": tmp}


@pytest.fixture(scope="module")
def world(tmp_path_factory, layouts):
    """Every 2-rank check of this file, in one spawned world (tp_cases.tp_world): the parity
    cases (tp_runs), the ledger cases, the cross-entropy cases, the MQA case's training and its
    saved run, and the checkpoint test's two resumes at tp = 2 (of the 4-rank checkpoint, and
    of the one-process run's). One set of rank processes instead of twelve."""
    from ckpt_cases import checkpoint_of

    tmp = tmp_path_factory.mktemp("tp")
    base = tiny_overrides(tmp)
    parity = [({**base, "parallel.tp": 2}, STEPS, -1),
              ({**base, "parallel.tp": 2, "parallel.sequence_parallel": True}, STEPS, -1),
              ({**tiny_overrides(tmp, model__preset="llama-tiny"), "parallel.tp": 2}, STEPS, -1)]
    ledger = [(_ledger_overrides(tmp, *case), 2, -1) for case in LEDGER_CASES]
    mqa = _mqa_base(tmp)
    train = parity + ledger + [({**mqa, "parallel.tp": 2}, STEPS, -1)]
    ckpt = _ckpt_base(layouts["tmp"])
    runs = [{**mqa, "parallel.tp": 2, "parallel.zero_stage": 2, "checkpoint.every": STEPS, "run.name": "mqa"},
            {**ckpt, "parallel.tp": 2, "parallel.zero_stage": 1, "train.grad_accum": 2, "run.name": "tp2",
             "checkpoint.resume": checkpoint_of(layouts["saved"]["run_dir"], CKPT_N)},
            {**ckpt, "parallel.tp": 2, "train.grad_accum": 2, "run.name": "back", "train.steps": 3 * CKPT_N,
             "checkpoint.resume": checkpoint_of(layouts["one"]["run_dir"], 2 * CKPT_N)}]
    out = run_ranks(tp_world, 2, tmp, train, VOCABS, runs, timeout=600)
    return {"parity": [r["train"][:3] for r in out],
            "ledger": [r["train"][3:3 + len(ledger)] for r in out],
            "mqa": [r["train"][-1] for r in out], "mqa_saved": out[0]["runs"][0],
            "tp2": out[0]["runs"][1], "back": out[0]["runs"][2],
            "cross_entropy": [r["cross_entropy"] for r in out]}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


# 17: the ranks hold 9 and 8 rows; ignored: targets of -100 (SFT), left out as ignore_index does
@pytest.mark.parametrize("case", range(len(VOCABS)), ids=[f"{v}-{i}" for v, i in VOCABS])
def test_vocab_parallel_cross_entropy_equals_the_full_one(world, case):
    vocab, _ = VOCABS[case]
    out = [rank[case] for rank in world["cross_entropy"]]
    logits, targets = out[0]["logits"], out[0]["targets"]
    full = logits.clone().requires_grad_()
    loss = F.cross_entropy(full.flatten(0, 1), targets.flatten())
    loss.backward()
    for r in out:
        assert r["loss"] == pytest.approx(float(loss.detach()), rel=1e-6)
        torch.testing.assert_close(r["grad"], full.grad[..., r["lo"]:r["hi"]], rtol=1e-5, atol=1e-7)
        assert torch.equal(r["gathered"], logits)
        # Never the logits: all-reduces of 3 fp32 numbers per token (the max, the sum of
        # exponentials, the target's logit), counted x2 as all-reduces are; the all-gather is
        # the explicit gather() for sampling.
        tokens = targets.numel()
        assert r["bytes"] == {"all_reduce/tp": 2 * 3 * tokens * 4, "all_gather/tp": 2 * 15 * ((vocab + 1) // 2) * 4}


@pytest.fixture(scope="module")
def tp_runs(world, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp-ref")
    base = tiny_overrides(tmp)
    out = world["parity"]
    refs = [reference_case(base, 1, STEPS), reference_case(base, 1, STEPS),
            reference_case(tiny_overrides(tmp, model__preset="llama-tiny"), 1, STEPS)]
    return out, refs


# fp32 throughout. Tensor parallelism changes the order of the sums: a row-parallel matmul adds
# two half-width partial products, the vocabulary-parallel softmax two partial sums of
# exponentials; the losses agree to 1e-5 relative, the parameters after 3 AdamW steps to 1e-5.
# Except the key bias (GPT's qkv.bias rows [d, 2d)): its true gradient is 0 (a softmax is
# unchanged by adding one number to every key a query sees), so what it gets is rounding noise,
# and AdamW's first updates are ±lr whatever the gradient's size: compared apart, loosely, as
# tests/test_zero.py does.
@pytest.mark.parametrize("case, what", [(0, "tp=2 gpt"), (1, "tp=2 gpt, sequence parallel"), (2, "tp=2 llama (GQA, SwiGLU, RoPE)")])
def test_tp_matches_one_process(tp_runs, case, what):
    out, refs = tp_runs
    ref = refs[case]
    ranks = [out[r][case] for r in range(2)]
    for got in ranks:
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5), what
    whole = whole_params(ranks)
    assert whole.keys() == ref["params"].keys()
    d = 64  # gpt-tiny's and llama-tiny's d_model
    key_bias = {n: (whole[n][d:2 * d], v[d:2 * d]) for n, v in ref["params"].items() if n.endswith("qkv.bias")}
    strict = {n: (torch.cat([whole[n][:d], whole[n][2 * d:]]), torch.cat([v[:d], v[2 * d:]]))
              if n in key_bias else (whole[n], v) for n, v in ref["params"].items()}
    worst = max((_rel(a, b), n) for n, (a, b) in strict.items())
    assert worst[0] <= 1e-5, (what, worst)
    for name, (a, b) in key_bias.items():  # within STEPS updates of lr (1e-3) of the reference
        assert float((a - b).abs().max()) <= STEPS * 1e-3, name


def test_zero3_over_dp2_with_tp2_on_4_ranks(layouts):
    """dp_shard 2 x tp 2: each tensor-parallel piece is itself ZeRO-3-sharded over the two
    data-parallel ranks that hold it (FSDP2 + TP's 2-D layout); against one process with the
    same global batch (2 data-parallel ranks' micro-batches as 2 accumulation steps)."""
    out = layouts["zero3"]  # the 4-rank world's run: tp 2, ZeRO-3, sequence parallel, STEPS steps
    ref = reference_case(_zero3_base(layouts["tmp"]), 2, STEPS)
    for r in range(4):
        assert out[r]["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    for dp in range(2):  # ranks (dp, tp): 2·dp + tp; both data-parallel ranks hold every piece
        whole = whole_params([out[2 * dp], out[2 * dp + 1]])
        worst = max((_rel(whole[n], v), n) for n, v in ref["params"].items())
        assert worst[0] <= 1e-5, worst


def test_checkpoints_load_across_tensor_parallel_layouts(tmp_path, layouts, world):
    """Saved at dp 2 x tp 2 (ZeRO-3, 4 ranks), resumed at tp 2 alone (ZeRO-1, 2 ranks) and in
    one process: the same loss curve continues. And back: saved in one process, resumed at tp 2."""
    from ckpt_cases import checkpoint_of, train_run

    n = CKPT_N
    base = _ckpt_base(tmp_path)
    saved, tp2, one = layouts["saved"], world["tp2"], layouts["one"]  # as the docstrings above say
    for result in (tp2, one):
        assert result["start"] == n
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(saved["losses"][n:]),
                                   rtol=1e-5, atol=0)
    back = world["back"]  # tp 2 from the one-process run's checkpoint of step 2n, to 3n
    alone = train_run({**base, "train.grad_accum": 2, "run.name": "alone", "train.steps": 3 * n,
                       "checkpoint.resume": checkpoint_of(one["run_dir"], 2 * n)})
    assert back["start"] == alone["start"] == 2 * n
    torch.testing.assert_close(torch.tensor(back["losses"]), torch.tensor(alone["losses"]), rtol=1e-5, atol=0)


@pytest.mark.parametrize("case", range(len(LEDGER_CASES)), ids=["-".join(map(str, c)) for c in LEDGER_CASES])
def test_ledger_bytes_match_the_formula(world, tmp_path, case):
    """The tensor-parallel group's bytes per step in the ledger are exactly the planner's
    formula (planner/traffic.py tp_comm_bytes): Megatron's four all-reduces of b·s·h per block,
    the same bytes as all-gathers + reduce-scatters with sequence parallelism, plus the
    embedding, head, loss and (SP) replicated-parameter gradient terms; a MoE block's own
    (traffic.moe_tp_bytes: attention's pair, the routed output's all-gathers, the balancing
    statistics and the router's gradient), its expert all-to-all apart (it follows the
    routing: test_moe.py counts it)."""
    from shardlm.config.load import load_config
    from shardlm.planner.traffic import tp_comm_bytes

    preset, sp, recompute = LEDGER_CASES[case]
    over = _ledger_overrides(tmp_path, preset, sp, recompute)  # what the world trained (2 steps)
    model = load_config(overrides=over).validate().model
    expected = 2 * tp_comm_bytes(model, 4 * 64, 2, sp, 4, recompute)  # 2 micro-batches of 4 x 64
    for r in range(2):
        ops = world["ledger"][r][case]["comm_ops"][-1]
        assert sum(v for k, v in ops.items() if k.endswith("/tp") and not k.startswith("all_to_all")) == expected
        assert any(k.startswith("all_to_all/") for k in ops) == bool(model.experts)


def test_tp_beyond_the_key_value_heads(world, tmp_path):
    """tp = 2 > n_kv_heads = 1 (multi-query attention): each rank keeps every key/value row and
    uses the one head, the rows' gradients summed over the group. Against one process (1e-5,
    as above); the ledger's tensor-parallel bytes are the formula's (with the shared rows'
    all-reduce); and a checkpoint saved at tp = 2 resumes in one process on the same curve
    (the shared rows written once: the manifest's tiling check would refuse them twice)."""
    from ckpt_cases import checkpoint_of, train_run
    from shardlm.config.load import load_config
    from shardlm.planner.traffic import tp_comm_bytes

    base = _mqa_base(tmp_path)
    out = world["mqa"]  # the world's run of {**base, "parallel.tp": 2}, STEPS steps
    ref = reference_case(base, 1, STEPS)
    for r in range(2):
        assert out[r]["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    whole = whole_params([out[0], out[1]])
    worst = max((_rel(whole[n], v), n) for n, v in ref["params"].items())
    assert worst[0] <= 1e-5, worst
    model = load_config(overrides=base).validate().model
    assert out[0]["comm_by_op"][-1]["tp"] == tp_comm_bytes(model, 8 * 64, 2, False, 4)
    saved = world["mqa_saved"]  # the world's train_run of tp = 2, ZeRO-2, saving every STEPS
    one = train_run({**base, "run.name": "one", "checkpoint.resume": checkpoint_of(saved["run_dir"], STEPS)})
    assert one["start"] == STEPS
    torch.testing.assert_close(torch.tensor(one["losses"]), torch.tensor(saved["losses"][STEPS:]),
                               rtol=1e-5, atol=0)
    # The run's final weights (and so its HF export) are whole tensors, the one-process run's.
    from safetensors.torch import load_file

    weights = load_file(str(Path(saved["run_dir"]) / "model.safetensors"))
    assert weights.keys() == one["params"].keys()
    worst = max((_rel(weights[n], v), n) for n, v in one["params"].items())
    assert worst[0] <= 1e-5, worst
    transformers = pytest.importorskip("transformers")
    from shardlm.checkpoint.export import export_hf

    hf = transformers.AutoModelForCausalLM.from_pretrained(export_hf(saved["run_dir"], tmp_path / "hf"))
    assert hf.model.layers[0].self_attn.k_proj.weight.shape == (16, 64)  # 1 kv head of 16, whole
