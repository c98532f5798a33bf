"""Evaluation (val_loss, val_perplexity, val_token_accuracy from summed token counts, the same on
any layout) and Arrow / Parquet sources (streamed, the same tokens as the equivalent JSONL)."""

from __future__ import annotations

import json
import math
import random
import sys

import datasets  # the test extra: writes save_to_disk fixtures
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_overrides
from eval_cases import eval_case, eval_cases
from shardlm.cli.main import main
from shardlm.config.schema import DataConfig
from shardlm.config.load import load_config
from shardlm.data.loader import build_dataset
from shardlm.data.corpus import iter_documents
from shardlm.data.sft import IGNORE
from shardlm.errors import ConfigError
from shardlm.parallel.data.evaluation import metrics_of, token_sums
from shardlm.launch.spawn import run_ranks
from shardlm.train.build import build_run
from shardlm.train.loop import train


VOCAB = 512  # the tiny presets' vocabulary
SEQ = 32
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def _chats(n: int, seed: int) -> list[dict]:
    """Chats whose answers have 1 to 12 words: rows end up with different loss-token counts."""
    rng = random.Random(seed)
    return [{"messages": [{"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(2, 6)))},
                          {"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 12)))}]}
            for _ in range(n)]


def _texts(n: int, seed: int, words: int = 40) -> list[dict]:
    rng = random.Random(seed)
    return [{"text": f"doc {i}: " + " ".join(rng.choices(WORDS, k=words))} for i in range(n)]


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _parquet(path, records, row_group_size=16):
    pq.write_table(pa.Table.from_pylist(records), path, row_group_size=row_group_size)
    return str(path)


def _saved(path, records):
    datasets.Dataset.from_list(records).save_to_disk(str(path))
    return str(path)


def _data(tmp_path, source: str, **extra) -> DataConfig:
    return DataConfig(source=source, cache_dir=str(tmp_path / "cache"), val_fraction=0.1, **extra)


def _tokens(ds) -> tuple[np.ndarray, np.ndarray | None]:
    mask = None if ds.train_mask is None else np.concatenate([ds.train_mask, ds.val_mask])
    return np.concatenate([ds.train, ds.val]), mask


# -- metrics ------------------------------------------------------------------------------------


def test_perplexity_is_exp_of_the_loss_over_targets_with_loss():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g, dtype=torch.float32)
    targets = torch.randint(0, 11, (2, 5), generator=g)
    targets[0, :2] = IGNORE
    m = metrics_of(token_sums(logits, targets))
    assert m["val_loss"] == pytest.approx(float(F.cross_entropy(logits.flatten(0, 1), targets.flatten())),
                                          rel=1e-6)  # torch's mean skips -100 too
    assert m["val_perplexity"] == math.exp(m["val_loss"])


def test_token_accuracy_counts_only_targets_with_loss():
    predicted = torch.tensor([0, 2, 2, 1, 1])  # argmax per position
    logits = F.one_hot(predicted, 3).float()[None]  # (1, 5, 3), float32
    targets = torch.tensor([[0, 1, IGNORE, 1, 0]])
    sums = token_sums(logits, targets)
    # By hand: 4 targets carry loss (position 2 does not); positions 0 and 3 are right.
    assert sums.dtype == torch.float64 and sums[1:].tolist() == [2.0, 4.0]
    assert metrics_of(sums)["val_token_accuracy"] == 0.5
    with pytest.raises(ValueError, match="no validation target"):
        metrics_of(token_sums(logits, torch.full((1, 5), IGNORE)))


@pytest.fixture(scope="module")
def chat_files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("evalchat")
    return tmp, _jsonl(tmp / "train.jsonl", _chats(60, 0)), _jsonl(tmp / "val.jsonl", _chats(20, 1))


def _eval_overrides(tmp, **extra) -> dict:
    return tiny_overrides(tmp, model__preset="llama-tiny", data__max_bytes=200_000,
                          data__cache_dir=str(tmp / "cache"), train__seq_len=SEQ, train__micro_batch=2,
                          train__eval_batches=3, train__lr=3e-3, **extra)


STEPS = 12


def test_eval_metrics_on_two_ranks_equal_one_process(chat_files, monkeypatch):
    """After the same training steps: dp = 2 (ZeRO 0 and 3) and pp = 2 on SFT rows whose
    loss-token counts differ per rank, and tp = 2 and cp = 2 on text, give one process's figures (the
    reference has the ranks' thread count and their global batch: their micro-batches as
    accumulation steps). A mean of the two ranks' means would be off by ~2e-3 here."""
    tmp, train_src, val_src = chat_files
    chat = _eval_overrides(tmp, data__source=train_src, data__val_source=val_src, data__format="chat")
    text = _eval_overrides(tmp)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    refs = {"dp": eval_case({**chat, "train.grad_accum": 2}, STEPS), "pp": eval_case(chat, STEPS),
            "text": eval_case(text, STEPS)}
    cases = [("dp", {**chat, "parallel.zero_stage": 0}), ("dp", {**chat, "parallel.zero_stage": 3}),
             ("pp", {**chat, "parallel.pp": 2}), ("text", {**text, "parallel.tp": 2}),
             ("text", {**text, "parallel.cp": 2})]
    results = run_ranks(eval_cases, 2, tmp, [c for _, c in cases], STEPS, timeout=600)
    assert all(ref["val_token_accuracy"] > 0 for ref in refs.values()), refs  # argmax is tested
    for i, (kind, case) in enumerate(cases):
        ref, what = refs[kind], {k: v for k, v in case.items() if k.startswith("parallel.")}
        for rank in range(2):
            got = results[rank][i]
            assert got["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-5), what
            assert got["val_perplexity"] == math.exp(got["val_loss"]), what
            assert got["val_token_accuracy"] == ref["val_token_accuracy"], what
        if kind == "dp":  # the ranks' shares differ, and add up to the whole
            shares = [results[r][i]["rank_targets"] for r in range(2)]
            assert shares[0] != shares[1] and sum(shares) == ref["rank_targets"], (what, shares)


def test_train_logs_the_metrics_and_val_source_is_the_held_out_file(chat_files, tmp_path):
    _, train_src, val_src = chat_files
    cfg = load_config(overrides=_eval_overrides(tmp_path, data__source=train_src, data__val_source=val_src,
                                                data__format="chat", train__steps=2))
    run = build_run(cfg.validate())
    alone = build_dataset(DataConfig(source=val_src, format="chat", cache_dir=str(tmp_path / "c2"),
                                     val_fraction=0.1), VOCAB, (run.dataset.tokenizer, run.dataset.eot_id), SEQ)
    assert np.array_equal(run.dataset.val, _tokens(alone)[0])  # all of it, in order
    assert len(run.dataset.train) == run.dataset.meta["n_tokens"]  # all of data.source trains
    result = train(run)
    last = json.loads((result.run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["val_loss"] == result.val_loss and last["val_perplexity"] == math.exp(last["val_loss"])
    assert 0 <= last["val_token_accuracy"] == result.val_token_accuracy <= 1


def test_shardlm_eval_scores_a_saved_run_as_training_did(chat_files, tmp_path, capsys):
    _, train_src, val_src = chat_files
    cfg = load_config(overrides=_eval_overrides(tmp_path, data__source=train_src, data__val_source=val_src,
                                                data__format="chat", train__steps=3))
    result = train(build_run(cfg.validate()))
    last = json.loads((result.run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    as_parquet = _parquet(tmp_path / "val.parquet", [json.loads(line) for line in open(val_src)])
    for extra in ([], [f"--data.val_source={as_parquet}"]):  # the same rows from Parquet
        assert main(["eval", "--checkpoint", str(result.run_dir), *extra]) == 0
        scored = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        for key in ("val_loss", "val_perplexity", "val_token_accuracy"):
            assert scored[key] == pytest.approx(last[key], rel=1e-6), (extra, key)
        assert scored["val_rows"] == 6
    assert main(["eval", "--checkpoint", str(result.run_dir), "--train.seq_len=16"]) == 2
    assert "train.seq_len belong to the trained run" in capsys.readouterr().err


# -- Arrow / Parquet sources ----------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["text", "chat"])
def test_parquet_and_save_to_disk_give_the_jsonl_tokens(tmp_path, fmt):
    records = _texts(60, 2) if fmt == "text" else _chats(60, 3)
    sources = [_jsonl(tmp_path / "d.jsonl", records), _parquet(tmp_path / "d.parquet", records),
               _saved(tmp_path / "saved", records)]
    built = [build_dataset(_data(tmp_path, s, format=fmt), VOCAB, seq_len=SEQ) for s in sources]
    tokens, mask = _tokens(built[0])
    assert len(tokens) > 1000 and built[0].meta["n_files"] == 1
    for ds in built[1:]:
        other, other_mask = _tokens(ds)
        assert np.array_equal(tokens, other)
        assert (mask is None and other_mask is None) or np.array_equal(mask, other_mask)
        assert ds.tokenizer.to_str() == built[0].tokenizer.to_str()


def test_parquet_directory_glob_columns_mapping_and_dataset_dict(tmp_path):
    pairs = [{"prompt": f"q{i} " + " ".join(WORDS[:i % 7 + 1]), "completion": " ".join(WORDS[i % 5:])}
             for i in range(40)]
    ref = _tokens(build_dataset(_data(tmp_path, _jsonl(tmp_path / "pc.jsonl", pairs), format="prompt_completion"),
                                VOCAB, seq_len=SEQ))
    renamed = [{"question": p["prompt"], "answer": p["completion"], "id": i} for i, p in enumerate(pairs)]
    (tmp_path / "shards").mkdir()
    _parquet(tmp_path / "shards" / "a.parquet", renamed[:25])
    _parquet(tmp_path / "shards" / "b.parquet", renamed[25:])
    for source in (str(tmp_path / "shards"), str(tmp_path / "shards" / "*.parquet")):
        cfg = _data(tmp_path, source, format="prompt_completion", columns="prompt=question,completion=answer")
        got = _tokens(build_dataset(cfg, VOCAB, seq_len=SEQ))
        assert np.array_equal(ref[0], got[0]) and np.array_equal(ref[1], got[1]), source
    # A DatasetDict: 'train' for data.source, 'test' for data.val_source.
    texts, held_out = _texts(50, 4), _texts(12, 5)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(texts),
                          "test": datasets.Dataset.from_list(held_out)}).save_to_disk(str(tmp_path / "dd"))
    ds = build_dataset(_data(tmp_path, str(tmp_path / "dd"), val_source=str(tmp_path / "dd")), VOCAB)
    plain = build_dataset(_data(tmp_path, _jsonl(tmp_path / "t.jsonl", texts)), VOCAB)
    val = build_dataset(_data(tmp_path, _jsonl(tmp_path / "v.jsonl", held_out)), VOCAB,
                        (plain.tokenizer, plain.eot_id))
    assert np.array_equal(ds.train, _tokens(plain)[0]) and np.array_equal(ds.val, _tokens(val)[0])


def test_parquet_is_streamed_not_read_whole(tmp_path):
    """Reading a 4 MB Parquet file (row groups of 64 rows) never has more than 1 MB in Arrow
    buffers: iter_batches a row group at a time. Reading it whole is measured as ≥ 4 MB, so
    the bound is one the measurement can break."""
    rng = random.Random(6)
    records = [{"text": "".join(rng.choices("abcdefghij klmnop", k=1000))} for _ in range(4000)]
    path = _parquet(tmp_path / "big.parquet", records, row_group_size=64)
    del records
    base = pa.total_allocated_bytes()
    peak, n = 0, 0
    for doc in iter_documents(_data(tmp_path, path)):
        peak = max(peak, pa.total_allocated_bytes() - base)
        n += 1
    assert n == 4000 and peak < 1 << 20, peak
    whole = pq.read_table(path)
    assert pa.total_allocated_bytes() - base >= 4_000_000
    del whole


def test_missing_columns_name_the_column_and_the_columns_present(tmp_path):
    path = _parquet(tmp_path / "d.parquet", [{"body": "x", "id": 1}])
    with pytest.raises(ConfigError, match=r"no column 'text' \(columns: \['body', 'id'\]\).*data.jsonl_field"):
        list(iter_documents(_data(tmp_path, path)))
    saved = _saved(tmp_path / "saved", [{"conversation": [{"role": "user", "content": "x"}]}])
    with pytest.raises(ConfigError, match=r"no column 'messages' \(columns: \['conversation'\]\).*data.columns"):
        build_dataset(_data(tmp_path, saved, format="chat"), VOCAB, seq_len=SEQ)
    with pytest.raises(ConfigError, match=r"no column 'answer' \(columns: \['body', 'id'\]\)"):
        build_dataset(_data(tmp_path, path, format="prompt_completion",
                            columns="prompt=body,completion=answer"), VOCAB, seq_len=SEQ)
    jsonl = _jsonl(tmp_path / "pc.jsonl", [{"question": "a", "reply": "b"}])
    with pytest.raises(ConfigError, match=r"pc.jsonl:1: no field 'answer' \(found \['question', 'reply'\]\)"):
        build_dataset(_data(tmp_path, jsonl, format="prompt_completion",
                            columns="prompt=question,completion=answer"), VOCAB, seq_len=SEQ)


def test_bad_sources_are_clear_errors(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="matches no file"):
        build_dataset(_data(tmp_path, str(tmp_path / "none-*.parquet")), VOCAB)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(_texts(3, 7))}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ConfigError, match=r"data.val_source .* splits \['train'\], none of \['validation', 'test'\]"):
        build_dataset(_data(tmp_path, str(tmp_path / "dd"), val_source=str(tmp_path / "dd")), VOCAB)
    with pytest.raises(ConfigError, match="data.columns = 'prompt' must be"):
        load_config(overrides={"data.columns": "prompt"}).validate()
    path = _parquet(tmp_path / "d.parquet", _texts(3, 8))
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if it were not installed
    with pytest.raises(ConfigError, match=r"needs pyarrow: pip install 'shardlm\[data\]'"):
        list(iter_documents(_data(tmp_path, path)))
