"""`shardlm train --nproc N`: real workers through torch's elastic launcher."""

import ipaddress
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import tiny_overrides
from cli_runs import STEPS, address as _address, listening_sockets, process_tree as _process_tree
from shardlm.parallel.data.zero.partition import comm_bytes_per_step


def _shardlm(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardlm", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_nproc_two_trains_with_zero2_and_logs_ledgers(two_rank_cli_run):
    run = two_rank_cli_run  # conftest.py: `shardlm train --nproc 2`, ZeRO-2 (tests/cli_runs.py)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "rank 0: model states" in run.stdout and "rank 1: model states" in run.stdout
    records = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").open()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    last = records[-1]
    assert last["model_state_bytes"] > 0
    assert last["comm_bytes"] >= comm_bytes_per_step(136960, 2, 4, 4)  # gpt-tiny Ψ, fp32, + padding
    assert set(last["comm_bytes_by_op"]) == {"reduce_scatter/dp_shard", "all_gather/dp_shard"}


def test_bad_layout_fails_before_spawning(tmp_path):
    result = _shardlm("train", "--nproc", "3", "--parallel.dp_replicate=2", f"--run.dir={tmp_path}")
    assert result.returncode == 2
    assert "world size 3 is not divisible by dp_replicate (2)" in result.stderr
    assert not any(tmp_path.iterdir())


# -- network: a single-node run listens on loopback only ---------------------------------------

def _is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address[1:address.index("]")]).is_loopback


def test_address_decoding():
    assert _address("0100007F:1F90") == "[127.0.0.1]:8080"
    assert _address("00000000:0050") == "[0.0.0.0]:80"
    assert _address("00000000000000000000000000000000:A27B") == "[::]:41595"
    assert _address("00000000000000000000000001000000:0016") == "[::1]:22"
    assert _is_loopback("[::1]:22") and _is_loopback("[127.0.0.1]:1")
    assert not _is_loopback("[::]:1") and not _is_loopback("[0.0.0.0]:1")


def test_local_run_listens_on_loopback_only(two_rank_cli_run):
    """`shardlm train --nproc 2`: every listening socket of the launcher and its workers, sampled
    while they run, is on loopback. (Before: the launcher's rendezvous store and rank 0's
    MASTER_PORT store listened on every interface, `[::]:PORT`.)"""
    run = two_rank_cli_run  # conftest.py: sampled every 50 ms while it ran (tests/cli_runs.py)
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(run.workers) == 2, f"the probe saw no worker's sockets (too slow?): {run.listening}"
    exposed = sorted(s for s in run.listening if not _is_loopback(s[1]))
    assert not exposed, f"listening beyond loopback: {exposed}"


def _own_listening_sockets(rank: int, world_size: int) -> list[str]:
    return [address for _, address in listening_sockets([os.getpid()])]


def test_spawned_ranks_listen_on_loopback_only(tmp_path):
    """The tests' launcher (file rendezvous): the process group's own sockets are on loopback."""
    from shardlm.launch.spawn import run_ranks

    for addresses in run_ranks(_own_listening_sockets, 2, tmp_path):
        assert addresses, "gloo listens for its peers: the probe should see it"
        assert all(_is_loopback(a) for a in addresses), addresses


def test_launcher_refuses_impossible_counts():
    import pytest

    from shardlm.errors import ConfigError
    from shardlm.launch.local import launch_local

    for nproc, restarts in ((0, 0), (-1, 0), (2, -1)):
        with pytest.raises(ConfigError, match="must be >= 1 and --max-restarts"):
            launch_local(nproc, ["-c", "pass"], restarts)


# -- processes: workers die with their launcher; a signalled stop is clean (issue 12) ----------


def _start_long_run(tmp_path, name: str, **env) -> tuple[subprocess.Popen, Path]:
    """`shardlm train --nproc 2` for far more steps than a test waits for, logging each step;
    its own TMPDIR (returned) so that what it leaves there can be seen."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    overrides = tiny_overrides(tmp_path, train__steps=100_000, train__log_every=1, run__name=name)
    proc = subprocess.Popen([sys.executable, "-m", "shardlm", "train", "--nproc", "2",
                             *[f"--{k}={v}" for k, v in overrides.items()]],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp), **env})
    return proc, tmp


def _wait_for_first_step(proc: subprocess.Popen, metrics: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not (metrics.exists() and metrics.read_text().strip()):
        if proc.poll() is not None:
            raise AssertionError(f"the run ended early: {proc.communicate()[1][-3000:]}")
        assert time.monotonic() < deadline, "no step logged in time"
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    try:  # a zombie is dead for our purposes: it holds no sockets, files or CPU
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_workers_die_with_a_killed_launcher(tmp_path):
    """SIGKILL of `shardlm train --nproc 2` (torch's elastic agent runs in that process and is
    the workers' parent): both workers are gone within seconds. Before, they trained on as
    orphans, sockets listening."""
    import signal

    proc, _ = _start_long_run(tmp_path, "orphans")
    workers: list[int] = []
    try:
        _wait_for_first_step(proc, tmp_path / "runs" / "orphans" / "metrics.jsonl")
        workers = [pid for pid in _process_tree(proc.pid) if pid != proc.pid]
        assert len(workers) == 2, workers
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 15
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        survivors = [pid for pid in workers if _alive(pid)]
        assert not survivors, f"workers {survivors} outlived their launcher"
    finally:
        for pid in [proc.pid, *workers]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.communicate()


def test_sigterm_stops_a_local_run_cleanly(tmp_path):
    """SIGTERM to `shardlm train --nproc 2` after its first step: the workers finish the step,
    save a checkpoint and exit; the launcher exits 0 without a traceback and leaves nothing in
    its TMPDIR. Before: exit 1, SignalException's traceback, a `torchelastic_*` directory."""
    import signal

    proc, tmp = _start_long_run(tmp_path, "term")
    run_dir = tmp_path / "runs" / "term"
    try:
        _wait_for_first_step(proc, run_dir / "metrics.jsonl")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert (run_dir / "checkpoints" / "latest").exists()
    assert "checkpoint saved" in out
    # torchinductor_<user> is inductor's compile cache (made at import, meant to be kept)
    left = sorted(p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_"))
    assert left == [], f"left in TMPDIR: {left}"


def test_one_gpu_per_local_rank(monkeypatch):
    """On a machine with one GPU: rank i of the local ranks takes GPU i; two local ranks are
    refused before any group forms (NCCL would refuse two ranks on one device later, less
    clearly), and 'cuda:N' cannot serve several ranks. CUDA is faked: the rule is host logic."""
    import pytest
    import torch

    from shardlm.errors import ConfigError
    from shardlm.launch.runtime import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert pick_device("auto", 0, 1) == torch.device("cuda", 0)
    assert pick_device("cuda", 0, 1) == torch.device("cuda", 0)
    assert pick_device("cpu", 1, 2) == torch.device("cpu")
    with pytest.raises(ConfigError, match="2 ranks on this machine but 1 GPU"):
        pick_device("auto", 1, 2)
    with pytest.raises(ConfigError, match="names one GPU for 2 ranks"):
        pick_device("cuda:0", 0, 2)
    with pytest.raises(ConfigError, match="has 1 GPU"):
        pick_device("cuda:1", 0, 1)


@pytest.mark.parametrize("unbuffered", ["1", ""])
def test_a_closed_pipe_ends_quietly(unbuffered):
    """`shardlm presets | head -1` when head has gone: the command ends with a shell's SIGPIPE
    status (141) and no traceback (it was a BrokenPipeError traceback, exit 1). The pipe's
    reading end is closed before the command starts, so every write meets it, whether printed
    at once (unbuffered) or flushed at the end (a pipe's block buffering)."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-m", "shardlm", "presets"], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=60,
                              env={**os.environ, "PYTHONUNBUFFERED": unbuffered})
    finally:
        os.close(write)
    assert proc.returncode == 141, proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr
