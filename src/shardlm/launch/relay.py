"""The workers' stderr on its way to the terminal (`shardlm train --nproc N`, launch/local.py).

It passes through as it comes, except a traceback a rank prints after joining its process group
(torch's excepthook prefixes each of its lines with `[rankN]:`): that is held until the launcher
knows how the job ended. When a rank died (a signal, a crash), the others' tracebacks are
consequences — their collectives lost a peer — and go only to the run's log file, beside the
launcher's one line naming the dead rank; any other ending shows them, as before.

The workers write to a pipe (a pseudo-terminal when the launcher's stderr is a terminal, so that
rank 0 still draws its progress bar) that a thread of the launcher reads. Nothing of torch is
patched: the workers inherit the launcher's stderr, which is pointed at the pipe for the run.
"""

from __future__ import annotations

import os
import re
import select
import sys
import threading
import time

_RANK_LINE = re.compile(rb"^\[rank(\d+)\]:")
_TRACEBACK = b"Traceback (most recent call last):"
_QUIET_S = 0.1
"""A partial line (a progress bar's \\r update) is passed on once the stream is this quiet."""


class StderrRelay:
    """`with StderrRelay() as relay:` — fd 2 (and so every process started meanwhile) writes to
    the relay; `relay.held()` is what it held back, by rank; `relay.show_held()` writes it out."""

    def __init__(self) -> None:
        self._held: dict[int, list[bytes]] = {}
        self._stop = threading.Event()
        self._console = -1
        self._read_fd = -1
        self._thread: threading.Thread | None = None

    def __enter__(self) -> StderrRelay:
        sys.stderr.flush()
        self._console = os.dup(2)
        self._read_fd, write_fd = _terminal_like(self._console)
        os.dup2(write_fd, 2)
        os.close(write_fd)
        self._thread = threading.Thread(target=self._pump, name="shardlm-stderr-relay", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        sys.stderr.flush()
        os.dup2(self._console, 2)  # our end of the pipe closed: the pump drains it and stops
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        os.close(self._read_fd)
        os.close(self._console)

    def held(self) -> dict[int, str]:
        """The tracebacks held back, by rank, as text."""
        return {rank: b"".join(lines).decode("utf-8", errors="replace")
                for rank, lines in sorted(self._held.items())}

    def show_held(self) -> None:
        """Write what was held to stderr (after the relay ended): the job ended otherwise than by
        a dead rank, so the tracebacks are the news."""
        for text in self.held().values():
            sys.stderr.write(text if text.endswith("\n") else text + "\n")
        sys.stderr.flush()

    def _pump(self) -> None:
        pending, last = b"", time.monotonic()
        while True:
            ready, _, _ = select.select([self._read_fd], [], [], _QUIET_S)
            if not ready:
                if pending and not _RANK_LINE.match(pending) and time.monotonic() - last >= _QUIET_S:
                    self._write(pending)  # a line still being written: a progress bar
                    pending = b""
                if self._stop.is_set():
                    break
                continue
            try:
                data = os.read(self._read_fd, 1 << 16)
            except OSError:  # EIO: a pseudo-terminal whose writers all closed it
                data = b""
            if not data:
                break
            last = time.monotonic()
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                self._line(line + b"\n")
        if pending:
            self._line(pending)

    def _line(self, line: bytes) -> None:
        match = _RANK_LINE.match(line)
        if match is not None:
            rank = int(match[1])
            if rank in self._held or line[match.end():].lstrip().startswith(_TRACEBACK):
                self._held.setdefault(rank, []).append(line)
                return
        self._write(line)

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self._console, view):]
            except OSError:  # the terminal went away: nothing left to show it to
                return


def _terminal_like(console: int) -> tuple[int, int]:
    """(read end, write end): a pseudo-terminal where `console` is a terminal (so the workers see
    one), else — or where none can be had — a pipe."""
    if os.isatty(console):
        try:
            import pty
            import tty

            read_fd, write_fd = pty.openpty()
            tty.setraw(write_fd)  # bytes pass as written: no \n -> \r\n, no echo
            _copy_window_size(console, write_fd)
            return read_fd, write_fd
        except (ImportError, OSError):
            pass
    return os.pipe()


def _copy_window_size(source: int, target: int) -> None:
    """The terminal's rows and columns onto the pseudo-terminal (a progress bar fits its width)."""
    try:
        import fcntl
        import termios

        fcntl.ioctl(target, termios.TIOCSWINSZ, fcntl.ioctl(source, termios.TIOCGWINSZ, b"\0" * 8))
    except (ImportError, OSError):
        pass
