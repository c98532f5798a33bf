"""The named pipeline schedules built as tables (parallel/pipeline/tables.py holds the table, the CSV
reader, the check and the simulation): GPipe, 1F1B and interleaved 1F1B (Narayanan et al. 2021),
zero-bubble ZB-H1 by list scheduling (Qi et al. 2023), ZB-V (Qi et al. 2024) and DualPipeV
(DeepSeek-V3's DualPipe cut in half). `table_for` is the one entry point: a named schedule or a
user's CSV. Pure Python (no torch)."""

from __future__ import annotations

import collections
import functools

from shardlm.parallel.pipeline.tables import COST, NAMED, V_SHAPED, Op, ScheduleError, Table, check_table, read_table


def _forward_steps(p: int, v: int, micro: int) -> list[tuple[int, int]]:
    """(chunk, micro-batch) of forward step k (Megatron-LM's order): P micro-batches through
    chunk 0, the same P through chunk 1, ..., then the next P micro-batches."""
    return [((k % (p * v)) // p, (k // (p * v)) * p + k % p) for k in range(micro * v)]


def gpipe_order(p: int, v: int, micro: int, rank: int) -> list[tuple[str, int, int]]:
    """Every micro-batch's forward, then every backward (kind, chunk, micro-batch)."""
    steps = _forward_steps(p, v, micro)
    return [("F", c, i) for c, i in steps] + [("B", c, i) for c, i in reversed(steps)]


def one_f_one_b_order(p: int, v: int, micro: int, rank: int) -> list[tuple[str, int, int]]:
    """Warm up with a few forwards, then alternate one forward and one backward, then drain
    the backwards (PipeDream-Flush). One chunk per rank: P - r - 1 warm-up forwards, at most
    P - r micro-batches held on rank r. With V chunks per rank ('interleaved', Narayanan et
    al. 2021, Megatron-LM's order): 2·(P - r - 1) + (V - 1)·P warm-up forwards."""
    forwards = _forward_steps(p, v, micro)
    backwards = [(v - 1 - c, i) for c, i in forwards]  # chunks in reverse
    total = len(forwards)
    warmup = min(total, p - rank - 1 if v == 1 else 2 * (p - rank - 1) + (v - 1) * p)
    out = [("F", *forwards[k]) for k in range(warmup)]
    for k in range(total - warmup):
        out += [("F", *forwards[warmup + k]), ("B", *backwards[k])]
    out += [("B", *backwards[k]) for k in range(total - warmup, total)]
    return out


@functools.lru_cache(maxsize=None)
def _list_schedule(p: int, micro: int) -> tuple[list[list[tuple[str, int, int]]], int]:
    """The 'zb' schedule: every rank's order (B: the input-gradient half) and the timeline's
    length in unit steps. A list schedule of the whole pipeline (F, B and W one unit each):
    every rank runs, at each step, a ready B first, else a ready F if it holds fewer than P - r
    micro-batches (1F1B's memory bound) and fewer than P - r deferred W, else its oldest W."""
    done: dict[tuple[str, int, int], int] = {}  # (kind, rank, micro-batch) -> finishing step
    orders: list[list[tuple[str, int, int]]] = [[] for _ in range(p)]
    nxt_f, nxt_b, pending_w = [0] * p, [0] * p, [[] for _ in range(p)]
    t = 0
    while any(len(o) < 3 * micro for o in orders):
        picks = []
        for r in range(p):
            f, b = nxt_f[r], nxt_b[r]
            b_ready = b < f and done.get(("F", r, b), t) < t and (r == p - 1 or done.get(("B", r + 1, b), t) < t)
            f_ready = f < micro and (r == 0 or done.get(("F", r - 1, f), t) < t) and f - b < p - r
            if b_ready:
                picks.append((r, "B", b))
            elif f_ready and len(pending_w[r]) < p - r:  # at most P - r sets of deferred gradients
                picks.append((r, "F", f))
            elif pending_w[r]:
                picks.append((r, "W", pending_w[r][0]))
            elif f_ready:
                picks.append((r, "F", f))
        for r, kind, m in picks:
            done[(kind, r, m)] = t
            orders[r].append((kind, 0, m))
            if kind == "F":
                nxt_f[r] += 1
            elif kind == "B":
                nxt_b[r] += 1
                pending_w[r].append(m)
            else:
                pending_w[r].pop(0)
        t += 1
    return orders, t


class _Rank:
    """One rank's operations as a V-shaped schedule appends them: per-stage counters give the
    next micro-batch of each kind; `weights` queues the W of each I (oldest first)."""

    def __init__(self):
        self.ops: list[Op] = []
        self.count: collections.Counter = collections.Counter()
        self.weights: list[Op] = []

    def add(self, kind: str, stage: int) -> None:
        counter = "B" if kind in "BI" else kind  # one backward per micro-batch, whole or split
        op = Op(kind, stage, self.count[(counter, stage)])
        self.count[(counter, stage)] += 1
        self.ops.append(op)
        if kind == "I":
            self.weights.append(Op("W", stage, op.micro))

    def weight(self) -> None:
        if self.weights:
            self.ops.append(self.weights.pop(0))


def zbv_ops(p: int, micro: int, rank: int) -> list[Op]:
    """ZB-V (Qi et al. 2024, 'Zero Bubble Pipeline Parallelism' §6): rank r holds stages r
    (chunk 0, down) and 2P-1-r (chunk 1, back up). Warm up with 2(P-r)-1 forwards of chunk 0,
    then r pairs (F1, F0), then P-r triples (F1 I1 W1); the steady state repeats F0 I0 W0 F1 I1 W1;
    the cool-down runs the remaining input gradients first (r pairs I0 I1, then P-r pairs I0 W0)
    and the weight gradients last, where they fill what would be the drain's bubble. At most 2P
    chunk-micro-batches of activations (P stages' worth: 1F1B's memory). Built for
    max(M, 2P-1) micro-batches (the pattern's minimum), the ones past M dropped."""
    n = max(micro, 2 * p - 1)
    c0, c1, out = rank, 2 * p - 1 - rank, _Rank()
    for _ in range(2 * (p - rank) - 1):
        out.add("F", c0)
    for _ in range(rank):
        out.add("F", c1)
        out.add("F", c0)
    for _ in range(p - rank):
        out.add("F", c1)
        out.add("I", c1)
        out.weight()
    while out.count[("F", c1)] < out.count[("F", c0)] or out.count[("F", c0)] < n:
        if out.count[("F", c0)] < n:
            out.add("F", c0)
        out.add("I", c0)
        out.weight()
        out.add("F", c1)
        out.add("I", c1)
        out.weight()
    for _ in range(rank):
        out.add("I", c0)
        out.add("I", c1)
    for _ in range(p - rank):
        out.add("I", c0)
        out.weights.sort(key=lambda w: w.stage != c0)  # chunk 0's oldest weight gradients first
        out.weight()
    out.weights.sort(key=lambda w: (w.stage != c1, w.micro))  # then chunk 1's, then chunk 0's
    while out.weights:
        out.weight()
    return [op for op in out.ops if op.micro < micro]


def dualpipev_ops(p: int, micro: int, rank: int) -> list[Op]:
    """DualPipeV (DeepSeek-V3's DualPipe, Liu et al. 2024, cut in half: deepseek-ai/DualPipe
    dualpipev.py). Rank r holds stages r and 2P-1-r; micro-batches enter at rank 0 and come back
    up. Eight phases: (1) 2(P-r-1) forwards of chunk 0; (2) r+1 pairs F0 F1; (3) P-r-1 triples
    I1 W F1 (zero bubble); (4) the main phase, M - 2P + r + 1 pairs of overlapped forward and
    backward: F0 with B1, then F1 with B0 (the first pair on the last rank not overlapped);
    (5) P-r-1 pairs B1, F1 with B0; (6) r+1 pairs of backwards B1 B0, the second half split
    (I, its W later); (7) P-r-1 pairs W B0; (8) the remaining weight gradients. The overlap of
    a forward with another micro-batch's backward (in DeepSeek's, their communication hidden
    behind each other's computation) is run here one after the other: forward, then backward.
    Needs M >= 2P."""
    s0, s1, out = rank, 2 * p - 1 - rank, _Rank()
    for _ in range(2 * (p - rank - 1)):
        out.add("F", s0)
    for _ in range(rank + 1):
        out.add("F", s0)
        out.add("F", s1)
    for _ in range(p - rank - 1):
        out.add("I", s1)
        out.weight()
        out.add("F", s1)
    for _ in range(micro - 2 * p + rank + 1):
        out.add("F", s0)  # with the next: overlapped in DeepSeek's (not on the last rank's first)
        out.add("B", s1)
        out.add("F", s1)  # overlapped with the next
        out.add("B", s0)
    for _ in range(p - rank - 1):
        out.add("B", s1)
        out.add("F", s1)  # overlapped with the next
        out.add("B", s0)
    split = False
    for i in range(rank + 1):
        if i == (rank + 1) // 2 and rank % 2 == 1:
            split = True
        out.add("I" if split else "B", s1)
        if i == (rank + 1) // 2 and rank % 2 == 0:
            split = True
        out.add("I" if split else "B", s0)
    for _ in range(p - rank - 1):
        out.weight()
        out.add("I" if split else "B", s0)
    while out.weights:
        out.weight()
    return out.ops


def build_table(name: str, ranks: int, virtual: int, micro: int) -> Table:
    """The named schedule's table for `ranks` pipeline ranks, `virtual` chunks each, `micro`
    micro-batches (not checked: check_table)."""
    return _build(name, ranks, virtual, micro)


@functools.lru_cache(maxsize=64)
def _build(name: str, p: int, v: int, micro: int) -> Table:
    if name in V_SHAPED:
        if v != 2:
            raise ScheduleError(f"pipeline schedule {name!r} places two chunks per rank in a V: "
                                f"set parallel.pp_virtual = 2 (got {v})")
        fn = zbv_ops if name == "zbv" else dualpipev_ops
        return Table(name, tuple(tuple(fn(p, micro, r)) for r in range(p)), 2 * p, micro)
    if name == "zb":
        orders = _list_schedule(p, micro)[0]
        rows = [[Op("I" if k == "B" else k, r, m) for k, _, m in orders[r]] for r in range(p)]
    elif name in ("gpipe", "1f1b", "interleaved"):
        order = gpipe_order if name == "gpipe" else one_f_one_b_order
        rows = [[Op(k, c * p + r, m) for k, c, m in order(p, v, micro, r)] for r in range(p)]
    else:
        raise ScheduleError(f"unknown pipeline schedule {name!r}: choose {', '.join(NAMED)} or 'file:PATH'")
    return Table(name, tuple(tuple(row) for row in rows), p * v, micro)


def table_for(schedule: str, ranks: int, virtual: int, micro: int) -> Table:
    """parallel.pp_schedule's table (a name, or 'file:PATH'), checked (check_table)."""
    if schedule.startswith("file:"):
        table = read_table(schedule.removeprefix("file:"))
    else:
        table = build_table(schedule, ranks, virtual, micro)
    check_table(table, ranks, ranks * virtual, micro)
    return table


def bubble_formula(name: str, ranks: int, virtual: int, micro: int) -> float:
    """The idle fraction of a step its authors give, for per-chunk times F = I = W (B = I + W):
    GPipe and 1F1B (P-1)/(M+P-1); interleaved (P-1)/(V·M+P-1) (Narayanan et al. 2021); ZB-V 0
    (Qi et al.'s comparison at T_F = T_B = T_W, sail-sg/zero-bubble-pipeline-parallelism: the
    steady state's; the warm-up's P-1 forwards are not counted); DualPipeV (P-1)(F&B + B - 3W)
    idle per rank (deepseek-ai/DualPipe's (PP/2-1)(F&B + B - 3W) with PP = 2P stages; B the whole
    backward, F&B an overlapped forward and backward, here F + B: run one after the other) over
    2M(F + B) of work per rank. 'zb' and a user's table have no published formula: the idle
    share of their simulated table (check_table)."""
    p, m, v = ranks, micro, virtual
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if name == "zbv":
        return 0.0
    if name == "dualpipev":
        f, b, w = COST["F"], COST["B"], COST["W"]
        idle = (p - 1) * ((f + b) + b - 3 * w)
        return idle / (idle + 2 * m * (f + b))
    return check_table(table_for(name, p, v, m)).idle
