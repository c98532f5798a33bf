"""Shared fixtures: one token cache per test session, and tiny configs."""

import pytest


@pytest.fixture(scope="session", autouse=True)
def session_cache(tmp_path_factory):
    """Tokenizers, token shards and the CPU probe go to one fresh cache per session, so tests
    never depend on (or pollute) the user's ~/.cache/shardlm."""
    path = tmp_path_factory.mktemp("shardlm-cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("SHARDLM_CACHE", str(path))
    yield path
    mp.undo()


def tiny_overrides(tmp_path, **extra) -> dict:
    """A seconds-long run on a slice of the default stdlib corpus."""
    overrides = {"model.preset": "gpt-tiny", "train.seq_len": 64, "train.micro_batch": 8,
                 "train.steps": 10, "train.warmup_steps": 2, "train.eval_every": 0,
                 "train.eval_batches": 2, "train.sample_tokens": 0, "data.max_bytes": 1_000_000,
                 "run.dir": str(tmp_path / "runs"), "run.progress": "off"}
    overrides.update({k.replace("__", "."): v for k, v in extra.items()})
    return overrides
