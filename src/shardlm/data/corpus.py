"""Corpus sources: which files make the text, in which order, and a fingerprint for caching.

`source = "stdlib"` is the Python standard library's own `.py` files (present wherever Python is,
so the default run needs no download); anything else is a comma-separated list of `.txt`, `.py`,
`.md` or `.jsonl` files or directories of them, or Arrow / Parquet tables (data/tables.py: a
datasets save_to_disk directory, .parquet files, a directory of them or a glob). One text file
is one document; one JSONL line, or one table row, is one document. Everything is read in a
fixed (sorted) order so every rank and every rerun sees the same text, which the tokenizer cache
and the sampler's determinism both depend on.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from shardlm.config.schema import DataConfig
from shardlm.data.tables import TABLE_SUFFIXES, dataset_dir_files, is_dataset_dir, iter_rows
from shardlm.errors import ConfigError

TEXT_SUFFIXES = (".txt", ".py", ".md")
JSONL_SUFFIXES = (".jsonl",)
ACCEPTED = TEXT_SUFFIXES + JSONL_SUFFIXES + (".parquet",)
"""What a directory walk picks up; an explicit .arrow file, or a save_to_disk directory, also reads."""

# Directories never part of the stdlib corpus: third-party packages, bytecode, the test suites
# (large, repetitive, and full of deliberately odd code that is not "the library"), and generated
# data posing as code: `encodings` (1.4 MB of codec tables) and `pydoc_data` (one 0.75 MB string),
# which otherwise dominate what a small model learns to write.
_STDLIB_SKIP = frozenset({"site-packages", "dist-packages", "__pycache__",
                          "test", "tests", "idle_test", "encodings", "pydoc_data"})

# Bump when the meaning of the text changes (new skip rule, new document split) so caches rebuild.
_CORPUS_FORMAT = 2


def _walk(root: Path, suffixes: tuple[str, ...],
          skip_dirs: frozenset[str] = frozenset()) -> list[Path]:
    """Files under `root` with one of `suffixes`, in sorted order.

    os.walk with in-place pruning instead of rglob: the stdlib directory holds site-packages,
    which can be far larger than the stdlib itself, and pruning avoids walking it at all.
    """
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs)
        found.extend(Path(dirpath) / f for f in filenames if f.endswith(suffixes))
    # Sort the full paths (not per directory) so the order is independent of walk order.
    return sorted(found)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(cfg: DataConfig, split: str = "train") -> list[Path]:
    """The files of the corpus, in the order they are read. Raises ConfigError for a bad source.
    `split`: which split of a DatasetDict directory ('train', or 'val' for data.val_source)."""
    if cfg.source.strip() == "stdlib":
        files = _walk(stdlib_root(), (".py",), _STDLIB_SKIP)
        if not files:
            raise ConfigError(f"data.source = 'stdlib': no .py files found under {stdlib_root()}; "
                              f"point data.source at your own text files instead")
        return files
    parts = [p.strip() for p in cfg.source.split(",") if p.strip()]
    if not parts:
        raise ConfigError("data.source is empty; use 'stdlib' or a path to "
                          f"{'/'.join(ACCEPTED)} files or directories (comma-separated for several)")
    files: list[Path] = []
    for part in parts:
        part = os.path.expanduser(part)
        if any(c in part for c in "*?["):  # a glob, 'shards/*.parquet': its matches, sorted
            matches = sorted(glob.glob(part))
            if not matches:
                raise ConfigError(f"data.source pattern {part!r} matches no file")
            for match in matches:
                files.extend(_files_of(Path(match), split))
        else:
            files.extend(_files_of(Path(part), split))
    return files


def _files_of(path: Path, split: str = "train") -> list[Path]:
    accepted = "/".join(ACCEPTED)
    if not path.exists():
        raise ConfigError(f"data.source path {str(path)!r} does not exist; data.source accepts "
                          f"'stdlib', {accepted} files or directories, a glob, or a datasets "
                          f"save_to_disk directory (comma-separated for several)")
    if path.is_dir() and is_dataset_dir(path):
        return dataset_dir_files(path, split)
    if path.is_dir():
        files = _walk(path, ACCEPTED)
        if not files:
            raise ConfigError(f"data.source directory {str(path)!r} holds no {accepted} files")
        return files
    if not path.name.endswith(ACCEPTED + TABLE_SUFFIXES):
        raise ConfigError(f"data.source file {str(path)!r} has an unsupported type; "
                          f"accepted: {accepted}/.arrow (or a directory of them, or a datasets "
                          f"save_to_disk directory)")
    return [path]


def _read_text(path: Path, limit: int | None) -> str:
    # Read at most `limit` bytes: with a small max_bytes we never touch the rest of a big file.
    with open(path, "rb") as f:
        raw = f.read() if limit is None else f.read(limit)
    return raw.decode("utf-8", errors="replace")


SNIFF_BYTES = 1 << 16
"""How much of each text file check_text_files reads."""
NOT_TEXT_LIMIT = 0.3
"""The fraction of a text file's first SNIFF_BYTES that may be bytes no text has. Random bytes
score ~0.6 (half of them are >= 0x80 and rarely form valid UTF-8; a tenth are control
characters), UTF-16 text ~0.5 (a NUL in every other byte), UTF-8 text 0, a Latin-1 / cp1252
file a few hundredths (its accented letters)."""
_NOT_TEXT = re.compile("[\x00-\x08\x0e-\x1a\x1c-\x1f\x7f\udc80-\udcff]")
"""With errors='surrogateescape' each byte outside valid UTF-8 decodes to U+DC80..U+DCFF; the
control characters text does not use (all but \\t \\n \\v \\f \\r and ESC) count too."""


def not_text_fraction(raw: bytes) -> tuple[float, int]:
    """(the fraction of `raw` that is bytes no text has: invalid UTF-8, or a control character
    other than whitespace and ESC; the offset of the first such byte, -1 if none)."""
    text = raw.decode("utf-8", errors="surrogateescape")
    found = _NOT_TEXT.findall(text)
    if not found:
        return 0.0, -1
    first = _NOT_TEXT.search(text)
    offset = len(text[:first.start()].encode("utf-8", errors="surrogateescape"))
    return len(found) / max(len(raw), 1), offset


_TABLE_MAGIC = {".parquet": ((b"PAR1",), "a Parquet file begins with PAR1"),
                ".arrow": ((b"ARROW1", b"\xff\xff\xff\xff"), "an Arrow file begins with ARROW1 "
                           "(the file format) or 0xFFFFFFFF (the stream format datasets writes)")}
"""What a table's first bytes are (data/tables.py reads .parquet and .arrow files)."""


def source_file_problem(path: Path, raw: bytes) -> str:
    """What is wrong with data.source file `path` given its first bytes `raw`, '' if nothing:
    text (.txt, .py, .md) and JSONL files must be text (not_text_fraction under NOT_TEXT_LIMIT),
    tables must begin with their format's magic bytes. Sniffed by content, whatever the name
    promises: random bytes named .jsonl or .parquet are refused as surely as ones named .txt."""
    for suffix, (magics, expected) in _TABLE_MAGIC.items():
        if path.name.endswith(suffix):
            if raw.startswith(magics):
                return ""
            return (f"is not a {suffix} table: {expected}, this one with {raw[:8]!r} (a file of "
                    f"another kind, or cut short); write it again or remove it from data.source")
    fraction, first = not_text_fraction(raw)
    if fraction <= NOT_TEXT_LIMIT:
        return ""
    return (f"is not UTF-8 text: {fraction:.0%} of its first {len(raw):,} bytes are invalid "
            f"UTF-8 or control characters (the first at byte {first}); a binary file, or text in "
            f"another encoding (convert it: iconv -t UTF-8). Remove it from data.source or convert it")


def check_text_files(cfg: DataConfig) -> None:
    """Every file data.source (and data.val_source) reads is what its name says, sniffed by its
    content (source_file_problem): text and JSONL files are text — one whose first SNIFF_BYTES
    are more than NOT_TEXT_LIMIT bytes no text has (binary data, another encoding than UTF-8
    such as UTF-16) is a ConfigError naming it; a few odd bytes in text pass (they read as
    U+FFFD) — and tables begin with their format's magic bytes. Only the files a run reads are
    looked at (data.max_bytes), and the default 'stdlib' source not at all (Python's own
    sources). Cheap: run before the run starts."""
    from dataclasses import replace

    for source, split in ((cfg.source, "train"), (cfg.val_source, "val")):
        if not source.strip() or source.strip() == "stdlib":
            continue
        budget = cfg.max_bytes if cfg.max_bytes > 0 else None
        for path in corpus_files(replace(cfg, source=source), split):
            table = path.name.endswith(TABLE_SUFFIXES)
            try:
                with open(path, "rb") as f:
                    raw = f.read(8 if table else SNIFF_BYTES if budget is None else min(SNIFF_BYTES, budget))
            except OSError as e:
                raise ConfigError(f"data.{'source' if split == 'train' else 'val_source'} file "
                                  f"{str(path)!r} cannot be read: {e.strerror or e}") from None
            problem = source_file_problem(path, raw)
            if problem:
                raise ConfigError(f"data.{'source' if split == 'train' else 'val_source'} file "
                                  f"{str(path)!r} {problem}")
            if budget is not None and not table:
                budget -= path.stat().st_size
                if budget <= 0:
                    break


def jsonl_records(path: Path) -> Iterator[tuple[int, bytes, object]]:
    """(line number, raw line, parsed JSON) of every non-blank line of a JSONL file; a line that
    is not JSON is a ConfigError naming file:line."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            line = raw.decode("utf-8", errors="replace").strip()
            if not line:
                continue
            try:
                yield lineno, raw, json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None


def _jsonl_documents(path: Path, field: str) -> Iterator[str]:
    for lineno, _, record in jsonl_records(path):
        if not isinstance(record, dict) or field not in record:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise ConfigError(f"{path}:{lineno}: no field {field!r} (found {keys}); "
                              f"set data.jsonl_field to the field holding the text")
        yield str(record[field])


def _documents_of(path: Path, cfg: DataConfig, budget: int | None) -> Iterator[str]:
    if path.name.endswith(JSONL_SUFFIXES):
        yield from _jsonl_documents(path, cfg.jsonl_field)
    elif path.name.endswith(TABLE_SUFFIXES):
        field = cfg.jsonl_field
        for row in iter_rows(path, [field], "set data.jsonl_field to the column holding the text"):
            if row[field] is not None:  # a null cell: no document
                yield str(row[field])
    else:
        yield _read_text(path, budget)


def iter_documents(cfg: DataConfig, files: list[Path] | None = None) -> Iterator[str]:
    """Every non-empty document of the corpus in order, stopping after `max_bytes` bytes of text.

    The byte budget counts UTF-8 bytes of the text; the document that crosses the limit is cut
    there, so a run with max_bytes = N always sees the same first N bytes.
    """
    budget = cfg.max_bytes if cfg.max_bytes > 0 else None
    for path in files if files is not None else corpus_files(cfg):
        for doc in _documents_of(path, cfg, budget):
            if budget is not None:
                encoded = doc.encode("utf-8")
                if len(encoded) > budget:
                    doc = encoded[:budget].decode("utf-8", errors="replace")
                    encoded = encoded[:budget]
                budget -= len(encoded)
            if doc:
                yield doc
            if budget is not None and budget <= 0:
                return


def fingerprint(cfg: DataConfig, files: list[Path] | None = None) -> str:
    """Hash of everything that decides the text: each file's path, size and mtime, max_bytes, the
    JSONL field and data.columns. Editing, adding or removing a file changes it, so the cache rebuilds."""
    h = hashlib.sha256()
    columns = f";columns={cfg.columns}" if cfg.columns else ""  # so older caches keep their names
    h.update(f"format={_CORPUS_FORMAT};max_bytes={cfg.max_bytes};field={cfg.jsonl_field}{columns}\n".encode())
    for path in files if files is not None else corpus_files(cfg):
        st = path.stat()
        h.update(f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]
