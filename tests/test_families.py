"""The family registry (config/families/): each built-in file registers its own model_type, the
choices and loadable lists are read from it; each family's record (its config.json reader, name
table and export keys) gives exactly its transformers class's tensors; and a family is one file:
a copy of llama.py under a new model_type, loaded from a temporary directory with nothing else
edited, loads a checkpoint with transformers' logits and exports it bit for bit, and a copy of
gpt_neox.py (its own reader, per-head q/k/v rows, renamed head) names its class's tensors."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from shardlm.config import families
from shardlm.config.fields import _CHOICES

transformers = pytest.importorskip("transformers")


def test_each_builtin_file_registers_its_model_type():
    registered = families.registered()
    assert list(registered)[:len(families.BUILTIN)] == list(families.BUILTIN)
    for name, family in registered.items():
        assert family.name == name and family.export is not None
        assert hasattr(transformers, family.config_class) and hasattr(transformers, family.model_class)
        assert name in families.loadable() and (name in families.sizable()) == family.sizable
    assert families.loadable() == tuple(registered) == families.BUILTIN
    assert list(_CHOICES["model.family"]) == ["", *families.loadable()]
    with pytest.raises(ValueError, match="registered twice"):
        families.register(registered["llama"])


TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
            num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)
"""A tiny config of every family's class (each takes the keys it knows)."""


def _names_its_class(tmp_path: Path, name: str, model_type: str = "") -> None:
    """Family `name`'s config class with TINY's sizes, as a config.json (model_type `model_type`
    where given), reads as a model of ours (exactly: hf_shape refuses nothing) that exports back
    to `name` with the class's every tensor by name and shape (meta devices: no values)."""
    from shardlm.checkpoint.export import hf_config, hf_state_dict
    from shardlm.checkpoint.hf_names import hf_family
    from shardlm.config.load import load_config
    from shardlm.models.decoder import build_model

    fam = families.family(model_type or name)
    config = getattr(transformers, fam.config_class)(**TINY).to_dict()
    directory = tmp_path / (model_type or name)
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(dict(config, model_type=model_type or name)))
    cfg = load_config(overrides={"model.hf_path": str(directory), "train.seq_len": 16}).validate()
    assert cfg.model.family == (model_type or name) and hf_family(cfg.model) == (model_type or name)
    ours = build_model(cfg.model, "meta")
    with torch.device("meta"):
        theirs = getattr(transformers, fam.model_class)(hf_config(cfg.model, 0))
    exported = hf_state_dict(ours.state_dict(), cfg.model)
    assert {fam.in_memory_names.get(k, k): tuple(t.shape) for k, t in exported.items()} == \
        {k: tuple(t.shape) for k, t in theirs.state_dict().items()}, name


def test_each_family_names_every_tensor_of_its_class(tmp_path):
    """Every registered family, read from its own class's config.json: our model's parameters
    through its name table are exactly its class's tensors (names and shapes), in the class its
    export keys build."""
    for name in families.registered():
        _names_its_class(tmp_path, name)


def _load_family_file(path: Path) -> None:
    spec = importlib.util.spec_from_file_location(f"family_{path.stem}", path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


def test_a_family_from_one_file_loads_and_exports_a_checkpoint(tmp_path, monkeypatch):
    """llama.py copied as model_type 'llama_copy' into tmp_path and imported from there: a
    LlamaForCausalLM saved with that model_type loads through model.hf_path (the choices accept
    it), has transformers' logits, and `shardlm export` writes every tensor back bit for bit."""
    from shardlm.config.load import load_config
    from shardlm.train.build import build_run
    from test_hf_families import LLAMA, _hf_logits, save_random_checkpoint, trained_export_is_the_checkpoint
    from test_hf_path import overrides

    monkeypatch.setattr(families, "_FAMILIES", dict(families.registered()))  # restored after
    source = (Path(families.__file__).parent / "llama.py").read_text()
    assert source.count('name="llama"') == 1
    (tmp_path / "llama_copy.py").write_text(source.replace('name="llama"', 'name="llama_copy"'))
    _load_family_file(tmp_path / "llama_copy.py")
    assert "llama_copy" in families.loadable() and "llama_copy" in _CHOICES["model.family"]

    config = transformers.LlamaConfig(head_dim=32, tie_word_embeddings=False, **LLAMA)
    hf_dir, hf = save_random_checkpoint(tmp_path / "llama_copy", transformers.LlamaForCausalLM, config)
    written = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps(dict(written, model_type="llama_copy")))

    cfg = load_config(overrides=overrides(tmp_path, hf_dir, train__lr=1e-30)).validate()
    assert (cfg.model.family, cfg.model.head_dim, cfg.model.n_kv_heads) == ("llama_copy", 32, 2)
    run = build_run(cfg)
    x, _ = run.train_loader.micro_batches(0)[0]
    with torch.no_grad():
        torch.testing.assert_close(run.model(x), _hf_logits(hf, x), atol=1e-5, rtol=1e-5)
    out = trained_export_is_the_checkpoint(tmp_path, run, hf_dir)
    again = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(again) is transformers.LlamaForCausalLM
    torch.testing.assert_close(_hf_logits(again, x), _hf_logits(hf, x), atol=0, rtol=0)

    # a family with hooks of its own (reader, per-head rows, renamed head) is one file too
    source = (Path(families.__file__).parent / "gpt_neox.py").read_text()
    assert source.count('name="gpt_neox"') == 1
    (tmp_path / "neox_copy.py").write_text(source.replace('name="gpt_neox"', 'name="neox_copy"'))
    _load_family_file(tmp_path / "neox_copy.py")
    _names_its_class(tmp_path, "gpt_neox", model_type="neox_copy")
