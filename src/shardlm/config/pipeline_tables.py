"""Pipeline schedules as data: a table of operations per rank, in the order each rank runs them;
built for every named schedule (pipeline_schedules.py), read from a CSV for a user's own (here),
checked before a run by simulating it (here), and executed by the one executor
(parallel/pipeline.py Schedule.run).

An operation is `<stage><kind><micro-batch>` (torch.distributed.pipelining's notation, as in its
CSV tables): "3F1" runs global stage 3's forward of micro-batch 1. Kinds: F (forward), B (the
whole backward), I (the backward's input gradient only: what the previous stage waits for) and
W (the weight gradients an I set aside: the zero-bubble split, Qi et al. 2023). A CSV has one
row per rank; an empty cell is an idle slot (ignored: each rank runs its operations in order as
soon as their inputs arrive).

Stages sit on ranks in one of two placements, read off the table: 'loop' (stage g on rank g mod
P: one chunk per rank, or interleaved's V chunks) or 'v' (two chunks per rank, rank r holding
stages r and 2P-1-r: the model goes down the ranks and back up, so rank 0 holds the embedding
and the head and the turn at rank P-1 passes activations without communication; ZB-V, Qi et
al. 2024, and DualPipeV, DeepSeek-V3's DualPipe cut in half).

Pure Python (no torch): the planner and the config rules use it too.
"""

from __future__ import annotations

import collections
import csv
import io
import re
from dataclasses import dataclass
from pathlib import Path

from shardlm.errors import ConfigError

KINDS = {"F": "forward", "B": "backward", "I": "input-gradient backward", "W": "weight-gradient backward"}
NAMED = ("gpipe", "1f1b", "interleaved", "zb", "zbv", "dualpipev")
"""parallel.pp_schedule's named schedules; 'file:PATH' reads a table (read_table)."""
V_SHAPED = ("zbv", "dualpipev")
COST = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
"""Unit times for the simulation: F, I and W equal (the zero-bubble paper's T_F = T_B = T_W),
a whole backward both halves."""


class ScheduleError(ConfigError):
    """A schedule table that cannot run: the message names the rank, slot and rule."""


@dataclass(frozen=True)
class Op:
    kind: str
    stage: int
    micro: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.micro}"


@dataclass(frozen=True)
class Table:
    """Every rank's operations, in order (None: an idle slot)."""

    name: str
    rows: tuple[tuple[Op | None, ...], ...]
    stages: int
    micro: int

    @property
    def ranks(self) -> int:
        return len(self.rows)

    @property
    def placement(self) -> str:
        return placement_of(self)

    @property
    def splits_backward(self) -> bool:
        return any(op is not None and op.kind == "I" for row in self.rows for op in row)

    def rank_stages(self, rank: int) -> list[int]:
        """The global stages `rank` holds, ascending (its chunks, in order)."""
        return [g for g in range(self.stages) if stage_rank(self.placement, self.ranks, g) == rank]

    def to_csv(self) -> str:
        out = io.StringIO()
        csv.writer(out, lineterminator="\n").writerows([[str(op) if op else "" for op in row] for row in self.rows])
        return out.getvalue()


def stage_rank(placement: str, ranks: int, stage: int) -> int:
    """The rank holding global stage `stage`."""
    if placement == "v":
        return stage if stage < ranks else 2 * ranks - 1 - stage
    return stage % ranks


def placement_of(table: Table) -> str:
    """'loop' or 'v': where the table's operations put each stage (ScheduleError otherwise)."""
    where: dict[int, tuple[int, int]] = {}
    for rank, row in enumerate(table.rows):
        for slot, op in enumerate(row):
            if op is None:
                continue
            if op.stage in where and where[op.stage][0] != rank:
                r, s = where[op.stage]
                raise ScheduleError(f"pipeline schedule {table.name!r}: stage {op.stage} runs on rank {r} "
                                    f"(slot {s}) and on rank {rank} (slot {slot}, {op}): a stage lives on one rank")
            where.setdefault(op.stage, (rank, slot))
    missing = [g for g in range(table.stages) if g not in where]
    if missing:
        raise ScheduleError(f"pipeline schedule {table.name!r}: stage(s) {missing} have no operations "
                            f"({table.stages} stages over {table.ranks} ranks)")
    for placement in ("loop", "v"):
        if placement == "v" and table.stages != 2 * table.ranks:
            continue
        if all(stage_rank(placement, table.ranks, g) == where[g][0] for g in where):
            return placement
    raise ScheduleError(f"pipeline schedule {table.name!r}: stages on ranks "
                        f"{[where[g][0] for g in range(table.stages)]} (by stage); supported placements: "
                        f"'loop' (stage g on rank g mod {table.ranks}) or, with {2 * table.ranks} stages, "
                        f"'v' (rank r holds stages r and {2 * table.ranks - 1}-r)")


# ---------------------------------------------------------------------------------------------
# The named schedules


# ---------------------------------------------------------------------------------------------
# A user's table

_CELL = re.compile(r"^\s*(\d+)\s*([FBIW])\s*(\d+)\s*$")


def read_table(path: str | Path) -> Table:
    """A CSV of one row per rank, each cell an operation ('0F1', '3I0', '3W0', '2B1') or empty
    (an idle slot). The numbers of stages and micro-batches are the table's own (checked against
    the run's by check_table)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ScheduleError(f"parallel.pp_schedule = 'file:{path}': cannot read it ({e}); give the path "
                            f"of a CSV with one row of operations per pipeline rank") from e
    rows = []
    for rank, cells in enumerate(csv.reader(io.StringIO(text))):
        row = []
        for slot, cell in enumerate(cells):
            if not cell.strip():
                row.append(None)
                continue
            match = _CELL.match(cell)
            if match is None:
                raise ScheduleError(f"{path}: rank {rank} slot {slot}: {cell!r} is not an operation; write "
                                    f"<stage><kind><micro-batch>, kind one of F, B, I, W (e.g. '0F1', '3I0')")
            row.append(Op(match[2], int(match[1]), int(match[3])))
        rows.append(tuple(row))
    ops = [op for row in rows for op in row if op is not None]
    if not ops:
        raise ScheduleError(f"{path}: no operations; write one row per pipeline rank")
    return Table(f"file:{path}", tuple(rows), max(op.stage for op in ops) + 1, max(op.micro for op in ops) + 1)


# ---------------------------------------------------------------------------------------------
# Checking by simulation


@dataclass
class Timeline:
    """A table run with unit costs (COST), each rank as soon as its inputs arrive."""

    makespan: float
    busy: list[float]
    """Per rank: time computing."""
    peak_in_flight: list[int]
    """Per rank: the most chunk-micro-batches between their F and their backward (B or I)."""

    @property
    def idle(self) -> float:
        """The step's idle fraction over all ranks: the bubble."""
        return 1 - sum(self.busy) / (len(self.busy) * self.makespan)

    @property
    def idle_by_rank(self) -> list[float]:
        return [1 - b / self.makespan for b in self.busy]


def check_table(table: Table, ranks: int | None = None, stages: int | None = None,
                micro: int | None = None) -> Timeline:
    """Every rule a table must keep to run, or a ScheduleError naming the rank and slot that
    breaks it: the run's numbers of ranks, stages and micro-batches; one placement; each
    micro-batch's F, then its B (or I then W), exactly once on each stage, in that order on its
    rank; and (by simulating it) each stage's inputs arriving from its neighbour in the order
    the neighbour sends them, without deadlock. Returns the simulated timeline."""
    name = table.name
    for want, got, what in ((ranks, table.ranks, "rows (pipeline ranks, parallel.pp)"),
                            (stages, table.stages, "stages (parallel.pp × parallel.pp_virtual)"),
                            (micro, table.micro, "micro-batches (train.grad_accum)")):
        if want is not None and want != got:
            raise ScheduleError(f"pipeline schedule {name!r} has {got} {what}; the run has {want}")
    placement_of(table)
    seen: dict[tuple[str, int, int], tuple[int, int]] = {}
    for rank, row in enumerate(table.rows):
        for slot, op in enumerate(row):
            if op is None:
                continue
            key = (op.kind, op.stage, op.micro)
            if key in seen:
                raise ScheduleError(f"pipeline schedule {name!r}: rank {rank} slot {slot} repeats {op} "
                                    f"(already at rank {seen[key][0]} slot {seen[key][1]}): each operation "
                                    f"runs exactly once")
            seen[key] = (rank, slot)
    for g in range(table.stages):
        owner = stage_rank(table.placement, table.ranks, g)
        for m in range(table.micro):
            have = {k for k in KINDS if (k, g, m) in seen}
            if have not in ({"F", "B"}, {"F", "I", "W"}):
                needs = "F and B (or F, I and W)"
                raise ScheduleError(f"pipeline schedule {name!r}: stage {g} micro-batch {m} has "
                                    f"{sorted(have) or 'no operations'}; it needs {needs} on rank {owner}")
            slots = [seen[(k, g, m)][1] for k in "FBIW" if k in have]
            if slots != sorted(slots):
                order = " then ".join(f"{g}{k}{m}" for k in "FBIW" if k in have)
                raise ScheduleError(f"pipeline schedule {name!r}: rank {owner} runs {order} out of order "
                                    f"(slots {slots}): a micro-batch's F comes before its backward, I before W")
    return simulate(table)


def simulate(table: Table, cost: dict[str, float] = COST) -> Timeline:
    """Each rank runs its operations in order, each as soon as its input is there (sends never
    block; a receive waits): F(g, m) needs stage g-1's activations of m, a backward of (g, m)
    the gradient from stage g+1; from another rank through a first-in first-out channel per
    (sender, receiver, direction), as the executor's point-to-point messages go. A receive
    whose channel holds another message first, or no rank able to move, is a ScheduleError."""
    sim = _Simulation(table)
    moved = True
    while moved:
        moved = False
        for rank in range(table.ranks):
            while sim.next[rank] < len(sim.ops[rank]):
                slot, op = sim.ops[rank][sim.next[rank]]
                at = sim.ready(rank, slot, op)
                if at is None:
                    break
                sim.run(rank, op, at, cost[op.kind])
                moved = True
    stuck = [f"rank {r} slot {sim.ops[r][sim.next[r]][0]} ({sim.ops[r][sim.next[r]][1]})"
             for r in range(table.ranks) if sim.next[r] < len(sim.ops[r])]
    if stuck:
        raise ScheduleError(f"pipeline schedule {table.name!r} deadlocks: {', '.join(stuck)} each wait for a "
                            f"neighbour's message that the neighbour sends only after its own wait")
    return Timeline(max(sim.clock), sim.busy, sim.peak)


class _Simulation:
    """simulate's state: each rank's operations, next index and clock; the messages in flight."""

    def __init__(self, table: Table):
        p = table.ranks
        self.table, self.last, self.where = table, table.stages - 1, table.placement
        self.ops = [[(slot, op) for slot, op in enumerate(row) if op is not None] for row in table.rows]
        self.channels: dict[tuple[int, int, str], collections.deque] = collections.defaultdict(collections.deque)
        self.done: dict[tuple[str, int, int], float] = {}
        self.clock, self.busy, self.held, self.peak, self.next = [0.0] * p, [0.0] * p, [0] * p, [0] * p, [0] * p

    def ready(self, rank: int, slot: int, op: Op) -> float | None:
        """When op's input is there (None: not yet); takes its message off the channel."""
        name = self.table.name
        if op.kind == "W":
            return self.done[("I", op.stage, op.micro)]
        if op.kind == "F":
            if op.stage == 0:
                return 0.0
            source, want, what = op.stage - 1, ("F",), "activations"
        else:
            if op.stage == self.last:
                return self.done[("F", op.stage, op.micro)]
            source, want, what = op.stage + 1, ("B", "I"), "gradient"
        frm = stage_rank(self.where, self.table.ranks, source)
        if frm == rank:  # the V's turn: the neighbour stage is on this rank
            for kind in want:
                if (kind, source, op.micro) in self.done:
                    return self.done[(kind, source, op.micro)]
            later = [s for s, o in self.ops[rank] if o.stage == source and o.micro == op.micro and o.kind in want]
            raise ScheduleError(f"pipeline schedule {name!r}: rank {rank} slot {slot} ({op}) needs stage "
                                f"{source}'s {what} of micro-batch {op.micro}, which this rank computes later "
                                f"(slot {later[0] if later else '?'}): swap them")
        queue = self.channels[(frm, rank, what)]
        if not queue:
            return None
        stage, micro, at = queue[0]
        if (stage, micro) != (source, op.micro):
            raise ScheduleError(f"pipeline schedule {name!r}: rank {rank} slot {slot} ({op}) receives "
                                f"stage {source}'s {what} of micro-batch {op.micro} from rank {frm}, but rank "
                                f"{frm} sends stage {stage}'s of micro-batch {micro} first: messages between "
                                f"two ranks arrive in the order they were sent")
        queue.popleft()
        return at

    def run(self, rank: int, op: Op, at: float, cost: float) -> None:
        """Run op on `rank` from max(its clock, `at`); send what it produces to another rank."""
        end = self.clock[rank] = max(self.clock[rank], at) + cost
        self.busy[rank] += cost
        self.done[(op.kind, op.stage, op.micro)] = end
        self.held[rank] += {"F": 1, "B": -1, "I": -1}.get(op.kind, 0)
        self.peak[rank] = max(self.peak[rank], self.held[rank])
        self.next[rank] += 1
        if op.kind == "F" and op.stage < self.last:
            to, what = stage_rank(self.where, self.table.ranks, op.stage + 1), "activations"
        elif op.kind in "BI" and op.stage > 0:
            to, what = stage_rank(self.where, self.table.ranks, op.stage - 1), "gradient"
        else:
            return
        if to != rank:
            self.channels[(rank, to, what)].append((op.stage, op.micro, end))


def untagged_order_problem(table: Table) -> str | None:
    """Where two ranks' messages would be matched wrongly if tags were ignored (NCCL matches a
    pair's point-to-point messages by order alone; gloo by tag too): the first ordered pair
    whose sends, activations and gradients together, go in another order than the receiver
    takes them. None when every pair's orders agree (gpipe, 1f1b, interleaved, zb do; ZB-V's
    and DualPipeV's interleave the two streams differently at the two ends)."""
    p, last, where = table.ranks, table.stages - 1, table.placement
    sent: dict[tuple[int, int], list] = collections.defaultdict(list)
    taken: dict[tuple[int, int], list] = collections.defaultdict(list)
    for rank, row in enumerate(table.rows):
        for op in (op for op in row if op is not None):
            forward = op.kind == "F"
            if (op.stage < last) if forward else (op.kind in "BI" and op.stage > 0):
                to = stage_rank(where, p, op.stage + (1 if forward else -1))
                if to != rank:
                    sent[(rank, to)].append(f"{op.stage}{'F' if forward else 'B'}{op.micro}")
            if (op.stage > 0) if forward else (op.kind in "BI" and op.stage < last):
                source = op.stage - 1 if forward else op.stage + 1
                frm = stage_rank(where, p, source)
                if frm != rank:
                    taken[(frm, rank)].append(f"{source}{'F' if forward else 'B'}{op.micro}")
    for (frm, to), order in sorted(sent.items()):
        for k, (mine, theirs) in enumerate(zip(order, taken[(frm, to)])):
            if mine != theirs:
                return (f"rank {frm}'s message {k} to rank {to} is {mine} but rank {to} takes {theirs} as its "
                        f"message {k} from rank {frm} (<stage>F<micro-batch>: activations, B: gradients)")
    return None


# ---------------------------------------------------------------------------------------------
# Published bubbles
