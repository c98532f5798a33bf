"""Re-predict a saved bench_planner run of another machine whose probe cache was not kept, by the
terms issue 41 part 3 added or changed (docs/planner.md, "Validation"): saved prediction + what
each new term adds, from the figures each saved row records (its `calibration` line and
`step_parts`): the in-situ factor never under 1, the optimizer's state read cold, the nvme
tier's first chunk at the lone-request rate, stages 2-3's gradient shards as fresh pages.
bench_planner.py --predict-from re-predicts a run in full where its cache is.

    PYTHONPATH=src python bench/planner_delta.py docs/planner/quiet-2026-11-27-v7-gpt-mini.json ...
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from shardlm.config.schema import ZeroConfig
from shardlm.config.load import load_config
from shardlm.hardware.catalog import CALIBRATION, MIB, interpolate
from shardlm.hardware.disk_probe import stream_rate
from shardlm.planner.memory import nvme_first_chunk
from shardlm.planner.workload import stage_params, zero_ranks

CORES = 2
"""The saved runs' machine: 2 vCPUs (bench_planner's table)."""


def _row_setup(row: dict):
    """(workload, strategy) of a saved case, as bench_planner.predict_case builds its config."""
    import argparse

    sys.path.insert(0, str(Path(__file__).parent))
    import bench_planner as bp
    from shardlm.hardware.catalog import LINKS, Cluster, Device, Node
    from shardlm.planner.search import config_strategy

    args = bp.parse_args([])
    settings = argparse.Namespace(**{**vars(args), **{k: row[k] for k in ("preset", "seq", "micro_batch",
                                                                            "precision", "steps") if k in row}})
    axes = "" if row["axes"] == "dp" else row["axes"]
    cfg = load_config(overrides=bp.overrides_for(settings, row["ranks"], row["stage"], row["ac"], row["offload"],
                                                 axes, "unused")).validate()
    n = row["ranks"]  # a stand-in CPU: the layout and dtypes only (nothing here is timed)
    cpu = Device("cpu (stand-in)", "cpu", 8e9, {"fp32": 1e11}, 1e10, 1.0, "stand-in")
    node = Node(n, LINKS["eth-10"], LINKS["eth-10"], 1, LINKS["eth-10"], 16e9, 1e10, 1e9, "stand-in")
    return config_strategy(cfg, Cluster(1, n, cpu, node, CALIBRATION["cpu"]))


def _figures(calibration: str) -> dict:
    """What a row's calibration line records."""
    out = {}
    m = re.search(r"took ([\d,.]+) ms, its parts timed apart ([\d,.]+) ms", calibration)
    if m:
        out["pass"], out["parts"] = (float(x.replace(",", "")) for x in m.groups())
    adamw = re.findall(r"([\d.]+) ns/param at ([\d.]+) M", calibration)
    out["adamw"] = tuple((float(size) * 2**20, float(ns) * 1e-9) for ns, size in adamw)
    out["fresh"] = float(re.search(r"fresh pages ([\d.]+) GB/s", calibration).group(1)) * 1e9
    return out


def _psi_opt(s, sp) -> float:
    lay = s.layout
    n_opt = zero_ranks(lay) if s.zero_stage else 1
    return sp.dense / n_opt + sp.experts / (max(1, zero_ranks(lay) // lay.ep) if s.zero_stage else 1)


def deltas(rows: list[dict]) -> list[dict[str, float]]:
    """Per saved row, the seconds each new term adds to its saved prediction."""
    setups = [_row_setup(r) for r in rows]
    # the disk: each nvme row's optimizer part less its AdamW and norm is 24 B x psi_opt / (B_n / n)
    disk = {}
    for row, (w, s) in zip(rows, setups):
        if row["offload"] == "nvme":
            f, sp = _figures(row["calibration"]), stage_params(w, s.layout)[0]
            psi, n = _psi_opt(s, sp), row["ranks"]
            share = min(1.0, CORES / n)
            adamw = psi * interpolate(f["adamw"], psi) / share
            norm = 4 * psi / 2.0e10  # the gradient norm: ~1 ms, read at ~20 GB/s (the rows' 8-64 MiB rates)
            disk[n] = 24 * psi * n / (row["step_parts"]["optimizer step"] - adamw - norm)
    out = []
    for row, (w, s) in zip(rows, setups):
        f, n = _figures(row["calibration"]), row["ranks"]
        share = min(1.0, CORES / n)
        sp = max(stage_params(w, s.layout), key=lambda x: x.dense + x.experts)
        parts, d = row["step_parts"], {}
        if "pass" in f and f["pass"] < f["parts"]:
            d["in situ >= 1"] = ((parts.get("compute", 0) + parts.get("memory-bound work", 0))
                                 * (f["parts"] / f["pass"] - 1))
        psi = _psi_opt(s, sp)
        d["cold AdamW"] = psi * max(0.0, max(f["adamw"])[1] - interpolate(f["adamw"], psi)) / share
        if row["offload"] == "nvme" and disk:
            streams = {k: {"bytes_per_s": v} for k, v in disk.items()}
            rates = {k: v["bytes_per_s"] for k, v in streams.items()}
            k, first_n = n / 2, min(rates)
            lone = rates[first_n] * k / first_n if k < first_n else stream_rate(rates, k)
            first = nvme_first_chunk(sp, zero_ranks(s.layout), ZeroConfig().nvme_chunk_mb * MIB, 4)
            d["nvme lone chunk"] = 24 * first * (n / lone - n / stream_rate(rates, n))
        if s.zero_stage >= 2:
            g, N = s.dtypes.grad_bytes, zero_ranks(s.layout)
            units = [sp.root_unit] + [sp.block_unit] * sp.layers
            shards = sum(g * u / N for u in units if g * u / N >= CALIBRATION["cpu"].mmap_threshold) * (sp.dense + sp.experts) / sum(units)
            d["gradient shards fresh"] = shards / (f["fresh"] * share)
        out.append(d)
    return out


def main(paths: list[str]) -> None:
    for path in paths:
        rows = json.loads(Path(path).read_text())
        ok_before = ok_after = 0
        print(f"\n{path}\n\n| ranks | axes | stage | AC | offload | step s measured | predicted saved | err | "
              f"predicted now | err | added |\n|---|---|---|---|---|---|---|---|---|---|---|")
        for row, d in zip(rows, deltas(rows)):
            m, p0 = row["step_measured"], row["step_predicted"]
            p1 = p0 + sum(d.values())
            ok_before += abs(p0 / m - 1) <= 0.2
            ok_after += abs(p1 / m - 1) <= 0.2
            added = ", ".join(f"{k} {v * 1e3:+.1f} ms" for k, v in d.items() if abs(v) >= 5e-5) or "–"
            print(f"| {row['ranks']} | {row['axes']} | {row['stage']} | {row['ac']} | {row['offload']} | {m:.3f} | "
                  f"{p0:.3f} | {p0 / m - 1:+.1%} | {p1:.3f} | {p1 / m - 1:+.1%} | {added} |")
        print(f"\nsteps within ±20%: {ok_before}/{len(rows)} saved, {ok_after}/{len(rows)} now")


if __name__ == "__main__":
    main(sys.argv[1:])
