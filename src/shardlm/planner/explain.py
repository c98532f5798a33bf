"""Why the winner wins: the step's parts, a strategy in words, and the sentences `shardlm plan`
prints under its table (the winner, the runner-up, what each lever would cost, what did not
fit). Split out of search.py, which re-exports these names (its Plan and SearchResult are
what these read; not imported here, so the two modules do not import each other).
"""

from __future__ import annotations

from shardlm.planner.timing import Timing
from shardlm.planner.workload import Strategy


def step_parts(t: Timing) -> dict[str, float]:
    bubble = t.compute * t.bubble
    return {"compute": t.compute - bubble, "pipeline bubble": bubble, "memory-bound work": t.memory_bound,
            "exposed communication": t.exposed_comm, "optimizer step": t.optimizer}


def describe_strategy(s: Strategy) -> str:
    lay = s.layout
    parts = [f"ZeRO-{s.zero_stage}" if s.zero_stage else "plain DP"]
    if lay.dp_size > 1:
        parts.append(f"dp {lay.dp_replicate}x{lay.dp_shard}" if lay.dp_replicate > 1 else f"dp {lay.dp_size}")
    if lay.tp > 1:
        parts.append(f"tp {lay.tp}" + (" async" if s.async_tp and s.sequence_parallel else ""))
    if lay.cp > 1:
        parts.append(f"cp {lay.cp}" + (f" {s.cp_mode}" if s.cp_mode != "ring" else ""))
    if lay.pp > 1:
        parts.append(f"pp {lay.pp} {s.pp_schedule}" + (f" x{s.pp_virtual}" if s.pp_virtual > 1 else "")
                     + (f" [{s.pp_layers}]" if s.pp_layers else ""))
    parts += [f"ep {lay.ep}"] if lay.ep > 1 else []
    parts.append(f"micro-batch {s.micro_batch} x accum {s.grad_accum}")
    if s.recompute != "none":
        parts.append(f"{s.recompute} recompute")
    if s.offload_optimizer != "none":
        parts.append(f"optimizer on {s.offload_optimizer}")
    if s.offload_params != "none":
        parts.append(f"params on {s.offload_params}")
    if s.activation_offload != "none":
        parts.append(f"activations of {s.activation_offload_blocks or 'all'} blocks on "
                     f"{s.activation_offload}")
    return ", ".join(parts)


def explain(result) -> list[str]:
    """Sentences about a search.SearchResult: the winner and why, what the runner-up costs, what
    did not fit."""
    lines = []
    if not result.plans:
        lines.append(f"Nothing fits on {result.cluster.describe()}.")
        if result.unfit:
            near = result.unfit[0]
            lines.append(f"Closest: {describe_strategy(near.strategy)} needs {near.memory.peak / 1e9:.1f} GB "
                         f"per device, {near.memory.capacity / 1e9:.1f} GB available; the peak is in "
                         f"{near.memory.limit}.")
        return lines
    win = result.plans[0]
    t = win.timing
    lines.append(f"Best: {describe_strategy(win.strategy)} — {t.tokens_per_s:,.0f} tokens/s, "
                 f"MFU {t.mfu:.0%} (HFU {t.hfu:.0%}), "
                 f"{win.memory.peak / 1e9:.1f} of {win.memory.capacity / 1e9:.1f} GB per device.")
    parts = step_parts(t)
    main = max(parts, key=parts.get)
    comm = parts["exposed communication"] / t.step
    lines.append(f"Its {t.step:.3g} s step is {parts[main] / t.step:.0%} {main}" +
                 (f"; exposed communication {comm:.1%}" if main != "exposed communication" else "")
                 + (f"; pipeline bubble {t.bubble:.0%}" if t.bubble else "") + ".")
    if len(result.plans) > 1:
        lines.append(_versus(win, result.plans[1], "The runner-up"))
    lay = win.strategy.layout
    contrasts = [
        ("ZeRO stage 0 (nothing sharded)", lambda s: s.zero_stage == 0, win.strategy.zero_stage != 0),
        ("tensor or pipeline parallelism", lambda s: s.layout.tp * s.layout.pp > 1, lay.tp * lay.pp == 1),
        ("no context parallelism", lambda s: s.layout.cp == 1, lay.cp > 1),
        ("no activation recompute", lambda s: s.recompute == "none", win.strategy.recompute != "none"),
    ]
    named = [result.plans[1]] if len(result.plans) > 1 else []  # each plan compared once
    for label, wanted, relevant in contrasts:
        if not relevant:
            continue
        other = next((p for p in result.plans[1:] if wanted(p.strategy)), None)
        if other is not None and all(other is not p for p in named):
            lines.append(_versus(win, other, f"With {label}, the best"))
            named.append(other)
        elif other is None:
            near = next((p for p in result.unfit if wanted(p.strategy)), None)
            if near is not None:
                lines.append(f"With {label} nothing fits: the closest ({describe_strategy(near.strategy)}) "
                             f"needs {near.memory.peak / 1e9:.1f} GB per device.")
    if not win.runtime_supported:
        ours = next((p for p in result.plans if p.runtime_supported), None)
        near = next((p for p in result.unfit if p.runtime_supported), None)
        lines.append(f"Not runnable: {win.not_runnable}; " + (
            f"the best plan it runs today: {describe_strategy(ours.strategy)} "
            f"({ours.timing.tokens_per_s:,.0f} tokens/s)." if ours else
            f"no plan it runs fits (closest: {describe_strategy(near.strategy)}, "
            f"{near.memory.peak / 1e9:.1f} GB, peak in {near.memory.limit})." if near else
            "no plan it runs fits."))
    return lines


def _versus(win, other, label: str) -> str:
    """One sentence: how much slower the search.Plan `other` is than `win`, and in which part."""
    slower = other.timing.step / win.timing.step - 1
    if slower < 0.01:
        return (f"{label} ({describe_strategy(other.strategy)}) is within 1% — a tie within the model's "
                f"error; the winner uses less memory." if win.memory.peak <= other.memory.peak
                else f"{label} ({describe_strategy(other.strategy)}) is within 1%: a tie within the model's error.")
    a, b = step_parts(win.timing), step_parts(other.timing)
    why = max(a, key=lambda k: b[k] - a[k])
    return (f"{label} ({describe_strategy(other.strategy)}) is {slower:.0%} slower: "
            f"+{b[why] - a[why]:.3g} s of {why} per step.")
