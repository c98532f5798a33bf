"""The disk the nvme tier streams through, as the planner prices it: hardware/disk_probe.py
measures N ranks reading and writing at once (`shardlm calibrate --disk DIR`), the probe cache
keeps it per machine, and the local CPU cluster gives each of its ranks 1/N of the rate N
streams reached. Timings are injected where a test checks a decision."""

import os

import pytest

from conftest import private_cache
from shardlm.cli.main import main
from shardlm.config.schema import ZeroConfig
from shardlm.config.dims import ParallelDims
from shardlm.hardware import disk_probe, probe
from shardlm.hardware.catalog import local_cpu
from shardlm.hardware.machine import LOCAL_DISK_BANDWIDTH, local_disk
from shardlm.planner.workload import Dtypes, Strategy, Workload
from shardlm.planner.timing import estimate_time
from shardlm.planner.shapes import preset_model
from shardlm.planner.memory import nvme_first_chunk
from shardlm.planner.workload import stage_params

MIB = 2**20


def test_each_stream_reads_one_file_while_writing_another_and_leaves_nothing(monkeypatch, tmp_path):
    """2 streams of 2 blocks: the files read are written first (untimed), then 2 readers and 2
    writers run at once; the rate is their 8 blocks over the wall time between start and end."""
    calls = {"read": 0, "write": 0}
    real_read, real_write = os.preadv, os.pwritev

    def count(kind, real):
        def wrapped(*a):
            calls[kind] += 1
            return real(*a)
        return wrapped

    monkeypatch.setattr(disk_probe.os, "preadv", count("read", real_read))
    monkeypatch.setattr(disk_probe.os, "pwritev", count("write", real_write))
    clock = iter([10.0, 10.5])
    monkeypatch.setattr(disk_probe.time, "perf_counter", lambda: next(clock))
    rate = disk_probe.stream_bandwidth(tmp_path, 2, nbytes=2 * MIB, block=MIB)
    assert rate == 2 * 2 * 2 * MIB / 0.5
    assert calls == {"read": 4, "write": 4 + 4}  # 4 untimed writes prepare the files read
    assert list(tmp_path.iterdir()) == []  # its private directory is gone


def test_stream_rate_is_linear_between_measured_counts_and_saturates():
    measured = {1: 1.0e9, 2: 1.4e9, 4: 1.5e9}
    assert disk_probe.stream_rate(measured, 1) == 1.0e9
    assert disk_probe.stream_rate(measured, 3) == pytest.approx(1.45e9)
    assert disk_probe.stream_rate(measured, 8) == 1.5e9


def test_calibrate_disk_is_cached_and_the_planner_gives_each_rank_its_share(monkeypatch, capsys, tmp_path):
    """`shardlm calibrate --disk DIR` alone measures only the disk, once per stream count; the
    2-rank cluster then streams at 2 streams' rate in all (1.4 GB/s, not one stream's 1.0 or
    the assumed 1.2), and the optimizer step's disk time moves by exactly that."""
    private_cache(monkeypatch, tmp_path / "cache")
    rates = {1: 1.0e9, 2: 1.4e9, 4: 1.5e9}
    timed = []
    monkeypatch.setattr(disk_probe, "stream_bandwidth", lambda d, n: timed.append(n) or rates[n])
    assert probe.disk_streams() == {}
    assert local_disk({}, 2) == (LOCAL_DISK_BANDWIDTH, "1.2 GB/s read + write assumed; `shardlm calibrate "
                                                       "--disk DIR` measures it")
    assert main(["calibrate", "--disk", str(tmp_path / "disk")]) == 0
    out = capsys.readouterr().out
    assert "2 rank(s) streaming 1.40 GB/s read + write in all" in out and "--model" not in out
    assert main(["calibrate", "--disk", str(tmp_path / "disk")]) == 0  # cached: not measured again
    assert timed == [1, 2, 4]
    streams = probe.disk_streams()
    assert {n: v["bytes_per_s"] for n, v in streams.items()} == rates
    rate, source = local_disk(streams, 2)
    assert rate == 1.4e9 and "with 2 rank(s) streaming at once, measured under" in source

    measured = {"cpu": "test cpu", "cores": 2, "threads": 1, "peak": {"fp32": 6e10}, "memory_bandwidth": 1e10,
                "gloo_in_step_bandwidth": 1e9, "gloo_in_step_latency": 1e-4, "baseline_rss": 2e8,
                "gloo_in_step_all_gather_factor": 1.0, "gloo_in_step_reduce_scatter_factor": 1.0,
                "gloo_in_step_send_recv_factor": 1.0, "curve": {}}
    w = Workload(preset_model("gpt-tiny"), 64, 4)
    s = Strategy(ParallelDims(dp_shard=2), zero_stage=2, micro_batch=2, offload_optimizer="nvme",
                 dtypes=Dtypes("fp32"))

    def optimizer(disk):
        monkeypatch.setattr(probe, "measure_cpu", lambda n: {**measured, "disk": disk})
        cluster = local_cpu(2)
        return cluster.node.nvme_bandwidth, estimate_time(w, s, cluster).optimizer

    (assumed_bw, assumed), (measured_bw, got) = optimizer({}), optimizer(streams)
    assert (assumed_bw, measured_bw) == (LOCAL_DISK_BANDWIDTH, 1.4e9)
    sp = stage_params(w, s.layout)[0]
    per_rank = sp.dense / 2
    # The tier's first chunk is read (and its last written) with one request in flight per rank:
    # at the lone rate, which 2 ranks' 2 requests put at one measured stream's (1.0 GB/s);
    # assumed, there is no lone rate and every byte moves at the streams' rate.
    first = nvme_first_chunk(sp, 2, ZeroConfig().nvme_chunk_mb * 2**20, 4)
    assert 0 < first < per_rank
    state = 2 * 3 * 4  # master, m, v, read + written
    expected = (state * per_rank / (LOCAL_DISK_BANDWIDTH / 2)
                - state * (per_rank - first) / (1.4e9 / 2) - state * first / (1.0e9 / 2))
    assert assumed - got == pytest.approx(expected, rel=1e-6)
