"""Run a function on N local processes joined in a process group (gloo on CPU, NCCL on GPUs)
through a file-based rendezvous — no fixed port, so runs can go side by side, and nothing listens
beyond loopback. The distributed tests and the benchmarks use this; training runs use
`shardlm train --nproc N` (torchrun).

On Linux the ranks are forked from a fork server that imported torch and shardlm once (PRELOAD),
not spawned: a spawned rank spends seconds importing them before any work (~4 s each on two
shared cores), which a test suite of a few hundred ranks pays in full. The fork server never
runs an operator, starts a thread or touches a GPU (it only imports), so what a rank inherits is
the state of a fresh import; the rank then takes the caller's environment and working directory
as they are at the call, as a spawned one would (_entry)."""

from __future__ import annotations

import datetime
import os
import sys
import time
import traceback
import uuid
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map
import torch.multiprocessing as mp

from shardlm.launch.local import loopback_interface
from shardlm.launch.runtime import backend_for, cpu_cores, die_with, end_process, leave_groups, pick_device


def _to_numpy(x: Any) -> Any:
    # Tensors cross the queue by value: torch's shared-memory hand-off needs the sender alive.
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().float().numpy() if x.dtype == torch.bfloat16 else x.detach().cpu().numpy()
    return x


def _to_torch(x: Any) -> Any:
    return torch.from_numpy(x) if isinstance(x, np.ndarray) else x


PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "numpy", "shardlm.launch.spawn",
           "shardlm.train.build", "shardlm.train.loop")
"""What the fork server imports before forking ranks: torch and the trainer (the costly part).
torch._dynamo too: torch imports it at the first call of a function it keeps from compilation
(an optimizer's add_param_group, an init under a device context), so every rank that builds an
optimizer paid ~3 s of CPU for it (10 two-rank launches of a Linear + AdamW: 31 -> 10.6 s of
CPU, the process tree; the fork server pays it once, ~3.8 s). It starts no thread."""


class _CallerFd:
    """One of the caller's file descriptors, handed to a forked rank through the fork server
    (multiprocessing's DupFd, at pickling): the rank writes where the caller's stdout and stderr
    go now, not where the fork server's went when it started."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        return (_detached, (reduction.DupFd(self.fd),))


def _detached(dup) -> int:
    return dup.detach()


def _context():
    if sys.platform.startswith("linux"):
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(PRELOAD))
        return ctx
    return mp.get_context("spawn")


def _entry(fn: Callable, rank: int, world_size: int, init_file: str, queue, args: tuple,
           parent: int = 0, timeout: float = 180, environ: dict | None = None, cwd: str = "",
           streams: tuple = ()) -> None:
    die_with(parent)  # a killed test run leaves no ranks behind (forked: the caller is not the parent)
    if environ is not None:  # the caller's, now (the fork server's is from when it started)
        os.environ.clear()
        os.environ.update(environ)
    if cwd:
        os.chdir(cwd)
    for target, fd in zip((1, 2), streams):  # the caller's stdout and stderr
        os.dup2(fd, target)
        os.close(fd)
    # The launcher's variables, as torchrun would set them, so code under test reads them as usual.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    # The store is a file; the collectives' own sockets (gloo pairs, NCCL's bootstrap) go on the
    # loopback interface, not on whatever address the host name resolves to.
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        os.environ.setdefault(name, loopback_interface())
    torch.set_num_threads(max(1, cpu_cores() // world_size))
    failed = True
    try:
        backend = backend_for(pick_device("auto", rank, world_size))
        # Every wait on another rank ends within `timeout`: a dead peer is an error, not a hang.
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=timeout))
        try:
            report = (rank, "ok", tree_map(_to_numpy, fn(rank, world_size, *args)))
        except BaseException:
            report = (rank, "error", traceback.format_exc())
        # Said before the groups come down: whatever happens after, the parent has the result,
        # or this rank's own traceback (not "exited without a result").
        queue.put(report)
        failed = report[1] != "ok"
        leave_groups()
    except BaseException:  # report every failure to the parent, which raises it
        queue.put((rank, "error", traceback.format_exc()))
        failed = True
    end_process(1 if failed else 0)  # as the product's ranks end: no finalisation racing gloo


def run_ranks(fn: Callable, world_size: int, tmp_dir: Path, *args: Any, timeout: float = 180,
              collective_timeout: float | None = None) -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` spawned ranks; return their results
    by rank. `fn` must be importable (module level). Raises with the failing ranks' tracebacks.
    The ranks never outlive this call: however it ends (a result, an error, a signal such as
    Ctrl-C's KeyboardInterrupt), those still running are killed; and they die with this process
    (PR_SET_PDEATHSIG) if it is killed outright. Each collective's wait on another rank ends
    with an error after `collective_timeout` (default: `timeout`), a dead peer's too."""
    ctx = _context()
    queue = ctx.SimpleQueue()
    init_file = str(Path(tmp_dir) / f"rendezvous-{uuid.uuid4().hex}")  # fresh: a used one is stale
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, init_file, queue, args,
                                              os.getpid(), collective_timeout or timeout,
                                              dict(os.environ), os.getcwd(),
                                              (_CallerFd(1), _CallerFd(2)) if ctx.get_start_method() == "forkserver" else ()))
             for r in range(world_size)]
    try:
        for p in procs:
            p.start()
        return _collect(procs, queue, world_size, timeout)
    finally:
        for p in procs:
            if p.pid is not None and p.is_alive():
                p.kill()
                p.join(5)


def _collect(procs: list, queue, world_size: int, timeout: float) -> list:
    results: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    while len(results) < world_size and not errors:
        if not queue.empty():
            rank, status, value = queue.get()
            if status == "ok":
                results[rank] = tree_map(_to_torch, value)
            else:  # the other ranks may be blocked in a collective with the failed one
                errors.append(f"rank {rank}:\n{value}")
            continue
        # A rank that died without a word (os._exit, a signal) would otherwise be waited for.
        dead = [(r, p.exitcode) for r, p in enumerate(procs)
                if p.exitcode is not None and r not in results]
        if dead and queue.empty():
            errors += [f"rank {r} exited with code {code} without a result" for r, code in dead]
        elif time.monotonic() > deadline:
            errors.append(f"no result from ranks {sorted(set(range(world_size)) - set(results))} "
                          f"within {timeout:g} s")
        else:
            time.sleep(0.05)
    for p in procs:
        p.join(timeout=timeout if not errors else 5)
        if p.is_alive():
            p.kill()
    if errors:
        raise RuntimeError("distributed test failed\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
