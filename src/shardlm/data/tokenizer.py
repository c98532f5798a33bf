"""Byte-level BPE (the GPT-2 scheme) trained on the corpus with the `tokenizers` library.

Byte-level means the base alphabet is the 256 bytes (mapped to printable characters), so any
string, in any script or with any control character, encodes without an unknown token and
decodes back to itself. `<|endoftext|>` separates documents in the token stream.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TypeVar

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from shardlm.errors import ConfigError
from shardlm.launch.cache_files import read_named_file, read_named_json
from shardlm.launch.files import atomic_write

EOT = "<|endoftext|>"
# 256 byte tokens + <|endoftext|>: below this the alphabet itself does not fit.
MIN_VOCAB = 257

log = logging.getLogger("shardlm")
T = TypeVar("T")

# Documents longer than this are encoded in line-aligned pieces, so one huge text file cannot
# make a single encode call (and its per-token offsets) hold the whole file in memory.
_PIECE_CHARS = 1 << 20
_BATCH_CHARS = 4 << 20


def _batched(items: Iterable[T], max_chars: int, size: Callable[[T], int] = len) -> Iterator[list[T]]:
    # Lists, not single strings: the trainer and encode_batch work through a list in parallel.
    batch: list[T] = []
    total = 0
    for item in items:
        batch.append(item)
        total += size(item)
        if total >= max_chars:
            yield batch
            batch, total = [], 0
    if batch:
        yield batch


def train_tokenizer(documents: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE with exactly `vocab_size` tokens (including `<|endoftext|>`)."""
    if vocab_size < MIN_VOCAB:
        raise ConfigError(f"model.vocab_size = {vocab_size} is too small for a byte-level BPE: "
                          f"it needs at least {MIN_VOCAB} (256 bytes + {EOT})")
    tok = Tokenizer(models.BPE())
    # add_prefix_space=False: the decoded text must equal the input exactly (a leading space
    # would be invented otherwise). use_regex keeps GPT-2's split into words, numbers, spaces.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        # All 256 bytes from the start, even those absent from the corpus, so any byte encodes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_batched(documents, _BATCH_CHARS), trainer=trainer)
    _pad_vocab(tok, vocab_size)
    return tok


def _pad_vocab(tok: Tokenizer, vocab_size: int) -> None:
    """A corpus too small to supply enough merges leaves the vocab short; fill it with unused
    special tokens so the embedding size the model was configured with is exactly right."""
    missing = vocab_size - tok.get_vocab_size(with_added_tokens=True)
    if missing > 0:
        log.warning("data: corpus supports only %d BPE tokens; padding to vocab_size = %d with %d "
                    "unused tokens (a larger corpus or a smaller model.vocab_size avoids this)",
                    vocab_size - missing, vocab_size, missing)
        tok.add_special_tokens([f"<|unused_{i}|>" for i in range(missing)])
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size, tok.get_vocab_size()


def save_tokenizer(tok: Tokenizer, path: str | Path) -> None:
    """Write atomically: a reader never sees a half-written tokenizer.json."""
    atomic_write(Path(path), tok.to_str(), fsync=True)


def load_tokenizer(path: str | Path) -> Tokenizer:
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"no tokenizer at {str(path)!r} (expected a tokenizer.json file or a "
                          f"directory holding one)")
    return read_tokenizer_file(path)


_SAVE_AGAIN = ("Save it again with AutoTokenizer.from_pretrained(...).save_pretrained(DIR) (a fast "
               "tokenizer's tokenizer.json), or download it again")


def read_tokenizer_file(path: Path, what: str = "the tokenizer file") -> Tokenizer:
    """The tokenizer in `path`, with a file that cannot be read (a dangling link, no permission:
    launch/cache_files.read_named_file) or that the `tokenizers` library cannot read (not JSON,
    not its schema, cut short) as a ConfigError naming the file, not the library's bare
    exception."""
    text = read_named_file(path, what, _SAVE_AGAIN)
    if text is None:
        raise ConfigError(f"{what} {str(path)!r} does not exist. {_SAVE_AGAIN}")
    try:
        return Tokenizer.from_str(text)
    except Exception as e:  # the library raises a plain Exception: "expected value at line 1 ..."
        raise ConfigError(f"{what} {str(path)!r} ({len(text.encode()):,} bytes) is not a tokenizer the "
                          f"`tokenizers` library can read: {e}. {_SAVE_AGAIN}") from None


def hf_tokenizer(directory: str | Path, vocab_size: int) -> tuple[Tokenizer, int]:
    """model.hf_path's tokenizer.json and the token that separates documents (config.json's
    eos_token_id, else <|endoftext|>). Its ids must all have a row in the model's embedding:
    more tokens than model.vocab_size is an error, fewer is fine (checkpoints pad their
    embeddings). A missing tokenizer.json is an error, never our BPE in its place: a new
    tokenizer's ids would mean nothing to the checkpoint's embeddings; so is one that exists by
    name but cannot be read (a dangling link: a hub snapshot missing its blob)."""
    root = Path(directory)
    path = root / "tokenizer.json"
    if not os.path.lexists(path):
        raise ConfigError(f"model.hf_path {str(directory)!r} has no tokenizer.json ({path} is "
                          f"missing): the checkpoint's own tokenizer is needed (only the fast "
                          f"tokenizers' tokenizer.json is read; save it with "
                          f"AutoTokenizer.from_pretrained(...).save_pretrained(DIR))")
    tok = read_tokenizer_file(path, f"model.hf_path {str(directory)!r}: its tokenizer")
    size = tok.get_vocab_size(with_added_tokens=True)
    if size > vocab_size:
        raise ConfigError(f"model.hf_path {str(directory)!r}: tokenizer.json has {size} tokens but "
                          f"the model's vocab_size is {vocab_size}: ids past it have no embedding")
    config_path = root / "config.json"
    config = read_named_json(config_path, f"model.hf_path {str(directory)!r}: its config",
                             "download or save the checkpoint's config.json again")
    eos = config.get("eos_token_id") if isinstance(config, dict) else None
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if eos is None:
        eos = tok.token_to_id(EOT)
    if not isinstance(eos, int) or not 0 <= eos < size:
        raise ConfigError(f"model.hf_path {str(directory)!r}: no token to separate documents "
                          f"(config.json has no eos_token_id within the tokenizer's {size} "
                          f"tokens, and tokenizer.json no {EOT}); set eos_token_id in config.json")
    return tok, int(eos)


def eot_id(tok: Tokenizer) -> int:
    token_id = tok.token_to_id(EOT)
    assert token_id is not None, f"tokenizer has no {EOT} token"
    return token_id


def _pieces(documents: Iterable[str]) -> Iterator[tuple[str, bool]]:
    """(text, starts_a_document) pairs, huge documents cut after a newline into bounded pieces."""
    for doc in documents:
        start = 0
        while len(doc) - start > _PIECE_CHARS:
            cut = doc.rfind("\n", start, start + _PIECE_CHARS) + 1 or start + _PIECE_CHARS
            yield doc[start:cut], start == 0
            start = cut
        yield doc[start:], start == 0


def encode_to_file(tok: Tokenizer, documents: Iterable[str], path: Path, dtype: np.dtype,
                   separator: int | None = None) -> dict:
    """Encode with encode_batch (parallel in Rust) a few MB at a time, appending each batch to the
    file, so memory stays bounded whatever the corpus size. Writes to a temporary name first.
    Documents are joined by `separator` (default: the tokenizer's <|endoftext|>)."""
    eot = np.array([eot_id(tok) if separator is None else separator], dtype=dtype)
    counts = {"n_tokens": 0, "n_documents": 0, "n_bytes": 0}
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
    # encode_batch_fast (tokenizers >= 0.20) skips the character offsets we never use.
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    with open(tmp, "wb") as f:
        for batch in _batched(_pieces(documents), _BATCH_CHARS, size=lambda piece: len(piece[0])):
            encodings = encode([text for text, _ in batch], add_special_tokens=False)
            parts = []
            for (text, is_start), enc in zip(batch, encodings):
                if is_start and (counts["n_tokens"] or parts):  # documents joined by <|endoftext|>
                    parts.append(eot)
                parts.append(np.asarray(enc.ids, dtype=dtype))
                counts["n_documents"] += is_start
                counts["n_bytes"] += len(text.encode("utf-8"))
            arr = np.concatenate(parts)
            arr.tofile(f)
            counts["n_tokens"] += arr.size
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return counts
