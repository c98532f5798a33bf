"""Adapters that plug a Hugging Face transformers model into our loop unmodified.

The loop calls `forward(idx) -> logits (B, T, vocab)` and computes the loss itself (trainer.
loss_of); a transformers model takes keyword arguments and returns a ModelOutput. An adapter
is the thinnest bridge: the wrapped model is a registered child (`self.model`), so the ZeRO
engine sees its modules unchanged — the units are found as for any model (the largest
nn.ModuleList's children, or `parallel.units` class names; zero/units.py), and tied weights
(GPT-2's and T5's embedding = output head) are the same Parameter in two places, which the
engine keeps tied.

    model = CausalLMAdapter(LlamaForCausalLM(LlamaConfig(vocab_size=cfg.model.vocab_size, ...)))
    run = build_run(cfg, model=model)

Build the model identically on every rank (seed torch first, set `attn_implementation`
explicitly) and set its dropout to 0 if runs are to be compared: each rank draws its own masks.
transformers is an optional extra (`pip install shardlm[hf]`): nothing here imports it, the
adapters only call the model they are given.
"""

from __future__ import annotations

import torch
from torch import nn


def _check_vocab(model: nn.Module, vocab_size: int | None) -> None:
    got = getattr(model.config, "vocab_size", None)
    if vocab_size is not None and got != vocab_size:
        raise ValueError(f"{type(model).__name__} has vocab_size {got}, the data {vocab_size}: "
                         "build it with the config's model.vocab_size")


class CausalLMAdapter(nn.Module):
    """Any `*ForCausalLM` (GPT2LMHeadModel, LlamaForCausalLM, ...): logits of `input_ids`."""

    def __init__(self, model: nn.Module, vocab_size: int | None = None):
        super().__init__()
        _check_vocab(model, vocab_size)
        self.model = model
        # No KV cache in training: it would only allocate (and, under ZeRO-3, the cache object
        # is not a tensor output, so nothing is lost by turning it off).
        self.model.config.use_cache = False

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx, use_cache=False).logits


class Seq2SeqAdapter(nn.Module):
    """A T5-style encoder-decoder (T5ForConditionalGeneration, ...) as `idx -> logits`.

    The encoder reads idx; the decoder reads idx shifted right by one, starting with the
    model's `decoder_start_token_id`, so the logits at position t are aligned with the loop's
    next-token targets y[t] = idx[t + 1]. THIS IS A TEST OBJECTIVE, not how one trains T5: the
    encoder sees the whole sequence, targets included, so the task is copying. It exercises
    every parameter (encoder, cross-attention, decoder, tied head) with the loop's loss, which
    is what parity tests of the distributed engine need.
    """

    def __init__(self, model: nn.Module, vocab_size: int | None = None):
        super().__init__()
        _check_vocab(model, vocab_size)
        self.model = model
        self.model.config.use_cache = False
        config = model.config
        # transformers >= 5 T5Config no longer defaults decoder_start_token_id; T5 convention
        # (and the library's own error message) is to start with the pad token.
        start = getattr(config, "decoder_start_token_id", None)
        self.start = start if start is not None else config.pad_token_id
        if self.start is None:
            raise ValueError("the model config has neither decoder_start_token_id nor pad_token_id")

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        start = idx.new_full((idx.shape[0], 1), self.start)
        decoder_ids = torch.cat([start, idx[:, :-1]], dim=1)
        return self.model(input_ids=idx, decoder_input_ids=decoder_ids, use_cache=False).logits
