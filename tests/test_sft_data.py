"""Supervised fine-tuning data (data.format chat / prompt_completion): the loss mask, packing, the
reported fraction of loss-carrying tokens, a tiny chat run that learns, and clear input errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import tiny_overrides
from shardlm.config import DataConfig, load_config
from shardlm.data import EOT, build_dataset
from shardlm.data.loader import _windows
from shardlm.data.sft import IGNORE, LOSS, START, encode_example, pack_to_files
from shardlm.errors import ConfigError
from shardlm.trainer import build_run, train

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


def test_tensor_and_context_parallel_are_refused():
    for key in ("tp", "cp"):
        cfg = load_config(overrides={"model.preset": "llama-tiny", "data.format": "chat",
                                     f"parallel.{key}": 2})
        with pytest.raises(ConfigError, match=f"data.format = 'chat' with parallel.{key} = 2"):
            cfg.validate()


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
