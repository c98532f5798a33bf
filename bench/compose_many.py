"""More than two features of the composition matrix at once, against one process: bench/compose.py's
features, base config, rank layout, reference and comparison, for a list of any length. Default:
issue 28's tp 2 x pp 2 x ZeRO-3 (dp_shard 2) x full recomputation on 8 gloo ranks.

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

from compose import MAX_RANKS, SAVE_AFTER, _reference, prepare, train_steps, verdict
from compose_matrix import BY_NAME, STEPS, Exclusive

from shardlm.config.load import load_config
from shardlm.launch.spawn import run_ranks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--features", default="tp,pp,zero3,recompute_full")
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE, after the features")
    args = parser.parse_args()
    names = [n for n in args.features.split(",") if n]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise SystemExit(f"unknown features {unknown}: choose from {', '.join(BY_NAME)}")
    extra = dict(kv.split("=", 1) for kv in args.set)
    with tempfile.TemporaryDirectory(prefix="compose-many-") as tmp:
        try:
            case = prepare(tuple(BY_NAME[n] for n in names), Path(tmp), extra)
        except Exclusive as e:
            raise SystemExit(str(e)) from None
        load_config(overrides=case.overrides).validate()  # a refused combination stops here, unspawned
        if case.world > MAX_RANKS:
            raise SystemExit(f"{case.name} needs {case.world} ranks (> {MAX_RANKS})")
        start = time.perf_counter()
        reference = _reference(case.reference, case.world, Path(tmp))
        ranks = run_ranks(train_steps, case.world, Path(tmp), case.overrides, STEPS, SAVE_AFTER, timeout=900)
        status, why = verdict(case, ranks, reference)
    print(json.dumps({"features": names, "set": extra, "ranks": case.world, "steps": STEPS,
                      "losses": ranks[0]["losses"], "reference_losses": reference["losses"],
                      "norms": ranks[0]["norms"], "reference_norms": reference["norms"],
                      "saved_exactly": [r["saved_exactly"] for r in ranks],
                      "verdict": "matched" if status == "matched" else why,
                      "seconds": round(time.perf_counter() - start)}, indent=1))
    sys.exit(0 if status == "matched" else 1)


if __name__ == "__main__":
    main()
