"""`shardlm train --nproc N`: real workers through torch's elastic launcher."""

import json
import subprocess
import sys

from conftest import tiny_overrides
from shardlm.zero.partition import comm_bytes_per_step


def _shardlm(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardlm", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_nproc_two_trains_with_zero2_and_logs_ledgers(tmp_path):
    overrides = tiny_overrides(tmp_path, train__steps=4, parallel__zero_stage=2, run__name="z2")
    result = _shardlm("train", "--nproc", "2", *[f"--{k}={v}" for k, v in overrides.items()])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rank 0: model states" in result.stdout and "rank 1: model states" in result.stdout
    records = [json.loads(line) for line in (tmp_path / "runs" / "z2" / "metrics.jsonl").open()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    last = records[-1]
    assert last["model_state_bytes"] > 0
    assert last["comm_bytes"] >= comm_bytes_per_step(136960, 2, 4, 4)  # gpt-tiny Ψ, fp32, + padding
    assert set(last["comm_bytes_by_op"]) == {"reduce_scatter/dp_shard", "all_gather/dp_shard"}


def test_bad_layout_fails_before_spawning(tmp_path):
    result = _shardlm("train", "--nproc", "3", "--parallel.dp_replicate=2", f"--run.dir={tmp_path}")
    assert result.returncode == 2
    assert "world size 3 is not divisible by dp_replicate (2)" in result.stderr
    assert not any(tmp_path.iterdir())
