"""Activation checkpointing changes memory and recomputation, never the gradients or the names."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from test_models import counted_flops

from shardlm.config.model import ModelConfig
from shardlm.models.decoder import build_model
from shardlm.models.flops import flops_per_token
from shardlm.config.presets import get_preset
from shardlm.parallel.blocks.activation import apply_ac

TINY = ("gpt-tiny", "llama-tiny")


def tiny(name: str):
    return build_model(ModelConfig(**get_preset(name)), seed=3)


def loss_and_grads(model, idx):
    loss = model(idx).square().mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("name", TINY)
def test_checkpointed_gradients_are_bitwise_equal(name, mode):
    reference = tiny(name)
    checkpointed = apply_ac(copy.deepcopy(reference), mode)
    idx = torch.randint(0, reference.cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    ref_loss, ref_grads = loss_and_grads(reference, idx)
    loss, grads = loss_and_grads(checkpointed, idx)
    # fp32 on CPU recomputes the same ops on the same inputs: bitwise equality holds.
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for key, grad in grads.items():
        assert torch.equal(grad, ref_grads[key]), key


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_names_and_tying_unchanged(mode):
    model = tiny("gpt-tiny")
    params_before = list(dict(model.named_parameters()))
    state_before = list(model.state_dict())
    modules_before = [n for n, _ in model.named_modules()]
    assert apply_ac(model, mode) is model
    assert list(dict(model.named_parameters())) == params_before
    assert list(model.state_dict()) == state_before
    assert [n for n, _ in model.named_modules()] == modules_before
    assert model.head.weight is model.tok_emb.weight


def test_none_is_identity(caplog):
    model = tiny("llama-tiny")
    blocks = list(model.blocks)
    hooks = [(len(b._forward_pre_hooks), len(b._forward_hooks)) for b in blocks]
    with caplog.at_level(logging.INFO, logger="shardlm"):
        assert apply_ac(model, "none") is model
    assert list(model.blocks) == blocks
    assert [(len(b._forward_pre_hooks), len(b._forward_hooks)) for b in blocks] == hooks
    assert not caplog.records


def test_logs_what_was_applied_and_rejects_unknown_modes(caplog):
    with caplog.at_level(logging.INFO, logger="shardlm"):
        apply_ac(tiny("gpt-tiny"), "selective")
    assert "selective on 2 blocks" in caplog.text
    with pytest.raises(ValueError, match="none, full, selective"):
        apply_ac(tiny("gpt-tiny"), "partial")


@pytest.mark.parametrize("mode", ["none", "full", "selective"])
def test_recompute_flops_match_flop_counter(mode):
    """Full recompute redoes each block's forward except its last linear; selective no matmul."""
    model = apply_ac(tiny("llama-tiny"), mode)
    cfg, batch, seq_len = model.cfg, 2, 32
    idx = torch.randint(0, cfg.vocab_size, (batch, seq_len))
    counted = counted_flops(model, idx)
    scores_recompute = 2 * cfg.n_layers * cfg.d_model * seq_len  # inside the attention backward kernel
    expected = (flops_per_token(cfg, seq_len, recompute=mode) + scores_recompute) * batch * seq_len
    assert counted == expected
