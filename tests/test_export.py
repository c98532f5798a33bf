"""`shardlm.export.export_hf`: a run directory becomes a transformers model with our logits."""

import sys

import pytest
import torch

from shardlm import checkpoint
from shardlm.config import load_config
from shardlm.errors import ConfigError
from shardlm.data.tokenizer import train_tokenizer
from shardlm.export import export_hf
from shardlm.models import build_model

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
    checkpoint.save_weights(run, model, cfg, tokenizer)
    return run, model.eval()


@pytest.mark.parametrize("overrides, cls", [
    ({"model.preset": "gpt-tiny"}, "GPT2LMHeadModel"),
    ({"model.preset": "gpt-tiny", "model.bias": False, "model.tie_embeddings": False},
     "GPT2LMHeadModel"),
    ({"model.preset": "llama-tiny"}, "LlamaForCausalLM"),  # GQA 4/2, untied
    ({"model.preset": "llama-tiny", "model.bias": True, "model.tie_embeddings": True,
      "model.rope_theta": 500000.0}, "LlamaForCausalLM"),
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

    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = hf_tok(TEXT + " \tnew  words")["input_ids"]
    assert ids == tokenizer.encode(TEXT + " \tnew  words").ids
    assert hf_tok.decode(ids) == TEXT + " \tnew  words"
    assert hf_tok.eos_token == "<|endoftext|>" == hf_tok.convert_ids_to_tokens(hf.config.eos_token_id)


def test_unmappable_config_is_config_error(tmp_path, tokenizer):
    run, _ = make_run(tmp_path, tokenizer, **{"model.preset": "gpt-tiny", "model.position": "rope"})
    with pytest.raises(ConfigError, match="model.position = 'rope'"):
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
