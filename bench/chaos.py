"""Chaos: random SIGKILLs of a rank or of the launcher on a tiny 2-rank run, each run to the end
(torchrun's --max-restarts, or a rerun with --resume) and checked against an uninterrupted
reference: every step's loss in metrics.jsonl must be the reference's, bit for bit.

Each trial (its own generator: --seed + trial, rerun alone with --only) picks a victim (rank 0,
rank 1 or the launcher) and a moment ('random', or 'save': inside the checkpoint writer), and
sends SIGKILL (a 'random' moment not reached by the last step but one finds the victim, or for
the launcher every rank, frozen there by $SHARDLM_FAULT: the table marks it "(backstop)"), or
for a rank with probability --stop-fraction SIGSTOP (the watchdog, or rank 0's wait for the save
notes, must name the frozen rank). It survives when the run completes, no
worker outlives a killed launcher, a stop was named, and every logged step's loss equals the
reference's; a step never logged is counted apart as a log gap. --cases runs chaos_cases.py's
disk and input faults instead.

    python bench/chaos.py --trials 20            # the long form (minutes; not in CI)
    python bench/chaos.py --trials 1 --only 7    # trial 7 again, alone
    python bench/chaos.py --trials 6 --stop-fraction 0.5 --timeout 10   # frozen ranks too

tests/test_faults.py runs a fast subset (two kills) in CI; tests/test_watchdog.py a frozen rank.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from shardlm.launch.runtime import FAULT_ENV
from chaos_cases import CASES, Case, command, losses  # the run's config; the disk and input fault cases
from common import table, table_row
from common.cli import children, rank_of

VICTIMS = ("rank0", "rank1", "launcher")
MOMENTS = ("random", "save")
WATCHDOG_SAYS = "shardlm watchdog: rank "
"""How the collective watchdog's report begins (comm/watchdog.py)."""
NOTES_SAY = "did not finish writing"
"""How rank 0 names ranks whose part of a checkpoint never came (a rank frozen inside a save:
the wait for its note ends first, at the same timeout)."""
BACKEND_TIMEOUT = "Timed out waiting"
"""gloo's own timeout: must never be what ends a frozen rank's peers."""


def stopped(pid: int) -> bool:
    """Whether `pid` is frozen (SIGSTOP: state T)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@dataclass
class Trial:
    number: int
    victim: str
    moment: str
    delay_s: float
    signal: str = "SIGKILL"
    killed_at_step: int | None = None
    killed: bool = False
    workers_gone: bool | None = None
    resumed_by: str = ""
    exit_code: int | None = None
    steps_checked: int = 0
    mismatches: list[int] = field(default_factory=list)
    """Steps logged with another loss than the reference's."""
    missing: list[int] = field(default_factory=list)
    """Steps never logged (a kill between a checkpoint's publication and the step's record)."""
    seconds: float = 0.0
    recovery_s: float | None = None
    """A rank's fault: seconds from the signal to the next gang's first worker."""
    backstop: bool = False
    """A 'random' moment that came after the victim froze itself at the backstop (the last step
    but one: $SHARDLM_FAULT), so that a fast machine cannot end the run before the kill lands."""
    watchdog_named: bool | None = None
    """A stopped rank: whether the watchdog named the stalled collective, or the checkpoint's
    wait the rank that froze inside a save (and gloo's own timeout never ended either)."""
    note: str = ""

    @property
    def survived(self) -> bool:
        return (self.exit_code == 0 and not self.mismatches and self.workers_gone is not False
                and self.watchdog_named is not False
                and self.steps_checked > 0 and max(self.logged, default=0) == self.last_step)

    logged: list[int] = field(default_factory=list)
    last_step: int = 0


def reference(root: Path, steps: int, every: int) -> tuple[dict[int, float], float]:
    """The uninterrupted run's losses and its training time (first logged step to exit)."""
    run_dir = root / "runs" / "reference"
    with open(root / "reference.log", "w") as log:
        proc = subprocess.Popen(command(root, "reference", steps, every), stdout=log,
                                stderr=subprocess.STDOUT)
        _wait_for(lambda: bool(losses(run_dir)), proc, 600, poll=0.05)
        first = time.monotonic()
        proc.wait(900)
    if proc.returncode != 0:
        raise SystemExit(f"the reference run failed: see {root / 'reference.log'}")
    records = losses(run_dir)
    assert sorted(records) == list(range(1, steps + 1)), sorted(records)
    return records, max(0.5, time.monotonic() - first)


def _wait_for(predicate, proc: subprocess.Popen, timeout: float, poll: float = 0.002) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(poll)
    return False


def _timeout_of(extra: tuple[str, ...]) -> float:
    """The trials' parallel.collective_timeout_s (the config's default, 600, if not given)."""
    given = [a.split("=", 1)[1] for a in extra if a.startswith("--parallel.collective_timeout_s=")]
    return float(given[-1]) if given else 600.0


def run_trial(root: Path, number: int, seed: int, ref: dict[int, float], train_s: float,
              steps: int, every: int, stop_fraction: float = 0.0, *extra: str) -> Trial:
    rng = random.Random(seed + number)
    # within the first 70% of the reference's training time, so that the kill lands before the
    # run ends even when this machine is busier than it was for the reference
    trial = Trial(number, rng.choice(VICTIMS), rng.choice(MOMENTS), rng.uniform(0, 0.7 * train_s))
    if stop_fraction and trial.victim != "launcher" and rng.random() < stop_fraction:
        trial.signal = "SIGSTOP"  # drawn last: the trials without stops draw as they always did
    name = f"trial-{number:03d}"
    run_dir = root / "runs" / name
    ckpts = run_dir / "checkpoints"
    start = time.monotonic()
    log = open(root / f"{name}.log", "w")
    env = dict(os.environ)
    if trial.moment == "random":
        # The backstop: the victim (every rank, if it is the launcher) freezes itself after the
        # last step but one unless the kill came first. The reference's time runs to its exit,
        # and a fast machine can be past the last step (ranks gone, nothing to kill) within 70%
        # of it, however soon the poll below sees the step (CI: every step logged after 0.17 s;
        # on 2026-11-30 the run's end came between the poll and the kill).
        rank = "" if trial.victim == "launcher" else f":{trial.victim[-1]}"
        env[FAULT_ENV] = f"stop@{steps - 1}/0{rank}"
    proc = subprocess.Popen(command(root, name, steps, every, *extra), stdout=log,
                            stderr=subprocess.STDOUT, text=True, env=env)
    try:
        first = _wait_for(lambda: bool(losses(run_dir)), proc, 600, poll=0.05)
        if first and trial.moment == "random":
            # the delay, or the backstop's frozen victim if that comes first
            _wait_for(lambda: max(losses(run_dir), default=0) >= steps - 1 and any(
                stopped(w) for w in children(proc.pid)), proc, trial.delay_s, poll=0.01)
        elif first:
            _wait_for(lambda: ckpts.is_dir() and any(p.name.endswith(".tmp") for p in ckpts.iterdir()),
                      proc, 600)
        workers = children(proc.pid)
        if proc.poll() is not None or not workers:
            trial.note = "the run ended before the kill"
        else:
            trial.killed_at_step = max(losses(run_dir), default=0)
            trial.backstop = any(stopped(w) for w in workers) and trial.signal == "SIGKILL"
            if trial.victim == "launcher":
                os.kill(proc.pid, signal.SIGKILL)
                trial.killed = True
                proc.wait(30)
                deadline = time.monotonic() + 15
                while any(alive(w) for w in workers) and time.monotonic() < deadline:
                    time.sleep(0.05)
                trial.workers_gone = not any(alive(w) for w in workers)
                for w in workers:  # never leave one behind, whatever the verdict
                    if alive(w):
                        os.kill(w, signal.SIGKILL)
            else:
                target = [w for w in workers if rank_of(w) == int(trial.victim[-1])]
                if target:
                    os.kill(target[0], getattr(signal, trial.signal))
                    struck = time.monotonic()
                    trial.killed = True
                    trial.resumed_by = "--max-restarts"
                    # a frozen rank: its peers' watchdog reports within the collective timeout,
                    # and torchrun kills it 30 s later; one frozen after its peers finished
                    # training has no peer left to notice: thawed, and said so
                    limit = 600 if trial.signal == "SIGKILL" else _timeout_of(extra) + 60
                    if _wait_for(lambda: bool(set(children(proc.pid)) - set(workers)), proc, limit,
                                 poll=0.05):
                        trial.recovery_s = time.monotonic() - struck
                    elif trial.signal == "SIGSTOP" and alive(target[0]):
                        os.kill(target[0], signal.SIGCONT)
                        trial.note = "no peer was waiting on the frozen rank (training was over)"
                else:
                    trial.note = "no such rank found"
        if trial.victim != "launcher" or not trial.killed:
            proc.wait(900)
            trial.exit_code = proc.returncode
        else:
            saved = (ckpts / "latest").exists()
            trial.resumed_by = "--resume" if saved else "rerun (no checkpoint yet)"
            env.pop(FAULT_ENV, None)  # the run again, without the backstop
            again = subprocess.run(command(root, name, steps, every, *extra,
                                           *(["--resume"] if saved else [])),
                                   stdout=log, stderr=subprocess.STDOUT, text=True, timeout=900,
                                   env=env)
            trial.exit_code = again.returncode
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    if trial.signal == "SIGSTOP" and trial.killed and not trial.note:
        text = (root / f"{name}.log").read_text(errors="replace")
        trial.watchdog_named = (WATCHDOG_SAYS in text or NOTES_SAY in text) and BACKEND_TIMEOUT not in text
    got = losses(run_dir)
    trial.logged, trial.last_step = sorted(got), steps
    trial.steps_checked = len([s for s in ref if s in got])
    trial.mismatches = [s for s in ref if s in got and got[s] != ref[s]]
    trial.missing = [s for s in ref if s not in got]
    trial.seconds = time.monotonic() - start
    return trial


HEADER = ("trial", "victim", "signal", "moment", "killed at step", "workers gone", "resumed by", "recovery s",
          "exit", "steps equal", "s", "verdict")


def trial_row(t: Trial) -> list:
    gone = "-" if t.workers_gone is None else ("yes" if t.workers_gone else "NO")
    verdict = (f"no kill: {t.note}" if not t.killed else
               f"survived {t.note}".strip() if t.survived else f"FAILED {t.note}".strip())
    if t.watchdog_named is False:
        verdict += " (neither the watchdog nor the save named the stalled rank)"
    if t.mismatches:
        verdict += f" (steps {t.mismatches[:5]} differ)"
    if t.missing:
        verdict += f"; steps {t.missing[:5]} not logged"
    at = "-" if t.killed_at_step is None else f"{t.killed_at_step}{' (backstop)' if t.backstop else ''}"
    return [t.number, t.victim, t.signal, t.moment, at, gone,
            t.resumed_by or "-", "-" if t.recovery_s is None else f"{t.recovery_s:.1f}",
            "-" if t.exit_code is None else t.exit_code, t.steps_checked - len(t.mismatches), f"{t.seconds:.0f}",
            verdict]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", type=int, help="run only this trial number")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=3, help="checkpoint.every")
    parser.add_argument("--stop-fraction", type=float, default=0.0,
                        help="a rank victim gets SIGSTOP instead of SIGKILL with this probability")
    parser.add_argument("--timeout", type=float, default=0.0,
                        help="parallel.collective_timeout_s of the trials (0: the default)")
    parser.add_argument("--dir", help="work directory (default: a fresh temporary one, kept)")
    args = parser.parse_args(argv)
    root = Path(args.dir or tempfile.mkdtemp(prefix="shardlm-chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"chaos: work directory {root}", flush=True)
    ref, train_s = reference(root, args.steps, args.every)
    print(f"reference: {args.steps} steps, ~{train_s:.0f} s of training", flush=True)
    numbers = [args.only] if args.only is not None else list(range(args.trials))
    trials = []
    for n in numbers:
        t = run_trial(root, n, args.seed, ref, train_s, args.steps, args.every, args.stop_fraction,
                      *([f"--parallel.collective_timeout_s={args.timeout:g}"] if args.timeout else []))
        trials.append(t)
        print(table_row(trial_row(t)), flush=True)
    print()
    print(table(HEADER, [trial_row(t) for t in trials]))
    killed = [t for t in trials if t.killed]
    survived = sum(t.survived for t in killed)
    mismatched = sum(bool(t.mismatches) for t in killed)
    print(f"\ntrials {len(trials)}, kills {len(killed)}, survived {survived}, mismatches "
          f"{mismatched} (steps logged with another loss), log gaps "
          f"{sum(bool(t.missing) for t in killed)} (steps never logged), orphaned workers "
          f"{sum(t.workers_gone is False for t in trials)}")
    stopped = [t for t in killed if t.signal == "SIGSTOP"]
    saves = [t.recovery_s for t in killed
             if t.signal == "SIGKILL" and t.moment == "save" and t.recovery_s is not None]
    print(f"stops {len(stopped)}, named (watchdog or save) {sum(bool(t.watchdog_named) for t in stopped)}; "
          f"recovery after a rank killed in a save: "
          f"{', '.join(f'{s:.1f}' for s in saves) or '-'} s")
    print(f"reproduce: python bench/chaos.py --trials {args.trials} --seed {args.seed} "
          f"--steps {args.steps} --every {args.every}"
          + (f" --stop-fraction {args.stop_fraction:g}" if args.stop_fraction else "")
          + (f" --timeout {args.timeout:g}" if args.timeout else ""))
    return 0 if survived == len(killed) else 1


def run_cases(names: list[str], root: Path) -> list[Case]:
    cases = []
    for name in names:
        expected, run = CASES[name]
        case, start = Case(name, expected), time.monotonic()
        try:
            run(root, case)
        except Exception as e:  # a case that could not run is a failed case, with its reason
            case.problems.append(f"{type(e).__name__}: {e}")
        case.seconds = time.monotonic() - start
        cases.append(case)
        print(f"{name:38}  {case.exit_code if case.exit_code is not None else '-':>4}  "
              f"{case.seconds:5.1f}  {'ok' if case.passed else 'FAILED: ' + '; '.join(case.problems)}",
              flush=True)
    return cases


def cases_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="disk and input fault cases of bench/chaos.py")
    parser.add_argument("--cases", required=True, help=f"'all' or some of: {', '.join(CASES)}")
    parser.add_argument("--dir", help="work directory (default: a fresh temporary one, kept)")
    args = parser.parse_args(argv)
    names = list(CASES) if args.cases == "all" else [n.strip() for n in args.cases.split(",")]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; known: {', '.join(CASES)}")
    root = Path(args.dir or tempfile.mkdtemp(prefix="shardlm-chaos-cases-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"chaos cases: work directory {root}\n{'case':38}  {'exit':>4}  {'s':>5}  verdict", flush=True)
    cases = run_cases(names, root)
    print(f"\ncases {len(cases)}, passed {sum(c.passed for c in cases)}; "
          f"reproduce: python bench/chaos.py --cases {args.cases}")
    return 0 if all(c.passed for c in cases) else 1


if __name__ == "__main__":
    if any(a.startswith("--cases") for a in sys.argv[1:]):
        sys.exit(cases_main(sys.argv[1:]))
    sys.exit(main())
