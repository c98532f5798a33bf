"""The mixture-of-experts checkpoint families mapped onto our Decoder (model.hf_path; issue 27;
docs/finetuning.md, "Checkpoint families"): Mixtral, Qwen3-MoE and OLMoE load with transformers'
own logits, export (`shardlm export --format hf`) every tensor back bit for bit, and Mixtral
trains with expert parallelism as one process does.

Each family is a tiny random model written with save_pretrained (2 layers, hidden 64, 4 experts
of width 96, top 2, vocabulary 512, every tensor perturbed), fp32 throughout; the same pattern
as tests/test_hf_families.py, whose helpers it imports."""

from __future__ import annotations

import json

import pytest
import torch

from shardlm.config.load import load_config
from shardlm.errors import ConfigError
from shardlm.config.hf_shapes import causal_lm_config, hf_shape
from shardlm.launch.spawn import run_ranks
from shardlm.train.build import build_run
from test_hf_families import (LLAMA, _hf_logits, lora_adapter_is_peft_exact, save_random_checkpoint,
                              trained_export_is_the_checkpoint)
from test_hf_path import overrides
from tp_cases import whole_params
from zero_cases import reference_case, train_cases

transformers = pytest.importorskip("transformers")

MOE = dict(LLAMA, num_experts_per_tok=2, output_router_logits=False)


def _family(name: str, **extra):
    """(transformers class, its config) of each tiny mixture."""
    tf = transformers
    if name == "mixtral":  # every block sparse, renormalised top 2, a head_dim of its own
        return tf.MixtralForCausalLM, tf.MixtralConfig(
            **{**MOE, "intermediate_size": 96, "head_dim": 32, "num_local_experts": 4,
               "router_jitter_noise": 0.0, **extra})
    if name == "qwen3_moe":  # per-head q/k norms; block 0 dense (decoder_sparse_step 2)
        return tf.Qwen3MoeForCausalLM, tf.Qwen3MoeConfig(
            **{**MOE, "moe_intermediate_size": 96, "head_dim": 32, "num_experts": 4,
               "decoder_sparse_step": 2, "norm_topk_prob": True, "use_sliding_window": False, **extra})
    if name == "olmoe":  # whole-width q/k norms; the top 2's probabilities not renormalised
        return tf.OlmoeForCausalLM, tf.OlmoeConfig(
            **{**MOE, "intermediate_size": 96, "num_experts": 4, "norm_topk_prob": False,
               "pad_token_id": None, **extra})
    raise KeyError(name)


def make_moe_dir(root, name: str, **extra):
    """A tiny random checkpoint of family `name` saved with a WordLevel tokenizer of 512 tokens."""
    return save_random_checkpoint(root / name, *_family(name, **extra))


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "olmoe"])
def test_moe_family_loads_and_exports_bit_for_bit(tmp_path, name):
    """Our Decoder (not the transformers path) has transformers' logits on the first batch
    (1e-5); one step with lr 1e-30 and `shardlm export --format hf` give back every tensor of
    the checkpoint bit for bit, the same model_type and expert fields, and the export's logits."""
    hf_dir, hf = make_moe_dir(tmp_path, name)
    assert causal_lm_config(str(hf_dir)) == ""  # our Decoder's, not a transformers module
    cfg = load_config(overrides=overrides(tmp_path, hf_dir, train__lr=1e-30, run__name=name)).validate()
    m = cfg.model
    assert (m.family, m.experts, m.top_k, m.router_topk_norm) == (name, 4, 2, name != "olmoe")
    assert m.moe_every == (2 if name == "qwen3_moe" else 1)
    assert (m.aux_loss_coef, m.z_loss_coef) == (0.01 if name == "olmoe" else 0.001, 0.0)
    if name == "olmoe":  # the balancing losses are the run's to choose, not the checkpoint's shape
        tuned = load_config(overrides=overrides(tmp_path, hf_dir, model__z_loss_coef=1e-3,
                                                model__aux_loss_coef=0.1)).validate().model
        assert (tuned.z_loss_coef, tuned.aux_loss_coef) == (1e-3, 0.1)
    run = build_run(cfg)
    x, _ = run.train_loader.micro_batches(0)[0]
    with torch.no_grad():
        ours = run.model(x)
    torch.testing.assert_close(ours, _hf_logits(hf, x), atol=1e-5, rtol=1e-5)
    out = trained_export_is_the_checkpoint(tmp_path, run, hf_dir)
    written, source = (json.loads((d / "config.json").read_text()) for d in (out, hf_dir))
    for key in ("model_type", "head_dim", "num_local_experts", "num_experts", "num_experts_per_tok",
                "intermediate_size", "moe_intermediate_size", "decoder_sparse_step", "norm_topk_prob",
                "mlp_only_layers", "rope_parameters", "num_key_value_heads", "tie_word_embeddings"):
        assert written.get(key) == source.get(key), key
    again = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(again) is type(hf)
    torch.testing.assert_close(_hf_logits(again, x), _hf_logits(hf, x), atol=0, rtol=0)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "olmoe"])
def test_moe_lora_adapter_loads_in_peft_onto_the_checkpoint(tmp_path, name):
    """A LoRA run on each mixture (the default targets: attention's linears, and Qwen3-MoE's
    dense block's MLP; the router and the stacked experts are no nn.Linear of ours) writes a PEFT
    adapter that peft applies to the untouched checkpoint with the run's logits (1e-5)."""
    hf_dir, hf = make_moe_dir(tmp_path, name)
    lora_adapter_is_peft_exact(tmp_path, hf_dir, hf)


def test_mixtral_with_ep2_matches_one_process(tmp_path):
    """The Mixtral checkpoint, and the Qwen3-MoE one (a dense block, then a sparse one), with
    parallel.ep = 2 on 2 ranks (each reads only its 2 experts' tensors) against one process with the same global batch: losses and every parameter after
    2 steps within 1e-5 relative (fp32; the experts' rows grouped differently)."""
    from shardlm.checkpoint.hf_names import hf_initializer
    from shardlm.models.decoder import Decoder
    from shardlm.models.placement import Split

    steps = 2
    hf_dir, _ = make_moe_dir(tmp_path, "mixtral")
    base = overrides(tmp_path, hf_dir, train__steps=steps, train__lr=1e-3, run__device="cpu")
    m = load_config(overrides=base).validate().model
    init = hf_initializer(hf_dir, Decoder(m), m)  # rank 1's piece: experts 2 and 3, read alone
    whole = init("blocks.1.mlp.experts.gate_up")
    piece = init.piece("blocks.1.mlp.experts.gate_up", Split(tuple(whole.shape), 0, ((2, 4),)))
    assert torch.equal(piece, whole[2:]) and init.reader.elements_read == whole[2:].numel()
    qwen_dir, _ = make_moe_dir(tmp_path, "qwen3_moe")
    qwen = overrides(tmp_path, qwen_dir, train__steps=steps, train__lr=1e-3, run__device="cpu")
    out = run_ranks(train_cases, 2, tmp_path, [({**base, "parallel.ep": 2, "run.name": "ep"}, steps, -1),
                                               ({**qwen, "parallel.ep": 2, "run.name": "qep"}, steps, -1)])
    refs = [reference_case({**base, "run.name": "ref"}, 2, steps),
            reference_case({**qwen, "run.name": "qref"}, 2, steps)]
    for case, ref in enumerate(refs):
        ranks = [out[r][case] for r in range(2)]
        for got in ranks:
            assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5), case
        whole = whole_params(ranks)
        assert whole.keys() == ref["params"].keys()
        for n, v in ref["params"].items():
            rel = float((whole[n] - v).norm() / v.norm().clamp_min(1e-12))
            assert rel <= 1e-5, (case, n, rel)
        assert ref["losses"][1] != ref["losses"][0]  # it trained


@pytest.mark.parametrize("name, extra, message", [
    ("mixtral", {"router_jitter_noise": 0.1}, r"router_jitter_noise = 0.1"),
    ("qwen3_moe", {"mlp_only_layers": [1]}, r"mlp_only_layers = \[1\]"),
    ("olmoe", {"clip_qkv": 8.0}, r"clip_qkv = 8.0"),
    ("olmoe", {"head_dim": 32}, r"head_dim = 32 \(olmoe's is hidden_size / num_attention_heads = 16\)"),
])
def test_what_our_moe_cannot_compute_goes_the_transformers_way(tmp_path, name, extra, message):
    """A checkpoint with a feature our mixture does not compute is refused by name for our
    Decoder and trains through transformers instead (written as config.json only: no weights)."""
    _, config = _family(name, **extra)
    config.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=message):
        hf_shape(str(tmp_path), "model.hf_path", exact=True)
    assert causal_lm_config(str(tmp_path)) == str(tmp_path / "config.json")


def test_mixtral_8x7b_config_sizes_to_the_published_count(tmp_path):
    """The planner's view of a real Mixtral config.json (its published keys, no weights):
    count_params = Mixtral 8x7B's 46,702,792,704 (presets.PUBLISHED_PARAMS)."""
    from shardlm.models.flops import count_params
    from shardlm.planner.shapes import model_from_hf_config
    from shardlm.config.presets import PUBLISHED_PARAMS

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
        "num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02,
        "sliding_window": None, "tie_word_embeddings": False}))
    m = model_from_hf_config(str(tmp_path / "config.json"))
    assert (m.experts, m.top_k, m.expert_d_ff, m.aux_loss_coef) == (8, 2, 14336, 0.02)
    assert count_params(m) == PUBLISHED_PARAMS["mixtral-8x7b"]


@pytest.mark.parametrize("fields, answer", [
    ({}, "mixtral"),
    ({"qk_norm": True}, "qwen3_moe"),
    ({"qk_norm": True, "moe_every": 2, "router_topk_norm": False}, "qwen3_moe"),
    ({"qk_norm": True, "qk_norm_width": "all", "router_topk_norm": False}, "olmoe"),
    ({"router_topk_norm": False}, r"MixtralForCausalLM: model.router_topk_norm = false \(Mixtral always"),
    ({"qk_norm": True, "qk_norm_width": "all", "moe_every": 2},
     r"OlmoeForCausalLM: model.moe_every = 2 \(blocks \[0\] are dense"),
    ({"family": "qwen3_moe"}, r"Qwen3MoeForCausalLM \(model.family\): model.qk_norm = False"),
    ({"family": "qwen3"}, r"to transformers' qwen3 class \(model.family\): it has no experts"),
])
def test_which_moe_class_exports_a_mixture(fields, answer):
    """A mixture of ours exports to the class its fields imply (or model.family's), and one the
    class cannot express is a ConfigError naming each field."""
    from shardlm.checkpoint.hf_names import hf_family

    cfg = load_config(overrides={"model.preset": "moe-tiny", **{f"model.{k}": v for k, v in fields.items()}})
    if "(" not in answer:
        assert hf_family(cfg.model) == answer
        return
    with pytest.raises(ConfigError, match=answer):
        hf_family(cfg.model)
