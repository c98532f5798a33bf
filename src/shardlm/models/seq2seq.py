"""Encoder-decoder transformers models (T5, BART families): built from a config.json, their
FLOPs, and generation through the library's own KV cache.

    model = build_seq2seq("configs/hf/t5-tiny.json", vocab_size=512, device="meta")
    run = build_run(cfg, ...)            # train/build.py builds it (hf_build) from model.hf_config / hf_path
    ids = generate_seq2seq(model, source, source_mask, 32, temperature=0)   # greedy

transformers is imported inside the functions (the optional extra `shardlm[hf]`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from shardlm.models.flops import encoder_decoder_flops_per_token
from shardlm.models.hf import Seq2SeqAdapter
from shardlm.models.hf_build import build_hf_model

CROSS_KV = ("EncDecAttention.k", "EncDecAttention.v", "encoder_attn.k_proj", "encoder_attn.v_proj")
"""Cross-attention key/value projections (T5, BART): they multiply the encoder's outputs."""


def build_seq2seq(config_file: str | Path, vocab_size: int | None = None,
                  device: torch.device | str = "meta") -> Seq2SeqAdapter:
    """The `architectures[0]` class of a transformers config.json (T5ForConditionalGeneration,
    BartForConditionalGeneration, ...), built with fresh weights on `device` (meta: the sharded
    build materialises it), wrapped for the loop (models/hf_build.build_hf_model: the one
    transformers route). A class transformers does not have, or one that is not an
    encoder-decoder, is an error naming it."""
    if not json.loads(Path(config_file).read_text()).get("is_encoder_decoder"):
        raise ValueError(f"{config_file}: not an encoder-decoder (no is_encoder_decoder = true)")
    return build_hf_model(config_file, vocab_size, device)


def _matmul_elements(module: nn.Module, skip: tuple[str, ...] = ()) -> int:
    """Weight elements of the linears under `module` (embedding lookups and norms excluded)."""
    return sum(m.weight.numel() for n, m in module.named_modules()
               if isinstance(m, nn.Linear) and not n.endswith(skip))


def seq2seq_flops_per_token(model: Seq2SeqAdapter, source_len: int, target_len: int,
                            recompute: str = "none") -> float:
    """models.flops.encoder_decoder_flops_per_token for this model's shapes; recompute 'full'
    adds a second forward (8/6 of it, the usual approximation for a model we did not build)."""
    inner = model.model
    encoder, decoder, config = inner.get_encoder(), inner.get_decoder(), inner.config
    cross = sum(m.weight.numel() for n, m in decoder.named_modules()
                if isinstance(m, nn.Linear) and n.endswith(CROSS_KV))
    head = inner.get_output_embeddings().weight.numel()
    heads = getattr(config, "num_heads", None) or config.decoder_attention_heads
    width = heads * getattr(config, "d_kv", config.d_model // heads)
    layers = (getattr(config, "num_layers", None) or config.encoder_layers,
              getattr(config, "num_decoder_layers", None) or getattr(config, "decoder_layers", None)
              or config.num_layers)
    flops = encoder_decoder_flops_per_token(_matmul_elements(encoder), _matmul_elements(decoder),
                                            cross, head, *layers, width, source_len, target_len)
    return flops * (8 / 6 if recompute == "full" else 1.0)


@torch.no_grad()
def generate_seq2seq(model: Seq2SeqAdapter, source: torch.Tensor, source_mask: torch.Tensor,
                     max_new_tokens: int, end_id: int | None = None, temperature: float = 0.0,
                     top_k: int | None = 50, num_beams: int = 1,
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """Target ids (B, ≤ max_new_tokens), without the start token, by the library's generate
    (its KV cache: the encoder runs once, the decoder one token at a time). temperature 0 is
    greedy (or beam search with num_beams > 1); otherwise sampling from the top_k. Stops at
    `end_id` (data/seq2seq.py's end token). Sampling draws from torch's global generator,
    which is seeded from `generator`'s seed when one is given."""
    sample = temperature > 0
    if sample and generator is not None:
        torch.manual_seed(generator.initial_seed())
    kwargs = dict(do_sample=sample, num_beams=num_beams, max_new_tokens=max_new_tokens,
                  decoder_start_token_id=model.start, pad_token_id=model.pad, use_cache=True,
                  eos_token_id=end_id, forced_bos_token_id=None, forced_eos_token_id=None)
    if sample:
        kwargs.update(temperature=temperature, top_k=top_k or None)
    was_training = model.training
    model.eval()
    try:
        out = model.model.generate(input_ids=source, attention_mask=source_mask, **kwargs)
    finally:
        model.train(was_training)
    return out[:, 1:]  # (B, new)


def user_model_flops_per_token(model: nn.Module, seq_len: int, source_len: int,
                               recompute: str = "none") -> float:
    """MFU's numerator for a model we did not build: an encoder-decoder counted by its parts
    (seq2seq_flops_per_token), anything else 6 × parameters (8 × with 'full' recomputation: a
    second forward), the usual approximation with attention left out."""
    if isinstance(model, Seq2SeqAdapter):
        return seq2seq_flops_per_token(model, source_len or seq_len, seq_len, recompute)
    return (8.0 if recompute == "full" else 6.0) * sum(p.numel() for p in model.parameters())
