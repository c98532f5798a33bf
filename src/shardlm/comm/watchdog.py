"""A watchdog for collectives: a rank whose peer hangs or died would otherwise wait forever (gloo's
own timeout is 30 minutes, NCCL's may be longer). Every collective shardlm issues is tracked from
launch to completion; one that has not completed within the timeout is reported — rank, group,
operation, bytes, how long — and the process exits with EXIT_CODE, so a launcher can restart the
gang.

**The watchdog speaks first.** The process group is also given a timeout (its waits must end
even where no watchdog looks), but a longer one: `launch.process_group_timeout_s(T)` = T +
max(5 s, T / 10) for `parallel.collective_timeout_s` = T. The watchdog counts a collective's
time from its launch (no later than the backend starts it) and looks every `check_period_s(T)`
(<= 1 s), so it reports by T + 1 s, while gloo's or NCCL's own timeout would end the same wait
with a bare backend traceback ("Timed out waiting ... for recv operation") only at T + margin.
With both at T the backend's timeout won (seen: a SIGSTOP'd rank, T = 10 s).

**Completion, not return.** On gloo a handle's `wait()` blocks until the collective is done, so
the wait is its completion. On NCCL (and any device-asynchronous backend) `wait()` returns once
the device's stream is ordered after the collective, long before it is done: a hung peer would
show up later, in some unrelated host synchronisation, silently. There a handle's wait hands the
watchdog a *probe* — an object with `is_completed()` — and the collective stays tracked until the
probe says done. The probes are kept in hand-over order: each hand-over first drops the
finished ones at the front (a query or two, never a wait), so only the collectives still in
flight stay held; the watchdog thread polls them all every period (`overdue`). Nothing is polled,
and no synchronisation added, on the gloo path: its waits complete the entry at once.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import itertools
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

EXIT_CODE = 5
"""A hung collective's exit. Not 4: that is a disk error's (launch/preflight.DISK_EXIT), which the
launcher reports as one (a hang read as a full disk sent users to the wrong place)."""


class Probe(Protocol):
    """Whether a waited-on collective has really finished (torch's `Work.is_completed`, a CUDA
    event's `query` behind the same name: comm.collectives.DeviceDone)."""

    def is_completed(self) -> bool: ...


def check_period_s(timeout_s: float) -> float:
    """How often the watchdog looks: a tenth of the timeout, at most a second."""
    return min(1.0, timeout_s / 10)


@dataclass
class Pending:
    op: str
    group: str
    nbytes: int
    start: float
    """time.monotonic() at launch."""
    probe: Probe | None = None
    """Set once the handle was waited on where a wait is not completion (NCCL)."""


class CollectiveWatchdog:
    """`completion`, where the device runs asynchronously (CUDA): makes the probe that a blocking
    collective's `watch` hands over on exit (the host returns before the device is done). `start`:
    False for a watchdog without its thread (tests drive `overdue` themselves)."""

    def __init__(self, timeout_s: float, rank: int,
                 completion: Callable[[], Probe] | None = None, start: bool = True):
        self.timeout_s = timeout_s
        self.rank = rank
        self.completion = completion
        self._pending: dict[int, Pending] = {}
        self._polled: collections.deque[int] = collections.deque()
        """Tokens of the entries with a probe, in hand-over order (some may be gone)."""
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        if start:
            self._thread = threading.Thread(target=self._watch, name="shardlm-watchdog", daemon=True)
            self._thread.start()
            # ended before the interpreter finalises: no thread of ours left to wake into it
            atexit.register(self.close)

    def track(self, op: str, group: str, nbytes: int) -> int:
        token = next(self._ids)
        with self._lock:
            self._pending[token] = Pending(op, group, nbytes, time.monotonic())
        return token

    def done(self, token: int) -> None:
        with self._lock:
            self._pending.pop(token, None)

    def until_complete(self, token: int, probe: Probe) -> None:
        """The collective `token` was waited on but may still run (NCCL): tracked until
        `probe.is_completed()`, which the watchdog thread polls."""
        with self._lock:
            entry = self._pending.get(token)
            if entry is not None and entry.probe is None:
                entry.probe = probe
                self._polled.append(token)
            self._drop_finished_front()

    def _drop_finished_front(self) -> None:
        """Drop the finished entries at the front of the hand-over order (under the lock)."""
        while self._polled:
            entry = self._pending.get(self._polled[0])
            if entry is not None and not entry.probe.is_completed():
                return
            if entry is not None:
                del self._pending[self._polled[0]]
            self._polled.popleft()

    @contextlib.contextmanager
    def watch(self, op: str, group: str, nbytes: int) -> Iterator[None]:
        """For a blocking collective: tracked while inside (and, with `completion`, until the
        device has finished it)."""
        token = self.track(op, group, nbytes)
        try:
            yield
        except BaseException:
            self.done(token)
            raise
        if self.completion is None:
            self.done(token)
        else:
            self.until_complete(token, self.completion())

    def overdue(self, now: float | None = None) -> Pending | None:
        """Drop the entries whose probe says done; return the longest-running entry older than
        the timeout, or None."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._drop_finished_front()
            if self._polled:  # the rest too: streams may finish out of order
                for token in list(self._polled):
                    entry = self._pending.get(token)
                    if entry is not None and entry.probe.is_completed():
                        del self._pending[token]
                self._polled = collections.deque(t for t in self._polled if t in self._pending)
            late = [e for e in self._pending.values() if now - e.start > self.timeout_s]
        return max(late, key=lambda e: now - e.start) if late else None

    def message(self, entry: Pending, now: float | None = None) -> str:
        waited = (time.monotonic() if now is None else now) - entry.start
        return (f"shardlm watchdog: rank {self.rank}: {entry.op} on group {entry.group} "
                f"({entry.nbytes:,} bytes) has not finished after {waited:.1f} s "
                f"(parallel.collective_timeout_s = {self.timeout_s:g}); a peer rank is probably "
                f"hung or dead. Exiting with code {EXIT_CODE}.")

    def close(self) -> None:
        """End the thread (at the end of a run, at the latest at exit); nothing is reported
        after this."""
        self._closed.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
            atexit.unregister(self.close)
        self._thread = None

    def _watch(self) -> None:
        period = check_period_s(self.timeout_s)
        while not self._closed.wait(period):
            late = self.overdue()
            if late is not None and not self._closed.is_set():
                print(self.message(late), file=sys.stderr, flush=True)
                os._exit(EXIT_CODE)


def watched(watchdog: CollectiveWatchdog | None, op: str, group: str, nbytes: int):
    """Context for a blocking collective outside Comm: tracked if there is a watchdog."""
    return watchdog.watch(op, group, nbytes) if watchdog is not None else contextlib.nullcontext()


class Tracked:
    """A collective's handle whose wait() also tells the watchdog it finished: at once where the
    wait is completion (gloo), else through the probe `completion(handle)` makes after the wait
    (NCCL: see the module docstring)."""

    def __init__(self, handle, watchdog: CollectiveWatchdog, token: int,
                 completion: Callable[[object], Probe] | None = None):
        self.handle, self.watchdog, self.token = handle, watchdog, token
        self.completion = completion

    def wait(self) -> bool:
        result = self.handle.wait()
        if self.completion is None:
            self.watchdog.done(self.token)
        else:
            self.watchdog.until_complete(self.token, self.completion(self.handle))
        return result
