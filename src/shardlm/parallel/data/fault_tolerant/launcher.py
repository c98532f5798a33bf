"""`shardlm train --nproc N` with parallel.fault_tolerant: dp_replicate replicas of
N / dp_replicate processes each (each replica its own world: no process group spans two
replicas; inside one, ZeRO shards over its ranks as usual), a replica restarted whole when one
of its processes dies, and the coordination store they meet in — a TCPStore hosted here,
listening on the one address `--quorum-endpoint` names (loopback by default: one machine).

A replica's gradients are averaged with the others' over a group the replicas rebuild at each
step from the live ones (parallel/data/fault_tolerant/quorum.py, after torchft's Lighthouse quorum and Manager). This
module is the launcher half: it hosts the store, starts replica r's ranks with its identity in
the environment (RANK / WORLD_SIZE of the replica's own world, its group formed in a file),
records in the store each death it sees (`deaths/<r>`, so the live replicas stop waiting for
that one at once), and starts the replica again, up to `max_restarts` times; the new processes
rejoin from a live peer's state, rank i from its rank i. The worker half of the environment is read here too
(`replica_identity`), as runtime.py reads the launcher's RANK / WORLD_SIZE.

Each replica writes its own run directory, `<run.dir>/<run.name>/replica-<r>` (its metrics.jsonl,
its final weights); checkpoints, written by one live replica, go to `<run.dir>/<run.name>/checkpoints`
(train/checkpointing.py). docs/reliability.md, "Replica groups", says what is recovered and what is lost.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from shardlm.errors import ConfigError
from shardlm.launch.local import loopback_interface
from shardlm.launch.runtime import (FAULT_ENV, LAUNCHER_PID_ENV, LOCAL_RENDEZVOUS_ENV,
                                   RENDEZVOUS_PREFIX, loopback_store)

log = logging.getLogger("shardlm")

REPLICA_ENV = "SHARDLM_REPLICA"
"""Set by `launch_replicas` for its workers: 'REPLICA/REPLICAS/INCARNATION@HOST:PORT', this
process's replica id, how many replicas the run has, how many times this replica was restarted,
and the coordination store."""
REPLICA_FAULTS_ENV = "SHARDLM_REPLICA_FAULTS"
"""Tests and benchmarks: 'R:ACTION@STEP[/ROUND],...', the $SHARDLM_FAULT (launch/runtime.py
Fault) each replica R receives; a replica not named receives none. ROUND is the replica's
incarnation (its restarts so far): a replica named more than once receives, in each incarnation,
the fault of that round ('1:kill@2,1:leave@7/1': killed after step 2, and once restarted, takes
the launcher down after step 7 — the whole job lost at once). Without it, every replica
receives $SHARDLM_FAULT, if set."""
DONE = "done"
"""Set in the store when a replica finished the run: a restarted one waiting to rejoin stops."""
DEATHS = "deaths/{}"
"""The store's count of the deaths of replica r the launcher has seen (parallel/data/fault_tolerant/quorum.py)."""
JOINED = "joined/{}"
"""Set by a restarted replica r to its incarnation once it holds the live replicas' state."""


@dataclass(frozen=True)
class ReplicaIdentity:
    """Who this worker is among the replicas of a fault-tolerant run."""

    replica: int
    replicas: int
    incarnation: int
    """0 for the first process of this replica, k after its k-th restart (it then rejoins)."""
    store_host: str
    store_port: int


def replica_identity() -> ReplicaIdentity | None:
    """This worker's identity as `launch_replicas` set it, or None outside such a launch."""
    text = os.environ.get(REPLICA_ENV, "")
    if not text:
        return None
    ids, _, where = text.partition("@")
    replica, replicas, incarnation = (int(v) for v in ids.split("/"))
    host, _, port = where.rpartition(":")
    return ReplicaIdentity(replica, replicas, incarnation, host.strip("[]"), int(port))


def replica_argv(worker_argv: list[str], run_dir: str, run_name: str, replica: int) -> list[str]:
    """The worker's command line with its own run directory, <run.dir>/<run.name>/replica-<r>
    (later overrides win)."""
    return [*worker_argv, f"--run.dir={Path(run_dir) / run_name}", f"--run.name=replica-{replica}"]


def replica_faults(spec: str, every: str, replicas: int) -> dict[int, list[str]]:
    """$SHARDLM_REPLICA_FAULTS ('1:kill@3,0:stop@5') as {replica: [fault, ...]}, or
    $SHARDLM_FAULT for every replica when `spec` is empty."""
    if not spec:
        return {r: [every] for r in range(replicas)} if every else {}
    out: dict[int, list[str]] = {}
    for item in spec.split(","):
        replica, _, fault = item.strip().partition(":")
        if not replica.isdigit() or int(replica) >= replicas or not fault:
            raise ConfigError(f"{REPLICA_FAULTS_ENV}={spec!r}: write REPLICA:ACTION@STEP[/ROUND][,...] "
                              f"with REPLICA below {replicas} (e.g. 1:kill@3)")
        out.setdefault(int(replica), []).append(fault)
    return out


def fault_of(faults: list[str], incarnation: int) -> str:
    """The fault planned for this incarnation of a replica (its ROUND), '' if none: one per
    process, as $SHARDLM_FAULT holds one."""
    return next((f for f in faults if (f.partition("/")[2] or "0") == str(incarnation)), "")


def state_holders(store, procs: dict[int, subprocess.Popen], restarts: dict[int, int]) -> list[int]:
    """The replicas alive that hold the training state: a first incarnation (it started from
    scratch or from a checkpoint), or a restarted one that has rejoined (`JOINED`)."""
    def joined(r: int) -> bool:
        return store.check([JOINED.format(r)]) and int(store.get(JOINED.format(r))) == restarts[r]
    return [r for r, proc in procs.items() if proc.poll() is None and (restarts[r] == 0 or joined(r))]


def quorum_endpoint(endpoint: str) -> tuple[str, int]:
    """`--quorum-endpoint` HOST:PORT ([v6]:PORT) as (host, port), checked: the store listens on
    HOST and the replicas connect to it there, so HOST must be an address to reach."""
    host, _, port = endpoint.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isdigit() or int(port) > 65535 or any(c.isspace() for c in host):
        raise ConfigError(f"--quorum-endpoint {endpoint!r}: write HOST:PORT (e.g. 10.0.0.5:29400, "
                          f"or PORT 0 for a free one)")
    if host in ("0.0.0.0", "::", "*"):
        raise ConfigError(f"--quorum-endpoint {endpoint!r}: {host} is where to listen, not an "
                          f"address the replicas can connect to; name this machine's address on "
                          f"the network the replicas share (or 127.0.0.1 on one machine)")
    return host, int(port)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def launch_replicas(replicas: int, worker_argv: list[str], run_dir: str, run_name: str,
                    max_restarts: int = 0, store_timeout_s: float = 600.0,
                    endpoint: str = "127.0.0.1:0", ranks: int = 1) -> int:
    """Run `replicas` replicas of `ranks` worker processes each (`python worker_argv...`; a
    replica of several ranks is a world of its own, its process group formed in a file of a
    private directory, as `--nproc` forms one), meeting in a TCPStore hosted here, listening at
    `endpoint` only (--quorum-endpoint; by default loopback, a free port), their gloo groups
    then on the loopback interface too (else on the one gloo finds, or $GLOO_SOCKET_IFNAME). A
    replica one of whose workers exits non-zero is stopped whole, counted dead in the store and
    started again (it rejoins from a live peer) while restarts are left; one whose workers all
    exit 0 has finished. Returns 0 when the run finished (every replica exited 0, or the ones
    left without restarts died while the others finished), else 1. SIGTERM / SIGINT here are
    passed on to the workers, which are then waited for."""
    if replicas < 2 or max_restarts < 0 or ranks < 1:
        raise ConfigError(f"fault-tolerant replicas: {replicas} replicas (need >= 2) of {ranks} "
                          f"rank(s) (>= 1) and --max-restarts {max_restarts} (>= 0)")
    host, port = quorum_endpoint(endpoint)
    store = loopback_store(host, port, True, datetime.timedelta(seconds=store_timeout_s))
    base = dict(os.environ)
    if _is_loopback(host):
        base.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
        base.setdefault("NCCL_SOCKET_IFNAME", loopback_interface())
    base[LAUNCHER_PID_ENV] = str(os.getpid())  # the workers die with this process
    faults = replica_faults(base.pop(REPLICA_FAULTS_ENV, ""), base.pop(FAULT_ENV, ""), replicas)
    where = f"[{host}]" if ":" in host else host
    groups = Path(tempfile.mkdtemp(prefix=f"{RENDEZVOUS_PREFIX}{os.getpid()}-"))  # 0700: ours

    def start(replica: int, incarnation: int) -> list[subprocess.Popen]:
        env = dict(base, WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(replicas * ranks),
                   TORCHELASTIC_RESTART_COUNT=str(incarnation))  # a planned fault strikes once
        env[REPLICA_ENV] = f"{replica}/{replicas}/{incarnation}@{where}:{store.port}"
        env[LOCAL_RENDEZVOUS_ENV] = str(groups / f"replica-{replica}")  # group-<incarnation>
        (groups / f"replica-{replica}").mkdir(exist_ok=True)
        fault = fault_of(faults.get(replica, []), incarnation)
        if fault:
            env[FAULT_ENV] = fault
        argv = [sys.executable, *replica_argv(worker_argv, run_dir, run_name, replica)]
        return [subprocess.Popen(argv, env=dict(env, RANK=str(i), LOCAL_RANK=str(replica * ranks + i)))
                for i in range(ranks)]

    watch = _Watch(store, {r: start(r, 0) for r in range(replicas)}, start, max_restarts)
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    for s in previous:
        signal.signal(s, watch.forward)
    try:
        watch.run()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        watch.kill_all()
        shutil.rmtree(groups, ignore_errors=True)
    if watch.stopping:
        return 0 if all(c == 0 for c in watch.codes.values()) else 128 + watch.stopping[0]
    return 0 if any(c == 0 for c in watch.codes.values()) else 1


@dataclass
class _Watch:
    """The launcher's replicas while they run: each one's processes, its restarts, its exit."""

    store: object
    procs: dict[int, list[subprocess.Popen]]
    start: Callable[[int, int], list[subprocess.Popen]]
    max_restarts: int
    restarts: dict[int, int] = field(default_factory=dict)
    codes: dict[int, int] = field(default_factory=dict)
    stopping: list[int] = field(default_factory=list)

    def forward(self, signum, frame) -> None:
        self.stopping.append(signum)
        for group in self.procs.values():
            for proc in group:
                if proc.poll() is None:
                    proc.send_signal(signum)

    def kill_all(self) -> None:
        for group in self.procs.values():
            for proc in group:
                proc.kill()
        self.procs.clear()

    def run(self) -> None:
        self.restarts = {r: 0 for r in self.procs}
        while self.procs:
            time.sleep(0.05)
            for r, group in list(self.procs.items()):
                code = _replica_exit(group, wait_all=bool(self.stopping))
                if code is not None and self._exited(r, code):
                    return

    def _exited(self, r: int, code: int) -> bool:
        """Replica r's exit (`code`: its first failed worker's, or 0): finished, restarted, or
        left out. True when the job stops here."""
        del self.procs[r]
        if code == 0 or self.stopping:
            self.codes[r] = code
            if code == 0:  # the run is done: a replica still waiting to rejoin stops
                self.store.set(DONE, "1")
            return False
        self.store.add(DEATHS.format(r), 1)  # the live replicas stop waiting for it now
        firsts = {other: group[0] for other, group in self.procs.items()}  # a replica's rank 0
        if not self.store.check([DONE]) and not state_holders(self.store, firsts, self.restarts):
            log.error("shardlm: replica %d exited with %d and no live replica holds the training "
                      "state any more (a restarted one would wait in vain to rejoin): the job "
                      "stops; run it again to resume from its latest checkpoint "
                      "(checkpoint.every)", r, code)
            self.codes[r] = code
            self.kill_all()
            return True
        if self.restarts[r] < self.max_restarts:
            self.restarts[r] += 1
            log.warning("shardlm: replica %d exited with %d: restarting it (%d of %d); it "
                        "rejoins from a live replica", r, code, self.restarts[r], self.max_restarts)
            self.procs[r] = self.start(r, self.restarts[r])
        else:
            log.error("shardlm: replica %d exited with %d and has no restart left: the others "
                      "train on without it", r, code)
            self.codes[r] = code
        return False


def _replica_exit(group: list[subprocess.Popen], wait_all: bool) -> int | None:
    """A replica's exit status once it has exited: 0 when every worker exited 0, else the
    first failed worker's (the others, stopped with it: a replica is one world, lost whole).
    None while it runs. `wait_all` (the launcher is stopping): wait for every worker's own exit."""
    codes = [proc.poll() for proc in group]
    failed = [c for c in codes if c not in (None, 0)]
    if None in codes and (wait_all or not failed):
        return None
    for proc in group:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    return failed[0] if failed else 0
