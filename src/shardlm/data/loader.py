"""Token shards on disk, built once per (corpus, vocab), and a sampler that is a pure function of
(seed, step, dp_rank, dp_size).

Layout of one cache entry, `<cache root>/<corpus fingerprint>-v<vocab_size>/`:
  tokenizer.json   the trained BPE
  tokens.bin       the whole token stream (uint16, or uint32 for vocab > 65535), documents joined
                   by <|endoftext|>; train/val are views of it, so val_fraction needs no rebuild
  meta.json        dtype, token/document/byte counts
  done             written last: its presence means every other file is complete

data.format 'chat' / 'prompt_completion' (shardlm.data.sft) key the entry by the format and
train.seq_len too: tokens.bin then holds packed rows of seq_len + 1 tokens and mask.bin (uint8,
one per token) says which tokens are targets that carry loss; the split is by whole rows.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from itertools import chain
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from shardlm.config.schema import DataConfig
from shardlm.errors import ConfigError
from shardlm.launch.cache_files import file_lock, move_aside, read_json_cache
from shardlm.launch.files import atomic_write
from shardlm.launch.cache_files import cache_root
from shardlm.data.corpus import corpus_files, fingerprint, iter_documents
import shardlm.data.seq2seq as seq2seq
import shardlm.data.sft as sft
from shardlm.data.packed import PackedTokens, positions_from_starts
from shardlm.data.tokenizer import (encode_to_file, eot_id, load_tokenizer, save_tokenizer,
                                    train_tokenizer)

log = logging.getLogger("shardlm")
_SFT_VERSION = 3
"""Bump when the packing or the chat rendering changes, so SFT caches rebuild."""


@dataclass
class Dataset:
    train: np.memmap
    """Training tokens: the stream minus its last val_fraction."""
    val: np.memmap
    """Validation tokens: the last val_fraction of the stream (held-out text, not random windows,
    so no validation window shares text with a training window except at the one cut)."""
    tokenizer: Tokenizer
    cache_dir: Path
    eot_id: int
    train_mask: np.memmap | None = None
    """data.format chat / prompt_completion: 1 where a training token is a target with loss."""
    val_mask: np.memmap | None = None
    meta: dict | None = None
    """meta.json: the build's counts (for SFT formats: examples, truncated, loss_token_fraction)."""
    source_len: int = 0
    """data.format seq2seq: encoder tokens per row (rows of source_len + seq_len: data/seq2seq.py)."""

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 65535 else np.uint32)


def build_dataset(cfg: DataConfig, vocab_size: int,
                  given: tuple[Tokenizer, int] | None = None, seq_len: int | None = None,
                  batches: tuple[int, int] = (0, 0), chat_template: sft.ChatTemplate | None = None) -> Dataset:
    """Train the tokenizer and write the token stream once; later calls (and other ranks) load.
    `given`: a tokenizer to use instead of training one (a checkpoint's: model.hf_path) and the
    id that separates documents; the cache entry is then keyed by the tokenizer's content too.
    `seq_len`: the row length - 1 of the packed SFT formats (needed for those only; with
    `batches`, the window length of the text format too).
    data.val_source: a second entry, tokenized by the first's tokenizer, is the validation split
    (all of it), and all of data.source trains; else the last val_fraction of data.source, but at
    least batches[1] windows (one validation micro-batch) while batches[0] (one global batch)
    stay to train: see split_point.
    `chat_template`: data.format chat rendered with a model's own template (sft.template_for)."""
    cache_dir = _build_entry(cfg, vocab_size, given, seq_len, chat_template=chat_template)
    if not cfg.val_source:
        return load_dataset(cache_dir, cfg.val_fraction, seq_len or 0, batches)
    train = load_dataset(cache_dir, 0.0)
    held_out = replace(cfg, source=cfg.val_source)
    val = load_dataset(_build_entry(held_out, vocab_size, (train.tokenizer, train.eot_id), seq_len,
                                    "val", chat_template), 1.0)
    return replace(train, val=val.val, val_mask=val.val_mask)


def _build_entry(cfg: DataConfig, vocab_size: int, given: tuple[Tokenizer, int] | None,
                 seq_len: int | None, split: str = "train",
                 chat_template: sft.ChatTemplate | None = None) -> Path:
    """The cache entry of cfg.source (`split`: a DatasetDict's 'train' or 'val' split), built
    under a lock by the first rank to get there."""
    files = corpus_files(cfg, split)
    name = f"{fingerprint(cfg, files)}-v{vocab_size}"
    if cfg.format != "text":
        if not seq_len:
            raise ValueError(f"data.format = {cfg.format!r} packs rows of seq_len + 1 tokens: pass seq_len")
        name += f"-{cfg.format}-s{seq_len}-p{_SFT_VERSION}"
    if cfg.format == "seq2seq":  # the encoder's length decides the rows too
        name += f"-e{cfg.source_len or seq_len}"
    if given is not None:
        digest = hashlib.sha256(f"{given[1]}\0{given[0].to_str()}".encode()).hexdigest()[:12]
        name += f"-t{digest}"
    if chat_template is not None and cfg.format == "chat":
        name += f"-c{chat_template.sha256[:12]}"
    cache_dir = cache_root(cfg.cache_dir) / name
    if not (cache_dir / "done").exists() or entry_damage(cache_dir):
        cache_dir.mkdir(parents=True, exist_ok=True)
        with file_lock(cache_dir / "lock"):
            # Checked again under the lock: another rank may have finished (or repaired the
            # entry) while we waited.
            damage = entry_damage(cache_dir) if (cache_dir / "done").exists() else None
            if damage is not None:  # a finished entry damaged since: set aside, built again
                (cache_dir / "done").unlink()
                move_aside(cache_dir / damage[0], damage[1], "token cache file")
            if not (cache_dir / "done").exists():
                if cfg.format == "text":
                    _build(cfg, files, vocab_size, cache_dir, given)
                elif cfg.format == "seq2seq":
                    _build_seq2seq(cfg, files, vocab_size, cache_dir, given, seq_len)
                else:
                    _build_sft(cfg, files, vocab_size, cache_dir, given, seq_len + 1, chat_template)
    return cache_dir


def _check_meta(meta: object) -> str:
    """meta.json's schema: what load_dataset reads from it ('' when whole)."""
    if not isinstance(meta, dict):
        return f"a JSON {type(meta).__name__}, not an object"
    if not isinstance(meta.get("n_tokens"), int) or meta["n_tokens"] < 0:
        return "no token count (n_tokens)"
    if meta.get("dtype") not in ("uint16", "uint32"):
        return f"dtype {meta.get('dtype')!r} is not uint16 / uint32"
    if "row_len" in meta and not (isinstance(meta["row_len"], int) and isinstance(meta.get("n_rows"), int)):
        return "row_len without integer n_rows"
    return ""


def entry_damage(cache_dir: Path) -> tuple[str, str] | None:
    """What is wrong with a finished cache entry, as (file, why), or None: meta.json not JSON or
    not its schema, tokenizer.json not JSON, tokens.bin / mask.bin not the size meta.json says
    (a crash or a full disk after `done`, a file truncated or edited since). Cheap: sizes and
    two small JSON files; a damaged meta.json is moved aside by read_json_cache itself."""
    meta = read_json_cache(cache_dir / "meta.json", _check_meta, "token cache file")
    if meta is None:
        return "meta.json", "missing or damaged"
    tokenizer = read_json_cache(cache_dir / "tokenizer.json", lambda v: "" if isinstance(v, dict) else
                                "not a tokenizer", "token cache file")
    if tokenizer is None:
        return "tokenizer.json", "missing or damaged"
    sizes = {"tokens.bin": meta["n_tokens"] * np.dtype(meta["dtype"]).itemsize}
    if "row_len" in meta:
        sizes["mask.bin"] = meta["n_tokens"]
    for file, expected in sizes.items():
        try:
            size = (cache_dir / file).stat().st_size
        except OSError:
            return file, "missing"
        if size != expected:
            return file, f"{size:,} bytes where meta.json says {expected:,}"
    return None


def split_point(n: int, val_fraction: float, train_min: int = 0, val_min: int = 0) -> int:
    """Of n units (packed rows, or tokens), how many train; the rest validate. The last
    val_fraction validate, but at least val_min (one validation micro-batch, so that evaluation
    scores a whole batch) when that leaves train_min (one training global batch) to train: with
    small data, 1% is a row or two (400 chat examples pack into a few dozen rows). When the data
    cannot spare val_min, the rest of it validates, as much as val_fraction gives at least
    (evaluation then scores the rows there are: eval_batches). Without minimums, or where
    val_fraction gives enough, exactly the val_fraction split."""
    val = int(round(n * val_fraction))
    if val < val_min:
        val = max(val, min(val_min, n - train_min))
    return n - val


def load_dataset(cache_dir: Path, val_fraction: float, seq_len: int = 0,
                 batches: tuple[int, int] = (0, 0)) -> Dataset:
    """The cache entry as train/val views; `batches` = (windows one training global batch takes,
    windows one validation micro-batch takes), `seq_len` the text format's window: split_point."""
    meta = json.loads((cache_dir / "meta.json").read_text())
    n_tokens = meta["n_tokens"]
    tokens = np.memmap(cache_dir / "tokens.bin", dtype=meta["dtype"], mode="r", shape=(n_tokens,))
    train_min, val_min = batches
    split = n_tokens - int(round(n_tokens * val_fraction))
    if seq_len and val_min and "row_len" not in meta and 0 < val_fraction < 1:
        # a token stream: k windows of seq_len + 1 tokens (each sharing one with the next) take
        # k * seq_len + 1 tokens
        split = split_point(n_tokens, val_fraction, train_min * seq_len + 1, val_min * seq_len + 1)
        _note_split(max(n_tokens - split - 1, 0) // seq_len, "windows of train.seq_len + 1 tokens",
                    val_min, val_fraction, max(int(round(n_tokens * val_fraction)) - 1, 0) // seq_len)
    tok = load_tokenizer(cache_dir / "tokenizer.json")
    separator = meta.get("separator")
    masks: dict = {}
    if "row_len" in meta:  # packed SFT rows: split by whole rows, the mask alongside
        row_len, n_rows = meta["row_len"], meta["n_rows"]
        train_rows = (split_point(n_rows, val_fraction, train_min, val_min) if 0 < val_fraction < 1
                      else n_rows - int(round(n_rows * val_fraction)))
        split = train_rows * row_len
        if val_min and 0 < val_fraction < 1:
            _note_split(n_rows - train_rows, "rows", val_min, val_fraction, int(round(n_rows * val_fraction)))
        mask = np.memmap(cache_dir / "mask.bin", dtype=np.uint8, mode="r", shape=(n_tokens,))
        masks = {"train_mask": mask[:split], "val_mask": mask[split:]}
    return Dataset(train=tokens[:split], val=tokens[split:], tokenizer=tok, cache_dir=cache_dir,
                   eot_id=eot_id(tok) if separator is None else separator, meta=meta,
                   source_len=meta.get("source_len", 0), **masks)


def _note_split(units: int, what: str, val_min: int, val_fraction: float, by_fraction: int) -> None:
    """Say so where small data moved the split from data.val_fraction, or left evaluation fewer
    than one micro-batch of validation rows."""
    if units < val_min:
        log.warning("data: the validation split has %d %s, fewer than one micro-batch of %d: "
                    "evaluation scores those %d (data.val_fraction = %g; more data or a smaller "
                    "train.micro_batch gives a whole batch)", units, what, val_min, units, val_fraction)
    elif units > by_fraction:
        log.info("data: the validation split is %d %s (one micro-batch): data.val_fraction = %g "
                 "would give %d", units, what, val_fraction, by_fraction)


def _documents(cfg: DataConfig, files: list[Path]) -> Iterator[str]:
    """The corpus documents; a source that yields no text at all is the user's mistake."""
    docs = iter_documents(cfg, files)
    first = next(docs, None)
    if first is None:
        raise ConfigError(f"data.source = {cfg.source!r} yields no text ({len(files)} files, all "
                          f"empty); point it at non-empty .txt/.py/.md/.jsonl files")
    return chain([first], docs)


def _build(cfg: DataConfig, files: list[Path], vocab_size: int, cache_dir: Path,
           given: tuple[Tokenizer, int] | None) -> None:
    start = time.perf_counter()
    for stale in cache_dir.glob("*.tmp.*"):  # left by a build that crashed; we hold the lock
        stale.unlink()
    tok, separator = given if given is not None else (train_tokenizer(_documents(cfg, files), vocab_size), None)
    save_tokenizer(tok, cache_dir / "tokenizer.json")
    trained = time.perf_counter()
    dtype = token_dtype(vocab_size)
    counts = encode_to_file(tok, _documents(cfg, files), cache_dir / "tokens.bin", dtype, separator)
    meta = {"dtype": dtype.name, "vocab_size": vocab_size, "source": cfg.source,
            "max_bytes": cfg.max_bytes, "n_files": len(files), "separator": separator, **counts}
    atomic_write(cache_dir / "meta.json", json.dumps(meta, indent=2), fsync=True)
    atomic_write(cache_dir / "done", "", fsync=True)
    done = time.perf_counter()
    log.info("data: built %s: %d files, %d documents, %.1f MB text -> %d tokens (vocab %d, "
             "%.2f bytes/token); tokenizer %.1fs, encode %.1fs", cache_dir, len(files),
             counts["n_documents"], counts["n_bytes"] / 1e6, counts["n_tokens"], vocab_size,
             counts["n_bytes"] / max(counts["n_tokens"], 1), trained - start, done - trained)


def _build_sft(cfg: DataConfig, files: list[Path], vocab_size: int, cache_dir: Path,
               given: tuple[Tokenizer, int] | None, row_len: int,
               chat_template: sft.ChatTemplate | None = None) -> None:
    """Chat / prompt-completion examples -> packed rows of row_len tokens and their loss mask."""
    start = time.perf_counter()
    for stale in cache_dir.glob("*.tmp.*"):
        stale.unlink()
    if given is not None:
        tok, end_id = given
    else:  # our BPE, trained on the rendered examples; <|endoftext|> ends a turn
        from shardlm.data.tokenizer import EOT
        texts = (sft.render(r, cfg.format, EOT) for r in sft.iter_examples(cfg, files))
        tok = train_tokenizer(texts, vocab_size)
        end_id = eot_id(tok)
    save_tokenizer(tok, cache_dir / "tokenizer.json")
    dtype = token_dtype(vocab_size)
    tmp = {name: cache_dir / f"{name}.bin.tmp.{os.getpid()}" for name in ("tokens", "mask")}
    counts = sft.pack_to_files(tok, sft.iter_examples(cfg, files), cfg.format, end_id, row_len,
                               tmp["tokens"], tmp["mask"], dtype, chat_template)
    if not counts["n_rows"]:
        raise ConfigError(f"data.source = {cfg.source!r}: no example has a token that carries loss "
                          f"({counts['n_dropped']} dropped: no assistant message / empty completion, "
                          f"or cut away at train.seq_len + 1 = {row_len} tokens)")
    for name, path in tmp.items():
        os.replace(path, cache_dir / f"{name}.bin")
    meta = {"dtype": dtype.name, "vocab_size": vocab_size, "source": cfg.source, "format": cfg.format,
            "max_bytes": cfg.max_bytes, "n_files": len(files), "separator": end_id,
            "row_len": row_len, "n_tokens": counts["n_rows"] * row_len, **counts}
    atomic_write(cache_dir / "meta.json", json.dumps(meta, indent=2), fsync=True)
    atomic_write(cache_dir / "done", "", fsync=True)
    log.info("data: built %s (%s): %d examples packed into %d rows of %d tokens, %d truncated, "
             "%d dropped (no loss token); loss_token_fraction %.3f; %.1fs", cache_dir, cfg.format,
             counts["n_examples"], counts["n_rows"], row_len, counts["n_truncated"],
             counts["n_dropped"], counts["loss_token_fraction"], time.perf_counter() - start)


def _build_seq2seq(cfg: DataConfig, files: list[Path], vocab_size: int, cache_dir: Path,
                   given: tuple[Tokenizer, int] | None, seq_len: int) -> None:
    """Source -> target pairs -> one row of source_len + seq_len tokens each, and its mask."""
    start = time.perf_counter()
    for stale in cache_dir.glob("*.tmp.*"):
        stale.unlink()
    if given is not None:
        tok, end_id = given
    else:  # our BPE, trained on sources and targets; <|endoftext|> ends a target
        tok = train_tokenizer(chain.from_iterable(seq2seq.iter_pairs(cfg, files)), vocab_size)
        end_id = eot_id(tok)
    save_tokenizer(tok, cache_dir / "tokenizer.json")
    source_len, dtype = cfg.source_len or seq_len, token_dtype(vocab_size)
    tmp = {name: cache_dir / f"{name}.bin.tmp.{os.getpid()}" for name in ("tokens", "mask")}
    counts = seq2seq.write_rows(tok, seq2seq.iter_pairs(cfg, files), end_id, source_len, seq_len,
                                tmp["tokens"], tmp["mask"], dtype)
    for name, path in tmp.items():
        os.replace(path, cache_dir / f"{name}.bin")
    row_len = source_len + seq_len
    meta = {"dtype": dtype.name, "vocab_size": vocab_size, "source": cfg.source, "format": cfg.format,
            "max_bytes": cfg.max_bytes, "n_files": len(files), "separator": end_id,
            "row_len": row_len, "source_len": source_len, "n_tokens": counts["n_rows"] * row_len, **counts}
    atomic_write(cache_dir / "meta.json", json.dumps(meta, indent=2), fsync=True)
    atomic_write(cache_dir / "done", "", fsync=True)
    log.info("data: built %s (seq2seq): %d examples as rows of %d source + %d target tokens, %d cut; "
             "loss_token_fraction %.3f; %.1fs", cache_dir, counts["n_examples"], source_len, seq_len,
             counts["n_truncated"], counts["loss_token_fraction"], time.perf_counter() - start)


def _require_windows(n_tokens: int, seq_len: int, needed: int, split: str, what: str,
                     rows: bool = False, source_len: int = 0) -> int:
    row_len = source_len + seq_len if source_len else seq_len + 1  # seq2seq rows: source + target
    n_windows = n_tokens // row_len if rows else max(n_tokens - 1, 0) // seq_len
    if n_windows < needed and rows:
        raise ConfigError(
            f"the {split} split has {n_windows} rows of {row_len} tokens, "
            f"but {what} needs {needed} rows; add examples, or lower the batch size"
            + (", or raise data.val_fraction" if split == "val" else ""))
    if n_windows < needed:
        raise ConfigError(
            f"the {split} split has {n_tokens} tokens = {n_windows} windows of seq_len+1 = "
            f"{seq_len + 1} tokens, but {what} needs {needed} windows ({needed * seq_len + 1} "
            f"tokens); lower train.seq_len or the batch size, or raise data.max_bytes"
            + (" or data.val_fraction" if split == "val" else ""))
    return n_windows


Batch = tuple[torch.Tensor, torch.Tensor]


def _windows(tokens: np.ndarray, window_ids: np.ndarray, seq_len: int,
             mask: np.ndarray | None = None, source_len: int = 0,
             document_end: int | None = None) -> Batch:
    """Inputs and targets of the given windows: x = tokens[w*T : w*T+T], y = x shifted by one.
    With a loss mask (packed SFT rows of T+1 tokens, stride T+1): targets without loss are -100.
    With a source_len (seq2seq rows): x = (source, source_mask, labels), y = labels.
    With document_end (data.document_mask on): x is PackedTokens, the ids and each token's
    position in its document — for packed rows, from the packer's START bits; for text windows,
    a document starts after each `document_end` token (a window's first token starts one too:
    the part of a document cut by the window's start is a document of its own)."""
    if source_len:
        return seq2seq.rows(tokens, window_ids, source_len, seq_len, mask)
    stride = seq_len if mask is None else seq_len + 1
    index = window_ids[:, None] * stride + np.arange(seq_len + 1)  # (B, T+1)
    w = torch.from_numpy(tokens[index].astype(np.int64))  # fancy index reads only these rows
    x, y = w[:, :-1].contiguous(), w[:, 1:].contiguous()  # (B, T), (B, T)
    if mask is not None:  # a copy of its own: with one row, contiguous() left x and y views of w
        y = y.clone()
        y[torch.from_numpy(mask[index[:, 1:]] & sft.LOSS == 0)] = sft.IGNORE
    if document_end is not None:
        if mask is not None:
            starts = torch.from_numpy(mask[index[:, :-1]] & sft.START != 0)
        else:
            starts = torch.zeros_like(x, dtype=torch.bool)
            starts[:, 1:] = x[:, :-1] == document_end
        x = PackedTokens(x, positions_from_starts(starts), None if mask is None else y != sft.IGNORE)
    return x, y


def eval_batches(tokens: np.ndarray, seq_len: int, micro_batch: int, n: int,
                 mask: np.ndarray | None = None, dp_rank: int = 0, dp_size: int = 1,
                 source_len: int = 0, document_end: int | None = None) -> Iterator[Batch]:
    """Validation: the first n*micro_batch windows in order (fewer, in whole micro-batches, when
    the split is smaller; all of them when it holds less than one micro-batch: data too small
    for split_point to raise it to one), the same on every call and every step, so validation
    figures are comparable across a run and across runs. They are dealt to the data-parallel ranks in
    contiguous shares (sizes differing by at most one window), so the windows evaluated do not
    depend on dp_size. Every rank yields the same number of (x, y) micro-batches of micro_batch
    rows (ZeRO-3 gathers and expert all-to-alls need every rank in every forward): a share's
    last batch is filled with copies of its windows whose targets are all -100 (no loss)."""
    n_windows = _require_windows(len(tokens), seq_len, 1, "val", "evaluation",
                                 rows=mask is not None, source_len=source_len)
    total = min(n, n_windows // micro_batch) * micro_batch if n_windows >= micro_batch else n_windows
    share = np.array_split(np.arange(total), dp_size)[dp_rank]
    largest_share = -(-total // dp_size)  # ceil
    n_batches = -(-largest_share // micro_batch)
    filled = np.resize(share if len(share) else np.arange(1), n_batches * micro_batch)
    for b in range(n_batches):
        x, y = _windows(tokens, filled[b * micro_batch:(b + 1) * micro_batch], seq_len, mask, source_len,
                        document_end)
        padding = np.arange(b * micro_batch, (b + 1) * micro_batch) >= len(share)
        if padding.any():  # a copy of its own: y may be a view of the same rows as x
            y = y.clone()
            y[torch.from_numpy(padding)] = sft.IGNORE
            if isinstance(x, PackedTokens) and x.counted is not None:  # the head's positions too
                x = PackedTokens(x.ids, x.positions, y != sft.IGNORE)
        yield x, y


class Loader:
    """Batches that are a pure function of (seed, step, dp_rank, dp_size): no sampler state to save.

    The stream is cut into windows of seq_len+1 tokens that overlap by one token, so every token
    after the first is a target exactly once per epoch. Epoch e visits the windows in a permutation
    seeded by (seed, e). Global sample g = step*global_batch + i lies in epoch g // n_windows. Rank
    r takes the contiguous slice [r*L, (r+1)*L), L = micro_batch*grad_accum, of its step's global
    batch and cuts it into grad_accum micro-batches: ranks and micro-steps in order concatenate to
    the global batch, which is the same for every dp_size with the same global batch size. So a
    resume, or a resume at another world size, neither repeats nor skips a sample. A resume with
    another global batch continues after the sequences consumed (`resume_at`: g is offset).
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, micro_batch: int, grad_accum: int,
                 seed: int, dp_rank: int = 0, dp_size: int = 1, split: str = "train",
                 mask: np.ndarray | None = None, source_len: int = 0, document_end: int | None = None):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank = {dp_rank} must be in [0, dp_size = {dp_size})")
        self.tokens, self.seq_len, self.seed, self.mask = tokens, seq_len, seed, mask
        self.source_len = source_len
        """seq2seq rows (Dataset.source_len): batches are ((source, mask, labels), labels)."""
        self.document_end = document_end
        """data.document_mask on: the end-of-document token id; x is then PackedTokens (_windows)."""
        self.micro_batch, self.grad_accum = micro_batch, grad_accum
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.local_batch = micro_batch * grad_accum
        self.global_batch = self.local_batch * dp_size
        what = (f"one global batch (micro_batch {micro_batch} * grad_accum {grad_accum} * "
                f"dp_size {dp_size})")
        # At least one global batch of windows: then a step spans at most two epochs. Validation
        # (eval_batches) deals what there is, at least one window.
        needed, what = (self.global_batch, what) if split != "val" else (1, "evaluation")
        self.n_windows = _require_windows(len(tokens), seq_len, needed, split, what,
                                          rows=mask is not None, source_len=source_len)
        self._perms: dict[int, np.ndarray] = {}
        self.sample_offset = 0
        """Added to every global sample index: set on a resume with another global batch (a gang
        restarted at another size without train.global_batch) so that the samples already
        consumed are neither repeated nor skipped: `samples_done` carries across."""

    def samples_done(self, step: int) -> int:
        """Sequences consumed by the steps before `step` (what a checkpoint at `step` records)."""
        return self.sample_offset + step * self.global_batch

    def resume_at(self, step: int, samples_done: int) -> None:
        """Continue at `step` with `samples_done` sequences consumed, whatever the global batch was."""
        self.sample_offset = samples_done - step * self.global_batch

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # only the current and the next epoch are ever needed
                del self._perms[min(self._perms)]
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch])))
            self._perms[epoch] = rng.permutation(self.n_windows)
        return self._perms[epoch]

    def window_ids(self, step: int) -> np.ndarray:
        """This rank's window ids for `step`, shape (grad_accum, micro_batch)."""
        g = self.samples_done(step) + self.dp_rank * self.local_batch + np.arange(self.local_batch)
        epochs = g // self.n_windows
        ids = np.empty(self.local_batch, dtype=np.int64)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            ids[mask] = self.permutation(int(epoch))[g[mask] % self.n_windows]
        return ids.reshape(self.grad_accum, self.micro_batch)

    def micro_batches(self, step: int) -> list[Batch]:
        """grad_accum pairs (x, y) of LongTensors (micro_batch, seq_len), y = x shifted by one."""
        return [_windows(self.tokens, ids, self.seq_len, self.mask, self.source_len, self.document_end)
                for ids in self.window_ids(step)]

    def eval_batches(self, n: int) -> Iterator[Batch]:
        """This rank's share of the validation windows (module-level eval_batches)."""
        return eval_batches(self.tokens, self.seq_len, self.micro_batch, n, self.mask,
                            self.dp_rank, self.dp_size, self.source_len, self.document_end)
