"""Checkpoint families mapped onto our Decoder (model.hf_path; docs/finetuning.md, "Checkpoint
families"): each loads with transformers' own logits, a 1-step run with a negligible learning
rate exports (`shardlm export --format hf`) the checkpoint's tensors bit for bit, and the mapped
model trains under the parallel axes as one process does.

Each family is a tiny random model written with save_pretrained (2 layers, hidden 64, vocabulary
512, every tensor perturbed so that each one matters), fp32 throughout."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch

from shardlm.cli.main import main as shardlm_main
from shardlm.config.load import load_config
from shardlm.errors import ConfigError
from shardlm.models.hf_build import route_line
from shardlm.config.hf_shapes import causal_lm_config, hf_shape
from shardlm.launch.spawn import run_ranks
from shardlm.train.build import build_run
from shardlm.train.loop import train
from test_hf_path import SPECIAL, WORDS, overrides
from tp_cases import whole_params
from zero_cases import reference_case, train_cases

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402

LLAMA = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
             rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=1)
# original_max_position_embeddings 32 puts the tiny head's frequencies in all three of llama3's
# regimes (kept, smoothed, divided by the factor) and YaRN's ramp inside the head.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


FAMILIES = ["llama3", "llama-yarn", "qwen3", "gemma", "gemma2", "gemma3", "mistral", "phi3", "olmo2",
            "granite", "smollm3", "starcoder2", "gpt_neox", "stablelm"]


def _family(name: str):
    """(transformers class, its config) of each tiny family."""
    tf = transformers
    if name == "llama3":  # Llama 3.2-style: llama3 scaling, tied head, GQA, head_dim * heads != hidden
        return tf.LlamaForCausalLM, tf.LlamaConfig(head_dim=32, tie_word_embeddings=True,
                                                   rope_parameters=LLAMA3_ROPE, **LLAMA)
    if name == "llama-yarn":
        return tf.LlamaForCausalLM, tf.LlamaConfig(rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 32, "beta_fast": 16.0, "beta_slow": 2.0}, **LLAMA)
    if name == "llama-linear":
        return tf.LlamaForCausalLM, tf.LlamaConfig(rope_parameters={
            "rope_type": "linear", "rope_theta": 10000.0, "factor": 3.0}, **LLAMA)
    if name == "llama-dynamic":
        return tf.LlamaForCausalLM, tf.LlamaConfig(rope_parameters={
            "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 1.7}, **LLAMA)
    if name == "qwen2":  # biases on q/k/v only
        return tf.Qwen2ForCausalLM, tf.Qwen2Config(**LLAMA)
    if name == "qwen3":  # q/k RMSNorm per head, a head_dim of its own
        return tf.Qwen3ForCausalLM, tf.Qwen3Config(head_dim=32, tie_word_embeddings=False, **LLAMA)
    if name == "qwen3-window":  # use_sliding_window: a window of 16 on the layer_types' sliding block
        return tf.Qwen3ForCausalLM, tf.Qwen3Config(head_dim=32, use_sliding_window=True, sliding_window=16,
                                                   layer_types=["sliding_attention", "full_attention"], **LLAMA)
    # Gemma: a head_dim of its own, (1 + w) norms, sqrt(hidden)-scaled embeddings, GeGLU, tied
    gemma = dict(LLAMA, head_dim=32)
    # Gemma 2 and 3: a query_pre_attn_scalar that is not head_dim, and a window of 16 that the
    # 32-token rows overrun (caps small enough to bend these tiny models' scores and logits)
    sliding = dict(gemma, query_pre_attn_scalar=24, sliding_window=16)
    if name == "gemma":
        return tf.GemmaForCausalLM, tf.GemmaConfig(hidden_act="gelu_pytorch_tanh", **gemma)
    if name == "gemma2":  # layer_types: sliding, full
        return tf.Gemma2ForCausalLM, tf.Gemma2Config(attn_logit_softcapping=2.0,
                                                     final_logit_softcapping=3.0, **sliding)
    if name == "gemma3":  # q/k norms; linear-scaled global RoPE, the sliding blocks' own base
        return tf.Gemma3ForCausalLM, tf.Gemma3TextConfig(
            layer_types=["sliding_attention", "full_attention"], rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}, **sliding)
    if name == "mistral":  # a window of 16 on every block, a head_dim of its own
        return tf.MistralForCausalLM, tf.MistralConfig(sliding_window=16, head_dim=32, **LLAMA)
    if name == "phi3":  # fused qkv_proj and gate_up_proj; a window of 16 on every block
        return tf.Phi3ForCausalLM, tf.Phi3Config(sliding_window=16, pad_token_id=None, **LLAMA)
    if name == "olmo2":  # norms after attention and the MLP, q/k norms over whole projections
        return tf.Olmo2ForCausalLM, tf.Olmo2Config(**LLAMA)
    if name == "granite":  # its four multipliers
        return tf.GraniteForCausalLM, tf.GraniteConfig(embedding_multiplier=12.0, residual_multiplier=0.22,
                                                       attention_multiplier=0.0625, logits_scaling=8.0,
                                                       **LLAMA)
    if name == "smollm3":  # NoPE in every 2nd block
        return tf.SmolLM3ForCausalLM, tf.SmolLM3Config(no_rope_layer_interval=2, pad_token_id=None, **LLAMA)
    if name == "starcoder2":  # LayerNorm + biases, GELU c_fc/c_proj, RoPE, GQA, a window of 16
        return tf.Starcoder2ForCausalLM, tf.Starcoder2Config(sliding_window=16, pad_token_id=None, **{
            k: v for k, v in LLAMA.items() if k != "rms_norm_eps"})
    if name == "gpt_neox":  # parallel residual, half the head rotated, exact GELU, qkv fused per head
        return tf.GPTNeoXForCausalLM, tf.GPTNeoXConfig(
            vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=160,
            max_position_embeddings=128, bos_token_id=1, eos_token_id=1, pad_token_id=None,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    if name == "stablelm":  # LayerNorms with biases, q/k/v biases, a quarter of each head rotated
        return tf.StableLmForCausalLM, tf.StableLmConfig(use_qkv_bias=True, pad_token_id=None, **{
            k: v for k, v in LLAMA.items() if k != "rms_norm_eps"})
    raise KeyError(name)


def make_family_dir(root, name: str):
    """A tiny random checkpoint of family `name` saved with a WordLevel tokenizer of 512 tokens."""
    return save_random_checkpoint(root / name, *_family(name))


def save_random_checkpoint(out, cls, config):
    """`cls(config)` at seed 0, every tensor perturbed, saved to `out` with a WordLevel tokenizer
    of 512 tokens: (out, the transformers model)."""
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():  # norms start at 1 and biases at 0: perturb so every tensor matters
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(out)
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(SPECIAL + WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(out / "tokenizer.json"))
    return out, model


def _hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("rope", [
    LLAMA3_ROPE,
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 3.0},
    {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 1.7},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
     "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False, "mscale": 0.8, "mscale_all_dim": 0.5},
], ids=["llama3", "linear", "dynamic", "yarn", "yarn-mscale-untruncated"])
def test_rope_frequencies_are_transformers_own(tmp_path, rope):
    """model.rope_* read from config.json give exactly the inverse frequencies and attention
    factor of transformers' ROPE_INIT_FUNCTIONS (bit for bit), head_dim 32 of hidden 64."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from shardlm.models.rope import rope_frequencies

    config = transformers.LlamaConfig(head_dim=32, rope_parameters=dict(rope), **LLAMA)
    config.save_pretrained(tmp_path)
    ours = load_config(overrides={"model.hf_path": str(tmp_path), "train.seq_len": 32}).validate().model
    theirs, factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, None)
    inv_freq, attention_factor = rope_frequencies(ours)
    assert torch.equal(inv_freq, theirs) and attention_factor == factor


@pytest.mark.parametrize("kind, keys, window, every", [
    ("qwen2", {"use_sliding_window": False}, 0, 0),  # the window is ignored: full attention
    ("qwen2", {"use_sliding_window": True, "max_window_layers": 0}, 16, 0),  # every block
    ("qwen3", {"use_sliding_window": True, "layer_types": ["sliding_attention", "full_attention"] * 2}, 16, 2),
    ("qwen3", {"use_sliding_window": True, "max_window_layers": 2}, 0, 0),  # full blocks first: capped
    ("qwen3_moe", {"use_sliding_window": True}, 16, 0),  # every block, whatever the layers
])
def test_qwen_sliding_blocks_are_transformers_own(tmp_path, kind, keys, window, every):
    """use_sliding_window / max_window_layers / layer_types read as transformers' Qwen2, Qwen3
    and Qwen3-MoE configs compute them: the blocks that slide and their window are the ones
    transformers' modules mask (config.json only); a pattern our model.global_every cannot
    express caps the context at the window, where windowed and full attention agree."""
    from shardlm.models.decoder import is_sliding

    config = transformers.AutoConfig.for_model(kind, **dict(LLAMA, num_hidden_layers=4, sliding_window=16,
                                                            head_dim=16), **keys)
    config.save_pretrained(tmp_path)
    m = load_config(overrides={"model.hf_path": str(tmp_path), "train.seq_len": 16}).validate().model
    theirs = [config.sliding_window is not None and getattr(config, "layer_types", ["sliding_attention"] * 4)[i]
              == "sliding_attention" for i in range(4)]
    assert (m.sliding_window, m.global_every) == (window, every)
    if window or not any(theirs):
        assert [is_sliding(m, i) for i in range(4)] == theirs and m.max_seq_len == 128
    else:
        assert m.max_seq_len == config.sliding_window


def trained_export_is_the_checkpoint(tmp_path, run, hf_dir, tied_head_written: bool = False):
    """Train `run` (an lr-negligible one), export it with `shardlm export --format hf` (the CLI)
    and check every tensor of the checkpoint comes back bit for bit (a tied head: written or
    not, as the family's class does); returns the export's directory."""
    train(run)
    out = tmp_path / "export"
    assert shardlm_main(["export", "--checkpoint", str(run.run_dir), "--format", "hf", "--out", str(out)]) == 0
    original, exported = load_file(hf_dir / "model.safetensors"), load_file(out / "model.safetensors")
    head = {"lm_head.weight"} if tied_head_written else set()
    assert exported.keys() - head == original.keys() - head
    for key, value in original.items():
        assert torch.equal(exported[key], value), key
    return out


@pytest.mark.parametrize("name", [*FAMILIES, "qwen3-window"])
def test_family_loads_trains_and_exports_bit_for_bit(tmp_path, name):
    """transformers' logits on the first batch (1e-5); then one step with lr 1e-30 (AdamW moves
    no fp32 weight by so little) and `shardlm export --format hf` (the CLI): every tensor of the
    checkpoint comes back equal bit for bit, with the same model_type and RoPE, and the export
    loads in AutoModelForCausalLM with the original's logits."""
    hf_dir, hf = make_family_dir(tmp_path, name)
    cfg = load_config(overrides=overrides(tmp_path, hf_dir, train__lr=1e-30, run__name=name)).validate()
    run = build_run(cfg)
    x, y = run.train_loader.micro_batches(0)[0]
    with torch.no_grad():
        ours = run.model(x)
    torch.testing.assert_close(ours, _hf_logits(hf, x), atol=1e-5, rtol=1e-5)
    out = trained_export_is_the_checkpoint(tmp_path, run, hf_dir, tied_head_written=True)
    written, source = (json.loads((d / "config.json").read_text()) for d in (out, hf_dir))
    for key in ("model_type", "head_dim", "rope_parameters", "tie_word_embeddings", "num_key_value_heads",
                "query_pre_attn_scalar", "sliding_window", "layer_types", "attn_logit_softcapping",
                "final_logit_softcapping", "no_rope_layers", "embedding_multiplier", "residual_multiplier",
                "attention_multiplier", "logits_scaling", "use_parallel_residual", "hidden_act"):
        assert written.get(key) == source.get(key), key
    again = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(again) is type(hf)
    torch.testing.assert_close(_hf_logits(again, x), _hf_logits(hf, x), atol=0, rtol=0)


def test_families_train_with_tp_and_zero3_as_one_process(tmp_path):
    """Llama 3.2-style (llama3 RoPE scaling, tied head, GQA 4/2, head_dim 32 with hidden 64)
    with parallel.tp = 2 and with ZeRO-3 on 2 ranks; Qwen3 (its per-head q/k norms summed over
    the tensor-parallel group) with tp = 2; Gemma-2-style (soft-capping, sliding window, sandwich
    (1 + w) norms) with tp = 2 and sequence parallelism; the Llama 3.2-style again with pp = 2
    and cp = 2 (ring attention over its scaled RoPE); OLMo-2 (q/k norms over every head, their
    sums of squares all-reduced over the tensor-parallel group) with tp = 2: losses and every parameter after 2 steps
    within 1e-5 relative of one process with the same global batch (fp32; tensor parallelism
    and the ring reorder sums: a reordered fp32 sum of K terms moves by ~√K·eps relative,
    eps = 1.2e-7, K ≤ 256 here, ~2e-6; AdamW's eps is 1e-4 so that Adam does not turn the
    rounding of a near-zero gradient into a whole lr-sized step, see below)."""
    steps = 2
    # AdamW's eps 1e-4 (not 1e-8) in every case: Adam's update m/(√v + eps) is ±lr whatever the
    # gradient's size, so for an element whose gradient is near zero (a sum that cancels) the
    # rounding of a reordered sum — tp's partial products, the ring's merge — decides a
    # lr-sized step: with 1e-8, a gate_up element behind OLMo-2's post-norms moved 6.6e-6 of its
    # weight (measured on the Intel kind), and Gemma-2's gate_up under tp + SP 1.13e-5 of it on
    # an AMD EPYC Zen 4, past the bound below. With eps 1e-4 an update is at most lr·|g|/eps,
    # so a gradient's rounding error stays a rounding error of the update (with eps 1e-3 every
    # parameter was within 3e-8).
    exact = dict(train__steps=steps, train__lr=1e-3, train__eps=1e-4, run__device="cpu")
    llama, _ = make_family_dir(tmp_path, "llama3")
    qwen, _ = make_family_dir(tmp_path, "qwen3")
    base = overrides(tmp_path, llama, **exact)
    gemma, _ = make_family_dir(tmp_path, "gemma2")
    qwen_base = overrides(tmp_path, qwen, **exact)
    gemma_base = overrides(tmp_path, gemma, **exact)
    olmo, _ = make_family_dir(tmp_path, "olmo2")
    olmo_base = overrides(tmp_path, olmo, **exact)
    cases = [({**base, "parallel.tp": 2, "run.name": "tp"}, steps, -1),
             ({**base, "parallel.zero_stage": 3, "run.name": "z3"}, steps, -1),
             ({**qwen_base, "parallel.tp": 2, "run.name": "qtp"}, steps, -1),
             ({**gemma_base, "parallel.tp": 2, "parallel.sequence_parallel": True, "run.name": "gtp"}, steps, -1),
             ({**base, "parallel.pp": 2, "run.name": "pp"}, steps, -1),
             ({**base, "parallel.cp": 2, "run.name": "cp"}, steps, -1),
             ({**olmo_base, "parallel.tp": 2, "run.name": "otp"}, steps, -1)]
    out = run_ranks(train_cases, 2, tmp_path, cases)
    # the global batch: tp's one data-parallel rank, ZeRO-3's two (accumulated in one process)
    refs = [reference_case({**base, "run.name": "ref1"}, 1, steps),
            reference_case({**base, "run.name": "ref2"}, 2, steps),
            reference_case({**qwen_base, "run.name": "qref"}, 1, steps),
            reference_case({**gemma_base, "run.name": "gref"}, 1, steps)]
    refs += [refs[0], refs[0]]  # pp and cp: one data-parallel rank, as tp
    refs.append(reference_case({**olmo_base, "run.name": "oref"}, 1, steps))
    whole_of = {0: whole_params, 1: lambda r: r[0]["params"], 2: whole_params, 3: whole_params,
                4: lambda r: {**r[0]["params"], **r[1]["params"]},  # each stage its blocks
                5: lambda r: r[0]["params"], 6: whole_params}
    for case, what in enumerate(["tp=2 llama3", "zero3 llama3", "tp=2 qwen3", "tp=2 + SP gemma2",
                                 "pp=2 llama3", "cp=2 llama3", "tp=2 olmo2"]):
        ref, ranks = refs[case], [out[r][case] for r in range(2)]
        for got in ranks:
            assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5), what
        whole = whole_of[case](ranks)
        assert whole.keys() == ref["params"].keys(), what
        for n, v in ref["params"].items():
            rel = float((whole[n] - v).norm() / v.norm().clamp_min(1e-12))
            assert rel <= 1e-5, (what, n, rel)
        assert ref["losses"][1] != ref["losses"][0]  # it trained


@pytest.mark.parametrize("rope, message, unreadable", [
    ({"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0], "long_factor": [1.0]},
     r"rope scaling 'longrope'", None),
    ({"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}, r"'llama3' without low_freq_factor",
     r"transformers cannot read it as a LlamaConfig: .*Missing required keys"),
    ({"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0, "partial_rotary_factor": 0.5},
     r"partial_rotary_factor = 0.5", None),
])
def test_rope_the_decoder_cannot_compute_goes_the_transformers_way(tmp_path, rope, message, unreadable):
    """A mapped family with a feature our decoder does not compute is never loaded into a network
    that only resembles it: it trains as transformers' own module, and the route line says why
    (or, where transformers cannot read the config either, a ConfigError says what is missing)."""
    config = {"model_type": "llama", "vocab_size": 512, "num_hidden_layers": 2,
              "num_attention_heads": 4, "hidden_size": 64, "intermediate_size": 128,
              "max_position_embeddings": 64, "rope_parameters": rope}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message):
        hf_shape(str(tmp_path), "model.hf_path", exact=True)
    cfg = load_config(overrides={"model.hf_path": str(tmp_path)})
    if unreadable:  # said by the route line, before anything is spawned
        with pytest.raises(ConfigError, match=unreadable):
            route_line(cfg.model)
        return
    assert causal_lm_config(str(tmp_path)) and "transformers" in cfg.model.preset
    assert re.search(message, route_line(cfg.model)), route_line(cfg.model)


def test_transformers_4_rope_scaling_spelling_maps_the_same(tmp_path):
    """transformers 4 wrote rope_scaling (and rope_theta beside it); 5 writes rope_parameters."""
    common = {"model_type": "llama", "vocab_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
              "hidden_size": 64, "intermediate_size": 128, "max_position_embeddings": 64, "head_dim": 32}
    old = dict(common, rope_theta=500000.0, rope_scaling={"type": "llama3", **{
        k: v for k, v in LLAMA3_ROPE.items() if k not in ("rope_type", "rope_theta")}})
    new = dict(common, rope_parameters=LLAMA3_ROPE)
    shapes = []
    for i, config in enumerate((old, new)):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "config.json").write_text(json.dumps(config))
        shapes.append(load_config(overrides={"model.hf_path": str(tmp_path / str(i))}).model)
    same = ("preset", "hf_path")  # the directories' names
    assert replace(shapes[0], **{k: "" for k in same}) == replace(shapes[1], **{k: "" for k in same})
    m = shapes[0]
    assert (m.rope_type, m.rope_factor, m.rope_original_max_seq_len, m.head_dim) == ("llama3", 8.0, 32, 32)


@pytest.mark.parametrize("fields, message", [
    ({"model.attn_softcap": 50.0, "model.attention": "sdpa"}, r"only 'math' writes the scores out"),
    ({"model.sliding_window": 16, "model.attention": "per_document"}, r"has no window mask yet"),
    ({"model.qk_norm": True, "model.qk_norm_width": "all", "model.n_kv_heads": 1, "parallel.tp": 2},
     r"parallel.tp = 2 > the 1 key/value heads: the key norm spans every head"),
    ({"model.rope_fraction": 0.2}, r"rotates 3 features of each head"),
    ({"model.rope_type": "llama3", "model.rope_low_freq_factor": 4.0}, r"must exceed"),
])
def test_features_a_kernel_or_axis_cannot_compute_are_refused_early(fields, message):
    """Before any process starts (Config.validate), naming the keys and the way out."""
    values = {"model.preset": "llama-tiny", "train.seq_len": 32, **fields}
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=values).validate()


def lora_adapter_is_peft_exact(tmp_path, hf_dir, hf, **extra) -> None:
    """A LoRA step (rank 4, lr 1e-2: every lora_B moves off zero) on the checkpoint in `hf_dir`:
    the PEFT adapter the run writes (run_dir/adapter), applied by peft.PeftModel.from_pretrained
    to `hf` (the transformers model that wrote the checkpoint, untouched by the run), gives
    the run's logits (1e-5)."""
    import peft

    values = overrides(tmp_path, hf_dir, lora__rank=4, train__lr=1e-2, run__name="lora", **extra)
    run = build_run(load_config(overrides=values).validate())
    train(run)
    lora_b = {n: p for n, p in run.model.named_parameters() if "lora_B" in n}
    assert lora_b and all(p.abs().max() > 1e-3 for p in lora_b.values())  # the adapters count
    x, _ = run.train_loader.micro_batches(0)[0]
    adapted = peft.PeftModel.from_pretrained(hf, run.run_dir / "adapter").eval()
    with torch.no_grad():
        ours = run.model(x)
        torch.testing.assert_close(adapted(input_ids=x).logits, ours, atol=1e-5, rtol=1e-5)
    targets = json.loads((run.run_dir / "adapter" / "adapter_config.json").read_text())["target_modules"]
    modules = dict(hf.named_modules())  # PEFT holds the checkpoint's own module names
    assert all(any(n.endswith(t) for n in modules) for t in targets), targets


@pytest.mark.parametrize("name", [*(f for f in FAMILIES if f != "llama-yarn"), "qwen2"])  # yarn: llama3's names
def test_lora_adapter_loads_in_peft_onto_the_checkpoint(tmp_path, name):
    """Each family's LoRA run (the default targets: attention's q/k/v and output, the MLP's
    linears) writes a PEFT adapter on transformers' own modules: fused ones as they are fused
    (Phi-3's qkv_proj and gate_up_proj take our B whole; GPT-NeoX's per-head query_key_value
    rows reordered as the weights are), split ones with our B's rows apiece and A shared.
    Llama 3.2-style also adapts its head, tied to the embedding (PEFT's lm_head)."""
    hf_dir, hf = make_family_dir(tmp_path, name)
    head = {"lora__targets": "attn.qkv,attn.proj,mlp.gate_up,mlp.down,head"} if name == "llama3" else {}
    lora_adapter_is_peft_exact(tmp_path, hf_dir, hf, **head)


def test_parameter_counts_are_the_checkpoints(tmp_path):
    """models/flops.py count_params (what the planner and MFU use) = our built model's
    parameters = the transformers model's, for every family's shape (q/k norms, sandwich
    norms, LayerNorm biases, head_dim included)."""
    from shardlm.models.decoder import build_model
    from shardlm.models.flops import count_params

    for name in ["llama3", "qwen3", "gemma2", "gemma3", "phi3", "olmo2", "granite", "smollm3",
                 "starcoder2", "gpt_neox", "stablelm"]:
        cls, config = _family(name)
        config.save_pretrained(tmp_path / name)
        m = load_config(overrides={"model.hf_path": str(tmp_path / name), "train.seq_len": 32}).model
        built = sum(p.numel() for p in build_model(m, device="meta").parameters())
        with torch.device("meta"):
            theirs = sum(p.numel() for p in cls(config).parameters())
        assert count_params(m) == built == theirs, name
