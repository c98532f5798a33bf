"""What `shardlm train --nproc N` says when a worker dies: one line at any world size — the rank,
its signal or exit code, the last step it logged, the last checkpoint and the command that
resumes — and the detail (torch's elastic failure report, its agent's log, the other ranks'
tracebacks: launch/relay.py) in the run's `launcher.log`. docs/reliability.md, Damaged inputs.

The launcher knows the workers' command line, not their Config: the run directory is read from
that command line the way a worker reads it (config.load), and the step and checkpoint from the
run's files, defensively (a run that died early has neither)."""

from __future__ import annotations

import json
import logging
import signal
import time
from pathlib import Path

log = logging.getLogger("shardlm")
LAUNCHER_LOG = "launcher.log"
"""The run directory's file of launcher detail (appended, one section per failure)."""
_AGENT_LOGGER = "torch.distributed.elastic"
_RESTARTS = "torch.distributed.elastic.agent.server.api"
"""Its logger says 'will restart worker group' at INFO."""


class AgentLog(logging.Handler):
    """`with AgentLog() as agent:` — torch's elastic agent logs ('Sending process N closing signal
    SIGTERM', 'failed (exitcode: -9) local_rank: 3 ...') into `agent.lines` instead of the
    console; a restart of the gang (--max-restarts) is one console line."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self._last_failure = ""
        self._saved: tuple[bool, int] | None = None
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

    def __enter__(self) -> AgentLog:
        agent, restarts = logging.getLogger(_AGENT_LOGGER), logging.getLogger(_RESTARTS)
        self._saved = (agent.propagate, restarts.level)
        agent.propagate = False
        agent.addHandler(self)
        restarts.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc) -> None:
        agent = logging.getLogger(_AGENT_LOGGER)
        agent.removeHandler(self)
        agent.propagate, level = self._saved
        logging.getLogger(_RESTARTS).setLevel(level)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            self.lines.append(self.format(record))
        except Exception:  # a log record must never end the launcher
            return
        if "failed (exitcode" in message:
            self._last_failure = message.split(" of binary", 1)[0]
        elif "will restart worker group" in message:
            log.warning("shardlm: a worker %s; torchrun restarts the workers from the last "
                        "checkpoint (%s)", self._last_failure or "failed", message.strip())


def dead_rank(failures: dict) -> tuple[int, object] | None:
    """The rank that died — killed by a signal (SIGKILL, the kernel's OOM killer, a segfault) —
    of torch's ChildFailedError.failures ({rank: ProcessFailure}), the first observed (then the
    lowest rank); None when the failed workers exited with a status of their own (those said
    why themselves). A SIGTERM is news only when nothing else is: torchrun sends it to the
    survivors once one failed, and a survivor caught before its handler was installed dies of it."""
    killed = [(f.timestamp, rank, f) for rank, f in failures.items() if f.exitcode is not None and f.exitcode < 0]
    hard = [k for k in killed if k[2].exitcode != -signal.SIGTERM]
    if not hard and any(f.exitcode is not None and f.exitcode > 0 for f in failures.values()):
        return None
    first = hard or killed
    return min(first, key=lambda k: k[:2])[1:] if first else None


def how_it_ended(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with status {exitcode}"


def run_dir_of(worker_argv: list[str]) -> Path | None:
    """The run directory a `-m shardlm train [CONFIG] --key=value ...` command line trains in
    (its config's run.dir / run.name), or None where it names none (no run.name) or cannot be
    read."""
    from shardlm.config.load import load_config, parse_overrides

    try:
        args = worker_argv[worker_argv.index("train") + 1:]
        config = args[0] if args and not args[0].startswith("--") else None
        cfg = load_config(config, parse_overrides(args[1:] if config else args))
    except Exception:  # whatever it is, the failure line goes out without the run's details
        return None
    return Path(cfg.run.dir) / cfg.run.name if cfg.run.name else None


def is_cut_off(line: str) -> bool:
    """Whether a metrics.jsonl line is a record cut off as it was written: a process killed in
    the middle of its write (SIGKILL can end a write() short) leaves the start of a JSON object
    that does not parse (it may end in a nested object's '}'). Readers skip it
    (studies/compare.py); MetricsLog ends it with a newline before a resumed run appends, so the
    records after it stay whole lines."""
    text = line.strip()
    if not text.startswith("{"):
        return False
    try:
        json.loads(text)
    except ValueError:
        return True
    return False


def last_step(run_dir: Path) -> int | None:
    """The last step metrics.jsonl recorded (its tail, read defensively), or None."""
    try:
        with open(run_dir / "metrics.jsonl", "rb") as f:
            f.seek(0, 2)
            f.seek(max(f.tell() - (1 << 16), 0))
            tail = f.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(tail):
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            continue
        if isinstance(step, int):
            return step
    return None


def last_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint `checkpoints/latest` names (checkpoint/manifest.py writes it), or None."""
    try:
        name = json.loads((run_dir / "checkpoints" / "latest").read_text()).get("step_dir")
    except (OSError, ValueError, AttributeError):
        return None
    path = run_dir / "checkpoints" / name if isinstance(name, str) and name else None
    return path if path is not None and path.is_dir() else None


def failure_line(rank: int, exitcode: int, run_dir: Path | None, log_file: Path | None) -> str:
    """The one line: 'rank 3 was killed by SIGKILL after step 7; last checkpoint: ...; resume
    with: shardlm train --resume RUN (detail: RUN/launcher.log)'."""
    parts = [f"rank {rank} {how_it_ended(exitcode)}"]
    if run_dir is not None:
        step = last_step(run_dir)
        parts[0] += f" after step {step}" if step is not None else " before its first logged step"
        checkpoint = last_checkpoint(run_dir)
        parts.append(f"last checkpoint: {checkpoint}" if checkpoint else "no checkpoint saved yet")
        parts.append(f"resume with: shardlm train --resume {run_dir}")
    else:
        parts.append("resume with: shardlm train --resume <run directory>")
    detail = f" (detail: {log_file})" if log_file is not None else ""
    return "; ".join(parts) + detail


def write_run_log(worker_argv: list[str], what: str, report: str, agent: AgentLog, relay) -> Path | None:
    """Append the detail of a failure to the run's launcher.log: torch's report, its agent's log,
    the tracebacks the relay held back. The file, or None where there is no run directory to
    put it in (a run that died before making it) or it cannot be written."""
    run_dir = run_dir_of(worker_argv)
    if run_dir is None or not run_dir.is_dir():
        return None
    sections = [f"== {time.strftime('%Y-%m-%d %H:%M:%S')} {what}", report, *agent.lines]
    for rank, text in relay.held().items():
        sections.append(f"-- rank {rank}'s traceback (its collectives lost a peer, or its own error):\n{text}")
    path = run_dir / LAUNCHER_LOG
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write("\n".join(s.rstrip("\n") for s in sections if s) + "\n")
    except OSError:
        return None
    return path
