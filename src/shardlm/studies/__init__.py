"""`shardlm study NAME`: studies that answer "which strategy, for my model, on my cluster".

Each study (specs.py: a declarative spec) is measured on this machine's ranks at sizes that fit
here, every point one `shardlm train` run (points.py), and predicted by the planner for a named
cluster at the real sizes (predict.py); studies.py puts both side by side, report.py writes
report.md, PNG plots and the raw JSONL into one directory. Finished points are kept in
points.jsonl: a rerun skips them. docs/studies/README.md explains each study.
"""

from __future__ import annotations

import argparse
import importlib.util
import shlex
from dataclasses import replace
from pathlib import Path

from shardlm.errors import ConfigError
from shardlm.studies.points import PointStore, Progress, Runner, subprocess_runner
from shardlm.studies.specs import FULL, NAMES, QUICK


def run_study(name: str, out: Path, quick: bool = False, gpus: str | None = None, ranks: int = 2,
              cap_mib: float | None = None, runner: Runner = subprocess_runner,
              reproduce: str = "") -> Path:
    """Measure, predict and write study `name` into `out`; returns report.md's path."""
    from shardlm.hardware.catalog import parse_cluster
    from shardlm.studies.report import write
    from shardlm.studies.studies import RUN, Context

    if name not in NAMES:
        raise ConfigError(f"unknown study {name!r}: choose one of {', '.join(NAMES)}")
    if ranks < 1:
        raise ConfigError(f"--ranks {ranks} must be >= 1")
    if cap_mib is not None and cap_mib <= 0:
        raise ConfigError(f"--cap-mib {cap_mib:g} must be > 0")
    if importlib.util.find_spec("matplotlib") is None:  # before any point is measured
        raise ConfigError("a study draws its plots with matplotlib, which is not installed: "
                          "pip install 'shardlm[plots]'")
    study = (QUICK if quick else FULL)[name]
    if ranks != 2:  # the measured ranks follow --ranks (a sweep's up to it)
        chosen = tuple(r for r in study.measured.ranks if r <= ranks) or (ranks,)
        study = replace(study, measured=replace(study.measured, ranks=chosen))
    if gpus is not None and gpus.strip().lower().endswith("cpu"):  # before the CPU probe runs
        raise ConfigError(f"--gpus {gpus}: a study predicts a GPU/TPU cluster (the CPU half is "
                          f"measured); give e.g. 8xV100-16GB or 2x8xA100-80GB")
    cluster = parse_cluster(gpus or study.predicted.cluster)
    progress = Progress(f"study {name}")
    store = PointStore(out, runner, progress)
    ctx = Context(study, store, cluster, ranks, study.cap_mib if cap_mib is None else cap_mib)
    try:
        result = RUN[name](ctx)
    finally:
        progress.close()
    return write(out, result, reproduce or f"shardlm study {name}" + (" --quick" if quick else ""))


def study_args(sub) -> None:
    """`shardlm study`'s options (cli/main.py adds the subcommand)."""
    p = sub.add_parser(
        "study", help="run a study here and predict it on a cluster: report.md, plots, raw JSONL",
        description="Measure a study on this machine's ranks (each point a `shardlm train` run) and "
                    "predict it with the planner on a named cluster at full size; write report.md "
                    "(measured and predicted side by side, the command of every point), PNG plots "
                    "(pip install 'shardlm[plots]') and the raw JSONL into --out. Finished points "
                    "are kept (points.jsonl): rerunning resumes. See docs/studies/README.md.")
    p.add_argument("name", choices=NAMES, metavar="NAME", help=f"one of: {', '.join(NAMES)}")
    p.add_argument("--gpus", metavar="CLUSTER",
                   help="the cluster to predict (8xV100-16GB, 2x8xA100-80GB; default: the study's)")
    p.add_argument("--quick", action="store_true", help="a seconds-long version (tiny models, few points)")
    p.add_argument("--out", metavar="DIR", help="output directory (default studies/NAME, or "
                                                "studies/NAME-quick with --quick)")
    p.add_argument("--ranks", type=int, default=2, metavar="N",
                   help="ranks to measure with here (default 2; a sweep measures up to N)")
    p.add_argument("--cap-mib", type=float, metavar="MIB",
                   help="max-batch, offload-rescue: the per-rank memory cap (default: the study's)")


def cmd_study(args: argparse.Namespace) -> int:
    out = Path(args.out or f"studies/{args.name}" + ("-quick" if args.quick else ""))
    words = ["shardlm", "study", args.name] + (["--quick"] if args.quick else [])
    words += [w for flag, v in (("--gpus", args.gpus), ("--ranks", args.ranks if args.ranks != 2 else None),
                                ("--cap-mib", args.cap_mib), ("--out", args.out)) if v is not None
              for w in (flag, str(v))]
    path = run_study(args.name, out, args.quick, args.gpus, args.ranks, args.cap_mib,
                     reproduce=shlex.join(words))
    print(f"study {args.name}: {path} (plots and raw JSONL beside it)")
    return 0


__all__ = ["NAMES", "cmd_study", "run_study", "study_args"]
