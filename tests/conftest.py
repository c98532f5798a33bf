"""Shared fixtures: one token cache per test session, and tiny configs."""

import os

import pytest

# oneDNN picks bf16 kernels by ISA, and on AMX CPUs its blocking (and so the rounding of a
# reduction) can follow the thread count: the parity tests compare a 2-rank run (1 thread
# each) with a 1-process reference, so every process takes the same non-AMX path. Set before
# torch loads oneDNN; spawned ranks inherit it. A no-op on CPUs without AMX.
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")


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
    """A seconds-long run on a slice of the default stdlib corpus, in fp32 unless a test says
    otherwise: 'auto' would follow the CPU (bf16 where it is faster), and a test pins what it
    claims."""
    overrides = {"model.preset": "gpt-tiny", "precision.compute": "fp32", "train.seq_len": 64,
                 "train.micro_batch": 8,
                 "train.steps": 10, "train.warmup_steps": 2, "train.eval_every": 0,
                 "train.eval_batches": 2, "train.sample_tokens": 0, "data.max_bytes": 1_000_000,
                 "run.dir": str(tmp_path / "runs"), "run.progress": "off"}
    overrides.update({k.replace("__", "."): v for k, v in extra.items()})
    return overrides
