"""The bench toolkit: one way to start ranks, time steps, read memory and ledgers, and print a
table. Every bench script imports it (`python bench/x.py` puts bench/ on sys.path first).
Beside it: common.cli (`shardlm train` as a user runs it, a run's JSONL read back) and
common.peer (the plain PyTorch loop a user would write, the anchor shardlm is timed against).

A bench script: bench_parser + add_step_args -> prepare() once in the parent -> per case a
`measure(case)` running a module-level rank function through start_ranks, returning
summarize(ranks, tokens) -> rounds() over the cases -> table() of combine()d results ->
machine() and reproduce().

Every case runs in fresh processes (peak RSS is a per-process high-water mark), with
MALLOC_MMAP_THRESHOLD_=65536 unless set (freed blocks >= 64 KiB go back to the OS), and
max(1, cores // ranks) threads per rank. A step takes the slowest rank's median, memory the
highest rank's; repeats run in interleaved rounds (A B C, B C A, ...) so that other jobs' load
hits every case alike.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

from shardlm.config.load import load_config, typed_overrides
from shardlm.launch.runtime import cpu_cores
from shardlm.launch.spawn import run_ranks
from shardlm.train.telemetry import peak_rss_bytes, reset_peak_rss  # noqa: F401 (the benches take both from here)

MiB, GiB = 2**20, 2**30
MMAP_THRESHOLD = "65536"


# -- ranks -------------------------------------------------------------------------------------

def threads_per_rank(ranks: int) -> int:
    """What shardlm.launch.spawn gives each rank: the cores split evenly, at least one."""
    return max(1, cpu_cores() // ranks)


def prepare(cfg, ranks: int, mmap_threshold: str | None = MMAP_THRESHOLD, precision: str = "fp32") -> int:
    """Before any rank starts: MALLOC_MMAP_THRESHOLD_ (unless set; None: leave it), the dataset
    (tokenizer and token stream, cached for the ranks) and the CPU's matmul peak (build_run looks
    it up for MFU, probing with 3 matrices of 16 MiB on a cache miss) made here at the ranks'
    thread count. Returns that thread count."""
    from shardlm.data.loader import build_dataset
    from shardlm.data.sft import template_for
    from shardlm.data.tokenizer import hf_tokenizer
    from shardlm.train.telemetry import peak_flops

    if mmap_threshold is not None:
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", mmap_threshold)
    # as build_run builds it: a checkpoint's tokenizer, rows of seq_len + 1 for the chat formats
    given = hf_tokenizer(cfg.model.hf_path, cfg.model.vocab_size) if cfg.model.hf_path else None
    build_dataset(cfg.data, cfg.model.vocab_size, given, cfg.train.seq_len,
                  chat_template=template_for(cfg.data.format, cfg.model.hf_path))
    threads = threads_per_rank(ranks)
    torch.set_num_threads(threads)
    peak_flops(torch.device("cpu"), precision)
    return threads


def start_ranks(fn: Callable, ranks: int, tmp: str | Path, *args, timeout: float = 3600) -> list:
    """`fn(rank, ranks, *args)` on `ranks` fresh processes (run_ranks: gloo, file rendezvous in a
    new directory under `tmp`); their results by rank."""
    return run_ranks(fn, ranks, Path(tempfile.mkdtemp(dir=tmp)), *args, timeout=timeout)


def run_overrides(run_dir: str | Path, sets: list[str] = (), precision: str = "fp32") -> dict:
    """The overrides every measured shardlm run shares (on the CPU, no progress bar, no eval, no
    samples), then the user's --set KEY=VALUE ones, which win."""
    return {"precision.compute": precision, "run.device": "cpu", "run.dir": str(run_dir),
            "run.progress": "off", "train.eval_every": 0, "train.sample_tokens": 0,
            **typed_overrides(dict(kv.split("=", 1) for kv in sets))}


def step_overrides(args, run_dir: str | Path, keys: dict) -> dict:
    """A timed case's config: --preset, --seq, --warmup + --steps steps, then this case's `keys`,
    then run_overrides (the user's --set wins)."""
    return {"model.preset": args.preset, "train.seq_len": args.seq, "train.steps": args.warmup + args.steps,
            **keys, **run_overrides(run_dir, args.set)}


def setup_line(cfg, ranks: int, threads: int) -> str:
    """The report's first words: the machine, the ranks and threads, the model and its size."""
    from shardlm.models.flops import count_params

    return (f"{machine()}; {ranks} gloo ranks x {threads} thread(s), {cfg.model.preset} "
            f"({count_params(cfg.model) / 1e6:.1f}M params)")


def bench_parser(doc: str, preset: str, seq: int, micro_batch: int | None = None,
                 micro_help: str = "sequences per rank per micro-batch") -> argparse.ArgumentParser:
    """The argument parser every bench starts from: its docstring as --help, --preset, --seq and
    (where given) --micro-batch with this bench's defaults."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default=preset, help="the model (shardlm.config.presets)")
    parser.add_argument("--seq", type=int, default=seq, help="tokens per sequence (train.seq_len)")
    if micro_batch is not None:
        parser.add_argument("--micro-batch", type=int, default=micro_batch, help=micro_help)
    return parser


def add_step_args(parser, steps: int, warmup: int, repeat: int | None = None) -> None:
    """--steps, --warmup, --set (and --repeat where given) as every bench spells them."""
    parser.add_argument("--steps", type=int, default=steps, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=warmup, help="untimed steps per case")
    if repeat is not None:
        parser.add_argument("--repeat", type=int, default=repeat,
                            help="rounds over the case list (interleaved; median tokens/s and range)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every case (repeatable), e.g. model.d_model=512")


# -- timing ------------------------------------------------------------------------------------

def timed_steps(step_fn: Callable[[int], float], warmup: int, steps: int, after=None) -> dict:
    """Losses of every step; wall and process CPU seconds (all threads) of each timed step;
    `after(step, seconds)`, if given, runs after each step, outside the timing."""
    losses, seconds, cpu = [], [], []
    for step in range(warmup + steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        losses.append(step_fn(step))
        wall, used = time.perf_counter() - start, time.process_time() - start_cpu
        if step >= warmup:
            seconds.append(wall)
            cpu.append(used)
        if after is not None:
            after(step, wall)
    return {"losses": losses, "seconds": seconds, "cpu": cpu}


def train_timed(run, warmup: int, steps: int, after=None, first: int = 0) -> dict:
    """timed_steps over shardlm's train_step from step `first` (a resumed run's start), with each
    timed step's byte ledger (reset before the step, so setup's collectives are not a step's);
    `after(step, seconds, result)`, the step counted from 0."""
    from shardlm.train.step import train_step

    ledgers, results = [], []

    def step(s: int) -> float:
        run.strategy.ledger.reset()
        results.append(train_step(run, first + s))
        return results[-1].loss

    def read(s: int, seconds: float) -> None:
        ledgers.append(run.strategy.ledger.snapshot())
        if after is not None:
            after(s, seconds, results[-1])

    return {**timed_steps(step, warmup, steps, read), "ledgers": ledgers[warmup:]}


def build(overrides: dict):
    """shardlm's run of these config overrides (build_run of the validated config)."""
    from shardlm.train.build import build_run

    return build_run(load_config(overrides=overrides).validate())


def shardlm_rank(rank: int, world: int, overrides: dict, warmup: int, steps: int) -> dict:
    """A rank of a shardlm case: build, then train_timed; peak RSS after setup and at the end."""
    run = build(overrides)
    setup_rss = peak_rss_bytes()
    return {**train_timed(run, warmup, steps), "setup_rss": setup_rss, "rss": peak_rss_bytes(),
            "state": sum(run.strategy.model_state_bytes().values())}


# -- memory and ledgers ------------------------------------------------------------------------

def proc_status(field: str, pid: int | str = "self") -> int:
    """One memory line of /proc/<pid>/status (VmRSS, VmHWM, RssAnon, ...) in bytes (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1)) * 1024


def by_group(ledger: dict[str, int]) -> dict[str, int]:
    """A ledger ('op/group' -> bytes) summed by group."""
    groups: dict[str, int] = defaultdict(int)
    for key, nbytes in ledger.items():
        groups[key.split("/", 1)[1]] += nbytes
    return dict(groups)


def ledger_text(ledger: dict | None, steady: bool = True) -> str:
    """'group MiB, ...' of one step's ledger; '–' for a run without one (not shardlm)."""
    if ledger is None:
        return "– (not shardlm)"
    text = ", ".join(f"{g} {b / MiB:,.2f}" for g, b in sorted(by_group(ledger).items())) or "0"
    return text + ("" if steady else " (varies by step)")


# -- summaries ---------------------------------------------------------------------------------

def summarize(ranks: list[dict], tokens_per_step: int) -> dict:
    """One case's ranks -> one result: the slowest rank's median step (tokens/s), the highest
    rank's median CPU seconds and memory marks, rank 0's losses and last ledger."""
    step_s = max(statistics.median(r["seconds"]) for r in ranks)
    ledgers = ranks[0].get("ledgers") or []
    out = {"tok_s": tokens_per_step / step_s, "step_s": step_s,
           "first": ranks[0]["losses"][0], "last": ranks[0]["losses"][-1],
           "ledger": ledgers[-1] if ledgers else None,
           "ledger_steady": all(led == ledgers[-1] for led in ledgers)}
    if "cpu" in ranks[0]:
        out["cpu_s"] = max(statistics.median(r["cpu"]) for r in ranks)
    for key in ("rss", "setup_rss"):
        if key in ranks[0]:
            out[key] = max(r[key] for r in ranks)
    return out


def combine(runs: list[dict]) -> dict:
    """Repeats of one case: median tokens/s (and its range) and CPU seconds, the highest memory
    marks; `repeatable` says whether losses and ledgers came out the same every time."""
    first = runs[0]
    speeds = sorted(r["tok_s"] for r in runs)
    out = {**first, "tok_s": statistics.median(speeds), "tok_s_range": (speeds[0], speeds[-1]),
           "repeatable": all((r["first"], r["last"], r["ledger"]) == (first["first"], first["last"],
                                                                     first["ledger"]) for r in runs)}
    if "cpu_s" in first:
        out["cpu_s"] = statistics.median(r["cpu_s"] for r in runs)
    for key in ("rss", "setup_rss"):
        if key in first:
            out[key] = max(r[key] for r in runs)
    return out


def rounds(keys: list, repeat: int, measure: Callable, label: Callable = str,
           note: Callable | None = None) -> dict[object, list]:
    """measure(key) for every key, `repeat` rounds of the whole list, each round starting one case
    further on (A B C, B C A, ...): load from other jobs comes and goes, and so hits every case
    alike. A progress line per run (`note(result)`, default its speed and losses).
    {key: [result of each round]}."""
    runs: dict[object, list] = defaultdict(list)
    start = time.perf_counter()
    for i in range(repeat):
        for key in keys[i % len(keys):] + keys[:i % len(keys)]:
            m = measure(key)
            runs[key].append(m)
            print(f"round {i + 1} {label(key)}: {(note or step_note)(m)}, load average "
                  f"{os.getloadavg()[0]:.1f}, {time.perf_counter() - start:.0f} s so far", flush=True)
    return runs


def step_note(m: dict) -> str:
    cpu = f", {m['cpu_s']:.2f} CPU s/step" if "cpu_s" in m else ""
    return f"{m['tok_s']:,.1f} tok/s{cpu}, loss {m['first']:.4f} -> {m['last']:.4f}"


def speed_text(m: dict, digits: int = 0) -> str:
    """A combined result's tokens/s: 'median (low-high)' where the rounds differ."""
    low, high = m.get("tok_s_range", (m["tok_s"], m["tok_s"]))
    return f"{m['tok_s']:,.{digits}f}" + (f" ({low:,.{digits}f}-{high:,.{digits}f})" if high > low else "")


def err(predicted: float, measured: float) -> str:
    """A prediction beside its relative error against the measurement."""
    return f"{predicted:,.0f} ({(predicted - measured) / measured:+.0%})"


# -- the report --------------------------------------------------------------------------------

def machine() -> str:
    """The CPU model (lscpu), the cores this process may use, torch's version, the load."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, check=False).stdout
        model = re.search(r"Model name:\s*(.+)", text).group(1).strip()
    except (OSError, subprocess.SubprocessError, AttributeError):
        model = "CPU model unknown (no lscpu)"
    return (f"{model}, {cpu_cores()} cores, torch {torch.__version__}, "
            f"load average {os.getloadavg()[0]:.1f} (other jobs may share the machine)")


def table_row(cells) -> str:
    """One markdown table line."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def table(header: tuple | list, rows: list) -> str:
    """A markdown table: the header line, its rule, then the rows (sequences of cells)."""
    return "\n".join([table_row(header), "|" + "---|" * len(header), *map(table_row, rows)])


def plot(path: str | Path, title: str, xlabel: str, ylabel: str, draw: Callable, dpi: int = 120) -> None:
    """A PNG at `path` (matplotlib, no display): `draw(ax)` plots the lines, then the labels,
    the title and the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    draw(ax)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    print(f"plot: {path}")


def reproduce() -> str:
    """The exact command that ran this bench (from the repository root)."""
    return f"Reproduce: PYTHONPATH=src python {shlex.join(sys.argv)}"
