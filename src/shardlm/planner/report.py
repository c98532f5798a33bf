"""Text tables for people and JSON for machines: `shardlm estimate` and `shardlm plan`."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from shardlm.config.model import ModelConfig
from shardlm.hardware.catalog import Cluster
from shardlm.config.presets import ALIASES, PRESETS, get_preset
from shardlm.launch.torchrun import torchrun_argv
from shardlm.planner.cost import (CostBasis, basis_json, cost_json, duration, money, number, rank, tokens,
                                  training_cost)
from shardlm.planner.memory import Item, Memory, stage_memories
from shardlm.planner.search import Plan, SearchResult
from shardlm.planner.explain import describe_strategy, explain, step_parts
from shardlm.planner.timing import Timing
from shardlm.planner.pipeline import pp_in_flight
from shardlm.planner.workload import (Strategy, Workload, describe_dtypes, pipeline_layers, shape_of,
                                      stage_params)

GB = 1e9


def describe_model(w: Workload) -> str:
    m = w.model
    psi = shape_of(w).total
    heads = f"{m.n_heads}" + (f"/{m.n_kv_heads} kv" if m.n_kv_heads and m.n_kv_heads != m.n_heads else "")
    experts = f", {w.experts} experts top-{w.top_k}" if w.experts else ""
    return (f"{m.preset} ({psi / 1e9:.3f}e9 params: {m.n_layers} layers, d_model {m.d_model}, "
            f"{heads} heads, vocab {m.vocab_size}, {m.mlp}/{m.norm}/{m.position}{experts})")


def describe_run(w: Workload, s: Strategy) -> str:
    lay = s.layout
    dims = [f"dp_replicate {lay.dp_replicate} x dp_shard {lay.dp_shard}"]
    sp = " (sequence parallel)" if s.sequence_parallel else ""
    dims += [f"tp {lay.tp}{sp}"] if lay.tp > 1 else []
    dims += [f"cp {lay.cp}"] if lay.cp > 1 else []
    if lay.pp > 1:
        split = "/".join(map(str, pipeline_layers(w, s)))
        dims.append(f"pp {lay.pp} ({s.pp_schedule}" + (f", {s.pp_virtual} chunks per rank" if s.pp_virtual > 1
                                                      else "") + f", blocks {split})")
    dims += [f"ep {lay.ep}"] if lay.ep > 1 else []
    offload = "".join(f", {what} on {tier}" for what, tier in
                      (("optimizer", s.offload_optimizer), ("params", s.offload_params)) if tier != "none")
    per_rank = f" ({w.seq_len // lay.cp} tokens per rank)" if lay.cp > 1 else ""
    return (f"ZeRO stage {s.zero_stage} over {', '.join(dims)}; micro-batch {s.micro_batch} x "
            f"seq {w.seq_len}{per_rank}, grad-accum {s.grad_accum} ({w.global_batch} sequences/step)"
            f"{offload}\n"
            f"  {describe_dtypes(s.dtypes, s.local)}; activation checkpoint: {s.recompute}")


def _rows(items: list[Item], depth: int = 0) -> list[str]:
    out = []
    for item in items:
        name = "  " * depth + item.name
        out.append(f"  {name:<30s} {item.bytes / GB:9.3f}  {item.formula}")
        out += _rows(item.parts, depth + 1)
    return out


def render_estimate(w: Workload, s: Strategy, cluster: Cluster, memory: Memory, timing: Timing,
                    suggestions: list[Plan], basis: CostBasis | None = None) -> str:
    lines = [f"model:   {describe_model(w)}",
             f"devices: {cluster.describe()}",
             f"run:     {describe_run(w, s)}",
             "",
             f"per-rank memory, {memory.stage} (GB = 1e9 bytes; Ψ_r = {memory.params_on_rank:,.0f} "
             f"parameters on this rank before ZeRO sharding, N = ranks sharding them)",
             f"  {'category':<30s} {'GB':>9s}  formula"]
    lines += _rows(memory.items)
    lines.append(f"  {'-' * 30} {'-' * 9}")
    lines.append(f"  {'peak, training step':<30s} {memory.train_peak / GB:9.3f}")
    if memory.step_peak > memory.train_peak:
        lines.append(f"  {'peak, optimizer step':<30s} {memory.step_peak / GB:9.3f}")
    if memory.setup_peak > memory.train_peak:
        lines.append(f"  {'peak, setup':<30s} {memory.setup_peak / GB:9.3f}")
    lines.append(f"  {'device memory':<30s} {memory.capacity / GB:9.3f}  {cluster.device.name}")
    if memory.host:
        lines.append(f"  host memory per node (offload): {memory.host_per_node / GB:.1f} of "
                     f"{memory.host_capacity / GB:.0f} GB usable "
                     f"(90% of {cluster.node.host_memory / GB:.0f})")
        lines += ["  " + line for line in _rows(memory.host)]
    if s.layout.pp > 1:
        lines += _stage_rows(w, s, cluster)
    lines.append("")
    lines.append(_verdict(memory))
    for note in memory.notes:
        lines.append(f"  note: {note}")
    if suggestions:
        lines.append("  fits instead (same ranks, same global batch):")
        for plan in suggestions:
            lines.append(f"    {describe_strategy(plan.strategy)}: peak {plan.memory.peak / GB:.1f} GB, "
                         f"{plan.timing.tokens_per_s:,.0f} tokens/s")
    lines += ["", _time_line(timing), f"  compute rate from {timing.calibration}"]
    if s.layout.pp > 1:
        lines.append(f"  (the pipeline paced by its heaviest stage; below, the {timing.stage}'s "
                     f"communication, the stage that finishes last after the pipeline drains)")
    for comm in timing.comms:
        latency = f" ({comm.latency * 1e3:.1f} ms of it latency)" if comm.latency else ""
        lines.append(f"  {comm.name:<34s} {comm.bytes / GB:8.3f} GB over {comm.group}: "
                     f"{comm.seconds * 1e3:.1f} ms{latency}, {comm.exposed * 1e3:.1f} ms exposed")
        for term in comm.terms:
            lines.append(f"      {term.name}: {term.seconds * 1e3:.1f} ms, {term.exposed * 1e3:.1f} ms exposed")
    for work in timing.work:  # memory-bound terms and the optimizer (planner/memory_bound.py)
        lines.append(f"  {work.name:<34s} {work.seconds * 1e3:8.1f} ms: {work.formula}")
    if basis is not None:
        lines += ["", *_cost_lines(training_cost(timing.tokens_per_s, cluster.world_size, basis), basis,
                                   cluster.world_size)]
    return "\n".join(lines)


def _cost_lines(c, basis: CostBasis, devices: int) -> list[str]:
    return [f"to train {tokens(basis.tokens)} tokens: {duration(c.seconds)} on {devices} "
            f"devices ({number(c.device_hours)} device-hours), cost {money(c.usd)}, energy "
            f"{number(c.kwh)} kWh, CO2 {number(c.co2_kg)} kg",
            *(f"  {line}" for line in basis.describe())]


def _stage_rows(w: Workload, s: Strategy, cluster: Cluster) -> list[str]:
    """Every pipeline stage's peak, next to its blocks and micro-batches held (the table above
    is the worst stage's)."""
    lines = ["", f"  per pipeline stage ({s.pp_schedule}, {s.grad_accum} micro-batches):",
             f"  {'stage':<14s} {'blocks':>6s} {'in flight':>9s} {'activations GB':>14s} {'peak GB':>8s}"]
    split = pipeline_layers(w, s)
    for sp, m in zip(stage_params(w, s.layout, split), stage_memories(w, s, cluster)):
        lines.append(f"  {sp.index:<3d}{sp.name:<11s} {sp.layers:>6d} {pp_in_flight(s, sp.index, split):>9.3g} "
                     f"{m.activations / GB:>14.3f} {m.peak / GB:>8.3f}")
    return lines


def _verdict(memory: Memory) -> str:
    if memory.fits:
        return (f"fits: peak {memory.peak / GB:.2f} GB of {memory.capacity / GB:.2f} GB "
                f"({memory.capacity / memory.peak - 1:.0%} headroom)")
    if memory.peak > memory.capacity:
        return (f"DOES NOT FIT: peak {memory.peak / GB:.2f} GB > {memory.capacity / GB:.2f} GB "
                f"({(memory.peak - memory.capacity) / GB:.2f} GB over)")
    return (f"DOES NOT FIT: host memory {memory.host_per_node / GB:.0f} GB per node > "
            f"{memory.host_capacity / GB:.0f} GB usable")


def _time_line(t: Timing) -> str:
    parts = ", ".join(f"{k} {v:.3g} s" for k, v in step_parts(t).items() if v > 0)
    return (f"step: {t.step:.3g} s ({parts}); {t.tokens_per_s:,.0f} tokens/s, MFU {t.mfu:.1%} "
            f"(HFU {t.hfu:.1%}; {t.model_flops_per_token / 1e9:.3g} model GFLOP/token, PaLM 6N + "
            f"12·L·h·s; HFU adds recomputation)")


def render_plan(result: SearchResult, top: int, basis: CostBasis | None = None,
                rank_by: str = "speed") -> str:
    w = result.workload
    lines = [f"model:   {describe_model(w)}",
             f"devices: {result.cluster.describe()}",
             f"batch:   {w.global_batch} sequences x {w.seq_len} tokens per step; "
             f"{result.evaluated} candidates evaluated, {len(result.plans)} distinct ones fit",
             *([f"compute: {result.plans[0].timing.calibration}"] if result.plans else []),
             ""]
    if result.plans:
        priced = f" {'to train':>9s} {'cost':>10s} {'kWh':>10s} {'kg CO2':>10s}" if basis else ""
        lines.append(f"  {'#':>2s} {'tokens/s':>12s} {'MFU':>6s} {'HFU':>6s} {'peak GB':>8s} "
                     f"{'step s':>8s}{priced}  "
                     f"{'runs today':<10s} strategy")
        for i, plan in enumerate(result.plans[:top], 1):
            t = plan.timing
            priced = ""
            if basis:
                c = training_cost(t.tokens_per_s, result.cluster.world_size, basis)
                priced = (f" {duration(c.seconds):>9s} {money(c.usd):>10s} {number(c.kwh):>10s} "
                          f"{number(c.co2_kg):>10s}")
            lines.append(f"  {i:>2d} {t.tokens_per_s:>12,.0f} {t.mfu:>6.1%} {t.hfu:>6.1%} "
                         f"{plan.memory.peak / GB:>8.1f} {t.step:>8.3g}{priced}  "
                         f"{'yes' if plan.runtime_supported else 'no':<10s} "
                         f"{describe_strategy(plan.strategy)}")
        if basis:
            lines.append(f"  to train {tokens(basis.tokens)} tokens, ranked by {rank_by}")
            lines += [f"  {line}" for line in basis.describe()]
            if rank_by == "cost":
                lines.append("  (one cluster: every plan uses the same devices at the same price, so "
                             "the cheapest is the fastest; cost ranks differently across clusters)")
        lines.append("")
    lines += explain(result)
    if result.plans:
        lines += ["", "commands (each passes `shardlm train --dry-run`; add it to check one):"]
        for i, plan in enumerate(result.plans[:top], 1):
            command = train_command(plan, w, result.cluster)
            lines.append(f"  {i:>2d} {command}" if command else
                         f"  {i:>2d} not runnable yet: {plan.not_runnable} (config keys: "
                         f"{_flags(plan.overrides())})")
    return "\n".join(lines)


def _best_of_each(results: list[SearchResult], bases: list[CostBasis | None],
                  rank_by: str) -> list[tuple[SearchResult, CostBasis | None]]:
    """Each cluster's best plan (its search's first), clusters in `rank_by` order: by time to
    train and cost when priced (--tokens), else by tokens/s; clusters where nothing fits last."""
    fitting = [(r, b) for r, b in zip(results, bases) if r.plans]
    if all(b is not None for _, b in fitting):
        fitting = rank(fitting, [training_cost(r.plans[0].timing.tokens_per_s, r.cluster.world_size, b)
                                 for r, b in fitting], rank_by)
    else:
        fitting.sort(key=lambda rb: -rb[0].plans[0].timing.tokens_per_s)
    return fitting + [(r, b) for r, b in zip(results, bases) if not r.plans]


def render_clusters(results: list[SearchResult], bases: list[CostBasis | None], top: int,
                    rank_by: str = "speed") -> str:
    """Several clusters for one workload: the best plan of each side by side, then each
    cluster's own plan table."""
    w = results[0].workload
    priced = bases[0] is not None
    width = max(len(r.cluster.describe()) for r in results)
    lines = [f"model:   {describe_model(w)}",
             f"batch:   {w.global_batch} sequences x {w.seq_len} tokens per step",
             "", f"{len(results)} clusters, the best plan of each"
             + (f", ranked by {rank_by} to train {tokens(bases[0].tokens)} tokens:" if priced else
                ", fastest first:"),
             f"  {'cluster':<{width}s} {'tokens/s':>12s} {'MFU':>6s} {'peak GB':>8s}"
             + (f" {'to train':>9s} {'cost':>10s} {'kWh':>10s} {'kg CO2':>10s}" if priced else "")
             + "  strategy"]
    for result, basis in _best_of_each(results, bases, rank_by):
        name = result.cluster.describe()
        if not result.plans:
            lines.append(f"  {name:<{width}s} nothing fits")
            continue
        plan = result.plans[0]
        t = plan.timing
        cost = ""
        if basis is not None:
            c = training_cost(t.tokens_per_s, result.cluster.world_size, basis)
            cost = (f" {duration(c.seconds):>9s} {money(c.usd):>10s} {number(c.kwh):>10s} "
                    f"{number(c.co2_kg):>10s}")
        lines.append(f"  {name:<{width}s} {t.tokens_per_s:>12,.0f} {t.mfu:>6.1%} "
                     f"{plan.memory.peak / GB:>8.1f}{cost}  {describe_strategy(plan.strategy)}")
    for result, basis in zip(results, bases):
        lines += ["", "=" * 100, render_plan(result, top, basis, rank_by)]
    return "\n".join(lines)


def clusters_json(results: list[SearchResult], bases: list[CostBasis | None], top: int,
                  rank_by: str = "speed") -> str:
    """render_clusters as JSON: `ranking` (cluster names, best first) and each cluster's plan
    result as plan_result_json writes it."""
    ranking = [r.cluster.describe() for r, _ in _best_of_each(results, bases, rank_by)]
    return json.dumps({"ranking": ranking, "rank_by": rank_by,
                       "clusters": [json.loads(plan_result_json(r, top, b, rank_by))
                                    for r, b in zip(results, bases)]}, indent=1)


def _flags(overrides: dict[str, object]) -> str:
    return " ".join(f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in overrides.items())


def model_overrides(m: ModelConfig) -> dict[str, object]:
    """The [model] keys that make `m` in a train config: its preset, plus every key that differs
    from the preset (a model given by --params starts from the default shape)."""
    name = m.preset if m.preset in PRESETS or m.preset in ALIASES else ModelConfig().preset
    base = ModelConfig(preset=name, **get_preset(name))
    out: dict[str, object] = {"model.preset": base.preset}
    for f in dataclasses.fields(m):
        if f.name != "preset" and getattr(m, f.name) != getattr(base, f.name):
            out[f"model.{f.name}"] = getattr(m, f.name)
    return out


def train_command(plan: Plan, w: Workload, cluster: Cluster) -> str | None:
    """The command line that trains `plan` on `cluster` (None when shardlm train cannot run its
    layout yet): `shardlm train --nproc N` on one node, torchrun on several."""
    if not plan.runtime_supported:
        return None
    flags = _flags({**model_overrides(w.model), "train.seq_len": w.seq_len, **plan.overrides()})
    if cluster.nodes == 1:
        return f"shardlm train --nproc {cluster.per_node} {flags}"
    return " ".join(torchrun_argv(cluster.nodes, cluster.per_node, "HEAD_NODE:29500", flags.split()))


# ---------------------------------------------------------------------------------------------
# JSON


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def memory_json(memory: Memory) -> dict:
    out = _plain(memory)
    out.update(peak=memory.peak, fits=memory.fits, unit="bytes")
    return out


def timing_json(timing: Timing) -> dict:
    return {**_plain(timing), "exposed_comm": timing.exposed_comm, "parts": step_parts(timing),
            "unit": "seconds"}


def estimate_json(w: Workload, s: Strategy, cluster: Cluster, memory: Memory, timing: Timing,
                  suggestions: list[Plan], basis: CostBasis | None = None) -> str:
    extra = {} if basis is None else {
        "cost_basis": basis_json(basis),
        "cost": cost_json(training_cost(timing.tokens_per_s, cluster.world_size, basis))}
    return json.dumps({
        "model": {**_plain(w.model), "params": shape_of(w).total},
        "workload": {"seq_len": w.seq_len, "global_batch": w.global_batch, "experts": w.experts},
        "cluster": {"description": cluster.describe(), "nodes": cluster.nodes,
                    "per_node": cluster.per_node, "device": cluster.device.name},
        "strategy": _plain(s), "memory": memory_json(memory), "time": timing_json(timing),
        "suggestions": [plan_json(p, w, cluster, basis) for p in suggestions], **extra}, indent=1)


def plan_json(plan: Plan, workload: Workload, cluster: Cluster, basis: CostBasis | None = None) -> dict:
    extra = {} if basis is None else {
        "cost": cost_json(training_cost(plan.timing.tokens_per_s, cluster.world_size, basis))}
    return {"strategy": _plain(plan.strategy), "description": describe_strategy(plan.strategy),
            "runtime_supported": plan.runtime_supported, "not_runnable": plan.not_runnable,
            "overrides": plan.overrides(),
            "command": train_command(plan, workload, cluster),
            "tokens_per_s": plan.timing.tokens_per_s, "mfu": plan.timing.mfu, "hfu": plan.timing.hfu,
            "step_s": plan.timing.step, "calibration": plan.timing.calibration, "peak_bytes": plan.memory.peak,
            "capacity_bytes": plan.memory.capacity, **extra}


def plan_result_json(result: SearchResult, top: int, basis: CostBasis | None = None,
                     rank_by: str = "speed") -> str:
    extra = {} if basis is None else {"cost_basis": basis_json(basis), "rank_by": rank_by}
    return json.dumps({
        "model": {**_plain(result.workload.model), "params": shape_of(result.workload).total},
        "cluster": result.cluster.describe(), "seq_len": result.workload.seq_len,
        "global_batch": result.workload.global_batch, "evaluated": result.evaluated,
        "plans": [plan_json(p, result.workload, result.cluster, basis) for p in result.plans[:top]],
        "explanation": explain(result), **extra}, indent=1)
