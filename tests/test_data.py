"""Corpus, tokenizer, token cache and sampler. Small corpora (max_bytes) and vocabularies keep
this file fast; one session-scoped cache directory is shared by the tests that need a dataset."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from shardlm.config.schema import DataConfig
from shardlm.errors import ConfigError
from shardlm.data.tokenizer import EOT
from shardlm.data.loader import Loader, build_dataset, eval_batches
from shardlm.data.corpus import corpus_files, iter_documents
from shardlm.data.corpus import fingerprint

VOCAB = 512


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("shardlm_cache")


@pytest.fixture(scope="session")
def small_cfg(cache_dir) -> DataConfig:
    return DataConfig(source="stdlib", max_bytes=200_000, cache_dir=str(cache_dir), val_fraction=0.05)


@pytest.fixture(scope="session")
def built(small_cfg):
    return build_dataset(small_cfg, VOCAB)


def _ids(n: int) -> np.ndarray:
    # A synthetic stream whose token at position p is p: window membership is readable from x.
    return np.arange(n, dtype=np.uint32)


# --- corpus ----------------------------------------------------------------------------------


def test_stdlib_corpus_files_sorted_without_tests():
    files = corpus_files(DataConfig())
    assert files == sorted(files)
    assert any(f.name == "os.py" for f in files)
    skipped = {"test", "tests", "idle_test", "site-packages", "__pycache__"}
    assert not any(skipped & set(f.parts) for f in files)
    assert all(f.suffix == ".py" for f in files)


def test_max_bytes_is_honoured():
    docs = list(iter_documents(DataConfig(max_bytes=12_345)))
    assert sum(len(d.encode("utf-8")) for d in docs) == 12_345


def test_missing_path_error_names_path_and_accepted_types(tmp_path):
    (tmp_path / "a.txt").write_text("fine")
    missing = tmp_path / "nope" / "corpus.txt"
    with pytest.raises(ConfigError) as err:
        corpus_files(DataConfig(source=f"{tmp_path},{missing}"))
    message = str(err.value)
    assert str(missing) in message and ".jsonl" in message and "stdlib" in message


def test_unsupported_and_empty_sources(tmp_path):
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(ConfigError, match="unsupported type"):
        corpus_files(DataConfig(source=str(tmp_path / "data.csv")))
    with pytest.raises(ConfigError, match="holds no"):
        corpus_files(DataConfig(source=str(tmp_path)))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ConfigError, match="yields no text"):
        build_dataset(DataConfig(source=str(tmp_path), cache_dir=str(tmp_path / "c")), 300)


def test_fingerprint_changes_with_content_and_max_bytes(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("hello")
    cfg = DataConfig(source=str(path))
    first = fingerprint(cfg)
    assert fingerprint(DataConfig(source=str(path), max_bytes=3)) != first
    path.write_text("hello world")
    assert fingerprint(cfg) != first


# --- tokenizer and cache ---------------------------------------------------------------------


def test_tokenizer_round_trips_arbitrary_text(built):
    tok = built.tokenizer
    rng = random.Random(0)
    samples = [
        "def f(x):\n\treturn x ** 2  # 平方\n",
        "naïve café — Ελληνικά, русский, עברית, العربية, हिन्दी 🚀👩‍👩‍👧 e\u0301",
        "\x00\x01\x1b[31m\x7f\r\n   trailing   ",
        bytes(rng.randrange(256) for _ in range(500)).decode("utf-8", errors="replace"),
        "".join(chr(rng.choice([rng.randrange(0x20, 0xD800), rng.randrange(0xE000, 0x110000)]))
                for _ in range(300)),
        "",
    ]
    for text in samples:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids, skip_special_tokens=False) == text


def test_vocab_size_exact_and_stream_decodes_to_corpus(built, small_cfg):
    ds = built
    assert ds.vocab_size == VOCAB
    assert ds.tokenizer.id_to_token(ds.eot_id) == EOT
    assert ds.train.dtype == np.uint16
    stream = np.concatenate([ds.train, ds.val])
    assert int(stream.max()) < VOCAB
    # The cached stream is exactly the documents joined by <|endoftext|>.
    text = ds.tokenizer.decode(stream.tolist(), skip_special_tokens=False)
    assert text == EOT.join(iter_documents(small_cfg))
    assert len(ds.val) == round(len(stream) * small_cfg.val_fraction)


def test_cache_is_reused(built, small_cfg):
    # Reused, not rebuilt: no file of the entry is written again (nothing is timed: a loaded
    # machine would make a timing fail for nothing).
    ds = built
    stamps = {p.name: p.stat().st_mtime_ns for p in ds.cache_dir.iterdir()}
    again = build_dataset(small_cfg, VOCAB)
    assert again.cache_dir == ds.cache_dir
    assert {p.name: p.stat().st_mtime_ns for p in again.cache_dir.iterdir()} == stamps
    assert np.array_equal(again.train, ds.train)
    # A different vocab is a different entry next to it.
    assert ds.cache_dir.name.endswith(f"-v{VOCAB}")


def _build_in_child(cache: str) -> dict[str, str]:
    ds = build_dataset(DataConfig(source="stdlib", max_bytes=100_000, cache_dir=cache), 400)
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(ds.cache_dir.iterdir()) if p.name != "lock"}


def test_concurrent_build_from_two_processes(tmp_path):
    # spawn, not fork: a forked child of a process that already ran the Rust thread pool would
    # have tokenizers parallelism disabled, and a test should not depend on that.
    with mp.get_context("spawn").Pool(2) as pool:
        results = pool.map(_build_in_child, [str(tmp_path)] * 2)
    assert results[0] == results[1]
    assert set(results[0]) == {"tokenizer.json", "tokens.bin", "meta.json", "done"}
    assert not list(tmp_path.rglob("*.tmp.*"))


def test_jsonl_source(tmp_path):
    docs = [f"record {i}: the quick brown fox ✓ jumps {i * i}" for i in range(40)]
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"id": i, "content": d}) for i, d in enumerate(docs)) + "\n")
    cfg = DataConfig(source=str(path), jsonl_field="content", cache_dir=str(tmp_path / "c"),
                     val_fraction=0.1)
    assert list(iter_documents(cfg)) == docs
    # A tiny corpus cannot supply 1000 merges: the vocab is padded so the size is still exact.
    ds = build_dataset(cfg, 1000)
    assert ds.vocab_size == 1000
    stream = np.concatenate([ds.train, ds.val]).tolist()
    assert ds.tokenizer.decode(stream, skip_special_tokens=False) == EOT.join(docs)
    with pytest.raises(ConfigError, match="no field 'text'"):
        list(iter_documents(DataConfig(source=str(path))))


# --- sampler ---------------------------------------------------------------------------------


def _step_ids(step: int, micro_batch: int, grad_accum: int, dp_size: int, n_tokens: int = 2000,
              seq_len: int = 16, seed: int = 7) -> np.ndarray:
    """The step's window ids over all ranks and micro-steps, in (rank, micro-step) order."""
    loaders = [Loader(_ids(n_tokens), seq_len, micro_batch, grad_accum, seed, r, dp_size)
               for r in range(dp_size)]
    return np.concatenate([loader.window_ids(step).reshape(-1) for loader in loaders])


def test_sampler_is_deterministic_and_seeded():
    a = Loader(_ids(5000), 32, 4, 2, seed=1)
    b = Loader(_ids(5000), 32, 4, 2, seed=1)
    c = Loader(_ids(5000), 32, 4, 2, seed=2)
    for step in (0, 3, 500):  # 500 is many epochs in: a resume there sees the same batches
        for (xa, ya), (xb, yb) in zip(a.micro_batches(step), b.micro_batches(step)):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not np.array_equal(a.window_ids(0), c.window_ids(0))


@pytest.mark.parametrize("micro_batch,grad_accum,dp_size",
                         [(4, 2, 1), (4, 1, 2), (2, 2, 2), (2, 1, 4), (1, 2, 4)])
def test_global_batch_is_independent_of_dp_layout(micro_batch, grad_accum, dp_size):
    for step in (0, 1, 12, 13, 40):  # n_windows = 124 with global batch 8: 15 and 16 cross epochs
        reference = _step_ids(step, 8, 1, 1)
        assert np.array_equal(_step_ids(step, micro_batch, grad_accum, dp_size), reference)


def test_every_window_once_per_epoch():
    loader = Loader(_ids(1617), 16, 4, 2, seed=3)  # n_windows = 101, not a multiple of 8
    n = loader.n_windows
    assert n == 101 and loader.global_batch == 8
    steps = -(-2 * n // loader.global_batch)
    order = np.concatenate([loader.window_ids(s).reshape(-1) for s in range(steps)])
    epoch0, epoch1 = order[:n], order[n:2 * n]
    assert sorted(epoch0) == list(range(n)) and sorted(epoch1) == list(range(n))
    assert not np.array_equal(epoch0, epoch1)


def test_x_y_shift_and_window_layout(built):
    loader = Loader(_ids(3000), 16, 3, 2, seed=0)
    batches = loader.micro_batches(5)
    assert len(batches) == 2
    for (x, y), ids in zip(batches, loader.window_ids(5)):
        assert x.shape == y.shape == (3, 16) and x.dtype == y.dtype == torch.long
        assert torch.equal(y, x + 1)
        assert x[:, 0].tolist() == (ids * 16).tolist()  # windows start at multiples of seq_len
    x, y = Loader(built.train, 64, 2, 1, seed=0).micro_batches(0)[0]
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_eval_batches_are_the_first_windows_in_order(built):
    batches = list(Loader(_ids(3000), 16, 4, 1, seed=9).eval_batches(3))
    assert len(batches) == 3
    assert batches[1][0][0, 0].item() == 4 * 16
    # dp = 2: the same 12 windows, 6 per rank; each rank's second batch padded with -100 rows.
    shares = [list(Loader(_ids(3000), 16, 4, 1, seed=9, dp_rank=r, dp_size=2).eval_batches(3))
              for r in range(2)]
    assert [len(s) for s in shares] == [2, 2]
    kept = [x[(y != -100).all(1), 0] // 16 for s in shares for x, y in s]
    assert torch.cat(kept).tolist() == list(range(12))
    assert all(((y == -100).all(1) | (y != -100).all(1)).all() for s in shares for _, y in s)
    assert len(list(eval_batches(_ids(200), 16, 4, 100))) == 3  # capped by the 12 windows there
    val = built.val
    first = [x for x, _ in eval_batches(val, 32, 2, 2)]
    assert all(torch.equal(a, b) for a, b in zip(first, [x for x, _ in eval_batches(val, 32, 2, 2)]))


def test_too_few_windows_is_a_clear_error():
    with pytest.raises(ConfigError) as err:
        Loader(_ids(100), 64, 4, 1, seed=0)
    message = str(err.value)
    assert "100 tokens" in message and "seq_len" in message and "max_bytes" in message
    with pytest.raises(ConfigError, match="val split"):
        list(eval_batches(_ids(10), 64, 1, 1))
