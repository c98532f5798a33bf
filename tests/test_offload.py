"""Offload tiers against no offload: the same kernel on the same values, so bitwise.

Every tier runs torch's fused AdamW on the same fp32 masters made from the same fp32 initial
values, over the same segments; only where the state lives differs. Element-wise is not enough
for a chunked step to equal the whole-segment step: the kernel's vector loop and its scalar tail
round differently (FMA: exp_avg_sq's last bit on AVX2, measured), so it is the nvme tier's chunk
boundaries, multiples of 4096 bytes (1024 fp32 elements, a multiple of every vector width), that
put every element in the vector loop or in the segment's own tail alike in both. So training
with `zero.offload_optimizer = cpu | nvme` must give exactly
the losses and parameters of `none` — fp32 and bf16, 1 and 2 ranks, stages 1-3, with gradient
accumulation and fp16 loss scaling, and across a checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from ckpt_cases import straight_and_resumed
from conftest import tiny_overrides
from shardlm.config.load import load_config
from shardlm.errors import ConfigError
from shardlm.launch.spawn import run_ranks
from zero_cases import train_case, train_cases

STEPS = 3


def _base(tmp_path, **extra) -> dict:
    return tiny_overrides(tmp_path, **{"model.preset": "llama-tiny", "train.micro_batch": 4,
                                       "zero.nvme_chunk_mb": 1, **extra})


_REFERENCES: dict[str, dict] = {}


def _reference(base: dict) -> dict:
    """`base` without offload, STEPS steps: trained once per config in this process (stage 3's
    is the reference of both test_one_process_every_stage_and_tier and
    test_stage3_parameter_offload: the same config, so the same run, whose results no test
    changes). The run directory is not part of what it computes."""
    key = json.dumps({k: v for k, v in base.items() if k != "run.dir"}, sort_keys=True)
    if key not in _REFERENCES:
        _REFERENCES[key] = train_case(base, STEPS)
    return _REFERENCES[key]


def _assert_equal(a: dict, b: dict, what: str) -> None:
    assert a["losses"] == b["losses"], what
    for name, value in a["params"].items():
        assert torch.equal(value, b["params"][name]), f"{what}: {name}"


@pytest.mark.parametrize("prec", ["fp32", "bf16"])
def test_one_process_every_stage_and_tier(tmp_path, prec):
    for stage in (1, 2, 3):
        base = _base(tmp_path, **{"parallel.zero_stage": stage, "precision.compute": prec})
        reference = _reference(base)
        for tier in ("cpu", "nvme"):
            offloaded = train_case({**base, "zero.offload_optimizer": tier}, STEPS)
            _assert_equal(reference, offloaded, f"stage {stage} {prec} {tier}")
            assert offloaded["state"]["optimizer"] == (0 if tier == "nvme" else reference["state"]["optimizer"])


@pytest.mark.parametrize("prec", ["fp32", "bf16"])
def test_stage3_parameter_offload(tmp_path, prec):
    base = _base(tmp_path, **{"parallel.zero_stage": 3, "precision.compute": prec})
    reference = _reference(base)
    for params, optimizer in (("cpu", "none"), ("nvme", "none"), ("nvme", "nvme")):
        offloaded = train_case({**base, "zero.offload_params": params,
                                "zero.offload_optimizer": optimizer}, STEPS)
        _assert_equal(reference, offloaded, f"params {params}, optimizer {optimizer}")
        if params == "nvme":
            assert offloaded["state"]["params"] == 0


def test_nvme_streams_many_chunks_with_accumulation_and_fp16(tmp_path):
    """gpt-mini's 8 MB embedding crosses eight 1 MB chunks; fp16 adds the loss scaler. Few
    tokens (16 per micro-batch): fp16 matmuls on a CPU are slow (its tied 8192-row head's
    backward took ~2.8 s per micro-batch of 64 tokens), and the chunking is of the parameters,
    not of the batch."""
    base = _base(tmp_path, **{"model.preset": "gpt-mini", "train.seq_len": 16, "train.micro_batch": 1,
                              "train.grad_accum": 2, "parallel.zero_stage": 2,
                              "precision.compute": "fp16"})
    reference = train_case(base, STEPS)
    _assert_equal(reference, train_case({**base, "zero.offload_optimizer": "nvme"}, STEPS), "gpt-mini fp16")


def test_two_ranks_every_stage(tmp_path):
    cases = []
    for stage in (1, 2, 3):
        for tier in ("none", "cpu", "nvme"):
            params = "nvme" if stage == 3 and tier == "nvme" else "none"
            cases.append((_base(tmp_path, **{"parallel.zero_stage": stage, "zero.offload_optimizer": tier,
                                              "zero.offload_params": params,
                                              "precision.compute": "bf16" if stage == 2 else "fp32"}),
                          STEPS, -1))
    for rank_results in run_ranks(train_cases, 2, tmp_path, cases, timeout=600):
        for i in range(0, len(cases), 3):
            _assert_equal(rank_results[i], rank_results[i + 1], f"case {i} cpu")
            _assert_equal(rank_results[i], rank_results[i + 2], f"case {i} nvme")


@pytest.mark.parametrize("stage", [1, 3])
def test_checkpoint_round_trip_with_nvme(tmp_path, stage):
    """Offloaded state is saved and restored like any other: resume is bitwise."""
    overrides = _base(tmp_path, **{"parallel.zero_stage": stage, "zero.offload_optimizer": "nvme",
                                   "zero.offload_params": "nvme" if stage == 3 else "none"})
    (straight, resumed), = straight_and_resumed(0, 1, [("nvme", overrides, 2)])
    assert resumed["start"] == 2 and resumed["losses"] == straight["losses"][2:]
    _assert_equal({"losses": [], "params": straight["params"]}, {"losses": [], "params": resumed["params"]}, "nvme")


def test_offload_needs_a_sharding_stage():
    with pytest.raises(ConfigError, match="needs parallel.zero_stage >= 1"):
        load_config(overrides={"zero.offload_optimizer": "nvme"}).validate()
    with pytest.raises(ConfigError, match="needs parallel.zero_stage = 3"):
        load_config(overrides={"zero.offload_params": "nvme", "parallel.zero_stage": 2}).validate()


def test_peak_rss_falls_by_the_optimizer_bytes_moved_to_disk(tmp_path):
    """Fresh processes, large blocks through mmap (so freed memory leaves RSS): peak RSS with the
    nvme tier falls by at least 70% of the optimizer bytes the in-memory run held (its AdamW
    moments; in fp32 the master is the parameter itself, which stays in memory either way). The
    nvme run's own ring (nvme_buffers x 4 x nvme_chunk_mb = 64 MiB = 14% of the 450 MiB held)
    counts against it; measured on an AMD EPYC Zen 3, the fall is 82% (none 1,340 MiB, nvme
    954 MiB, 450 MiB held).

    Peak RSS is the process's VmHWM: getrusage's ru_maxrss would start at this test process's
    own resident set (fork + exec keeps the parent's), which once made the nvme run "peak" at
    1,248 MiB in a full suite (train/telemetry.py peak_rss_bytes)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    last = {}
    for tier in ("none", "nvme"):
        overrides = tiny_overrides(tmp_path, **{
            "model.preset": "gpt-mini", "model.d_model": 1024, "model.n_heads": 16, "train.seq_len": 64,
            "train.micro_batch": 2, "train.steps": 2, "parallel.zero_stage": 1,
            "zero.offload_optimizer": tier, "zero.nvme_chunk_mb": 4, "run.name": tier})
        proc = subprocess.run([sys.executable, "-m", "shardlm", "train",
                               *[f"--{k}={v}" for k, v in overrides.items()]],
                              env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        records = [json.loads(line) for line in (tmp_path / "runs" / tier / "metrics.jsonl").read_text().splitlines()]
        print(tier, "peak RSS MiB by step:", [r.get("peak_rss_bytes", 0) >> 20 for r in records])
        last[tier] = records[-1]
    held = last["none"]["optimizer_bytes_by_tier"]["cpu"]
    assert set(last["nvme"]["optimizer_bytes_by_tier"]) == {"nvme"}  # nothing of it left in memory
    fall = last["none"]["peak_rss_bytes"] - last["nvme"]["peak_rss_bytes"]
    print(f"peak RSS none {last['none']['peak_rss_bytes'] / 2**20:.0f} MiB, "
          f"nvme {last['nvme']['peak_rss_bytes'] / 2**20:.0f} MiB, fall {fall / 2**20:.0f} MiB, "
          f"optimizer bytes held in memory without the tier {held / 2**20:.0f} MiB")
    assert held > 400 * 2**20
    assert fall >= 0.7 * held, {k: r["peak_rss_bytes"] for k, r in last.items()}


def test_hybrid_sharding_with_nvme(tmp_path):
    """2 replicas x 2 shards: each shard's optimizer state streamed from disk."""
    base = _base(tmp_path, **{"parallel.zero_stage": 2, "parallel.dp_replicate": 2, "parallel.dp_shard": 2,
                              "train.micro_batch": 2})
    cases = [(base, STEPS, -1), ({**base, "zero.offload_optimizer": "nvme"}, STEPS, -1)]
    for reference, offloaded in run_ranks(train_cases, 4, tmp_path, cases, timeout=600):
        _assert_equal(reference, offloaded, "hybrid nvme")


# -- isolation and disk faults (issue 12) ------------------------------------------------------


def _tier(directory, values: torch.Tensor):
    from shardlm.config.schema import TrainConfig
    from shardlm.parallel.data.zero.tiers.nvme import NvmeTier

    tier = NvmeTier(directory, torch.float32, chunk_bytes=4096, buffers=3)
    target = torch.empty_like(values)
    tier.add(target, values, decay=True)
    tier.build_optimizer(TrainConfig(lr=0.1, weight_decay=0.0))
    return tier, target


def test_two_tiers_sharing_an_nvme_path_keep_their_own_files(tmp_path):
    """Two runs on one zero.nvme_path: each in its own locked subdirectory. Before, the second
    opened the first's files with O_TRUNC (its masters read back as zeros) and the first to
    finish deleted the other's."""
    shared = tmp_path / "nvme" / "rank-00000"
    a_init, b_init = torch.arange(3000, dtype=torch.float32), -torch.arange(3000, dtype=torch.float32)
    tier_a, target_a = _tier(shared, a_init)
    tier_b, target_b = _tier(shared, b_init)
    assert tier_a.directory != tier_b.directory and tier_a.directory.parent == shared
    assert torch.equal(tier_a.segment_state(0)[0], a_init)  # not truncated by b
    grad = torch.ones(3000)
    tier_a.step([grad])
    tier_b.step([grad])
    a_dir, b_files = tier_a.directory, [f.path for f in tier_b.files.values()]
    tier_a.close()  # a's run ends: only its own directory goes
    assert not a_dir.exists() and all(p.exists() for p in b_files)
    tier_b.step([grad])
    # Adam's first steps move each element by ~lr against the gradient's sign.
    assert torch.allclose(tier_b.segment_state(0)[0], b_init - 0.2, atol=1e-3)
    assert torch.allclose(target_a, a_init - 0.1, atol=1e-3)
    tier_b.close()
    assert sorted(p.name for p in shared.iterdir()) == []


def test_a_dead_runs_nvme_directory_is_cleaned_by_the_next(tmp_path):
    """A run killed mid-training leaves its directory with an unheld lock: the next run on the
    path removes it; a live run's directory (its lock held) is kept."""
    shared = tmp_path / "rank-00000"
    code = ("import sys, os, torch; from pathlib import Path\n"
            "from shardlm.parallel.data.zero.tiers.nvme import PrivateDir\n"
            "d = PrivateDir(Path(sys.argv[1]), 'optimizer'); (d.path / 'master.bin').write_bytes(b'x')\n"
            "os._exit(0)\n")  # dies without cleaning up, as a SIGKILL would
    subprocess.run([sys.executable, "-c", code, str(shared)], check=True, timeout=120)
    (dead,) = [p for p in shared.iterdir() if p.is_dir()]
    live, _ = _tier(shared, torch.zeros(10))
    assert not dead.exists() and not dead.with_suffix(".lock").exists()
    later, _ = _tier(shared, torch.zeros(10))
    assert live.directory.exists() and later.directory.exists()  # a live owner's lock holds
    live.close()
    later.close()


@pytest.mark.parametrize("code", ["ENOSPC", "EROFS"])
def test_a_disk_error_in_the_nvme_step_is_one_clear_error(tmp_path, monkeypatch, code):
    import errno as errnos

    from shardlm.launch.preflight import DiskError

    tier, _ = _tier(tmp_path / "nvme", torch.ones(5000))

    def fail(*args, **kwargs):
        raise OSError(getattr(errnos, code), os.strerror(getattr(errnos, code)))

    monkeypatch.setattr(os, "pwritev", fail)
    with pytest.raises(DiskError) as caught:
        tier.step([torch.ones(5000)])
    text = str(caught.value)
    assert f"({code})" in text and "nvme offload: writing" in text and str(tier.directory) in text
    assert "resume" in text
    monkeypatch.undo()
    tier.close()


def test_disk_full_during_an_nvme_run_stops_with_one_message(tmp_path, monkeypatch, capsys):
    """ENOSPC at the offload files' write during training: `shardlm train` exits 4 with one
    message naming the file and the command to resume from the last checkpoint (before: a raw
    OSError traceback out of the writer thread)."""
    import errno as errnos

    from shardlm.cli import main as cli
    overrides = _base(tmp_path, **{"parallel.zero_stage": 1, "zero.offload_optimizer": "nvme",
                                   "zero.nvme_path": str(tmp_path / "nvme"), "run.name": "full",
                                   "train.steps": 6, "checkpoint.every": 2})
    real, latest = os.pwritev, tmp_path / "runs" / "full" / "checkpoints" / "latest"

    def fill_up(fd, buffers, offset):
        if latest.exists():  # the disk fills up after the first checkpoint (step 2)
            raise OSError(errnos.ENOSPC, os.strerror(errnos.ENOSPC))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", fill_up)
    code = cli.main(["train", *[f"--{k}={v}" for k, v in overrides.items()]])
    err = capsys.readouterr().err
    assert code == 4, err
    assert "No space left on device (ENOSPC)" in err and "Traceback" not in err
    assert "nvme offload: writing" in err and ".bin' failed" in err
    assert "Last checkpoint:" in err and "step-00000002" in err
    assert f"shardlm train --resume {tmp_path / 'runs' / 'full'}" in err
