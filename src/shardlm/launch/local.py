"""`shardlm train --nproc N`: N workers on this machine through torch's elastic launcher,
rendezvous in a private directory (a FileStore: no socket) and every worker listening on loopback
only (docs/reliability.md, Network); and the removal of rendezvous directories dead launchers
left behind."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import sys
import tempfile
import uuid
from pathlib import Path

from shardlm.launch.failures import AgentLog, dead_rank, failure_line, run_dir_of, write_run_log
from shardlm.launch.preflight import DISK_EXIT, pid_alive
from shardlm.launch.relay import StderrRelay
from shardlm.errors import ConfigError
from shardlm.launch.runtime import LAUNCHER_PID_ENV, LOCAL_RENDEZVOUS_ENV, RENDEZVOUS_PREFIX, cpu_cores

log = logging.getLogger("shardlm")


def loopback_interface() -> str:
    """The name of this machine's loopback network interface ('lo' on Linux, 'lo0' on macOS)."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (AttributeError, OSError):
        names = []
    exact = [n for n in names if n in ("lo", "lo0")]
    return (exact or [n for n in names if n.startswith("lo")] or ["lo"])[0]


def local_launch_args(nproc: int, rendezvous_dir: Path, max_restarts: int = 0) -> list[str]:
    """torch.distributed.run's options for `nproc` workers on this machine that listen on no
    network interface but loopback (docs/reliability.md, Network).

    torchrun's --standalone hosts its rendezvous in a TCPStore, and a TCPStore server (torch 2.13,
    either backend) listens on every interface whatever host it is given ('localhost:0' binds
    `*:PORT`). Here the agent's rendezvous is a c10d FileStore in a private directory instead
    (`store_type=file`: no socket), and --local-addr makes the workers' MASTER_ADDR 127.0.0.1."""
    return ["--nnodes=1", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={rendezvous_dir / 'agent'}",
            "--rdzv-conf=store_type=file", f"--rdzv-id={uuid.uuid4().hex}",
            "--local-addr=127.0.0.1"]


def launch_local(nproc: int, worker_argv: list[str], max_restarts: int = 0,
                 shutdown_timeout_s: int = 120) -> int:
    """Start `nproc` workers on this machine through torch's elastic launcher (torchrun), which
    sets RANK / WORLD_SIZE / LOCAL_RANK for each. When a worker dies the launcher stops the
    others and starts the gang again, up to `max_restarts` times. Returns the exit status: 0
    when the workers finished, or stopped cleanly on a SIGTERM / SIGINT sent here (forwarded to
    them; they save a checkpoint and exit within `shutdown_timeout_s`, else they are killed).

    Nothing listens beyond loopback: the launcher's rendezvous and the workers' process-group
    store are files in a private temporary directory (no socket), and the collectives' own
    sockets (gloo pairs, NCCL's bootstrap) are put on the loopback interface unless
    GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME say otherwise. Everything torchrun writes (its
    rendezvous, its per-worker log directory) goes in that directory, removed on exit; the
    directory of a launcher that was killed is removed by the next one. The workers die with
    this process (`die_with_launcher`): a launcher killed with SIGKILL leaves no orphans."""
    if nproc < 1 or max_restarts < 0:
        raise ConfigError(f"--nproc {nproc} must be >= 1 and --max-restarts {max_restarts} >= 0")
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    rendezvous_dir = _prepare_environment(nproc)
    args = get_args_parser().parse_args([
        *local_launch_args(nproc, rendezvous_dir, max_restarts),
        # torchrun's default is a `torchelastic_*` directory in $TMPDIR that nobody removes
        f"--log-dir={rendezvous_dir / 'logs'}", f"--shutdown-timeout={shutdown_timeout_s}",
        "--no-python", sys.executable, *worker_argv])
    agent_log = AgentLog()
    relay = StderrRelay()
    try:
        with agent_log, relay:
            run(args)
        if relay.held():  # a gang restarted after a failure (--max-restarts), then finished
            write_run_log(worker_argv, "the workers finished after a restart", "", agent_log, relay)
    except ChildFailedError as e:
        return _child_failed(e, worker_argv, agent_log, relay)
    except SignalException as e:
        # torchrun has forwarded the signal to the workers and waited for them to exit.
        return _signalled(e, nproc, rendezvous_dir, relay)
    finally:
        for name in (LOCAL_RENDEZVOUS_ENV, LAUNCHER_PID_ENV):
            os.environ.pop(name, None)
        shutil.rmtree(rendezvous_dir, ignore_errors=True)
    return 0


def _prepare_environment(nproc: int) -> Path:
    """The environment torchrun and the workers inherit, and the private rendezvous directory
    (returned) named in it."""
    # Each worker sets its own thread count (init_runtime); saying so here silences torchrun's
    # OMP_NUM_THREADS=1 default and its warning.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cpu_cores() // nproc)))
    # The agent's shared rendezvous store outlives a restart, and with it the previous gang's
    # process-group keys: a restarted worker can read a dead peer's address and fail to connect
    # (seen here: one of two restarts wasted that way). Unshared, each round forms a fresh group
    # (group-<restart count>: launch/runtime.py). Also required by the file rendezvous: a shared
    # store would send the workers to a TCP server that does not exist.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    loopback = loopback_interface()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", loopback)
    remove_dead_rendezvous_dirs(Path(tempfile.gettempdir()))
    # mode 0700: ours only; our pid in the name says when its owner is gone
    rendezvous_dir = Path(tempfile.mkdtemp(prefix=f"{RENDEZVOUS_PREFIX}{os.getpid()}-"))
    os.environ[LOCAL_RENDEZVOUS_ENV] = str(rendezvous_dir)
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    return rendezvous_dir


def _child_failed(e, worker_argv: list[str], agent_log: AgentLog, relay: StderrRelay) -> int:
    """The exit status of a gang whose worker failed, after the run log is written and the one
    message to read is shown."""
    dead = dead_rank(e.failures)
    log_file = write_run_log(worker_argv, "a worker failed", e.format_msg(), agent_log, relay)
    if dead is None:  # no rank died: the workers' own tracebacks are the news
        relay.show_held()
    codes = {f.exitcode for f in e.failures.values()}
    if DISK_EXIT in codes:  # the worker printed its DiskError: the one message to read
        log.error("shardlm: a worker stopped on a disk error (exit %d): see its message above",
                  DISK_EXIT)
        return DISK_EXIT
    if dead is None and e.get_first_failure()[1].exitcode == 2:  # a ConfigError (a checkpoint
        # refused, say), printed by the worker; the others may have been stopped meanwhile
        log.error("shardlm: the workers stopped on the error above (exit 2)")
        return 2
    rank, failure = dead or e.get_first_failure()
    log.error("shardlm: %s", failure_line(rank, failure.exitcode, run_dir_of(worker_argv), log_file))
    return 1


def _signalled(e, nproc: int, rendezvous_dir: Path, relay: StderrRelay) -> int:
    """The exit status after a SIGTERM / SIGINT forwarded to the workers: 0 if each saved a
    checkpoint and stopped, else 128 + the signal."""
    relay.show_held()
    stopped = [r for r in range(nproc) if (rendezvous_dir / f"stopped-{r}").exists()]
    if len(stopped) == nproc:
        log.warning("shardlm: %s: the workers saved a checkpoint and stopped", e.sigval.name)
        return 0
    log.error("shardlm: %s: workers %s did not stop cleanly (no checkpoint saved by them)",
              e.sigval.name, sorted(set(range(nproc)) - set(stopped)))
    return 128 + int(e.sigval)


def remove_dead_rendezvous_dirs(tmp: Path) -> None:
    """Remove the rendezvous directories of launchers that died without cleaning up (SIGKILL):
    `shardlm-rendezvous-<pid>-*` whose pid is gone. A live launcher's is kept."""
    for path in tmp.glob(f"{RENDEZVOUS_PREFIX}*-*"):
        pid = path.name[len(RENDEZVOUS_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)) and path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
