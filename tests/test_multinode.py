"""Multi-node on loopback (issue 17 item 3): torchrun agents started from the line
`shardlm launch --target torchrun` writes for a 2-node job, one worker each, on this machine.

- Two agents (--nnodes=2) train together, and equal one agent of the same world size
  (--nnodes=1 --nproc-per-node=2): the same loss at every step and the same final weights, bit
  for bit; nothing they start listens beyond loopback.
- A worker killed mid-run (SIGKILL after step 3) under --max-restarts=1: both agents restart
  their workers, which resume from the latest checkpoint (step 2) by themselves, and end equal.
- Elastic (--nnodes=1:2): an agent leaves (it and its worker SIGKILLed after step 3); the other
  restarts alone at world size 1 from the latest checkpoint, resharded; then a third agent joins
  and the gang grows back to 2. train.global_batch keeps 8 sequences per step throughout
  (grad_accum 1 on 2 ranks, 2 on 1), so the run ends equal to the reference, bit for bit.

What the spec's line gets here, and why (docs/launch.md, Multi-node and elastic): torchrun runs as
`python -m torch.distributed.run`; --local-addr=127.0.0.1 (the workers' MASTER_ADDR);
--rdzv-conf is_host=0 (the c10d store is hosted by this test, listening on 127.0.0.1 only:
torch's own TCPStore server listens on every interface) and short elastic timeouts;
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (each round's process group gets a fresh store, which
shardlm binds to loopback); GLOO_SOCKET_IFNAME=lo. Faults come from $SHARDLM_FAULT
(launch.Fault), at a step, not at a moment: nothing here depends on timing.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import ipaddress
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_overrides
from cli_runs import children as _children
from test_restart import _records
from shardlm.cli import main as cli
from shardlm.checkpoint.weights import WEIGHTS
from shardlm.config.load import load_config
from shardlm.data.loader import Loader
from shardlm.config.dims import grad_accum_for
from shardlm.errors import ConfigError
from shardlm.launch.runtime import FAULT_ENV, Fault, loopback_store, planned_fault
from shardlm.launch.local import loopback_interface

STEPS, EVERY = 10, 2
RDZV_CONF = ("--rdzv-conf=is_host=0,last_call_timeout=2,keep_alive_interval=1,"
             "keep_alive_max_attempt=5")
"""The test hosts the store (is_host=0); a round waits 2 s for more agents once it has the
minimum (torch's default 30 s), and an agent is dead after 5 s without a heartbeat (default
5 x 3 s; less would evict live agents on a loaded machine)."""
WAIT_S = 240.0
"""Deadline of any one wait (a failure's, not a pace: the waits end on events)."""


def train_overrides(root: Path) -> list[str]:
    """gpt-tiny in fp32 at ZeRO-3, 8 sequences per step. No gradient clipping: the norm of one
    rank's shard and that of two shards' partial sums differ in the last bit, and clipping by it
    would carry that into the weights (measured: 1.2e-6); the gradients themselves are the same
    sums (two micro-batches accumulated on one rank = reduce-scattered over two). The collective
    timeout is also how long a worker waits at the rendezvous for the other agent's workers: on
    two cores shared with other tests one agent's start-up was seen 66 s behind the other's (a
    deadline, not a pace: a dead peer is seen at once through its closed connections)."""
    values = tiny_overrides(root, train__steps=STEPS, train__seq_len=32, train__micro_batch=4,
                            train__global_batch=8, train__log_every=1, train__eval_batches=1,
                            train__grad_clip=0, checkpoint__every=EVERY, parallel__zero_stage=3,
                            parallel__collective_timeout_s=180)
    return [f"--{k}={v}" for k, v in values.items()]


def spec_line(root: Path, name: str, nodes: int, per_node: int, endpoint: str, *extra: str) -> list[str]:
    """The torchrun line `shardlm launch --target torchrun` prints for this job (one per node,
    all the same)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["launch", "--target", "torchrun", "--nodes", str(nodes), "--gpus-per-node",
                         str(per_node), "--rdzv-endpoint", endpoint, "--job-name", name, *extra,
                         *train_overrides(root)])
    assert code == 0
    lines = [shlex.split(ln) for ln in out.getvalue().splitlines() if ln.startswith("torchrun ")]
    assert len(lines) == nodes and all(ln == lines[0] for ln in lines)
    assert "--resume" not in lines[0]  # restarts find the checkpoints by themselves
    return lines[0]


class Job:
    """One job's rendezvous store (hosted here, on loopback) and its agents."""

    def __init__(self, root: Path, name: str, nodes: int, per_node: int, *launch_args: str):
        self.root, self.name = root, name
        self.store = loopback_store("127.0.0.1", 0, True, datetime.timedelta(seconds=WAIT_S))
        line = spec_line(root, name, nodes, per_node, f"127.0.0.1:{self.store.port}", *launch_args)
        assert line[0] == "torchrun"
        self.options = [sys.executable, "-m", "torch.distributed.run", "--local-addr=127.0.0.1",
                        RDZV_CONF]
        self.line = line[1:]
        self.run_dir = root / "runs" / name
        self.agents: list[subprocess.Popen] = []

    def start(self, fault: str = "", cores: int = 1) -> subprocess.Popen:
        """One more agent, on `cores` cores of its own (as if on its own machine), so that each
        worker computes with 1 thread in every job (init_runtime: cores / local workers): the
        same arithmetic, whatever the layout."""
        env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "LOGLEVEL": "INFO",
               "GLOO_SOCKET_IFNAME": loopback_interface(), "OMP_NUM_THREADS": "1"}
        env.pop(FAULT_ENV, None)
        if fault:
            env[FAULT_ENV] = fault
        log = self.root / f"{self.name}-agent{len(self.agents)}.log"
        # torchrun's own files (its default: a directory in $TMPDIR that nobody removes)
        command = [*self.options, f"--log-dir={log.with_suffix('')}", *self.line]
        mine = sorted(os.sched_getaffinity(0))
        first = len(self.agents) * cores
        pinned = {mine[(first + i) % len(mine)] for i in range(cores)}
        with open(log, "w") as out:  # pinned in the child before exec (no taskset binary needed)
            proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True,
                                    preexec_fn=lambda: os.sched_setaffinity(0, pinned))
        self.agents.append(proc)
        return proc

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}:\n{p.read_text()[-3000:]}"
                         for p in sorted(self.root.glob(f"{self.name}-agent*.log")))

    def processes(self) -> list[int]:
        """The agents still running and their workers."""
        agents = [p.pid for p in self.agents if p.poll() is None]
        return agents + [w for a in agents for w in _children(a)]

    def wait(self, watch: list | None = None) -> list[int]:
        """Every agent's exit status; with `watch`, the listening sockets seen meanwhile."""
        deadline = time.monotonic() + WAIT_S
        while any(p.poll() is None for p in self.agents):
            assert time.monotonic() < deadline, f"the job did not end within {WAIT_S:g} s\n{self.logs()}"
            if watch is not None:
                watch += listening(self.processes())
            time.sleep(0.05)
        return [p.returncode for p in self.agents]

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc) -> None:  # whatever happened, nothing of ours outlives the test
        for pid in self.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for p in self.agents:
            p.wait(30)


def wait_for(what: str, test, job: Job):
    deadline = time.monotonic() + WAIT_S
    while not (found := test()):
        assert time.monotonic() < deadline, f"no {what} within {WAIT_S:g} s\n{job.logs()}"
        assert any(p.poll() is None for p in job.agents), f"the job ended before {what}\n{job.logs()}"
        time.sleep(0.05)
    return found


def listening(pids: list[int]) -> list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    """(address, port) of each TCP socket of `pids` that listens (/proc/net/tcp, tcp6)."""
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        inodes.add(target[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        for row in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)
                # each 32-bit word in host (little-endian) order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                out.append((ipaddress.ip_address(raw), int(port, 16)))
    return out


def is_loopback(address) -> bool:
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or bool(mapped and mapped.is_loopback)


def final_records(run_dir: Path) -> dict[int, dict]:
    """step -> its record; a step logged twice (redone after a resume): the later one."""
    return {r["step"]: r for r in _records(run_dir)}


def assert_equal_to(reference: Job, job: Job) -> None:
    ours, theirs = final_records(job.run_dir), final_records(reference.run_dir)
    assert sorted(ours) == list(range(1, STEPS + 1)), sorted(ours)
    assert [ours[s]["loss"] for s in ours] == [theirs[s]["loss"] for s in ours]  # bit for bit
    mine, ref = load_file(job.run_dir / WEIGHTS), load_file(reference.run_dir / WEIGHTS)
    assert mine.keys() == ref.keys()
    assert all(torch.equal(mine[k], ref[k]) for k in ref)
    # one run directory: the agents' ranks 0 and 1 wrote into the same one, no second
    assert [d for d in (job.root / "runs").iterdir() if not d.is_symlink()] == [job.run_dir]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One agent, two workers: the same world size, uninterrupted."""
    with Job(tmp_path_factory.mktemp("reference"), "reference", 1, 2) as job:
        job.start(cores=2)
        assert job.wait() == [0], job.logs()
    assert {r["world_size"] for r in _records(job.run_dir)} == {2}
    return job


def test_two_agents_train_as_one_agent_of_the_same_world_size(reference, tmp_path):
    with Job(tmp_path, "pair", 2, 1) as job:
        job.start()
        job.start()
        seen: list = []
        assert job.wait(watch=seen) == [0, 0], job.logs()
    assert [f"{a}:{port}" for a, port in seen if not is_loopback(a)] == []
    assert seen, "no listening socket seen: the check above checked nothing"
    assert {r["world_size"] for r in _records(job.run_dir)} == {2}
    assert_equal_to(reference, job)


def test_a_killed_worker_restarts_both_agents_from_the_latest_checkpoint(reference, tmp_path):
    with Job(tmp_path, "crash", 2, 1, "--max-restarts", "1") as job:
        job.start()
        job.start(fault="kill@3")  # this agent's worker: SIGKILL after step 3
        assert job.wait() == [0, 0], job.logs()
    steps = [r["step"] for r in _records(job.run_dir)]
    assert steps[:3] == [1, 2, 3] and steps[3:] == list(range(3, STEPS + 1)), steps  # from step 2
    assert_equal_to(reference, job)


def _state(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return ""


def _sigterm_pending(pid: int) -> bool:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(("ShdPnd:", "SigPnd:")) and int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)):
                return True
    return False


def test_elastic_membership_leave_then_join(reference, tmp_path):
    with Job(tmp_path, "elastic", 2, 1, "--min-nodes", "1", "--max-restarts", "1") as job:
        first = job.start(fault="stop@6/1")  # frozen after step 6 once alone (its restart 1)
        leaver = job.start(fault="leave@3")  # its worker SIGKILLs it and itself after step 3
        worker = wait_for("worker of the first agent stopped at step 6",
                          lambda: next((w for w in _children(first.pid) if _state(w) == "T"), None), job)
        assert leaver.poll() == -signal.SIGKILL
        alone = final_records(job.run_dir)
        assert max(alone) == 6 and [alone[s]["world_size"] for s in (4, 5, 6)] == [1, 1, 1]
        job.start()  # a third agent joins: the first one's agent stops its worker to regroup
        wait_for("SIGTERM sent to the stopped worker", lambda: _sigterm_pending(worker), job)
        os.kill(worker, signal.SIGCONT)  # it finishes its step, saves, exits; the gang grows
        codes = job.wait()
    assert codes == [0, -signal.SIGKILL, 0], job.logs()
    records = final_records(job.run_dir)
    sizes = [records[s]["world_size"] for s in range(1, STEPS + 1)]
    # steps 3-7 (re)done alone from the checkpoint of step 2 (7: the step that saw SIGTERM), the
    # rest together again from the one of step 7
    assert sizes[2:7] == [1] * 5 and sizes[7:] == [2] * (STEPS - 7), sizes
    assert_equal_to(reference, job)


# -- the pieces, without processes ------------------------------------------------------------


def test_the_rendezvous_store_listens_on_loopback_only():
    """torch's TCPStore server alone would listen on every interface (*:PORT)."""
    store = loopback_store("127.0.0.1", 0, True, datetime.timedelta(seconds=30))
    client = loopback_store("127.0.0.1", store.port, False, datetime.timedelta(seconds=30))
    client.set("k", "v")
    assert store.get("k") == b"v"
    mine = [(a, port) for a, port in listening([os.getpid()]) if port == store.port]
    assert [str(a) for a, _ in mine] == ["127.0.0.1"]


def test_fault_plans(monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "kill@3")
    assert planned_fault() == Fault("kill", 3, 0)
    monkeypatch.setenv(FAULT_ENV, "stop@6/1")
    fault = planned_fault()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert not fault.due(6)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert fault.due(6) and not fault.due(5)
    monkeypatch.setenv(FAULT_ENV, "stop@7/1:1")  # rank 1 only (bench/chaos.py's backstop)
    fault = planned_fault()
    assert fault == Fault("stop", 7, 1, 1)
    monkeypatch.setenv("RANK", "0")
    assert not fault.due(7)
    monkeypatch.setenv("RANK", "1")
    assert fault.due(7)
    monkeypatch.setenv(FAULT_ENV, "explode@3")
    with pytest.raises(ConfigError, match="ACTION@STEP"):
        planned_fault()
    monkeypatch.delenv(FAULT_ENV)
    assert planned_fault() is None


def test_global_batch_sets_grad_accum_for_each_world_size():
    cfg = load_config(None, {"train.micro_batch": 4, "train.global_batch": 8, "train.grad_accum": 5})
    assert [grad_accum_for(cfg.train, cfg.parallel, n) for n in (1, 2)] == [2, 1]
    with pytest.raises(ConfigError, match=r"global_batch = 8 is not divisible .* 3 data-parallel"):
        grad_accum_for(cfg.train, cfg.parallel, 3)
    plain = load_config(None, {"train.micro_batch": 4, "train.grad_accum": 5})
    assert grad_accum_for(plain.train, plain.parallel, 3) == 5  # no global_batch: as given
    with pytest.raises(ConfigError, match="not a multiple of train.micro_batch"):
        load_config(None, {"train.micro_batch": 4, "train.global_batch": 6}).validate()


def test_the_data_position_is_the_sequences_consumed():
    """A resume with another global batch continues after the sequences consumed: 3 steps of 8,
    then steps of 4 read what the uninterrupted run's step 3 read, in two halves."""
    tokens = np.arange(10_000, dtype=np.uint16)
    eight = Loader(tokens, 16, micro_batch=4, grad_accum=2, seed=1)
    four = Loader(tokens, 16, micro_batch=4, grad_accum=1, seed=1)
    assert eight.samples_done(3) == 24
    four.resume_at(3, eight.samples_done(3))
    assert np.array_equal(np.concatenate([four.window_ids(3), four.window_ids(4)]), eight.window_ids(3))
    assert four.samples_done(5) == eight.samples_done(4)


def test_the_elastic_spec_and_its_checks(capsys, tmp_path):
    line = spec_line(tmp_path, "job", 2, 1, "10.0.0.1:29500", "--min-nodes", "1", "--max-restarts", "1")
    assert "--nnodes=1:2" in line and "--max-restarts=1" in line
    base = ["launch", "--nodes", "2", "--gpus-per-node", "1", "--min-nodes", "1"]
    assert cli.main([*base, "--target", "torchrun"]) == 2  # no --max-restarts: a leave ends the job
    assert "--max-restarts" in capsys.readouterr().err
    assert cli.main([*base, "--target", "slurm", "--max-restarts", "1"]) == 2
    assert "for --target torchrun" in capsys.readouterr().err
    assert cli.main(["launch", "--target", "torchrun", "--nodes", "3", "--gpus-per-node", "1",
                     "--min-nodes", "1", "--max-restarts", "2", *train_overrides(tmp_path)]) == 2
    assert "at world size 3" in capsys.readouterr().err  # 8 sequences over 3 ranks
