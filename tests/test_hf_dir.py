"""Slices of a local transformers directory (safetensors shards + index), read as a rank's
ZeRO shard would be: every flat range equals the same range of the whole tensor."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from shardlm.checkpoint.hf_dir import HFDirError, HFDirReader


@pytest.fixture
def sharded_dir(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"wte.weight": torch.randn(50, 12, generator=g), "h.0.attn.c_attn.weight": torch.randn(12, 36, generator=g),
               "h.0.ln_1.bias": torch.randn(12, generator=g), "h.0.mlp.c_fc.weight": torch.randn(3, 4, 5, generator=g)}
    names = sorted(tensors)
    files = {"model-00001-of-00002.safetensors": names[:2], "model-00002-of-00002.safetensors": names[2:]}
    for file, keys in files.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / file))
    index = {"metadata": {}, "weight_map": {k: f for f, keys in files.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    return tmp_path, tensors


def test_every_range_matches_the_whole_tensor(sharded_dir):
    root, tensors = sharded_dir
    reader = HFDirReader(root)
    assert reader.names() == sorted(tensors)
    for name, whole in tensors.items():
        flat, n = whole.reshape(-1), whole.numel()
        for start, end in [(0, n), (0, 1), (n - 1, n), (5, 5), (7, n // 2 + 3), (n // 3, n - 2)]:
            out = torch.full((end - start,), float("nan"), dtype=torch.float64)
            reader.read_range(name, tuple(whole.shape), start, end, out)
            assert torch.equal(out, flat[start:end].double()), (name, start, end)


def test_single_file_directory(tmp_path):
    save_file({"a": torch.arange(6.0).reshape(2, 3)}, str(tmp_path / "model.safetensors"))
    out = torch.empty(3)
    HFDirReader(tmp_path).read_range("a", (2, 3), 2, 5, out)
    assert out.tolist() == [2.0, 3.0, 4.0]


def test_clear_errors(sharded_dir, tmp_path_factory):
    root, tensors = sharded_dir
    reader = HFDirReader(root)
    with pytest.raises(HFDirError, match="no tensor 'missing'"):
        reader.read_range("missing", (1,), 0, 1, torch.empty(1))
    with pytest.raises(HFDirError, match="shape"):
        reader.read_range("wte.weight", (12, 50), 0, 1, torch.empty(1))
    (root / "model-00001-of-00002.safetensors").unlink()  # not opened yet
    with pytest.raises(HFDirError, match="missing"):
        reader.read_range("h.0.ln_1.bias", (12,), 0, 1, torch.empty(1))
    empty = tmp_path_factory.mktemp("empty")
    with pytest.raises(HFDirError, match="neither model.safetensors"):
        HFDirReader(empty)
    hostile = tmp_path_factory.mktemp("hostile")
    (hostile / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../x.safetensors"}}))
    with pytest.raises(HFDirError, match="plain file names"):
        HFDirReader(hostile)
