"""Tensor parallelism of transformers models through their config's base_model_tp_plan
(parallel/tensor/plan.py): a tiny LlamaForCausalLM at tp=2 on 2 gloo ranks against one process,
fp32 pinned; and the clear errors for models it cannot cut.

Tolerance, measured (fp32, 3 steps, stages 0 and 3): the losses equal the reference's to the
bit, the parameters within 9.3e-7 relative (worst: layers.1.mlp.down_proj.weight); asserted
1e-5, as test_tensor_parallel.py does. Tensor parallelism changes only the order of sums:
o_proj and down_proj add two half-width partial products (the all-reduce), and a weight's
gradient is summed over this rank's heads or features only. Llama has no biases, so there is no
key bias (true gradient zero, so rounding noise under Adam) to compare apart; a Qwen2 run (k_proj
bias) shows it at 2e-5, everything else as Llama.
"""

from __future__ import annotations

import types

import pytest
import torch

from conftest import tiny_overrides
from hf_cases import VOCAB, hf_model
from shardlm.errors import ConfigError
from shardlm.parallel.build import apply_tensor_parallel
from shardlm.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from shardlm.launch.spawn import run_ranks
from test_tensor_parallel import _rel, whole_params
from tp_hf_cases import hf_tp_cases
from zero_cases import reference_case

STEPS, TP = 3, 2
STAGES = (0, 3)
LAYERS, TOKENS, HIDDEN = 2, 4 * 64, 64  # hf_cases' llama; micro_batch 4 x seq_len 64


def _base(tmp_path) -> dict:
    return tiny_overrides(tmp_path, train__micro_batch=4)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp_hf")
    cases = [("llama", {**_base(tmp), "parallel.tp": TP, "parallel.zero_stage": stage}, STEPS)
             for stage in STAGES]
    ranks = run_ranks(hf_tp_cases, TP, tmp, cases)
    return ranks, reference_case(_base(tmp), 1, STEPS, model=hf_model("llama", "meta"))


@pytest.mark.parametrize("index", range(len(STAGES)), ids=[f"stage{s}" for s in STAGES])
def test_llama_tp2_matches_one_process(runs, index):
    ranks, ref = runs
    got = [ranks[r][index] for r in range(TP)]
    for result in got:
        assert result["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert got[0]["splits"].keys() == got[1]["splits"].keys()
    cut = {n.rsplit(".", 2)[-2] for n in got[0]["splits"]}
    assert cut == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    whole = whole_params(got)
    assert whole.keys() == ref["params"].keys()
    worst = max((_rel(whole[n], v), n) for n, v in ref["params"].items())
    assert worst[0] <= 1e-5, worst


def test_one_backward_all_reduce_per_block_half(runs):
    """Per layer and micro-batch: forward, the all-reduce after o_proj and after down_proj;
    backward, one before attention (q, k and v share it) and one before the MLP (gate and up
    share it) — Megatron's four of (tokens x hidden) fp32, counted x2 as all-reduces are. The
    embedding, head and loss are replicated: nothing more."""
    ranks, _ = runs
    expected = LAYERS * 4 * 2 * TOKENS * HIDDEN * 4
    for r in range(TP):
        for case in ranks[r]:
            assert case["comm_by_op"][-1]["tp"] == expected


def _fake_comm(rank: int = 0):
    """Only the group's size and this rank: what the cutting reads (the checks below fail, and
    the cutting ends, before any collective)."""
    return types.SimpleNamespace(size=TP, rank=rank, group=None)


def test_model_without_a_plan_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"GPT2LMHeadModel has no base_model_tp_plan.*parallel.tp = 1"):
        apply_tensor_parallel(hf_model("gpt2", "meta"), _fake_comm(), False)


def test_kv_heads_tp_does_not_divide_is_a_clear_error():
    import transformers as tf

    from shardlm.models.hf import CausalLMAdapter

    config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=1)
    with torch.device("meta"):
        model = CausalLMAdapter(tf.LlamaForCausalLM(config), VOCAB)
    with pytest.raises(ConfigError, match=r"attention heads \(4\) and the key/value heads \(1\)"):
        apply_tensor_parallel(model, _fake_comm(), False)


def test_sequence_parallel_is_refused_for_plan_models():
    with pytest.raises(ConfigError, match="parallel.sequence_parallel needs shardlm's Decoder"):
        apply_tensor_parallel(hf_model("llama", "meta"), _fake_comm(), True)


def test_plan_cuts_whole_heads_under_the_same_names():
    """Rank 1 of 2 of hf_cases' llama (4 query heads, 2 key/value heads of 16): query heads
    2-3, key/value head 1, the second half of the MLP; names unchanged."""
    model = hf_model("llama", "meta")
    names = [n for n, _ in model.named_parameters()]
    tp = apply_tensor_parallel(model, _fake_comm(rank=1), False)
    assert [n for n, _ in model.named_parameters()] == names
    attn, mlp = model.model.model.layers[0].self_attn, model.model.model.layers[0].mlp
    assert all(isinstance(m, ColumnParallelLinear) and not m.gather_input
               for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj))
    assert isinstance(attn.o_proj, RowParallelLinear) and isinstance(mlp.down_proj, RowParallelLinear)
    pre = "model.model.layers.0"
    assert tp.splits[f"{pre}.self_attn.q_proj.weight"].ranges == ((32, 64),)
    assert tp.splits[f"{pre}.self_attn.k_proj.weight"].ranges == ((16, 32),)
    assert tp.splits[f"{pre}.self_attn.o_proj.weight"].dim == 1
    assert tp.splits[f"{pre}.mlp.down_proj.weight"].ranges == ((64, 128),)
    assert "model.model.embed_tokens.weight" not in tp.splits and "model.lm_head.weight" not in tp.splits
