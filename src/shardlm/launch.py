"""Process environment: which rank am I, which device and backend, how many threads.

This is the one place that reads environment variables: the launcher's (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE as set by torchrun / torch.distributed.run) and $SHARDLM_CACHE;
everything else receives a `Runtime` or a path. Device and backend come from what exists: CUDA + NCCL when GPUs are there, CPU + gloo
otherwise; nothing is hard-coded.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from shardlm.errors import ConfigError

log = logging.getLogger("shardlm")


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


def cache_root(configured: str = "") -> Path:
    """Per-user cache (tokenizers, token shards, the CPU FLOP probe): the configured path, else
    $SHARDLM_CACHE, else ~/.cache/shardlm."""
    return Path(configured or os.environ.get("SHARDLM_CACHE") or "~/.cache/shardlm").expanduser()


def cpu_cores() -> int:
    """Cores this process may run on (respects taskset / cgroup affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def pick_device(preference: str, local_rank: int = 0) -> torch.device:
    """'auto' = this rank's GPU if CUDA exists, else the CPU; an explicit choice is checked."""
    if preference == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank % torch.cuda.device_count())
        return torch.device("cpu")
    device = torch.device(preference)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"run.device = {preference!r} but this machine has no CUDA device; "
                          f"use run.device = 'auto' or 'cpu'")
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"run.device = {preference!r}: use 'auto', 'cpu', 'cuda' or 'cuda:N'")
    return device


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_runtime(device_preference: str = "auto") -> Runtime:
    """Read the launcher's environment, pick device and backend, set the per-rank thread count,
    and join the process group when there is more than one rank."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    device = pick_device(device_preference, local_rank)
    if device.type == "cpu":
        # Ranks on one machine share its cores: oversubscription makes every rank slower.
        torch.set_num_threads(max(1, cpu_cores() // max(1, local_world)))
    else:
        torch.cuda.set_device(device)
    backend = None
    if world_size > 1:
        backend = backend_for(device)
        if not dist.is_initialized():
            dist.init_process_group(backend=backend, device_id=device if device.type == "cuda" else None)
    return Runtime(rank, world_size, local_rank, local_world, device, backend)


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


def launch_local(nproc: int, worker_argv: list[str], max_restarts: int = 0) -> int:
    """Start `nproc` workers on this machine through torch's elastic launcher (torchrun), which
    sets RANK / WORLD_SIZE / LOCAL_RANK for each and a free rendezvous port. When a worker dies
    the launcher stops the others and starts the gang again, up to `max_restarts` times."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    # Each worker sets its own thread count (init_runtime); saying so here silences torchrun's
    # OMP_NUM_THREADS=1 default and its warning.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cpu_cores() // nproc)))
    # The agent's shared rendezvous store outlives a restart, and with it the previous gang's
    # process-group keys: a restarted worker can read a dead peer's address and fail to connect
    # (seen here: one of two restarts wasted that way). Unshared, each round's rank 0 hosts a
    # fresh store.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    args = get_args_parser().parse_args(["--standalone", f"--nproc-per-node={nproc}",
                                         f"--max-restarts={max_restarts}",
                                         "--no-python", sys.executable, *worker_argv])
    try:
        run(args)
    except ChildFailedError as e:
        log.error("a worker failed: %s", e)
        return 1
    return 0


def shutdown(runtime: Runtime) -> None:
    if runtime.backend is not None and dist.is_initialized():
        dist.destroy_process_group()


class StopSignals:
    """While inside: SIGTERM and SIGINT (a scheduler's preemption, Ctrl-C, torchrun shutting
    down) only set `requested`, so the loop can finish its step, save, and exit cleanly. A
    second SIGINT interrupts at once. Outside the main thread it does nothing."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame) -> None:
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


def is_restart() -> bool:
    """Whether torchrun restarted this worker's gang after a failure (--max-restarts)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
