"""More than two features of the composition matrix at once, against one process: bench/compose.py's
features, base config, rank layout, reference and comparison, for a list of any length.

Issue 28's case, the default: tp 2 x pp 2 x ZeRO-3 (dp_shard 2) x full recomputation on 8 gloo
ranks, 4 steps of llama-tiny in fp32, every step's loss and gradient norm within 1e-4 relative of
one process with the same global batch (the data-parallel ranks' micro-batches accumulated).

Reproduce:  nice PYTHONPATH=src python bench/compose_many.py
            nice PYTHONPATH=src python bench/compose_many.py --features tp,pp,zero3,recompute_full \\
                --set parallel.pp_schedule=zb
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from compose import (
    BASE,
    BY_NAME,
    MAX_RANKS,
    SAVE_AFTER,
    STEPS,
    TOLERANCE,
    _planned_batches,
    _reference,
    compare,
    precision_of,
    reference_overrides,
    train_steps,
    world_of,
    write_chat,
)

from shardlm.config.load import load_config
from shardlm.launch.spawn import run_ranks


def overrides_of(names: list[str], work: Path, extra: dict[str, str]) -> dict:
    """The base config with every named feature on (ZeRO stages: the largest), then `extra`."""
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise SystemExit(f"unknown features {unknown}: choose from {', '.join(BY_NAME)}")
    out = dict(BASE)
    for name in names:
        for key, value in BY_NAME[name].keys.items():
            value = value.replace("{work}", str(work)) if isinstance(value, str) else value
            out[key] = max(out.get(key, 0), value) if key == "parallel.zero_stage" else value
    out.update(extra)
    out["run.dir"], out["data.cache_dir"] = str(work / "runs"), str(work / "data-cache")
    out["parallel.collective_timeout_s"] = 120.0
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--features", default="tp,pp,zero3,recompute_full")
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE, after the features")
    args = parser.parse_args()
    names = [n for n in args.features.split(",") if n]
    extra = dict(kv.split("=", 1) for kv in args.set)
    with tempfile.TemporaryDirectory(prefix="compose-many-") as tmp:
        work = Path(tmp)
        write_chat(work)
        overrides = overrides_of(names, work, extra)
        load_config(overrides=overrides).validate()  # a refused combination stops here, unspawned
        world = world_of(overrides, tuple(BY_NAME[n] for n in names))
        if world > MAX_RANKS:
            raise SystemExit(f"{'+'.join(names)} needs {world} ranks (> {MAX_RANKS})")
        start = time.perf_counter()
        reference = reference_overrides(overrides, world)
        if overrides.get("parallel.strategy") == "auto":  # the plan's micro-batches (compose.prepare)
            reference.update(_planned_batches(overrides, world))
        reference = _reference(reference, world, work)
        ranks = run_ranks(train_steps, world, work, overrides, STEPS, SAVE_AFTER, timeout=900)
        why = compare(ranks[0], reference, TOLERANCE[precision_of(overrides)])
        if any(r["saved_exactly"] is False for r in ranks):  # checkpoint.async: read back
            why = f"the asynchronous checkpoint of step {SAVE_AFTER} differs from that step's state"
    print(json.dumps({"features": names, "set": extra, "ranks": world, "steps": STEPS,
                      "losses": ranks[0]["losses"], "reference_losses": reference["losses"],
                      "norms": ranks[0]["norms"], "reference_norms": reference["norms"],
                      "saved_exactly": [r["saved_exactly"] for r in ranks], "verdict": why or "matched", "seconds": round(time.perf_counter() - start)}, indent=1))
    sys.exit(1 if why else 0)


if __name__ == "__main__":
    main()
