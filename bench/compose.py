"""The composition matrix: every pair of 24 everyday features, validated (no processes) and,
with --run, trained for a few steps on a tiny model against one process. The rows and the rules
that combine two into one config are bench/compose_matrix.py; this file runs them.

A pair is the base config plus both FEATURES rows' keys (`parallel.zero_stage` the larger).
Validation sorts every pair into accepted or refused and names the refusing rule
(`config.rules.refusing_rules`). --run trains each accepted pair for STEPS steps on the ranks its
layout needs (8 at most) and compares every step's loss and gradient norm with the reference:
the same config in one process, every execution choice taken out, the data-parallel ranks'
micro-batches as gradient accumulation; relative tolerance by precision (TOLERANCE). An async
checkpoint saved after step 2 must read back as that step's state exactly, on every rank.

Reproduce:  PYTHONPATH=src python bench/compose.py                     (validation only, seconds)
            PYTHONPATH=src nice python bench/compose.py --run --batch  (every accepted pair)
            PYTHONPATH=src python bench/compose.py --run --pairs tp+lora,cp+fp16
            PYTHONPATH=src python bench/compose.py --run --rotate 10 --seed 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from common import build, table
from compose_matrix import (BY_NAME, ELSEWHERE, FEATURES, FRONTIER, STEPS, Feature, _elsewhere, checked_elsewhere,
                            feature_overrides, pair_name, pairs, precision_of, reference_overrides, validation,
                            world_of)
from shardlm.config.load import load_config
from shardlm.launch.runtime import cpu_cores
from shardlm.launch.spawn import run_ranks

SAVE_AFTER = 2  # async checkpoints: saved after this many steps, written while training goes on
TOLERANCE = {"fp32": 1e-4, "fp16": 2e-2, "bf16": 2e-2, "fp8": 5e-2}
"""Relative tolerance on each step's loss and gradient norm, by the pair's compute precision."""
MAX_RANKS = 8
BATCH = 12
"""Pairs of one world size trained in one spawn (--batch): imports and process start-up once."""

CHATS = [
    {"messages": [{"role": "system", "content": "You are terse."},
                  {"role": "user", "content": "What is two plus two?"},
                  {"role": "assistant", "content": "Four."}]},
    {"messages": [{"role": "user", "content": "Name a colour."},
                  {"role": "assistant", "content": "Blue."},
                  {"role": "user", "content": "Another one?"},
                  {"role": "assistant", "content": "Green, then red."}]},
    {"messages": [{"role": "user", "content": "Count to three."},
                  {"role": "assistant", "content": "One, two, three."}]},
]


def train_steps(rank: int, world_size: int, overrides: dict, steps: int, save_after: int) -> dict:
    """A rank's run (or the one-process reference): every step's loss, gradient norm and
    whether it stepped; with checkpoint.async an asynchronous save after `save_after` steps, with
    checkpoint.every a save every that many steps (as the loop saves), the one after `save_after`
    steps read back."""
    import torch

    from shardlm.train.checkpointing import save_checkpoint
    from shardlm.train.step import train_step

    torch.manual_seed(0)
    run = build(overrides)
    out: dict[str, Any] = {"losses": [], "norms": [], "stepped": [], "saved_exactly": None}
    saved: list = []
    for step in range(steps):
        result = train_step(run, step)
        out["losses"].append(float(result.loss))
        out["norms"].append(float(result.grad_norm))
        out["stepped"].append(bool(result.stepped))
        every = run.cfg.checkpoint.every or (save_after if run.cfg.checkpoint.async_ else 0)
        if every and (step + 1) % every == 0:
            if step + 1 == save_after:
                saved = [dataclasses.replace(s, tensor=s.tensor.clone()) for s in run.strategy.state_slices()]
            save_checkpoint(run, step + 1)  # async: written in the background while the next steps run
    run.checkpoints.wait()
    if saved:  # the checkpoint holds the state of its step, not of the steps run while it wrote
        from shardlm.checkpoint.sharded import step_dir_name
        from shardlm.checkpoint.reader import load_slices
        read = [dataclasses.replace(s, tensor=torch.full_like(s.tensor, float("nan")) if s.tensor.is_floating_point()
                                    else s.tensor.bitwise_not()) for s in saved]
        load_slices(run.checkpoints.root / step_dir_name(save_after), read, run.runtime)
        out["saved_exactly"] = all(torch.equal(a.tensor, b.tensor) for a, b in zip(saved, read))
    return out


def compare(got: dict, ref: dict, tol: float) -> str:
    """'' when every step's loss and gradient norm agree within `tol` relative, else why not."""
    for what in ("losses", "norms"):
        for step, (g, r) in enumerate(zip(got[what], ref[what])):
            if not abs(g - r) <= tol * max(abs(r), 1e-12):
                label = {"losses": "loss", "norms": "gradient norm"}[what]
                return f"step {step + 1} {label} {g:.6g} vs one process {r:.6g} (tol {tol:g})"
    if got["stepped"] != ref["stepped"]:
        return f"stepped {got['stepped']} vs one process {ref['stepped']}"
    return ""


@dataclasses.dataclass
class PairRun:
    """One accepted pair (or any list of features) made ready to run: its config, ranks and
    one-process reference."""
    name: str
    overrides: dict[str, Any]
    world: int
    reference: dict[str, Any]
    key: str
    """The reference's identity: pairs that differ only in execution share one reference run."""


def prepare(features: tuple[Feature, ...], root: Path, extra: dict | None = None) -> PairRun:
    """The features' config in a scratch folder of `root`, `extra` keys last (bench/compose_many.py's
    --set), with its world size and one-process reference."""
    name = "+".join(f.name for f in features)
    work = root / name
    work.mkdir(parents=True, exist_ok=True)
    (work / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in CHATS * 16))
    overrides = {**feature_overrides(features, work), **(extra or {}), "run.dir": str(work / "runs"),
                 "data.cache_dir": str(root / "data-cache"),
                 "parallel.collective_timeout_s": 120.0}  # a rank left waiting fails, not hangs
    world = world_of(overrides, features)
    reference = reference_overrides(overrides, world)
    reference["run.dir"] = str(root / "reference-runs")
    if overrides.get("parallel.strategy") == "auto":
        reference.update(_planned_batches(overrides, world))
    key = json.dumps({k: v for k, v in reference.items() if k != "data.source"}, sort_keys=True) + str(world)
    return PairRun(name, overrides, world, reference, key)


def _planned_batches(overrides: dict[str, Any], world: int) -> dict[str, int]:
    """parallel.strategy = 'auto' keeps the global batch but may cut it into other micro-batches
    (e.g. 4 x 1 for 2 x 2), and a loss that is a mean per micro-batch (MoE's balancing loss, the
    SFT formats' mean over the kept targets) depends on the cut: the reference takes the plan's,
    as decided here the way rank 0 decides it (shardlm.train.resolve.decide, the same probe cache)."""
    import torch

    from shardlm.train.resolve import decide

    cfg = decide(load_config(overrides=overrides), world, torch.device("cpu"))
    par = cfg.parallel
    return {"train.micro_batch": cfg.train.micro_batch,
            "train.grad_accum": cfg.train.grad_accum * world // (par.tp * par.cp * par.pp)}


def verdict(pair: PairRun, ranks: list[dict], reference: dict) -> tuple[str, str]:
    if any(r["saved_exactly"] is False for r in ranks):
        return "mismatch", f"the asynchronous checkpoint of step {SAVE_AFTER} differs from that step's state"
    why = compare(ranks[0], reference, TOLERANCE[precision_of(pair.overrides)])
    return ("mismatch", why) if why else ("matched", f"{pair.world} ranks")


def run_pair(a: Feature, b: Feature, root: Path, references: dict) -> tuple[str, str]:
    """('matched' | 'mismatch' | 'failed', detail) for one accepted pair, in processes of its own
    (or (ELSEWHERE, the test) for a pair it cannot run)."""
    if checked_elsewhere((a, b)):
        return _elsewhere((a, b))
    try:
        pair = prepare((a, b), root)
    except Exception as e:
        return "failed", _last_line(e)
    if pair.world > MAX_RANKS:
        return "failed", f"needs {pair.world} ranks (> {MAX_RANKS})"
    try:
        if pair.key not in references:
            references[pair.key] = _reference(pair.reference, pair.world, root)
        ranks = run_ranks(train_steps, pair.world, root / pair.name, pair.overrides, STEPS, SAVE_AFTER,
                          timeout=900)
    except Exception as e:  # the matrix records it and goes on
        return "failed", _last_line(e)
    return verdict(pair, ranks, references[pair.key])


def train_many(rank: int, world_size: int, cases: list[tuple[str, dict]], steps: int,
               save_after: int) -> dict[str, Any]:
    """Several pairs in one set of processes (torch and shardlm imported once), one after the
    other; at the first failure the rest are left (a rank may have been left mid-collective:
    the caller runs them in fresh processes)."""
    out: dict[str, Any] = {}
    for name, overrides in cases:
        try:
            out[name] = train_steps(rank, world_size, overrides, steps, save_after)
        except Exception:
            out[name] = traceback.format_exc()
            break
    return out


def run_batch(chosen: list[tuple[Feature, Feature]], root: Path, references: dict,
              report) -> None:
    """Every pair of `chosen`, pairs of one world size together in one spawn (chunks of
    BATCH); `report(a, b, outcome)` for each. A pair that failed in a batch, and those after
    it, run again alone (run_pair): a failure is recorded only from a pair's own processes."""
    for a, b in [(a, b) for a, b in chosen if checked_elsewhere((a, b))]:
        report(a, b, _elsewhere((a, b)))
    pairs = {}
    for a, b in [(a, b) for a, b in chosen if not checked_elsewhere((a, b))]:
        try:
            pairs[pair_name(a, b)] = (a, b, prepare((a, b), root))
        except Exception as e:  # e.g. `auto` cannot plan the layout: recorded, the others go on
            report(a, b, ("failed", _last_line(e)))
    by_world: dict[int, list[PairRun]] = {}
    for a, b, pair in pairs.values():
        if pair.world > MAX_RANKS:
            report(a, b, ("failed", f"needs {pair.world} ranks (> {MAX_RANKS})"))
        else:
            by_world.setdefault(pair.world, []).append(pair)
    for world, group in sorted(by_world.items()):
        for start in range(0, len(group), BATCH):
            chunk = group[start:start + BATCH]
            todo = {p.key: p.reference for p in chunk if p.key not in references}
            results: list[dict] = []
            try:
                if todo:
                    made = run_ranks(_reference_many, 1, root, list(todo.items()), world, timeout=3600)[0]
                    references.update({k: v for k, v in made.items() if isinstance(v, dict)})
                results = run_ranks(train_many, world, root, [(p.name, p.overrides) for p in chunk],
                                    STEPS, SAVE_AFTER, timeout=3600)
            except Exception as e:  # a rank died: what it finished is lost, run the chunk alone
                print(f"batch of {len(chunk)} on {world} ranks: {_last_line(e)}", file=sys.stderr)
            for pair in chunk:
                a, b, _ = pairs[pair.name]
                ranks = [r.get(pair.name) for r in results]
                if ranks and all(isinstance(r, dict) for r in ranks) and pair.key in references:
                    report(a, b, verdict(pair, ranks, references[pair.key]))
                else:
                    report(a, b, run_pair(a, b, root, references))


def _reference_many(rank: int, world_size: int, cases: list[tuple[str, dict]], world: int) -> dict:
    import torch

    os.environ["LOCAL_WORLD_SIZE"] = str(world)  # init_runtime sets threads from it
    torch.set_num_threads(max(1, cpu_cores() // world))
    return train_many(rank, world_size, cases, STEPS, SAVE_AFTER)


def _reference(overrides: dict, world: int, root: Path) -> dict:
    """The one-process run, spawned alone (its own threads: one rank's share of the cores, as
    each of the `world` ranks has, so CPU kernels split their reductions the same way)."""
    overrides = {**overrides, "run.dir": str(root / "reference-runs")}
    out = run_ranks(_reference_many, 1, root, [("reference", overrides)], world, timeout=900)[0]["reference"]
    if isinstance(out, str):  # train_many's traceback
        raise RuntimeError(out)
    return out


def _last_line(e: Exception) -> str:
    """The exception line of a rank's traceback (`module.SomeError: what`), else the last line."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    raised = [ln for ln in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Unsupported|Failure)\b", ln)]
    return (raised[-1] if raised else lines[-1] if lines else type(e).__name__)[:300]


def choose(names: str, rotate: int, seed: int, frontier: bool = False) -> list[tuple[Feature, Feature]]:
    everything = pairs(frontier)
    if names:
        chosen = []
        for text in names.split(","):
            a, plus, b = text.strip().partition("+")
            if not plus or a not in BY_NAME or b not in BY_NAME:
                raise SystemExit(f"--pairs: {text!r} is not a+b of features {', '.join(BY_NAME)}")
            chosen.append((BY_NAME[a], BY_NAME[b]))
        return chosen
    if rotate:
        return sorted(random.Random(seed).sample(everything, min(rotate, len(everything))),
                      key=everything.index)
    return everything


def markdown(results: dict[tuple[str, str], tuple[str, str]], ran: bool) -> str:
    """The upper triangle: A = accepted (and, with --run, M = matched one process, X = mismatch,
    F = failed at run time, T = checked by a test of its own: Feature.elsewhere), R<n> = refused
    by the n-th rule listed below the table."""
    rules = sorted({d for s, d in results.values() if s == "refused"})
    code = {"accepted": "A", "matched": "M", "mismatch": "X", "failed": "F", "exclusive": "—", ELSEWHERE: "T"}
    named = {n for pair in results for n in pair}
    features = [f for f in FEATURES + FRONTIER if f in FEATURES or f.name in named]

    def cell(a: Feature, b: Feature) -> str:
        status, detail = results.get((a.name, b.name), results.get((b.name, a.name), ("", "")))
        return f"R{rules.index(detail) + 1}" if status == "refused" else code.get(status, "")

    rows = [[a.name, *(cell(a, b) if j > i else "" for j, b in enumerate(features))] for i, a in enumerate(features)]
    counts = {s: sum(1 for v in results.values() if v[0] == s)
              for s in ("accepted", "matched", ELSEWHERE, "mismatch", "failed", "refused", "exclusive")}
    lines = [table(["", *(f.name for f in features)], rows), "",
             "Refusing rules: " + "; ".join(f"R{i + 1} {r}" for i, r in enumerate(rules)), "",
             f"{len(results)} pairs: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n)]
    problems = [f"- {a}+{b}: {s}: {d}" for (a, b), (s, d) in results.items() if s in ("mismatch", "failed")]
    return "\n".join(lines + ([""] + problems if problems else []))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", action="store_true", help="train each accepted pair against one process")
    parser.add_argument("--pairs", default="", help="only these pairs, e.g. tp+lora,cp+fp16")
    parser.add_argument("--rotate", type=int, default=0, help="a fixed random subset of this many pairs")
    parser.add_argument("--seed", type=int, default=0, help="which subset --rotate picks")
    parser.add_argument("--frontier", action="store_true",
                        help="the pairs with a FRONTIER feature (fp8_ag, async_tp, zbv, dualpipev, muon, "
                             "ulysses, local_sgd, ft) instead")
    parser.add_argument("--json", default="", help="also write the results to this file")
    parser.add_argument("--batch", action="store_true", help=f"run the pairs of one world size together, "
                        f"{BATCH} per spawn (faster; a pair that fails there runs again alone)")
    parser.add_argument("--results", default="", help="comma-separated --json files of earlier --run's: their "
                        "outcomes for the pairs validation accepts now, instead of running them (later files win)")
    args = parser.parse_args()
    chosen = choose(args.pairs, args.rotate, args.seed, args.frontier)
    results = {(a.name, b.name): validation(a, b) for a, b in chosen}

    def save() -> None:
        if args.json:
            Path(args.json).write_text(json.dumps({"+".join(k): v for k, v in results.items()}, indent=1))

    accepted = {pair for pair, (status, _) in results.items() if status == "accepted"}
    for path in filter(None, args.results.split(",")):
        for name, (status, detail) in json.loads(Path(path).read_text()).items():
            pair = tuple(name.split("+"))
            if pair in accepted and status in ("matched", "mismatch", "failed", ELSEWHERE):
                results[pair] = (status, detail)
    if args.run:
        root = Path(tempfile.mkdtemp(prefix="shardlm-compose-"))
        os.environ.setdefault("SHARDLM_CACHE", str(root / "cache"))
        references: dict = {}
        started = time.perf_counter()

        def report(a: Feature, b: Feature, outcome: tuple[str, str]) -> None:
            results[(a.name, b.name)] = outcome
            print(f"{pair_name(a, b)}: {outcome} ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
            save()

        todo = [(a, b) for a, b in chosen if results[(a.name, b.name)][0] == "accepted"]
        if args.batch:
            run_batch(todo, root, references, report)
        for a, b in todo if not args.batch else ():
            report(a, b, run_pair(a, b, root, references))
    print(f"Composition matrix, {time.strftime('%Y-%m-%d')}, {platform.machine()} "
          f"{os.cpu_count()} CPUs; command: python bench/compose.py {' '.join(sys.argv[1:])}\n")
    print(markdown(results, args.run))
    save()


if __name__ == "__main__":
    main()
