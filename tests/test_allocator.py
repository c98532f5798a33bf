"""The allocator policy (shardlm/launch/allocator.py): every rank `shardlm train` starts fixes glibc's
mmap threshold, read back in the rank; the user's MALLOC_MMAP_THRESHOLD_ takes precedence and
run.malloc_mmap_threshold = 0 leaves glibc's default. Read-backs, not sizes or timings."""

import json
import os
import subprocess
import sys

from shardlm.launch.allocator import glibc_version

PROBE = """
import json
from shardlm.launch import allocator
before = allocator.threshold_in_effect()
policy = allocator.apply_malloc_policy({threshold})
print(json.dumps([before, policy.source, policy.threshold, allocator.threshold_in_effect(), policy.report()]))
"""


def _fresh_process(threshold: int, **env: str) -> list:
    clean = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")}
    out = subprocess.run([sys.executable, "-c", PROBE.format(threshold=threshold)], env={**clean, **env},
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return json.loads(out)


def test_policy_precedence_and_read_back_in_fresh_processes():
    assert glibc_version(), "these tests (and the CI machines) run on glibc"
    # glibc's dynamic default: a 16 MiB block comes from the heap once a larger one was freed
    before, source, threshold, after, report = _fresh_process(131072)
    assert (before, source, threshold, after) == (False, "config", 131072, True), report
    assert "mallopt" in report and "read back: in effect" in report
    # run.malloc_mmap_threshold = 0: nothing called, the default stays
    before, source, threshold, after, report = _fresh_process(0)
    assert (before, source, threshold, after) == (False, "off", None, False), report
    # the user's variable wins over the config (glibc applied it at start-up; no mallopt here)
    before, source, threshold, after, report = _fresh_process(0, MALLOC_MMAP_THRESHOLD_="262144")
    assert (before, source, threshold, after) == (True, "environment", 262144, True), report
    assert "MALLOC_MMAP_THRESHOLD_=262144 from the environment" in report
    _, source, _, _, report = _fresh_process(131072, GLIBC_TUNABLES="glibc.malloc.mmap_threshold=65536")
    assert source == "environment" and "glibc.malloc.mmap_threshold=65536" in report


def test_every_rank_of_shardlm_train_applies_it(two_rank_cli_run):
    """conftest.py's `shardlm train --nproc 2` run (tests/cli_runs.py), started without
    MALLOC_MMAP_THRESHOLD_ / GLIBC_TUNABLES: each rank applies the config's default."""
    result = two_rank_cli_run
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        assert (f"rank {rank}: malloc: mmap threshold fixed at 8,388,608 bytes (mallopt" in result.stdout
                and f"rank {rank}: malloc:" in result.stdout), result.stdout[-3000:]
    # counted over the whole output: the launcher relays both ranks' output, and two lines
    # written at once can arrive joined (seen in CI)
    assert result.stdout.count(": malloc:") == 2, result.stdout[-3000:]
    assert result.stdout.count("read back: in effect") == 2, result.stdout[-3000:]


def test_off_glibc_it_is_a_no_op_that_says_why():
    script = ("import json; from shardlm.launch import allocator; allocator.glibc_version = lambda: None; "
              "allocator._libc = None; p = allocator.apply_malloc_policy(); "
              "print(json.dumps([p.source, p.threshold, p.report(), allocator.threshold_in_effect()]))")
    clean = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")}
    out = subprocess.run([sys.executable, "-c", script], env=clean, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    source, threshold, report, probe = json.loads(out)  # _libc = None: any call into libc would fail
    assert (source, threshold, probe) == ("unsupported", None, None)
    assert report == ("malloc: not glibc: run.malloc_mmap_threshold has no effect here "
                      "(mallopt(M_MMAP_THRESHOLD) is glibc's); the allocator is left as it is")


def test_page_locked_memory_refused_falls_back_to_pageable(caplog):
    """On this machine without a GPU, page-locked memory is refused (no accelerator to lock it
    for): host_tensor gives pageable memory instead, with one warning naming the fix — what a
    memlock limit or an exhausted host does to a GPU run's offload buffers."""
    import logging

    import torch

    from shardlm.launch import allocator
    allocator._PINNED_REFUSED.clear()
    with caplog.at_level(logging.WARNING, logger="shardlm"):
        a = allocator.host_tensor((3, 4), torch.bfloat16, pinned=True)
        b = allocator.host_tensor((2, 5), torch.float32, pinned=True, stride=(1, 2))
    assert a.shape == (3, 4) and a.dtype == torch.bfloat16 and not a.is_pinned()
    assert b.stride() == (1, 2) and b.device.type == "cpu"
    warnings = [r for r in caplog.records if "page-locked host memory refused" in r.message]
    assert len(warnings) == 1 and "ulimit -l" in warnings[0].message
    assert allocator._PINNED_REFUSED
    plain = allocator.host_tensor((2,), torch.float32, pinned=False)
    assert not plain.is_pinned()
