"""Corpus sources: which files make the text, in which order, and a fingerprint for caching.

`source = "stdlib"` is the Python standard library's own `.py` files (present wherever Python is,
so the default run needs no download); anything else is a comma-separated list of `.txt`, `.py`,
`.md` or `.jsonl` files or directories of them. One text file is one document; one JSONL line is
one document. Everything is read in a fixed (sorted) order so every rank and every rerun sees the
same text, which the tokenizer cache and the sampler's determinism both depend on.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from shardlm.config import DataConfig
from shardlm.errors import ConfigError

TEXT_SUFFIXES = (".txt", ".py", ".md")
JSONL_SUFFIXES = (".jsonl",)
ACCEPTED = TEXT_SUFFIXES + JSONL_SUFFIXES

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


def corpus_files(cfg: DataConfig) -> list[Path]:
    """The files of the corpus, in the order they are read. Raises ConfigError for a bad source."""
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
        files.extend(_files_of(Path(part).expanduser()))
    return files


def _files_of(path: Path) -> list[Path]:
    accepted = "/".join(ACCEPTED)
    if not path.exists():
        raise ConfigError(f"data.source path {str(path)!r} does not exist; data.source accepts "
                          f"'stdlib' or {accepted} files or directories (comma-separated for several)")
    if path.is_dir():
        files = _walk(path, ACCEPTED)
        if not files:
            raise ConfigError(f"data.source directory {str(path)!r} holds no {accepted} files")
        return files
    if not path.name.endswith(ACCEPTED):
        raise ConfigError(f"data.source file {str(path)!r} has an unsupported type; "
                          f"accepted: {accepted} (or a directory of them)")
    return [path]


def _read_text(path: Path, limit: int | None) -> str:
    # Read at most `limit` bytes: with a small max_bytes we never touch the rest of a big file.
    with open(path, "rb") as f:
        raw = f.read() if limit is None else f.read(limit)
    return raw.decode("utf-8", errors="replace")


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
    """Hash of everything that decides the text: each file's path, size and mtime, max_bytes and
    the JSONL field. Editing, adding or removing a file changes it, so the cache rebuilds."""
    h = hashlib.sha256()
    h.update(f"format={_CORPUS_FORMAT};max_bytes={cfg.max_bytes};field={cfg.jsonl_field}\n".encode())
    for path in files if files is not None else corpus_files(cfg):
        st = path.stat()
        h.update(f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]
