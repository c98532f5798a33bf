"""The family registry (config/families/): each built-in file registers its own model_type, the
choices and loadable lists are read from it, and a family is one file: a copy of llama.py under a
new model_type, loaded from a temporary directory with nothing else edited, loads a checkpoint
with transformers' logits and exports it bit for bit."""

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
        assert name in families.loadable() and name in families.sizable()
    assert set(families.loadable()) == set(registered) | set(families.LEGACY)
    assert list(_CHOICES["model.family"]) == ["", *families.loadable()]
    with pytest.raises(ValueError, match="registered twice"):
        families.register(registered["llama"])


def _load_family_file(path: Path) -> None:
    spec = importlib.util.spec_from_file_location(f"family_{path.stem}", path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


def test_a_family_from_one_file_loads_and_exports_a_checkpoint(tmp_path, monkeypatch):
    """llama.py copied as model_type 'llama_copy' into tmp_path and imported from there: a
    LlamaForCausalLM saved with that model_type loads through model.hf_path (the choices accept
    it), has transformers' logits, and `shardlm export` writes every tensor back bit for bit."""
    from shardlm.config import load_config
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
