"""Three or more of bench/compose.py's features together, against one process, with the matrix's
own pieces (its base config, rank layout, one-process reference and per-step figures).

    nice PYTHONPATH=src python bench/compose_triple.py ep,compile --set precision.compute=bf16

prints every step's loss and gradient norm beside one process's and their relative difference
(no verdict: a bf16 run has no tolerance in the matrix; the matrix's pairs keep theirs).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))  # spawned ranks import the matrix's rank function by name
_spec = importlib.util.spec_from_file_location("compose", BENCH / "compose.py")
compose = importlib.util.module_from_spec(_spec)
sys.modules["compose"] = compose
_spec.loader.exec_module(compose)


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main() -> None:
    from shardlm.launch.spawn import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("features", help="comma-separated feature names of bench/compose.py, e.g. ep,compile")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an extra config override (e.g. precision.compute=bf16), repeatable")
    args = parser.parse_args()
    features = [compose.BY_NAME[name] for name in args.features.split(",")]
    root = Path(tempfile.mkdtemp(prefix="compose-triple-"))
    keys = dict(compose.BASE)
    for feature in features:
        keys.update({k: v.replace("{work}", str(root)) if isinstance(v, str) else v for k, v in feature.keys.items()})
    keys.update({k: _value(v) for k, v in (item.split("=", 1) for item in args.set)})
    compose.write_chat(root)
    keys.update({"run.dir": str(root / "runs"), "data.cache_dir": str(root / "data-cache"),
                 "parallel.collective_timeout_s": 120.0})
    world = compose.world_of(keys, tuple(features))
    reference = compose.reference_overrides(keys, world)
    one = compose._reference(reference, world, root)
    ranks = run_ranks(compose.train_steps, world, root, keys, compose.STEPS, compose.SAVE_AFTER, timeout=900)
    print(f"{'+'.join(f.name for f in features)} {' '.join(args.set)}: {world} ranks against one process")
    for what, label in (("losses", "loss"), ("norms", "gradient norm")):
        for step, (got, ref) in enumerate(zip(ranks[0][what], one[what])):
            print(f"  step {step + 1} {label}: {got:.6f} vs {ref:.6f}  relative {abs(got - ref) / max(abs(ref), 1e-12):.1e}")


if __name__ == "__main__":
    main()
