"""Supervised fine-tuning data (data.format chat / prompt_completion): the loss mask, packing, the
reported fraction of loss-carrying tokens, a tiny chat run that learns, and clear input errors."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import tiny_overrides
from shardlm.config.schema import DataConfig
from shardlm.config.load import load_config
from shardlm.data.tokenizer import EOT
from shardlm.data.loader import build_dataset
from shardlm.data.loader import _windows
from shardlm.data.sft import IGNORE, LOSS, START, encode_example, pack_to_files
from shardlm.errors import ConfigError
from shardlm.train.build import build_run
from shardlm.train.loop import train

VOCAB = 300
SEQ = 128

CHATS = [
    {"messages": [{"role": "system", "content": "You are terse."},
                  {"role": "user", "content": "What is two plus two?"},
                  {"role": "assistant", "content": "Four."}]},
    {"messages": [{"role": "user", "content": "Name a colour."},
                  {"role": "assistant", "content": "Blue."},
                  {"role": "user", "content": "Another one?"},
                  {"role": "assistant", "content": "Green, then red."}]},
    {"messages": [{"role": "user", "content": "Say hi."},
                  {"role": "assistant", "content": "Hi there!"}]},
    {"messages": [{"role": "user", "content": "Count to three."},
                  {"role": "assistant", "content": "One, two, three."}]},
]
PAIRS = [{"prompt": "Translate 'chat': ", "completion": "cat"},
         {"prompt": "Capital of France? ", "completion": "Paris"},
         {"prompt": "2 * 3 = ", "completion": "6"}]


def _write(path: Path, records: list, repeat: int = 1) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for _ in range(repeat) for r in records))
    return path


def _all_rows(ds) -> tuple[torch.Tensor, torch.Tensor]:
    """Every packed row (train then val), as the loader makes them: x and y with -100."""
    tokens = np.concatenate([ds.train, ds.val])
    mask = np.concatenate([ds.train_mask, ds.val_mask])
    return _windows(tokens, np.arange(len(tokens) // (SEQ + 1)), SEQ, mask)


def _kept_text(ds) -> str:
    _, y = _all_rows(ds)
    return ds.tokenizer.decode(y[y != IGNORE].tolist(), skip_special_tokens=False)


def _build(tmp_path: Path, fmt: str, records: list, repeat: int = 1):
    src = _write(tmp_path / f"{fmt}.jsonl", records, repeat)
    cfg = DataConfig(source=str(src), format=fmt, cache_dir=str(tmp_path / "cache"), val_fraction=0.1)
    return build_dataset(cfg, VOCAB, seq_len=SEQ)


def test_chat_loss_only_on_assistant_tokens(tmp_path):
    ds = _build(tmp_path, "chat", CHATS, repeat=3)
    expected = "".join(m["content"] + EOT for chat in CHATS for m in chat["messages"]
                       if m["role"] == "assistant") * 3
    assert _kept_text(ds) == expected
    assert ds.meta["n_examples"] == 12 and ds.meta["n_truncated"] == 0


def test_prompt_completion_loss_only_on_completions(tmp_path):
    ds = _build(tmp_path, "prompt_completion", PAIRS, repeat=4)
    assert _kept_text(ds) == "".join(p["completion"] + EOT for p in PAIRS) * 4
    x, _ = _all_rows(ds)
    text = ds.tokenizer.decode(x.flatten().tolist(), skip_special_tokens=False)
    assert all(p["prompt"] + p["completion"] + EOT in text for p in PAIRS)  # prompts are inputs


def test_packing_keeps_examples_whole_and_in_order(tmp_path):
    ds = _build(tmp_path, "chat", CHATS[:1])  # any tokenizer will do for the packing
    tok, end = ds.tokenizer, ds.eot_id
    records = CHATS * 5 + [{"messages": [{"role": "user", "content": "long?"},
                                          {"role": "assistant", "content": "ok " * 100}]}]
    encoded = [encode_example(tok, r, "chat", end) for r in records]
    row_len = SEQ + 1
    counts = pack_to_files(tok, iter(records), "chat", end, row_len, tmp_path / "t.bin",
                           tmp_path / "m.bin", np.dtype(np.uint16))
    tokens = np.fromfile(tmp_path / "t.bin", dtype=np.uint16).reshape(-1, row_len)
    bits_read = np.fromfile(tmp_path / "m.bin", dtype=np.uint8).reshape(-1, row_len)
    mask, starts = bits_read & LOSS, bits_read & START  # loss bits; example (and padding) starts
    assert counts["n_rows"] == len(tokens) and counts["n_truncated"] == 1
    row, at = 0, 0
    for ids, bits in encoded:  # greedy: each example where the last one ended, or on a new row
        ids, bits = ids[:row_len], bits[:row_len]
        if at + len(ids) > row_len:
            assert (tokens[row, at:] == end).all() and not mask[row, at:].any()  # padding
            assert starts[row, at:].tolist() == [START] + [0] * (row_len - at - 1)  # its own document
            row, at = row + 1, 0
        assert tokens[row, at:at + len(ids)].tolist() == ids
        assert mask[row, at:at + len(ids)].tolist() == bits
        assert starts[row, at:at + len(ids)].tolist() == [START] + [0] * (len(ids) - 1)
        at += len(ids)
    assert row == len(tokens) - 1
    assert len(encoded[-1][0]) > row_len  # the long example was cut, and counted
    assert len(encoded) > len(tokens)  # several examples share a row
    fraction = mask[:, 1:].sum() / (len(tokens) * SEQ)
    assert math.isclose(counts["loss_token_fraction"], fraction) and 0 < fraction < 1


def test_every_row_carries_loss_and_first_token_never_does(tmp_path):
    records = [{"prompt": "", "completion": "only completion"},
               {"messages": [{"role": "user", "content": "no answer"}]}]
    ds = _build(tmp_path, "prompt_completion", records[:1], repeat=20)
    _, y = _all_rows(ds)
    assert ((y != IGNORE).sum(1) > 0).all()
    ids, mask = encode_example(ds.tokenizer, records[0], "prompt_completion", ds.eot_id)
    assert mask[0] == 0 and all(mask[1:])
    ids, mask = encode_example(ds.tokenizer, records[1], "chat", ds.eot_id)
    assert not any(mask)  # such an example is dropped when packing


@pytest.mark.parametrize("line, message", [
    ({"conversation": []}, "chat.jsonl:2: no field 'messages'"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "chat.jsonl:2: messages[0] has unknown role 'bot'"),
    ({"messages": [{"role": "user"}]}, "chat.jsonl:2: messages[0] must be an object with 'role' and 'content'"),
])
def test_bad_chat_lines_name_the_line(tmp_path, line, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _build(tmp_path, "chat", [CHATS[0], line])


def test_bad_prompt_completion_and_empty_file(tmp_path):
    with pytest.raises(ConfigError, match="pc.jsonl:1: no field 'completion'"):
        build_dataset(DataConfig(source=str(_write(tmp_path / "pc.jsonl", [{"prompt": "a"}])),
                                 format="prompt_completion", cache_dir=str(tmp_path / "c")), VOCAB, seq_len=SEQ)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ConfigError, match="empty.jsonl: no examples"):
        build_dataset(DataConfig(source=str(tmp_path / "empty.jsonl"), format="chat",
                                 cache_dir=str(tmp_path / "c")), VOCAB, seq_len=SEQ)


def test_tensor_and_context_parallel_are_accepted():
    """The vocabulary-parallel cross-entropy ignores -100 (tests/test_tensor_parallel.py), the
    context-parallel loss divides by the whole sequence's count (bench/compose.py cp+chat_sft;
    document masks too: cp+doc_mask)."""
    for key, mask in (("tp", "auto"), ("cp", "off"), ("cp", "auto")):
        load_config(overrides={"model.preset": "llama-tiny", "data.format": "chat", "train.seq_len": 64,
                               "data.document_mask": mask, f"parallel.{key}": 2}).validate()


def test_chat_run_learns_and_logs_the_loss_fraction(tmp_path):
    src = _write(tmp_path / "chat.jsonl", CHATS, repeat=25)
    cfg = load_config(overrides=tiny_overrides(
        tmp_path, model__preset="llama-tiny", data__source=str(src), data__format="chat",
        data__max_bytes=0, data__val_fraction=0.2, data__cache_dir=str(tmp_path / "cache"),
        train__seq_len=64, train__micro_batch=4, train__steps=20, train__lr=3e-3))
    result = train(build_run(cfg.validate()))
    first, last = result.losses[0], sum(result.losses[-3:]) / 3
    assert last < first - 1.0, f"loss did not fall enough: {first:.3f} -> {last:.3f}"
    assert result.val_loss is not None and math.isfinite(result.val_loss)
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < r["loss_token_fraction"] < 1 for r in records)


def test_small_data_keeps_one_micro_batch_to_validate():
    """data.val_fraction's 1% of a few dozen packed rows is a row or two: the split gives one
    micro-batch to validation while one global batch is left to train; else what it can."""
    from shardlm.data.loader import eval_batches, split_point

    assert split_point(65, 0.01) == 64  # no minimums: the fraction alone, as before
    assert split_point(65, 0.01, train_min=8, val_min=8) == 57  # raised to one micro-batch
    assert split_point(2000, 0.01, train_min=8, val_min=8) == 1980  # the fraction gives enough
    assert split_point(12, 0.01, train_min=8, val_min=8) == 8  # what the data can spare: 4 rows
    assert split_point(8, 0.01, train_min=8, val_min=8) == 8  # nothing to spare
    # Fewer validation rows than a micro-batch are scored, in one batch padded with no-loss rows.
    tokens = np.arange(3 * (SEQ + 1)) % VOCAB
    mask = np.full(len(tokens), LOSS, dtype=np.uint8)
    (x, y), = list(eval_batches(tokens, SEQ, 8, 8, mask))
    assert x.shape == (8, SEQ) and (y[:3] != IGNORE).all() and (y[3:] == IGNORE).all()


def test_first_lora_chat_command_runs_with_defaults_on_400_examples(tmp_path):
    """The first fine-tuning command a user tries, `shardlm train --model.hf_path DIR
    --lora.rank=8 --data.format=chat --data.source=chat.jsonl`, on 400 short chats and a tiny
    random Llama (transformers save_pretrained + a tokenizer.json): every default but the steps.
    Packed, 400 chats are a few dozen rows, of which data.val_fraction = 0.01 is one."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(254)]
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, bos_token_id=1, eos_token_id=1, hidden_size=32,
                                      intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, max_position_embeddings=512)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    vocab = {t: i for i, t in enumerate(["<unk>", "</s>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "llama" / "tokenizer.json"))
    gen = np.random.default_rng(0)
    chats = [{"messages": [{"role": "user", "content": " ".join(gen.choice(words, gen.integers(4, 16)))},
                           {"role": "assistant", "content": " ".join(gen.choice(words, gen.integers(4, 24)))}]}
             for _ in range(400)]
    _write(tmp_path / "chat.jsonl", chats)
    result = subprocess.run([sys.executable, "-m", "shardlm", "train", "--model.hf_path", "llama",
                             "--lora.rank=8", "--data.format=chat", "--data.source=chat.jsonl",
                             "--train.steps=2"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "data: the validation split is 8 rows (one micro-batch): data.val_fraction = 0.01 would give" \
        in result.stderr, result.stderr[-3000:]
    assert "done: loss" in result.stdout and "val loss" in result.stdout
    records = [json.loads(line) for line in (tmp_path / "runs" / "latest" / "metrics.jsonl").open()]
    assert [r["step"] for r in records] == [1, 2] and math.isfinite(records[-1]["val_loss"])
