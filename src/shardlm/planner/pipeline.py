"""The pipeline schedules (parallel/pipeline/executor.py) as the memory and time models need
them: the micro-batches a stage holds at its peak, the bubble, the sends between stages and
their bytes.

Pure functions; no torch. docs/planner.md section 11.
"""

from __future__ import annotations

from shardlm.config.model import ModelConfig
from shardlm.parallel.pipeline.schedules import table_for
from shardlm.parallel.pipeline.tables import V_SHAPED, check_table
from shardlm.planner.workload import Strategy


def pp_in_flight(s: Strategy, index: int, split: list[int] | None = None) -> float:
    """Micro-batches of this rank's blocks whose activations stage `index` holds at its peak,
    with M = grad_accum micro-batches over P stages (parallel/pipeline/executor.py's orders). GPipe: all
    M (every forward before any backward). 1F1B (PipeDream-Flush): P - index, at most M; the
    zero-bubble schedule keeps 1F1B's bound (its deferred weight gradients are
    memory.deferred_weight_grads). Interleaved: the most blocks' worth of chunk-micro-batches
    its order holds at once (interleaved_peak), over the rank's blocks; `split` = blocks per
    global stage (pipeline_layers; None = equal chunks)."""
    p, m, v = s.layout.pp, s.grad_accum, s.pp_virtual
    if p == 1:
        return 1
    if s.pp_schedule == "gpipe":
        return m
    if s.pp_schedule in V_SHAPED or s.pp_schedule.startswith("file:"):  # the table's peak chunks, equal chunks
        return min(check_table(table_for(s.pp_schedule, p, v, m)).peak_in_flight[index] / v, m)
    if s.pp_schedule == "interleaved":
        split = split or [1] * (p * v)
        return interleaved_peak(split, p, v, index, m) / sum(split[index::p])
    return min(p - index, m)


def interleaved_peak(split: list[int], p: int, v: int, rank: int, micro: int) -> int:
    """The most blocks x micro-batches rank `rank` holds activations for under the interleaved
    order (parallel/pipeline/executor.py OneFOneB.order with V chunks, Megatron-LM's): forward step k
    runs chunk (k mod PV) // P, 2(P - rank - 1) + (V - 1)P warm-up forwards, then one forward
    and one backward (chunks in reverse), then the remaining backwards."""
    forwards = [(k % (p * v)) // p for k in range(micro * v)]
    backwards = [v - 1 - c for c in forwards]
    blocks = [split[c * p + rank] for c in range(v)]
    warmup = min(len(forwards), 2 * (p - rank - 1) + (v - 1) * p)
    held = peak = sum(blocks[c] for c in forwards[:warmup])
    for k in range(len(forwards) - warmup):
        held += blocks[forwards[warmup + k]]
        peak = max(peak, held)
        held -= blocks[backwards[k]]
    return peak


def pp_bubble(s: Strategy) -> float:
    """The idle fraction of a step for equal stage times (parallel/pipeline/executor.py
    Schedule.bubble_formula): P - 1 slots of fill and drain in M·V + P - 1 (GPipe, 1F1B, and
    interleaved with V chunks: Narayanan et al. 2021). Zero-bubble: the runtime's unit-time
    list schedule (F, B and W one unit each) is 3M + 2(P - 1) units long for every P and M
    (tests/test_planner_axes.py checks it against the runtime's), so 2(P-1)/(3M + 2(P-1)); with
    tp > 1 nothing is deferred (the tensor-parallel linears compute their weight gradients in
    B), so 1F1B's."""
    p, m = s.layout.pp, s.grad_accum
    if s.pp_schedule == "zb" and s.layout.tp == 1:
        return 2 * (p - 1) / (3 * m + 2 * (p - 1))
    if s.pp_schedule in V_SHAPED or s.pp_schedule.startswith("file:"):  # the table's simulated idle share
        return check_table(table_for(s.pp_schedule, p, s.pp_virtual, m)).idle
    return (p - 1) / (s.pp_virtual * m + p - 1)


def pp_sends(index: int, pp: int, micro: int, virtual: int = 1) -> tuple[int, int]:
    """(activations, gradients) pipeline rank `index` sends per step (parallel/pipeline/executor.py
    Schedule.run): each of its V chunks sends every micro-batch's output forward unless it is
    the model's last, and the gradient of its input back unless it is the model's first."""
    if pp == 1:
        return 0, 0
    return micro * (virtual - (index == pp - 1)), micro * (virtual - (index == 0))


def pp_hidden_bytes(m: ModelConfig, tokens: int, tp: int, cp: int, sequence_parallel: bool,
                    e: int) -> int:
    """Bytes of one micro-batch's hidden states between stages (B, T/cp[/t], h) in e bytes: a
    context-parallel rank's cut of the tokens; sequence parallelism cuts them over tp too."""
    return tokens // (cp * (tp if sequence_parallel and tp > 1 else 1)) * m.d_model * e
