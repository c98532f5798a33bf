"""transformers models (GPT-2, LLaMA, T5 from tiny configs) through the adapters, on the ZeRO
engine over 2 gloo ranks, against the single-process run — as tests/test_zero.py does for ours.

Reference: the same model in one process with the same global batch (micro_batch × grad_accum ×
ranks) and the same thread count as one rank (zero_cases.reference_case says why).

Tolerances, measured (fp32, 3 steps, grad_clip 1.0 unless said):
- LLaMA, stage 3 with grad_clip 0, and GPT-2, stage 3 with grad_clip 0: bitwise, losses and
  parameters, by construction: each rank's backward is one micro-batch of the reference at the
  same thread count, a sum of two gradients has no order, no clip coefficient, and fused AdamW
  (over a rank's flat segments here, per tensor there; its vector loop and scalar tail round
  differently) meets no tail on either side: every parameter, and every unit's shard, is a
  multiple of 16 floats (AVX-512's vector; asserted in the test). LLaMA's case trained with
  clipping before, and was bitwise only because its coefficient never fell below 1 (its norm
  0.80-0.92 in these 3 steps, measured).
- GPT-2 with clipping (stages 2, 3): the only difference
  is the global gradient norm: sharded, it is summed from per-shard partial norms, which rounds
  differently from torch's clip_grad_norm_ over whole tensors (parallel/data/zero/engine.py says so: bitwise
  only with whole gradients), and the clip coefficient moves by an ulp. Losses then agree to
  the bit, parameters to ≤ 1e-7 relative — except the attention key bias (the middle third of
  c_attn.bias), ~4e-5: its gradient is zero in exact arithmetic (softmax ignores a shift shared
  by a whole row), what Adam sees there is rounding noise normalised into full-size steps.
  It is left out of the comparison, as in test_zero.py.
- T5 (no biases), stage 3 with T5Block units, trained on its real objective (data.format =
  'seq2seq': source -> target with teacher forcing, tests/test_seq2seq.py): losses and parameters
  within the same clip-coefficient ulp. Asserted: 1e-6 relative for everything not bitwise.

Units: GPT2Block ×2 and LlamaDecoderLayer ×2 are the largest ModuleList's children. T5 has two
ModuleLists of T5Block; the larger is decoder.block (cross-attention), so by default the encoder
blocks land in the root unit (half the model gathered for the whole step at stage 3).
parallel.units = "T5Block" makes all four blocks units and leaves the shared embedding and the
two final norms in the root: that is what the T5 parity run uses.
"""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_overrides
from hf_cases import hf_model, hf_train_cases, reverse_jsonl
from shardlm.launch.spawn import run_ranks
from shardlm.parallel.data.zero.units import collect_units
from zero_cases import reference_case

STEPS, WORLD = 3, 2
T5_UNITS = {"parallel.units": "T5Block"}
SEQ2SEQ = {"data.format": "seq2seq", "train.seq_len": 8, "data.source_len": 8, "data.val_fraction": 0.1}


def _base(tmp_path, **extra):
    return tiny_overrides(tmp_path, train__micro_batch=4, **extra)


def _reference(name: str, overrides: dict) -> dict:
    return reference_case(overrides, WORLD, STEPS, model=hf_model(name))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _key_bias_free(name: str, t: torch.Tensor, d_model: int = 64) -> torch.Tensor:
    if name.endswith("attn.c_attn.bias"):  # GPT-2's [q | k | v] bias: drop k (see docstring)
        return torch.cat([t[:d_model], t[2 * d_model:]])
    return t


CASES = [  # (model, stage, extra overrides)
    ("llama", 3, {"train.grad_clip": 0.0}),  # bitwise: no clip coefficient (docstring)
    ("gpt2", 3, {}),
    ("gpt2", 2, {}),
    ("gpt2", 3, {"train.grad_clip": 0.0}),
    ("t5", 3, {**T5_UNITS, **SEQ2SEQ}),
]


def _data(extra: dict, tmp) -> dict:
    """The seq2seq cases' source -> target file."""
    return {"data.source": str(reverse_jsonl(tmp / "rev.jsonl"))} if "data.format" in extra else {}


def _built_cases(tmp) -> list[tuple[str, dict]]:
    """test_meta_built_models_shard_to_the_one_process_model's models and layouts."""
    t5 = {**T5_UNITS, **SEQ2SEQ, **_data(SEQ2SEQ, tmp)}
    return [(name, {**_base(tmp), **(t5 if name == "t5" else {}),
                    "parallel.zero_stage": stage, "run.name": f"{name}{stage}"})
            for name in ("llama", "gpt2", "t5") for stage in (1, 3)]


@pytest.fixture(scope="module")
def two_rank_world(tmp_path_factory):
    """The training cases (runs) and the meta-built models, in one spawned world
    (worlds.several), not one each."""
    from hf_cases import hf_built
    from worlds import several

    tmp = tmp_path_factory.mktemp("hf")
    cases = [(name, {**_base(tmp), **extra, **_data(extra, tmp), "parallel.zero_stage": stage}, STEPS)
             for name, stage, extra in CASES]
    return run_ranks(several, WORLD, tmp, [(hf_train_cases, (cases,)), (hf_built, (_built_cases(tmp),))],
                     timeout=600)


@pytest.fixture(scope="module")
def runs(two_rank_world, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf-ref")
    ranks = [rank[0] for rank in two_rank_world]
    refs = {}
    for name, _, extra in CASES:
        key = (name, extra.get("train.grad_clip"))
        if key not in refs:
            refs[key] = _reference(name, {**_base(tmp), **extra, **_data(extra, tmp)})
    return ranks, [refs[(name, extra.get("train.grad_clip"))] for name, _, extra in CASES]


@pytest.mark.parametrize("index", range(len(CASES)),
                         ids=[f"{n}-stage{s}" + ("-noclip" if "train.grad_clip" in e else "")
                              for n, s, e in CASES])
def test_two_ranks_match_one_process(runs, index):
    (rank0, rank1), refs = runs
    name, _, extra = CASES[index]
    got, ref = rank0[index], refs[index]
    for p in ref["params"]:  # the ranks hold the same model
        assert torch.equal(rank1[index]["params"][p], got["params"][p]), p
    if extra.get("train.grad_clip") == 0:  # bitwise by construction (module docstring)
        # no AdamW tail: each tensor a multiple of 32 floats, so each unit's half (a shard) too
        assert all(v.numel() % 32 == 0 for v in ref["params"].values())
        assert got["losses"] == ref["losses"]
        for p, value in ref["params"].items():
            assert torch.equal(got["params"][p], value), p
        return
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-6)
    for p, value in ref["params"].items():
        a, b = (_key_bias_free(p, t) for t in (got["params"][p], value))
        assert _rel(a, b) <= 1e-6, p


def _units(name: str, classes: str = "") -> list[tuple[str, str]]:
    return [(u.name, type(u.module).__name__) for u in collect_units(hf_model(name), classes)]


def test_units_found():
    assert _units("gpt2") == [("root", "CausalLMAdapter"), ("model.transformer.h.0", "GPT2Block"),
                              ("model.transformer.h.1", "GPT2Block")]
    assert _units("llama") == [("root", "CausalLMAdapter"),
                               ("model.model.layers.0", "LlamaDecoderLayer"),
                               ("model.model.layers.1", "LlamaDecoderLayer")]
    # T5 by default: only the decoder's blocks; the encoder's fall into the root unit.
    assert _units("t5") == [("root", "Seq2SeqAdapter"), ("model.decoder.block.0", "T5Block"),
                            ("model.decoder.block.1", "T5Block")]
    assert _units("t5", "T5Block") == [("root", "Seq2SeqAdapter")] + [
        (f"model.{part}.block.{i}", "T5Block") for part in ("encoder", "decoder") for i in (0, 1)]
    root = {r.name: r for r in collect_units(hf_model("t5"), "T5Block")[0].params}
    assert sorted(root) == ["model.decoder.final_layer_norm.weight",
                            "model.encoder.final_layer_norm.weight", "model.shared.weight"]
    # The tied embedding is one parameter in four places, which the engine keeps tied.
    places = {type(m).__name__ for m, _ in root["model.shared.weight"].places}
    assert len(root["model.shared.weight"].places) == 4 and places == {"Embedding", "Linear"}


def test_build_run_takes_a_user_model(tmp_path):
    from shardlm.config.load import load_config
    from shardlm.train.build import build_run

    model = hf_model("llama")
    run = build_run(load_config(overrides=_base(tmp_path)).validate(), model=model)
    assert run.model is model
    assert run.flops_per_token == 6 * sum(p.numel() for p in model.parameters())


def test_meta_built_models_shard_to_the_one_process_model(two_rank_world, tmp_path):
    """transformers models built on the meta device: each rank materialises only its units,
    initialised by the model's own _init_weights seeded per (seed, module), and the result is
    the model one process materialises whole — at stage 3 (units sharded) and stage 1."""
    from shardlm.models.init import materialize

    cases = _built_cases(tmp_path)
    ranks = [rank[1] for rank in two_rank_world]  # hf_cases.hf_built of _built_cases, in the shared world
    for index, (name, overrides) in enumerate(cases):
        whole = materialize(hf_model(name, "meta"), "cpu", overrides.get("train.seed", 1337))
        cpu_built = hf_model(name)  # the library's own init, for scale
        for key, value in [*whole.named_parameters(), *whole.named_buffers()]:
            for rank in ranks:
                assert torch.equal(rank[index][key], value.detach().float()), (name, key)
            if value.dim() == 2:  # initialised like the library does, not left at zero or garbage
                expected = cpu_built.get_parameter(key).std()
                assert 0.5 * expected < value.std() < 2 * expected, (name, key)
