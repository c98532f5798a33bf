"""Encoder-decoder data: JSONL `{"source": ..., "target": ...}` -> fixed-size rows with a mask.

`data.format = 'seq2seq'` (other field names: data.columns = 'source=...,target=...'; Arrow and
Parquet rows as for the SFT formats: data/sft.py). Each example is
one row of S + T tokens, S = data.source_len (0: train.seq_len), T = train.seq_len:

    row  = source ids, cut to S, padded with <end>   |  target ids + <end>, cut to T, padded
    mask = 1 on the real source tokens (the encoder's attention mask)  |  1 on the target tokens

where <end> is the end token (our BPE's <|endoftext|>, or model.hf_path's eos_token_id): the
decoder learns to emit it after the target, which is where generation stops. A batch is
`((source, source_mask, labels), labels)`: the first element is what the model's forward takes
(models/hf.Seq2SeqAdapter shifts the labels right behind the model's decoder start token:
teacher forcing), the second the targets the loop's loss reads, IGNORE (-100) on padding. Rows
are the loader's windows (loader.py: sampled by (seed, step, rank), split by whole rows).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from tokenizers import Tokenizer

from shardlm.config.schema import DataConfig
import shardlm.data.sft as sft
from shardlm.data.sft import IGNORE
from shardlm.errors import ConfigError


FIELDS = sft.FIELDS["seq2seq"]


class Seq2SeqInputs(NamedTuple):
    """What an encoder-decoder's forward takes for a micro-batch."""

    source: torch.Tensor
    """(B, S) encoder token ids, padded."""
    source_mask: torch.Tensor
    """(B, S) 1 on real source tokens, 0 on padding (the attention mask)."""
    labels: torch.Tensor
    """(B, T) target ids, IGNORE on padding; shifted right into the decoder's input."""


def iter_pairs(cfg: DataConfig, files: list[Path]) -> Iterator[tuple[str, str]]:
    """(source, target) of every record in order (JSONL lines, or Arrow / Parquet rows, fields
    renamed by data.columns: the SFT formats' reader); at most data.max_bytes bytes of them."""
    budget = cfg.max_bytes if cfg.max_bytes > 0 else None
    for path in files:
        found = 0
        for lineno, size, record in sft._records(path, "seq2seq", cfg.columns):
            if not isinstance(record, dict) or any(not isinstance(record.get(k), str) for k in FIELDS):
                got = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ConfigError(f"{path}:{lineno}: data.format = 'seq2seq' needs string fields "
                                  f"'source' and 'target' (named otherwise: data.columns = "
                                  f"'source=<field>,target=<field>'), found {got}")
            found += 1
            yield record["source"], record["target"]
            if budget is not None:
                budget -= size
                if budget <= 0:
                    return
        if not found:
            raise ConfigError(f"{path}: no examples (the file is empty); data.format = 'seq2seq' "
                              f"needs one JSON object per line")


def encode_pair(tok: Tokenizer, source: str, target: str, end_id: int, source_len: int,
                target_len: int) -> tuple[list[int], list[int], bool]:
    """One row's ids and mask (module docstring), and whether anything was cut."""
    src, tgt = (e.ids for e in tok.encode_batch([source, target], add_special_tokens=False))
    tgt = tgt + [end_id]
    cut = len(src) > source_len or len(tgt) > target_len
    src, tgt = src[:source_len], tgt[:target_len]
    ids = src + [end_id] * (source_len - len(src)) + tgt + [end_id] * (target_len - len(tgt))
    mask = [1] * len(src) + [0] * (source_len - len(src)) + [1] * len(tgt) + [0] * (target_len - len(tgt))
    return ids, mask, cut


def write_rows(tok: Tokenizer, pairs: Iterator[tuple[str, str]], end_id: int, source_len: int,
               target_len: int, tokens_path: Path, mask_path: Path, dtype: np.dtype) -> dict:
    """Every pair as one row, written as it comes; the counts for meta.json."""
    counts = {"n_examples": 0, "n_truncated": 0, "n_rows": 0, "n_loss_tokens": 0}
    with open(tokens_path, "wb") as ft, open(mask_path, "wb") as fm:
        for source, target in pairs:
            ids, mask, cut = encode_pair(tok, source, target, end_id, source_len, target_len)
            np.asarray(ids, dtype=dtype).tofile(ft)
            np.asarray(mask, dtype=np.uint8).tofile(fm)
            counts["n_examples"] += 1
            counts["n_rows"] += 1
            counts["n_truncated"] += cut
            counts["n_loss_tokens"] += sum(mask[source_len:])
    counts["loss_token_fraction"] = counts["n_loss_tokens"] / max(counts["n_rows"] * target_len, 1)
    return counts


def rows(tokens: np.ndarray, row_ids: np.ndarray, source_len: int, target_len: int,
         mask: np.ndarray) -> tuple[Seq2SeqInputs, torch.Tensor]:
    """The batch of the given rows: ((source, source_mask, labels), labels)."""
    index = row_ids[:, None] * (source_len + target_len) + np.arange(source_len + target_len)
    ids = torch.from_numpy(tokens[index].astype(np.int64))  # (B, S + T)
    keep = torch.from_numpy(mask[index].astype(bool))  # (B, S + T)
    source, labels = ids[:, :source_len].contiguous(), ids[:, source_len:].clone()
    labels[~keep[:, source_len:]] = IGNORE
    return Seq2SeqInputs(source, keep[:, :source_len].long().contiguous(), labels), labels
