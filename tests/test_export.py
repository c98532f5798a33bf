"""`shardlm.checkpoint.export.export_hf`: a run directory becomes a transformers model with our logits."""

import sys

import pytest
import torch

from shardlm.checkpoint.weights import load_for_inference, save_weights
from shardlm.config.load import load_config
from shardlm.errors import ConfigError
from shardlm.data.tokenizer import train_tokenizer
from shardlm.checkpoint.export import export_hf
from shardlm.models.decoder import build_model

transformers = pytest.importorskip("transformers")

TEXT = "def add(a, b):\n    return a + b  # ü\n"


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer([TEXT] * 50, 512)  # gpt-tiny and llama-tiny have 512 tokens


def make_run(tmp_path, tokenizer, **overrides):
    cfg = load_config(overrides=overrides)
    model = build_model(cfg.model, "cpu", seed=1)
    with torch.no_grad():  # norms start at 1 and biases at 0: perturb so every tensor matters
        gen = torch.Generator().manual_seed(2)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    run = tmp_path / "runs" / "run"
    save_weights(run, model, cfg, tokenizer)
    return run, model.eval()


@pytest.mark.parametrize("overrides, cls", [
    ({"model.preset": "gpt-tiny"}, "GPT2LMHeadModel"),
    ({"model.preset": "gpt-tiny", "model.bias": False, "model.tie_embeddings": False},
     "GPT2LMHeadModel"),
    ({"model.preset": "llama-tiny"}, "LlamaForCausalLM"),  # GQA 4/2, untied
    ({"model.preset": "llama-tiny", "model.bias": True, "model.tie_embeddings": True,
      "model.rope_theta": 500000.0}, "LlamaForCausalLM"),
    ({"model.preset": "llama-tiny", "model.qkv_bias": True, "model.tie_embeddings": True},
     "Qwen2ForCausalLM"),  # biases on q/k/v only
])
def test_export_matches_logits(tmp_path, tokenizer, overrides, cls):
    run, model = make_run(tmp_path, tokenizer, **overrides)
    out = export_hf(run, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == cls
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (hf(ids).logits - model(ids)).abs().max().item()
    print(f"{cls} {overrides}: max |logits diff| = {diff:.3g}")
    assert diff <= 1e-4

    # transformers 5's AutoTokenizer maps model_type qwen2 to Qwen2Tokenizer whatever
    # tokenizer_config.json names, and that class pre-tokenizes with Qwen2's own rules; our
    # tokenizer.json is exact through PreTrainedTokenizerFast (docs/finetuning.md says so).
    loader = transformers.PreTrainedTokenizerFast if cls == "Qwen2ForCausalLM" else transformers.AutoTokenizer
    hf_tok = loader.from_pretrained(out)
    ids = hf_tok(TEXT + " \tnew  words")["input_ids"]
    assert ids == tokenizer.encode(TEXT + " \tnew  words").ids
    assert hf_tok.decode(ids) == TEXT + " \tnew  words"
    assert hf_tok.eos_token == "<|endoftext|>" == hf_tok.convert_ids_to_tokens(hf.config.eos_token_id)


def test_unmappable_config_is_config_error(tmp_path, tokenizer):
    # (GPT-2 with RoPE is StarCoder2's shape, which exports: RMSNorm with learned positions is no class's)
    run, _ = make_run(tmp_path, tokenizer, **{"model.preset": "gpt-tiny", "model.norm": "rmsnorm"})
    with pytest.raises(ConfigError, match="model.norm = 'rmsnorm'"):
        export_hf(run, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_gqa_gpt2_is_config_error(tmp_path, tokenizer):
    run, _ = make_run(tmp_path, tokenizer, **{"model.preset": "gpt-tiny", "model.n_kv_heads": 1})
    with pytest.raises(ConfigError, match="n_kv_heads"):
        export_hf(run, tmp_path / "hf")


def test_export_refuses_the_run_dir_itself(tmp_path, tokenizer):
    run, _ = make_run(tmp_path, tokenizer, **{"model.preset": "gpt-tiny"})
    with pytest.raises(ConfigError, match="run directory itself"):
        export_hf(run, run)


def test_missing_transformers_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(ConfigError, match=r'pip install -e "\.\[hf\]"'):
        export_hf(tmp_path, tmp_path / "hf")


def test_export_refuses_a_non_empty_out_without_force(tmp_path, tokenizer):
    run, _ = make_run(tmp_path, tokenizer, **{"model.preset": "gpt-tiny"})
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="is not empty(.|\n)*--force"):
        export_hf(run, out)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    export_hf(run, out, force=True)
    assert (out / "notes.txt").read_text() == "mine" and (out / "model.safetensors").is_file()
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no staging left
    transformers.AutoModelForCausalLM.from_pretrained(out)


def test_export_never_writes_through_links(tmp_path, tokenizer):
    run, _ = make_run(tmp_path, tokenizer, **{"model.preset": "gpt-tiny"})
    victim = tmp_path / "victim.json"
    victim.write_text("untouched")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").symlink_to(victim)  # planted where the export writes
    with pytest.raises(ConfigError, match=r"\['config.json'\] as links or directories"):
        export_hf(run, out, force=True)
    assert victim.read_text() == "untouched"
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]  # nothing else written
    linked = tmp_path / "linked"
    linked.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.raises(ConfigError, match="is a symbolic link"):
        export_hf(run, linked, force=True)
    assert not (tmp_path / "elsewhere").exists()


# ---- LoRA: the PEFT adapter format (checkpoint/peft_adapter.py) and --merge ----

def make_lora_run(tmp_path, tokenizer, preset, rank=4, alpha=8.0):
    """A run holding a LoRA model whose adapters all matter: the base perturbed as make_run's,
    B (zero at the start) set by hand."""
    from shardlm.models.lora import apply_lora

    cfg = load_config(overrides={"model.preset": preset, "lora.rank": rank, "lora.alpha": alpha})
    model = build_model(cfg.model, "cpu", seed=1)
    apply_lora(model, rank, alpha, 0.0, "", cfg.model.mlp, seed=1)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(2)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    run = tmp_path / "runs" / "lora"
    save_weights(run, model, cfg, tokenizer)
    return run, model.eval()


def _logits(model, ids):
    with torch.no_grad():
        out = model(ids)
    return out if torch.is_tensor(out) else out.logits


@pytest.mark.parametrize("preset", ["llama-tiny", "gpt-tiny"])  # GQA 4/2 + SwiGLU; Conv1D
def test_peft_adapter_and_merge_give_our_logits(tmp_path, tokenizer, preset):
    import peft

    from shardlm.checkpoint.export import export_peft

    run, model = make_lora_run(tmp_path, tokenizer, preset)
    base_dir = export_hf(run, tmp_path / "base")
    adapter_dir = export_peft(run, tmp_path / "adapter")
    merged_dir = export_hf(run, tmp_path / "merged", merge=True)
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    ours = _logits(model, ids)
    loaded, _, _ = load_for_inference(run, torch.device("cpu"))  # adapters included
    assert torch.equal(_logits(loaded, ids), ours)

    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir).eval()
    plain = _logits(base, ids)
    assert (plain - ours).abs().max() > 1e-2  # the adapters change the outputs
    for directory in (adapter_dir, run / "adapter"):  # export's, and the run's own
        adapted = peft.PeftModel.from_pretrained(
            transformers.AutoModelForCausalLM.from_pretrained(base_dir), directory).eval()
        torch.testing.assert_close(_logits(adapted, ids), ours, atol=1e-5, rtol=0)
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    torch.testing.assert_close(_logits(merged, ids), ours, atol=1e-5, rtol=0)


def test_peft_layout(tmp_path, tokenizer):
    """The files as PEFT writes them (checked without peft): `base_model.model.` + the
    transformers module name + `.lora_A.weight`; our fused qkv's A shared by q/k/v, B split."""
    import json

    from safetensors.torch import load_file

    run, model = make_lora_run(tmp_path, tokenizer, "llama-tiny")
    config = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert (config["r"], config["lora_alpha"], config["bias"]) == (4, 8.0, "none")
    assert config["target_modules"] == sorted(f"{p}_proj" for p in (
        "mlp.down", "mlp.gate", "mlp.up", "self_attn.k", "self_attn.o", "self_attn.q", "self_attn.v"))
    assert config["fan_in_fan_out"] is False
    tensors = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    m = model.blocks[1].attn.qkv
    pre = "base_model.model.model.layers.1.self_attn"
    q, kv = 4 * 16, 2 * 16  # llama-tiny: d_model 64, 4 heads, 2 kv heads
    for name, rows in (("q_proj", slice(0, q)), ("k_proj", slice(q, q + kv)),
                       ("v_proj", slice(q + kv, q + 2 * kv))):
        assert torch.equal(tensors[f"{pre}.{name}.lora_A.weight"], m.lora_A.weight)
        assert torch.equal(tensors[f"{pre}.{name}.lora_B.weight"], m.lora_B.weight[rows])
    n_layers = len(model.blocks)
    assert len(tensors) == n_layers * 7 * 2


def test_lora_export_refusals(tmp_path, tokenizer):
    from shardlm.checkpoint.export import export_peft

    run, _ = make_run(tmp_path, tokenizer, **{"model.preset": "gpt-tiny"})
    with pytest.raises(ConfigError, match="no LoRA adapters"):
        export_peft(run, tmp_path / "adapter")
    with pytest.raises(ConfigError, match="not a LoRA run"):
        export_hf(run, tmp_path / "merged", merge=True)
    assert not (tmp_path / "adapter").exists() and not (tmp_path / "merged").exists()
    assert not (run / "adapter").exists()


def test_trained_lora_run_loads_in_peft(tmp_path):
    """A few steps of a llama-tiny LoRA run through the trainer: run_dir/adapter/ loads in peft
    onto the exported base and gives the run's logits; the merged export too."""
    import peft

    from conftest import tiny_overrides
    from shardlm.train.build import build_run
    from shardlm.train.loop import train

    overrides = tiny_overrides(tmp_path, model__preset="llama-tiny", lora__rank=4,
                               train__steps=3, train__lr=1e-2, train__micro_batch=2,
                               run__name="lora")
    train(build_run(load_config(overrides=overrides).validate()))
    run = tmp_path / "runs" / "lora"
    model, _, _ = load_for_inference(run, torch.device("cpu"))
    assert any(p.abs().max() > 0 for n, p in model.named_parameters() if "lora_B" in n)
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    ours = _logits(model, ids)
    base_dir = export_hf(run, tmp_path / "base")
    adapted = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base_dir), run / "adapter").eval()
    torch.testing.assert_close(_logits(adapted, ids), ours, atol=1e-5, rtol=0)
    merged = transformers.AutoModelForCausalLM.from_pretrained(
        export_hf(run, tmp_path / "merged", merge=True)).eval()
    torch.testing.assert_close(_logits(merged, ids), ours, atol=1e-5, rtol=0)
