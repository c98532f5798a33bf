"""A watchdog for collectives: a rank whose peer hangs or died would otherwise wait forever (gloo's
own timeout is 30 minutes, NCCL's may be longer). Every collective shardlm issues is tracked from
launch to completion; one that has not completed within the timeout is reported — rank, group,
operation, bytes, how long — and the process exits non-zero, so a launcher can restart the gang.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import threading
import time
from typing import Iterator

EXIT_CODE = 4


class CollectiveWatchdog:
    def __init__(self, timeout_s: float, rank: int):
        self.timeout_s = timeout_s
        self.rank = rank
        self._pending: dict[int, tuple[str, str, int, float]] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        thread = threading.Thread(target=self._watch, name="shardlm-watchdog", daemon=True)
        thread.start()

    def track(self, op: str, group: str, nbytes: int) -> int:
        token = next(self._ids)
        with self._lock:
            self._pending[token] = (op, group, nbytes, time.monotonic())
        return token

    def done(self, token: int) -> None:
        with self._lock:
            self._pending.pop(token, None)

    @contextlib.contextmanager
    def watch(self, op: str, group: str, nbytes: int) -> Iterator[None]:
        """For a blocking collective: tracked while inside."""
        token = self.track(op, group, nbytes)
        try:
            yield
        finally:
            self.done(token)

    def _watch(self) -> None:
        period = min(1.0, self.timeout_s / 10)
        while True:
            time.sleep(period)
            now = time.monotonic()
            with self._lock:
                late = [(now - start, op, group, nbytes)
                        for op, group, nbytes, start in self._pending.values()
                        if now - start > self.timeout_s]
            if late:
                waited, op, group, nbytes = max(late)
                print(f"shardlm watchdog: rank {self.rank}: {op} on group {group} ({nbytes:,} bytes) "
                      f"has not finished after {waited:.1f} s (parallel.collective_timeout_s = "
                      f"{self.timeout_s:g}); a peer rank is probably hung or dead. Exiting with "
                      f"code {EXIT_CODE}.", file=sys.stderr, flush=True)
                os._exit(EXIT_CODE)


def watched(watchdog: CollectiveWatchdog | None, op: str, group: str, nbytes: int):
    """Context for a blocking collective outside Comm: tracked if there is a watchdog."""
    return watchdog.watch(op, group, nbytes) if watchdog is not None else contextlib.nullcontext()


class Tracked:
    """A collective's handle whose wait() also tells the watchdog it finished."""

    def __init__(self, handle, watchdog: CollectiveWatchdog, token: int):
        self.handle, self.watchdog, self.token = handle, watchdog, token

    def wait(self) -> bool:
        result = self.handle.wait()
        self.watchdog.done(self.token)
        return result
