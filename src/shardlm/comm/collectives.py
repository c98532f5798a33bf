"""Collectives with a ledger: every call is counted by (operation, group) with its data volume.

Volume is counted as the ZeRO paper counts it (what `parallel.data.zero.partition.comm_bytes_per_step`
predicts): a reduce-scatter moves its input's bytes, an all-gather its output's, an all-reduce
twice its tensor's (it is a reduce-scatter plus an all-gather). On a ring each rank actually
sends (N-1)/N of that.

On gloo (CPU tensors), `reduce_scatter(..., scratch_input=True)` runs as an all-reduce in place
followed by a copy of this rank's chunk: gloo's own reduce-scatter is exactly that, but on a
clone of the input that it allocates at launch and frees only when the handle is dropped — a
second full-size buffer per reduction in flight. Same algorithm on the same values, so the same
bits; it is still counted as a reduce-scatter.

Under a watchdog (comm/watchdog.py) every handle is tracked until the collective is done: on gloo
its wait() is that moment; on NCCL, where wait() returns once the device's stream is ordered
after the collective, until a CUDA event recorded right after the wait has completed
(`DeviceDone`, polled by the watchdog's thread, never by the training thread).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from shardlm.comm.watchdog import CollectiveWatchdog, Tracked


@dataclass
class CommLedger:
    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    wait_s: float = 0.0
    """Seconds spent blocked in the handles' wait() (collectives and point-to-point): the
    communication a step did not hide behind computation (the JSONL's time_comm_wait_s)."""
    synchronize: Callable[[], None] | None = None
    """Set where the device runs asynchronously and a time split is asked for (run.time_split =
    'on'): each wait is bracketed by it, so it times the device's wait, not the host's."""

    def add(self, op: str, group_name: str, nbytes: int) -> None:
        key = f"{op}/{group_name}"
        self.bytes[key] += nbytes
        self.calls[key] += 1

    def total(self) -> int:
        return sum(self.bytes.values())

    def snapshot(self) -> dict[str, int]:
        return dict(self.bytes)

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()
        self.wait_s = 0.0

    def timed_wait(self, handle) -> bool:
        """handle.wait(), its blocked time added to wait_s."""
        if self.synchronize is not None:  # the work queued before it is not communication
            self.synchronize()
        start = time.perf_counter()
        result = handle.wait()
        if self.synchronize is not None:
            self.synchronize()
        self.wait_s += time.perf_counter() - start
        return result


# Recent torch names them *_single; older releases *_tensor (same semantics).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class DeviceDone:
    """The watchdog's probe on a device-asynchronous backend (NCCL): a CUDA event recorded on the
    current stream just after a handle's wait() — which made that stream wait for the collective
    — so `is_completed()` turns True when the collective has really finished. An event, not the
    torch Work itself: a Work keeps its tensors alive, and the watchdog would then hold, e.g., a
    ZeRO-3 unit's gathered parameters until its next poll instead of letting them be freed."""

    __slots__ = ("event",)

    def __init__(self, handle: object = None):
        self.event = torch.cuda.Event()
        self.event.record()

    def is_completed(self) -> bool:
        return self.event.query()


def asynchronous_backend(backend: str) -> bool:
    """Whether a handle's wait() on this backend returns before the collective is done."""
    return "nccl" in backend


class _Done:
    """The handle of a collective over one rank: nothing to wait for."""

    def wait(self) -> bool:
        return True


class _Timed:
    """A launched collective's handle whose wait() is timed into the ledger (CommLedger.wait_s)."""

    def __init__(self, handle, ledger: CommLedger):
        self.handle, self.ledger = handle, ledger

    def wait(self) -> bool:
        return self.ledger.timed_wait(self.handle)


class _ChunkOfAllReduce:
    """The handle of a reduce-scatter run as an all-reduce in place: waiting copies this rank's
    chunk of the reduced input into the output (nothing to copy when the output is that chunk,
    as at stage 1, where the gradient shard is a view of the full gradient)."""

    def __init__(self, work, output: torch.Tensor, chunk: torch.Tensor):
        self.work, self.output, self.chunk = work, output, chunk

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
            if self.output.data_ptr() != self.chunk.data_ptr():
                self.output.copy_(self.chunk)
            self.work = self.output = self.chunk = None
        return True


class Comm:
    """The collectives of one process group; each is launched asynchronously and returns a
    handle to wait on.

    A group of one rank (group=None) is valid: reductions are identities and gathers copies,
    and nothing is counted — so the engine runs unchanged on a single process. With a watchdog,
    every collective is tracked from launch until its handle is waited on.
    """

    def __init__(self, group: dist.ProcessGroup | None, name: str, ledger: CommLedger,
                 watchdog: CollectiveWatchdog | None = None):
        self.group = group
        self.name = name
        self.ledger = ledger
        self.watchdog = watchdog
        self.size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.backend = str(dist.get_backend(group)) if group is not None else ""
        self.completion = DeviceDone if asynchronous_backend(self.backend) else None
        """The watchdog's probe maker where a wait is not completion (NCCL); None on gloo."""

    def _launch(self, op: str, nbytes: int, collective: Callable[[], object]):
        self.ledger.add(op, self.name, nbytes)
        if self.watchdog is None:
            return _Timed(collective(), self.ledger)
        token = self.watchdog.track(op, self.name, nbytes)
        return _Timed(Tracked(collective(), self.watchdog, token, self.completion), self.ledger)

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM):
        if self.group is None:
            return _Done()
        return self._launch("all_reduce", 2 * tensor.numel() * tensor.element_size(),
                            lambda: dist.all_reduce(tensor, op=op, group=self.group, async_op=True))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM,
                       scratch_input: bool = False):
        """input (N * shard,) → output (shard,): the reduced slice this rank owns. With
        `scratch_input` the caller gives up the input until wait(): on gloo it then holds the
        whole reduction (see the module docstring), elsewhere it is left as it was."""
        if self.group is None:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return _Done()
        nbytes = input.numel() * input.element_size()
        if scratch_input and input.device.type == "cpu" and "gloo" in self.backend:
            chunk = input.view(self.size, -1)[self.rank]
            return self._launch("reduce_scatter", nbytes, lambda: _ChunkOfAllReduce(
                dist.all_reduce(input, op=op, group=self.group, async_op=True), output, chunk))
        return self._launch("reduce_scatter", nbytes,
                            lambda: _reduce_scatter_single(output, input, op=op, group=self.group,
                                                           async_op=True))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor):
        """input (shard,) from every rank → output (N * shard,) in rank order."""
        if self.group is None:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return _Done()
        return self._launch("all_gather", output.numel() * output.element_size(),
                            lambda: _all_gather_single(output, input, group=self.group,
                                                       async_op=True))

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
                   input_splits: list[int], op: str = "all_to_all"):
        """Rows input[sum(input_splits[:j]) ...] to group rank j; output holds what each rank
        sent here, in rank order (uneven splits: expert parallelism's token exchange). Counted
        as the bytes this rank sends to the others (its own rows stay), under `op`."""
        if self.group is None:
            output.copy_(input)
            return _Done()
        row = input[0].numel() * input.element_size() if input.shape[0] else 0
        sent = (sum(input_splits) - input_splits[self.rank]) * row
        return self._launch(op, sent, lambda: dist.all_to_all_single(
            output, input, output_splits, input_splits, group=self.group, async_op=True))

    def send(self, tensor: torch.Tensor, to: int, tag: int = 0):
        """Send to group rank `to` (a pipeline stage's activation or gradient); counted as its
        bytes ("send"). The tensor must stay alive and unchanged until the handle is waited on."""
        dst = dist.get_global_rank(self.group, to)
        return self._launch("send", tensor.numel() * tensor.element_size(),
                            lambda: dist.isend(tensor, dst, group=self.group, tag=tag))

    def recv(self, tensor: torch.Tensor, frm: int, tag: int = 0):
        """Receive from group rank `frm` into `tensor` (its shape and dtype agreed in advance);
        not counted (the sender counted the bytes)."""
        src = dist.get_global_rank(self.group, frm)
        work = dist.irecv(tensor, src, group=self.group, tag=tag)
        if self.watchdog is None:
            return _Timed(work, self.ledger)
        return _Timed(Tracked(work, self.watchdog, self.watchdog.track(
            "recv", self.name, tensor.numel() * tensor.element_size()), self.completion), self.ledger)

    def shift(self, send: torch.Tensor, recv: torch.Tensor):
        """Send `send` to the next rank of the group (ring order) and receive the previous
        rank's into `recv` (same shape), both at once: one hop of a ring. Counted as the bytes
        this rank sends ("send_recv")."""
        if self.group is None:
            recv.copy_(send)
            return _Done()
        to = dist.get_global_rank(self.group, (self.rank + 1) % self.size)
        frm = dist.get_global_rank(self.group, (self.rank - 1) % self.size)
        ops = [dist.P2POp(dist.isend, send, to, self.group), dist.P2POp(dist.irecv, recv, frm, self.group)]
        return self._launch("send_recv", send.numel() * send.element_size(),
                            lambda: _AllOf(dist.batch_isend_irecv(ops)))


class _AllOf:
    """One handle for several point-to-point requests."""

    def __init__(self, works):
        self.works = works

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        self.works = []
        return True
