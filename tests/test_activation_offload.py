"""Activation offload (activation.offload = 'cpu') moves saved activations, never the gradients.

On this CPU the device is the host, so offload normally leaves each saved tensor in place; the
tests set shardlm.parallel.blocks.activation.FORCE_HOST_COPY so every offloaded tensor becomes a separate
host copy (the path a GPU takes, without its streams) and compare bitwise with keeping them.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import shardlm.parallel.blocks.activation as activation
from conftest import tiny_overrides
from shardlm.config.load import load_config
from shardlm.errors import ConfigError
from shardlm.parallel.blocks.activation import apply_ac, apply_offload
from shardlm.launch.spawn import run_ranks

from test_activation import TINY, loss_and_grads, tiny  # the same tiny models and objective


@pytest.fixture
def forced_copy(monkeypatch):
    monkeypatch.setattr(activation, "FORCE_HOST_COPY", True)


@pytest.mark.parametrize("name", TINY)
def test_offloaded_gradients_are_bitwise_equal(name, forced_copy, monkeypatch):
    reference = tiny(name)
    model = copy.deepcopy(reference)
    offload = apply_offload(model, "cpu")
    packed_params = []
    original = activation.ActivationOffload._pack

    def spy(self, t):
        packed = original(self, t)
        if not isinstance(packed, torch.Tensor):  # a host copy: it must not be a parameter's
            own = {p.untyped_storage().data_ptr() for p in model.parameters()}
            packed_params.append(t.untyped_storage().data_ptr() in own)
            assert packed.record.host.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
        return packed

    monkeypatch.setattr(activation.ActivationOffload, "_pack", spy)
    idx = torch.randint(0, reference.cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    ref_loss, ref_grads = loss_and_grads(reference, idx)
    loss, grads = loss_and_grads(model, idx)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for key, grad in grads.items():
        assert torch.equal(grad, ref_grads[key]), key
    assert offload.packed_tensors + offload.deduplicated == len(packed_params) > 0
    assert offload.packed_bytes > 0
    # storage moves once: Llama's norm outputs feed q, k, v and gate, up (separate linears),
    # GPT-2's q, k, v are views of one c_attn output: each copied once
    assert offload.deduplicated > 0
    assert not any(packed_params)  # parameters stay where they are
    assert offload.skipped_params > 0 and offload.kept == 0


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_offload_with_recomputation_moves_each_block_s_input(mode, forced_copy):
    """With a checkpoint (activation.checkpoint), what a block keeps is its input (and for
    'selective' the policy's cache, which stays): offload copies exactly each block's input to
    host memory, the recomputation reads it back, and the gradients are bitwise those of the
    checkpoint alone."""
    reference = apply_ac(tiny("llama-tiny"), mode)
    model = apply_ac(tiny("llama-tiny"), mode)
    offload = apply_offload(model, "cpu")
    idx = torch.randint(0, reference.cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    ref_loss, ref_grads = loss_and_grads(reference, idx)
    loss, grads = loss_and_grads(model, idx)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(g, ref_grads[k]) for k, g in grads.items())
    n_blocks, d_model = len(model.blocks), model.cfg.d_model
    assert offload.packed_tensors == n_blocks  # one input (B, T, C) per block, nothing else
    assert offload.packed_bytes == n_blocks * 2 * 32 * d_model * 4


def test_cpu_device_without_forced_copy_moves_nothing():
    """The documented copy-free path: the hooks run, every saved tensor stays in place."""
    reference, model = tiny("llama-tiny"), tiny("llama-tiny")
    offload = apply_offload(model, "cpu")
    idx = torch.randint(0, reference.cfg.vocab_size, (2, 16))
    ref_loss, ref_grads = loss_and_grads(reference, idx)
    loss, grads = loss_and_grads(model, idx)
    assert torch.equal(loss, ref_loss) and all(torch.equal(g, ref_grads[k]) for k, g in grads.items())
    assert offload.packed_bytes == 0 and offload.kept > 0 and offload.skipped_params > 0


def test_first_blocks_only_and_names_unchanged(forced_copy, caplog):
    model = tiny("gpt-tiny")
    names, state = [n for n, _ in model.named_parameters()], list(model.state_dict())
    assert apply_offload(model, "none") is None
    with caplog.at_level(logging.INFO, logger="shardlm"):
        offload = apply_offload(model, "cpu", blocks=1)
    assert "saved activations of 1 of 2 blocks" in caplog.text
    assert offload.blocks == [model.blocks[0]]
    assert [n for n, _ in model.named_parameters()] == names and list(model.state_dict()) == state
    loss_and_grads(model, torch.randint(0, model.cfg.vocab_size, (1, 16)))
    one_block = offload.packed_bytes
    offload.remove()
    every = apply_offload(model, "cpu")
    loss_and_grads(model, torch.randint(0, model.cfg.vocab_size, (1, 16)))
    assert every.packed_bytes == 2 * one_block > 0  # two identical blocks
    with pytest.raises(ValueError, match="none, cpu"):
        apply_offload(model, "gpu")


def _errors(**overrides) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(overrides={k.replace("__", "."): v for k, v in overrides.items()}).validate()
    return str(err.value)


def test_config_refusals():
    for mode in ("full", "selective"):  # compose: the checkpoint's kept inputs are offloaded
        load_config(overrides={"activation.offload": "cpu", "activation.checkpoint": mode}).validate()
    assert "no effect with activation.offload = 'none'" in _errors(activation__offload_blocks="1")
    assert "exceeds the model's 2 blocks" in _errors(activation__offload="cpu", activation__offload_blocks="3",
                                                     model__preset="gpt-tiny")
    assert "choose one of none, cpu" in _errors(activation__offload="nvme")
    assert "activation.offload_blocks = -1 must be >= 0" in _errors(activation__offload_blocks="-1")
    load_config(overrides={"activation.offload": "cpu", "train.compile": "true"}).validate()  # composes (test_compile.py)
    load_config(overrides={"activation.offload": "cpu", "activation.offload_blocks": "1",
                           "model.preset": "gpt-tiny", "train.seq_len": "64", "parallel.zero_stage": "3"}).validate()


STEPS = 2


@pytest.fixture(scope="module")
def zero3_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("act_offload")
    base = tiny_overrides(tmp, train__micro_batch=4, train__seq_len=32, parallel__zero_stage=3)
    cases = [{**base, "model.preset": preset, **extra} for preset in TINY
             for extra in ({}, {"activation.offload": "cpu"})]
    from activation_offload_cases import offload_cases
    return run_ranks(offload_cases, 2, tmp, cases, STEPS, timeout=600)


@pytest.mark.parametrize("index", [0, 1])
def test_zero3_two_ranks_offload_matches_keeping(zero3_runs, index):
    """ZeRO-3 gathers inside the offload hooks' scope: its parameters are recognised (not
    copied) and its backward re-gather refills the storage the saved views point at."""
    for rank_cases in zero3_runs:
        kept, offloaded = rank_cases[2 * index], rank_cases[2 * index + 1]
        assert offloaded["losses"] == kept["losses"]
        assert offloaded["params"].keys() == kept["params"].keys()
        for name, value in offloaded["params"].items():
            assert torch.equal(value, kept["params"][name]), name
        assert kept["packed"] == 0 and offloaded["packed"] > 0
        assert offloaded["packed_params"] == 0
