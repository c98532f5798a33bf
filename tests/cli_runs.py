"""One real `shardlm train --nproc 2` run, shared by the tests that check what such a run does
(conftest.py's session fixture `two_rank_cli_run`): test_launch.py (it trains with ZeRO-2 and
logs its ledgers; every socket it listens on is loopback) and test_allocator.py (each rank fixes
glibc's mmap threshold). Each of those once launched its own run (a launcher and two workers,
each importing torch: 8-10 s apiece in CI); the checks are the same on the one run.

Also the /proc readers those checks use: a process's children, a process tree and its
listening TCP sockets."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from conftest import tiny_overrides

LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp{,6}
STEPS = 8
"""Steps of the shared run: short, yet its workers hold their sockets for well over the probe's
period (each probe of the process tree takes milliseconds; the workers live for seconds)."""


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`, from the kernel's list of each of its threads'
    children (/proc/PID/task/TID/children): the waits in test_restart.py and test_multinode.py
    and process_tree below poll this every 10-50 ms, and a scan of every process's stat costs
    ~10 ms of CPU on a hundred processes (a third of a core, for the whole of a run's start-up).
    Without that list (a kernel built without CONFIG_PROC_CHILDREN), the scan."""
    if not Path(f"/proc/{pid}/task/{pid}/children").exists() and Path(f"/proc/{pid}").exists():
        return _children_by_scan(pid)
    out = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:  # gone
        return []
    for task in tasks:
        try:
            out += [int(child) for child in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
        except OSError:  # the thread ended
            continue
    return out


def _children_by_scan(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def process_tree(root: int) -> list[int]:
    """`root` and every process below it."""
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children(pid)
    return tree


def _socket_inodes(pids: list[int]) -> dict[int, int]:
    """{socket inode: pid} over the processes' open file descriptors."""
    owners = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                owners[int(target[8:-1])] = pid
    return owners


def address(hex_addr: str) -> str:
    """/proc/net/tcp's 'HEXIP:HEXPORT' (IPv4 and IPv6: 32-bit words in host byte order)."""
    ip, port = hex_addr.split(":")
    raw = b"".join(struct.pack("=I", int(ip[i:i + 8], 16)) for i in range(0, len(ip), 8))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return f"[{socket.inet_ntop(family, raw)}]:{int(port, 16)}"


def parent_and_command(pid: int) -> tuple[int, str] | None:
    try:
        parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        return parent, Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except (OSError, IndexError, ValueError):
        return None  # exited while we looked


def listening_sockets(pids: list[int]) -> list[tuple[int, str]]:
    """(pid, '[address]:port') of every listening TCP socket the processes hold."""
    owners = _socket_inodes(pids)
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == LISTEN and int(fields[9]) in owners:
                found.append((owners[int(fields[9])], address(fields[1])))
    return found


@dataclass(frozen=True)
class CliRun:
    returncode: int
    stdout: str
    stderr: str
    run_dir: Path
    launcher_pid: int
    listening: frozenset[tuple[int, str]]
    """(pid, '[address]:port') of every listening socket of the launcher and the processes under
    it, sampled every 50 ms while they ran."""
    commands: dict[int, tuple[int, str]]
    """(parent pid, command line) of each process in `listening`."""

    @property
    def workers(self) -> set[int]:
        """The workers seen listening: the launcher's children that run `shardlm train`. (On a
        fresh cache the launcher first spawns the hardware probe's two gloo ranks, which listen
        too: the loopback check covers them, the worker count does not.)"""
        return {pid for pid, (parent, command) in self.commands.items()
                if parent == self.launcher_pid and " -m shardlm train " in command}


def two_rank_run(root: Path) -> CliRun:
    """`shardlm train --nproc 2`: gpt-tiny, ZeRO-2, STEPS steps, in an environment without
    MALLOC_MMAP_THRESHOLD_ / GLIBC_TUNABLES (so run.malloc_mmap_threshold's default applies in
    every rank); its output goes to files (a pipe nobody reads while sampling could fill)."""
    overrides = tiny_overrides(root, train__steps=STEPS, parallel__zero_stage=2, run__name="z2")
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")}
    out_path, err_path = root / "stdout.txt", root / "stderr.txt"
    seen: set[tuple[int, str]] = set()
    commands: dict[int, tuple[int, str]] = {}
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "shardlm", "train", "--nproc", "2",
                                 *[f"--{k}={v}" for k, v in overrides.items()]],
                                stdout=out, stderr=err, text=True, env=env)
        try:
            deadline = time.monotonic() + 300
            while proc.poll() is None and time.monotonic() < deadline:
                found = listening_sockets(process_tree(proc.pid))
                seen.update(found)
                for pid, _ in found:
                    if pid not in commands and (known := parent_and_command(pid)) is not None:
                        commands[pid] = known
                time.sleep(0.05)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    return CliRun(proc.returncode, out_path.read_text(), err_path.read_text(), root / "runs" / "z2",
                  proc.pid, frozenset(seen), commands)
