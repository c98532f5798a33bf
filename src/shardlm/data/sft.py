"""Supervised fine-tuning data: chat and prompt/completion JSONL -> token rows with a loss mask.
(Arrow / Parquet rows too, field for field: data/tables.py; data.columns renames the fields.)

`data.format = 'chat'`: one JSON object per line, `{"messages": [{"role": "system" | "user" |
"assistant", "content": "..."}, ...]}`, rendered with the default template (DEFAULT_TEMPLATE):

    <|role|>\\n{content}<end>          per message, in order

where `<end>` is the end-of-turn token: the document separator (`<|endoftext|>` of our BPE, or
model.hf_path's `eos_token_id`). The loss is on the assistant messages' content tokens and their
`<end>` only; headers and system/user messages carry none.

`data.format = 'prompt_completion'`: `{"prompt": "...", "completion": "..."}` per line, rendered
as prompt tokens, completion tokens, `<end>` (nothing inserted between them); the loss is on the
completion tokens and `<end>`.

Each segment is tokenized on its own (no BOS, add_special_tokens=False, as the text format).
Examples are packed greedily, in file order, into rows of seq_len + 1 tokens (x = row[:-1],
y = row[1:]); an example that does not fit the rest of a row starts a new one (the rest padded
with `<end>`, no loss); an example longer than a row is cut to it (counted). A token's mask bit
says whether it is a target that carries loss; an example's first token never does (it would be
predicted from the previous example's last token), and an example left without any loss token is
dropped (counted). So every row, and every micro-batch, has at least one loss token.

mask.bin holds two bits per token: LOSS (a target that carries loss) and START (an example's
first token, and the padding's: the padding is a document of its own). The chat template ends
every turn with `<end>`, so example boundaries cannot be read off the token ids: START is what
data.document_mask's positions restart at (data/loader.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from shardlm.config import DataConfig
from shardlm.config_rules import DATA_FORMATS, parse_columns
from shardlm.data.corpus import jsonl_records
from shardlm.data.tables import TABLE_SUFFIXES, iter_rows
from shardlm.errors import ConfigError

FORMATS = DATA_FORMATS
ROLES = ("system", "user", "assistant")
DEFAULT_TEMPLATE = "<|{role}|>\n{content}<end>"
"""The chat rendering, per message (documentation: the code builds it segment by segment)."""
IGNORE = -100
"""The target of a token that carries no loss (torch's cross_entropy ignore_index)."""
LOSS, START = 1, 2
"""mask.bin's bits: the token is a target with loss; the token starts an example (or the padding)."""


def _fail(path: Path, lineno: int, message: str) -> ConfigError:
    return ConfigError(f"{path}:{lineno}: {message}")


def _check(record: object, fmt: str, path: Path, lineno: int) -> dict:
    if not isinstance(record, dict):
        raise _fail(path, lineno, f"expected a JSON object, found {type(record).__name__}")
    if fmt == "chat":
        if "messages" not in record:
            raise _fail(path, lineno, f"no field 'messages' (found {sorted(record)}); data.format = "
                                      f"'chat' needs {{\"messages\": [{{\"role\", \"content\"}}, ...]}}")
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise _fail(path, lineno, "'messages' must be a non-empty list of {\"role\", \"content\"}")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise _fail(path, lineno, f"messages[{i}] must be an object with 'role' and 'content'")
            if m["role"] not in ROLES:
                raise _fail(path, lineno, f"messages[{i}] has unknown role {m['role']!r}; "
                                          f"roles are {', '.join(ROLES)}")
            if not isinstance(m["content"], str):
                raise _fail(path, lineno, f"messages[{i}].content must be a string, found "
                                          f"{type(m['content']).__name__}")
    else:
        for key in ("prompt", "completion"):
            if key not in record:
                raise _fail(path, lineno, f"no field {key!r} (found {sorted(record)}); data.format = "
                                          f"'prompt_completion' needs {{\"prompt\", \"completion\"}}")
            if not isinstance(record[key], str):
                raise _fail(path, lineno, f"{key!r} must be a string, found {type(record[key]).__name__}")
    return record


FIELDS = {"chat": ("messages",), "prompt_completion": ("prompt", "completion"),
          "seq2seq": ("source", "target")}
"""Each format's fields, by their default names (data.columns renames them; data/seq2seq.py
reads its pairs through _records too)."""


def _records(path: Path, fmt: str, columns: str) -> Iterator[tuple[int, int, object]]:
    """(line or row number, size in bytes, record under our field names) of a JSONL file or an
    Arrow / Parquet table (streamed: data/tables.py); data.columns says where each field is."""
    names = {key: key for key in FIELDS[fmt]}
    names.update((k, v) for k, v in parse_columns(columns).items() if k in names)
    if path.name.endswith(TABLE_SUFFIXES):
        hint = "set data.columns to the columns holding " + ", ".join(names) + \
               f" (e.g. '{next(iter(names))}=<column>')"
        for row_number, row in enumerate(iter_rows(path, list(names.values()), hint), start=1):
            # Sized as the JSONL line it would be, so data.max_bytes means the same for both.
            yield row_number, len(json.dumps(row, default=str).encode()), {k: row[v] for k, v in names.items()}
        return
    if not path.name.endswith(".jsonl"):
        raise ConfigError(f"data.format = {fmt!r} reads JSONL, Arrow or Parquet files; "
                          f"{str(path)!r} is none of them")
    renamed = any(k != v for k, v in names.items())
    for lineno, raw, record in jsonl_records(path):
        if renamed and isinstance(record, dict):
            missing = [v for v in names.values() if v not in record]
            if missing:
                raise _fail(path, lineno, f"no field {missing[0]!r} (found {sorted(record)}); "
                                          f"data.columns = {columns!r} names it")
            record = {k: record[v] for k, v in names.items()}
        yield lineno, len(raw), record


def iter_examples(cfg: DataConfig, files: list[Path]) -> Iterator[dict]:
    """The validated records of every file (JSONL, Arrow, Parquet) in order; at most
    data.max_bytes bytes of lines (whole lines) when it is set. A file with no example is an
    error naming it."""
    budget = cfg.max_bytes if cfg.max_bytes > 0 else None
    for path in files:
        found = 0
        for lineno, size, record in _records(path, cfg.format, cfg.columns):
            found += 1
            yield _check(record, cfg.format, path, lineno)
            if budget is not None:
                budget -= size
                if budget <= 0:
                    return
        if not found:
            raise ConfigError(f"{path}: no examples (the file is empty); data.format = "
                              f"{cfg.format!r} needs one example per line or row")


def segments(record: dict, fmt: str) -> list[tuple[str | None, bool]]:
    """(text, carries_loss) in order; text None stands for the end-of-turn token."""
    if fmt == "chat":
        out: list[tuple[str | None, bool]] = []
        for m in record["messages"]:
            loss = m["role"] == "assistant"
            out += [(f"<|{m['role']}|>\n", False), (m["content"], loss), (None, loss)]
        return out
    return [(record["prompt"], False), (record["completion"], True), (None, True)]


def render(record: dict, fmt: str, end: str) -> str:
    """The example as text (for training our BPE on it), `end` for the end-of-turn token."""
    return "".join(end if text is None else text for text, _ in segments(record, fmt))


def encode_example(tok: Tokenizer, record: dict, fmt: str, end_id: int) -> tuple[list[int], list[int]]:
    """Token ids and their loss bits (1 = a target that carries loss)."""
    parts = segments(record, fmt)
    texts = [text for text, _ in parts if text]
    encoded = iter(tok.encode_batch(texts, add_special_tokens=False) if texts else [])
    ids: list[int] = []
    mask: list[int] = []
    for text, loss in parts:
        if text is None:
            piece = [end_id]
        elif text:
            piece = next(encoded).ids
        else:
            continue
        ids += piece
        mask += [int(loss)] * len(piece)
    if mask:
        mask[0] = 0  # predicted from the previous example's last token: never a target
    return ids, mask


def pack_to_files(tok: Tokenizer, examples: Iterator[dict], fmt: str, end_id: int, row_len: int,
                  tokens_path: Path, mask_path: Path, dtype: np.dtype) -> dict:
    """Greedy packing (next fit, file order) into rows of `row_len` tokens, written as they fill.
    Returns the counts for meta.json."""
    counts = {"n_examples": 0, "n_truncated": 0, "n_dropped": 0, "n_rows": 0,
              "n_loss_tokens": 0, "n_example_tokens": 0}
    row_ids: list[int] = []
    row_mask: list[int] = []

    with open(tokens_path, "wb") as ft, open(mask_path, "wb") as fm:
        def flush() -> None:
            pad = row_len - len(row_ids)
            np.asarray(row_ids + [end_id] * pad, dtype=dtype).tofile(ft)
            np.asarray(row_mask + [START] * min(pad, 1) + [0] * (pad - 1), dtype=np.uint8).tofile(fm)
            row_ids.clear()
            row_mask.clear()
            counts["n_rows"] += 1

        for record in examples:
            ids, mask = encode_example(tok, record, fmt, end_id)
            if len(ids) > row_len:
                ids, mask = ids[:row_len], mask[:row_len]
                counts["n_truncated"] += 1
            if not any(mask):
                counts["n_dropped"] += 1
                continue
            if len(row_ids) + len(ids) > row_len:
                flush()
            row_ids += ids
            row_mask += [mask[0] | START] + mask[1:]
            counts["n_examples"] += 1
            counts["n_loss_tokens"] += sum(mask)
            counts["n_example_tokens"] += len(ids)
        if row_ids:
            flush()
    # Targets per row: row_len - 1 (the first token is only an input).
    counts["loss_token_fraction"] = counts["n_loss_tokens"] / max(counts["n_rows"] * (row_len - 1), 1)
    return counts
