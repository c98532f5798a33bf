"""Rank-side helpers for the transformers parity tests (importable by spawned ranks): tiny
models built from configs (no weights are downloaded), identically on every rank."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from shardlm.models.hf import CausalLMAdapter, Seq2SeqAdapter
from zero_cases import train_case

VOCAB = 512  # tests/conftest.py: tiny_overrides uses gpt-tiny's vocabulary
ATTN = "sdpa"  # the same attention kernel in every process, whatever the library would pick


def hf_model(name: str, device: str = "cpu") -> torch.nn.Module:
    """The adapted model, built under a fixed seed (on the CPU) or on the meta device for the
    sharded build. Dropout is 0: each process would draw its own masks, and the comparison is
    between processes."""
    with torch.device(device):
        return _hf_model(name)


def _hf_model(name: str) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    if name == "gpt2":
        config = tf.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                               bos_token_id=0, eos_token_id=0, attn_implementation=ATTN)
        return CausalLMAdapter(tf.GPT2LMHeadModel(config), VOCAB)
    if name == "llama":
        config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
                                attn_implementation=ATTN)
        return CausalLMAdapter(tf.LlamaForCausalLM(config), VOCAB)
    if name == "t5":
        config = tf.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                             num_heads=4, dropout_rate=0.0, attn_implementation=ATTN)
        return Seq2SeqAdapter(tf.T5ForConditionalGeneration(config), VOCAB)
    raise ValueError(name)


def reverse_jsonl(path: Path, n: int = 240) -> Path:
    """A data.format = 'seq2seq' file: short strings of a-f and their reversals."""
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(n):
            word = "".join(rng.choice("abcdef") for _ in range(rng.randint(3, 6)))
            f.write(json.dumps({"source": word, "target": word[::-1]}) + "\n")
    return path


def hf_train_cases(rank: int, world_size: int, cases: list[tuple[str, dict, int]]) -> list[dict]:
    return [train_case(overrides, steps, model=hf_model(name)) for name, overrides, steps in cases]


def hf_built(rank: int, world_size: int, cases: list[tuple[str, dict]]) -> list[dict]:
    """Each model built on the meta device, parallelized (the sharded build); its full
    parameters and buffers."""
    from shardlm.config import load_config
    from shardlm.train.loop import build_run

    out = []
    for name, overrides in cases:
        run = build_run(load_config(overrides=overrides).validate(), model=hf_model(name, "meta"))
        with run.strategy.full_parameters():
            out.append({n: t.detach().float().clone() for n, t in
                        [*run.model.named_parameters(), *run.model.named_buffers()]})
    return out
