"""Process environment: which rank am I, which device and backend, how many threads.

This is the one place that reads environment variables: the launcher's (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE as set by torchrun / torch.distributed.run) and $SHARDLM_CACHE;
everything else receives a `Runtime` or a path. Device and backend come from what exists: CUDA +
NCCL when GPUs are there, CPU + gloo otherwise; nothing is hard-coded. Also here: how a rank ends
(end_process), stop signals and planned faults. Starting local workers is local.py; the run
directory's ownership run_dir.py (docs/reliability.md).
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import ipaddress
import logging
import os
import re
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from shardlm.errors import ConfigError

log = logging.getLogger("shardlm")

LOCAL_RENDEZVOUS_ENV = "SHARDLM_LOCAL_RENDEZVOUS"
"""Set by `launch_local` for its workers: the private directory in which they form their
process group (a FileStore), instead of a TCP store on MASTER_PORT."""
LAUNCHER_PID_ENV = "SHARDLM_LAUNCHER_PID"
"""Set by `launch_local` for its workers: the launcher's pid. A worker asks the kernel to kill
it when that process dies (`die_with_launcher`)."""
RENDEZVOUS_PREFIX = "shardlm-rendezvous-"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@dataclass(frozen=True)
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str | None
    """The torch.distributed backend in use, or None for a single process."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def tracker_environment() -> dict[str, str | bool]:
    """What the experiment trackers' own variables say (shardlm.train.tracking): whether W&B was told a
    mode or given a key (if not, it runs offline), its project, MLflow's tracking URI ('' = a file
    store in the run directory) and experiment name. The key itself is never read."""
    return {"wandb_configured": "WANDB_MODE" in os.environ or "WANDB_API_KEY" in os.environ,
            "wandb_project": os.environ.get("WANDB_PROJECT") or "shardlm",
            "mlflow_uri": os.environ.get("MLFLOW_TRACKING_URI", ""),
            "mlflow_experiment": os.environ.get("MLFLOW_EXPERIMENT_NAME") or "shardlm"}


CPU_CORES_ENV = "SHARDLM_CPU_CORES"
"""Cores to divide among a machine's ranks, instead of those this process may run on: for a
machine shared with other jobs, and for the tests' perturbed mode (tests/conftest.py), which
runs the parity tests at thread counts other than this machine's, as other machines would."""


def cpu_cores() -> int:
    """Cores this process may run on (respects taskset / cgroup affinity), or $SHARDLM_CPU_CORES."""
    given = os.environ.get(CPU_CORES_ENV, "")
    if given:
        if not given.isdigit() or int(given) < 1:
            raise ValueError(f"{CPU_CORES_ENV}={given!r}: a whole number of cores >= 1, or unset")
        return int(given)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def launcher_sizes() -> tuple[int, int]:
    """(world size, ranks on this machine) as the launcher set them, before any group exists:
    (1, 1) without a launcher."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return world, int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))


def launcher_ranks() -> tuple[int, int]:
    """(this process's rank, its rank on this machine) as the launcher set them: (0, 0)
    without a launcher."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))


def pick_device(preference: str, local_rank: int = 0, local_world: int = 1) -> torch.device:
    """'auto' = this rank's GPU if CUDA exists, else the CPU; an explicit choice is checked.
    On CUDA, rank `local_rank` of the `local_world` ranks on this machine takes GPU
    `local_rank` ('auto' or 'cuda'; 'cuda:N' is taken as given, by one rank only): NCCL refuses
    two ranks on one GPU, so more ranks than GPUs is an error here, before any group forms."""
    if preference == "auto" and not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda" if preference == "auto" else preference)
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"run.device = {preference!r}: use 'auto', 'cpu', 'cuda' or 'cuda:N'")
    if device.type == "cpu":
        return device
    if not torch.cuda.is_available():
        raise ConfigError(f"run.device = {preference!r} but this machine has no CUDA device; "
                          f"use run.device = 'auto' or 'cpu'")
    count = torch.cuda.device_count()
    if device.index is not None:
        if local_world > 1:
            raise ConfigError(f"run.device = {preference!r} names one GPU for {local_world} ranks "
                              f"on this machine: use run.device = 'cuda' (rank i takes GPU i)")
        if device.index >= count:
            raise ConfigError(f"run.device = {preference!r} but this machine has {count} GPU(s)")
        return device
    if local_world > count:
        raise ConfigError(f"{local_world} ranks on this machine but {count} GPU(s): each rank needs "
                          f"its own GPU (NCCL refuses two ranks on one). Start at most {count} "
                          f"rank(s) per machine (--nproc {count}, torchrun --nproc-per-node {count}), "
                          f"or train on the CPU with run.device = 'cpu'")
    return torch.device("cuda", local_rank)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def process_group_timeout_s(timeout_s: float) -> float:
    """The process group's own timeout for a collective watchdog timeout of `timeout_s`
    (parallel.collective_timeout_s; 0: none, torch's default): longer by a margin, max(5 s, a
    tenth), so that the watchdog, which looks at least once a second, reports a stalled
    collective — rank, op, group — before gloo or NCCL end the wait with their own traceback
    (comm/watchdog.py)."""
    return timeout_s + max(5.0, timeout_s / 10) if timeout_s > 0 else 0.0


def init_runtime(device_preference: str = "auto", timeout_s: float = 0.0) -> Runtime:
    """Read the launcher's environment, pick device and backend, set the per-rank thread count,
    and join the process group when there is more than one rank. `timeout_s` (the config's
    parallel.collective_timeout_s; 0: torch's default) bounds the group's every wait on another
    rank, so a dead rank ends the others' waits with an error instead of a hang: the group's
    timeout is `process_group_timeout_s(timeout_s)`, a margin longer, so that the collective
    watchdog names the rank, op and group of a stalled collective before the backend's own
    timeout ends it with a bare traceback (comm/watchdog.py)."""
    die_with_launcher()
    world_size, local_world = launcher_sizes()
    rank, local_rank = launcher_ranks()
    device = pick_device(device_preference, local_rank, local_world)
    if device.type == "cpu":
        # Ranks on one machine share its cores: oversubscription makes every rank slower.
        torch.set_num_threads(max(1, cpu_cores() // max(1, local_world)))
    else:
        torch.cuda.set_device(device)
    backend = None
    if world_size > 1 and dist.is_initialized():
        # The launcher made the group before our entry ran (Ray Train's TorchTrainer: gloo on
        # CPU, nccl on GPU workers): join it as it is, and say which backend it has.
        backend = str(dist.get_backend())
    elif world_size > 1:
        backend = backend_for(device)
        # Under `shardlm train --nproc N` the group meets in a file the launcher made (no
        # listening store socket); under the user's own torchrun, through its MASTER_ADDR/PORT.
        local = os.environ.get(LOCAL_RENDEZVOUS_ENV)
        where = (dict(init_method=f"file://{Path(local) / f'group-{restart_count()}'}",
                      rank=rank, world_size=world_size) if local else {})
        if timeout_s > 0:
            where["timeout"] = datetime.timedelta(seconds=process_group_timeout_s(timeout_s))
        master = os.environ.get("MASTER_ADDR", "")
        if (not local and is_loopback(master)
                and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "False") != "True"):
            # A job on one machine (agents with --local-addr=127.0.0.1): rank 0's store
            # listens on loopback only, where torch's own would listen on every interface.
            store = loopback_store(master, int(os.environ["MASTER_PORT"]), rank == 0,
                                   where.get("timeout", dist.default_pg_timeout))
            where.update(store=store, rank=rank, world_size=world_size)
        dist.init_process_group(backend=backend, **where,
                                device_id=device if device.type == "cuda" else None)
    return Runtime(rank, world_size, local_rank, local_world, device, backend)


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address literal (127.0.0.0/8, ::1)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def loopback_store(host: str, port: int, is_server: bool,
                   timeout: datetime.timedelta) -> dist.TCPStore:
    """A TCPStore at `host`:`port` whose server (`is_server`) listens on `host` only.

    torch's TCPStore server (2.13, either backend) binds every interface whatever host it is
    given (`*:PORT`); given a socket we bound ourselves (master_listen_fd) it listens there. Used
    for the workers' process group when the job's master address is loopback, and by the
    multi-node tests to host the agents' c10d rendezvous (docs/launch.md)."""
    if not is_server:
        return dist.TCPStore(host, port, is_master=False, timeout=timeout)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return dist.TCPStore(host, sock.getsockname()[1], is_master=True, timeout=timeout,
                         wait_for_workers=False, master_listen_fd=sock.detach())


def broadcast_text(text: str | None, runtime: Runtime) -> str:
    """Rank 0's `text` on every rank (the others pass None). Bytes in a tensor, not a pickled
    object: nothing from another process is ever unpickled."""
    if runtime.world_size == 1:
        return text or ""
    data = (text or "").encode()
    size = torch.tensor([len(data)], dtype=torch.int64, device=runtime.device)
    dist.broadcast(size, src=0)
    buffer = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(runtime.device) if runtime.is_main
              else torch.empty(int(size), dtype=torch.uint8, device=runtime.device))
    dist.broadcast(buffer, src=0)
    return bytes(buffer.cpu().numpy()).decode()


def agree_on_name(name: str, runtime: Runtime) -> str:
    """Rank 0's `name` on every rank (e.g. a timestamped run directory)."""
    return broadcast_text(name if runtime.is_main else None, runtime)


# -- run directories: each run owns its own --------------------------------------------------


def die_with_launcher() -> None:
    """In a worker `launch_local` started: die with the launcher (`die_with_parent`). torchrun's
    agent runs inside `shardlm train --nproc` and starts the workers from its main thread, so
    the workers' parent is the launcher itself. A killed launcher would otherwise leave its
    workers training as orphans, holding their sockets and files; the run resumes from its last
    checkpoint."""
    launcher = os.environ.get(LAUNCHER_PID_ENV, "")
    if launcher.isdigit():
        die_with_parent(int(launcher))


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL this process when its parent (`parent_pid`) dies, however it
    dies (PR_SET_PDEATHSIG; strictly: when the parent's thread that started us ends). If the
    parent is gone already (we were re-parented before asking), exit now. Linux only; elsewhere
    nothing."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
            return
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:
        os._exit(1)


def die_with(pid: int) -> None:
    """Die (SIGKILL) when process `pid` dies, `pid` being any process, not only the parent: a
    daemon thread waits on a pidfd of it (Linux >= 5.3). For ranks forked by a fork server on
    behalf of `pid` (launch/spawn.py), whose parent outlives `pid` while they live. If `pid` is
    gone already, exit now."""
    if os.getppid() == pid or not hasattr(os, "pidfd_open"):
        die_with_parent(pid)
        return
    try:
        watched = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(1)

    def wait() -> None:
        import select

        select.select([watched], [], [])  # readable when the process has ended
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait, name="shardlm-die-with", daemon=True).start()


def note_clean_stop(runtime: Runtime) -> None:
    """In a worker `launch_local` started: this rank stopped on a signal after saving its
    checkpoint. The launcher, stopping on that signal, counts these notes to exit 0."""
    directory = os.environ.get(LOCAL_RENDEZVOUS_ENV)
    if directory and Path(directory).is_dir():
        (Path(directory) / f"stopped-{runtime.rank}").write_text(str(os.getpid()))


_groups_destroyed = False
"""Whether `shutdown` destroyed this process's process groups (their threads still run)."""


def shutdown(runtime: Runtime) -> None:
    """The end of a rank's distributed work, once every collective it issued has been waited on
    (and its asynchronous checkpoint written: train.loop.train): destroy every process group. The
    process then ends through `end_process`."""
    if runtime.backend is not None:
        leave_groups()


def leave_groups() -> None:
    """Destroy every process group this process joined, remembering that it joined one (so it
    ends through `end_process`)."""
    global _groups_destroyed
    if dist.is_initialized():
        dist.destroy_process_group()
        _groups_destroyed = True


def joined_group() -> bool:
    """Whether this process joined a process group (now or before `shutdown`)."""
    return _groups_destroyed or (dist.is_available() and dist.is_initialized())


def end_process(code: int | str | None) -> None:
    """End a process that joined a process group with exit status `code` (as sys.exit takes it),
    in order: its non-daemon threads joined and its exit handlers run (logging, finalizers, the
    trackers') while the interpreter is whole, its output flushed, then `os._exit`, without the
    interpreter's finalisation. A process that never joined a group returns here (and exits as
    usual). `python -m shardlm` ends this way.

    Why not finalise (issue 25, the SIGABRT after "done"): gloo's worker threads cannot be
    stopped. `destroy_process_group` only unregisters the groups (gloo's shutdown is a no-op);
    their threads end with the group's C++ object, which outlives the run (torch itself keeps
    the world group: it is a default argument of torch.distributed.nn.functional's collectives,
    which torch imports lazily, after the group exists). A worker thread that has completed a
    collective releases the work — and so the work's tensors — after the waiting thread has
    moved on, and releasing a tensor that has a Python object takes the GIL (torch 2.13 keeps
    the object alive while C++ holds the tensor). If the main thread has begun finalising by
    then, the interpreter ends that thread (pthread_exit) inside the work's noexcept
    destructor: `terminate called without an active exception`, SIGABRT, exit -6, a finished
    run reported as failed. Every collective was complete (no handle pending); only this
    release was late. Until finalisation begins any thread may take the GIL, so everything
    that must run runs first, here."""
    if not joined_group():
        return
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:  # sys.exit("message"): printed, status 1
        print(code, file=sys.stderr)
        status = 1
    join_threads = getattr(threading, "_shutdown", None)  # what finalisation calls first
    if join_threads is not None:
        join_threads()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can be said
            pass
    os._exit(status & 0xFF)


class StopSignals:
    """While inside: SIGTERM and SIGINT (a scheduler's preemption, Ctrl-C, torchrun shutting
    down) only set `requested`, so the loop can finish its step, save, and exit cleanly. A
    second SIGINT interrupts at once. Outside the main thread it does nothing."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self.received = 0
        """Signals received so far (see `watch`)."""
        self._previous: dict[int, object] = {}

    def watch(self) -> Callable[[], bool]:
        """For a wait on other ranks (a checkpoint's notes): a test that turns True when a
        signal arrives after this call. A stop already requested is what the wait serves (the
        last save); a signal during it means a peer died (torchrun then signals the rest) or
        the user insists: give up the wait, the previous checkpoint being whole."""
        mark = self.received
        return lambda: self.received > mark

    def _handle(self, signum: int, frame) -> None:
        self.received += 1
        if signum == signal.SIGINT and self.requested:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name
        log.warning("shardlm: %s received: finishing this step, then a checkpoint and exit "
                    "(Ctrl-C again to interrupt now)", self.requested)

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


FAULT_ENV = "SHARDLM_FAULT"
"""Fault injection for the fault tests (tests/test_multinode.py, bench/chaos.py):
`ACTION@STEP[/ROUND][:RANK]`."""


@dataclass(frozen=True)
class Fault:
    """What $SHARDLM_FAULT asks a worker to suffer once step `step` is done (and logged), in
    the gang's `round` (torchrun's restart count, TORCHELASTIC_RESTART_COUNT): 'kill' = SIGKILL
    itself (a crashed worker), 'leave' = SIGKILL its parent, the torchrun agent, then itself (a
    lost machine), 'stop' = SIGSTOP itself (frozen until SIGCONT: a test's deterministic pause).
    The round makes it fire once: a restarted gang that redoes the step is in another round.
    `rank`: the one global rank it strikes (every rank if None)."""

    action: str
    step: int
    round: int = 0
    rank: int | None = None

    def due(self, steps_done: int) -> bool:
        return (steps_done == self.step and restart_count() == self.round
                and self.rank in (None, int(os.environ.get("RANK", "0"))))

    def strike(self) -> None:
        log.warning("shardlm: %s=%s@%d/%d: %s now", FAULT_ENV, self.action, self.step, self.round,
                    self.action)
        sys.stdout.flush()
        sys.stderr.flush()
        if self.action == "leave":
            os.kill(os.getppid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGSTOP if self.action == "stop" else signal.SIGKILL)


def planned_fault() -> Fault | None:
    """The fault $SHARDLM_FAULT plans for this worker, if any (tests only)."""
    text = os.environ.get(FAULT_ENV, "").strip()
    if not text:
        return None
    match = re.fullmatch(r"(kill|leave|stop)@(\d+)(?:/(\d+))?(?::(\d+))?", text)
    if match is None:
        raise ConfigError(f"{FAULT_ENV}={text!r}: write ACTION@STEP[/ROUND][:RANK] with ACTION kill, "
                          f"leave or stop (e.g. kill@3, stop@7/0:1), or unset it")
    return Fault(match[1], int(match[2]), int(match[3] or 0), None if match[4] is None else int(match[4]))


RESTART_COUNT_ENV = "SHARDLM_RESTART_COUNT"
"""Set by a launcher other than torchrun in its workers (integrations/ray.py, counting Ray Train's
restarts of the worker group): what TORCHELASTIC_RESTART_COUNT says under torchrun."""


def restart_count() -> int:
    """How many times the launcher has restarted this worker's gang (torchrun's --max-restarts,
    Ray Train's FailureConfig(max_failures))."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or os.environ.get(RESTART_COUNT_ENV) or "0")


def is_restart() -> bool:
    """Whether torchrun restarted this worker's gang after a failure (--max-restarts)."""
    return restart_count() > 0
