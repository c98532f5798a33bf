"""Pipeline schedules as data: a table of operations per rank, in the order each rank runs them;
built for every named schedule (parallel/pipeline/schedules.py), read from a CSV for a user's own (here),
checked before a run by simulating it (here), and executed by the one executor
(parallel/pipeline/executor.py Schedule.run).

An operation is `<stage><kind><micro-batch>` (torch.distributed.pipelining's notation, as in its
CSV tables): "3F1" runs global stage 3's forward of micro-batch 1. Kinds: F (forward), B (the
whole backward), I (the backward's input gradient only: what the previous stage waits for) and
W (the weight gradients an I set aside: the zero-bubble split, Qi et al. 2023). A CSV has one
row per rank; an empty cell is an idle slot (ignored: each rank runs its operations in order as
soon as their inputs arrive). A rank posts its messages to another in the order that rank
takes them (send_plan), so a table runs where messages are matched by order alone (NCCL).

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
    rank; and (by simulating it, each rank posting its messages as send_plan says: in the order
    their receiver takes them) no deadlock. Returns the simulated timeline."""
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
    the gradient from stage g+1; from another rank through one first-in first-out channel per
    (sender, receiver), both streams in it, into which the sender posts its messages as
    send_plan says (the order the receiver takes them), as the executor does: a message matched
    by its place in that channel alone, as NCCL matches it. No rank able to move is a
    ScheduleError (a deadlock)."""
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
                sim.run(rank, slot, op, at, cost[op.kind])
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
        self.plan = send_plan(table)
        self.channels: dict[tuple[int, int], collections.deque] = collections.defaultdict(collections.deque)
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
        queue = self.channels[(frm, rank)]
        if not queue:
            return None
        label, at = queue[0]
        # the plan posts in the order receives are taken: a mismatch here is a bug in send_plan
        assert label == _label(source, want[0], op.micro), (label, rank, slot, op)
        queue.popleft()
        return at

    def run(self, rank: int, slot: int, op: Op, at: float, cost: float) -> None:
        """Run op on `rank` from max(its clock, `at`); then post what the plan sends after it."""
        end = self.clock[rank] = max(self.clock[rank], at) + cost
        self.busy[rank] += cost
        self.done[(op.kind, op.stage, op.micro)] = end
        self.held[rank] += {"F": 1, "B": -1, "I": -1}.get(op.kind, 0)
        self.peak[rank] = max(self.peak[rank], self.held[rank])
        self.next[rank] += 1
        for to, label in self.plan[rank][slot]:
            self.channels[(rank, to)].append((label, end))


def _label(stage: int, kind: str, micro: int) -> str:
    """A message's name: '<sending stage>F<micro-batch>' activations, '<sending stage>B<micro-batch>' a gradient."""
    return f"{stage}{'F' if kind == 'F' else 'B'}{micro}"


def _messages(table: Table) -> tuple[dict, dict]:
    """Every message between two ranks, per ordered pair (sender, receiver): the sender's as
    (slot, label) in the order its operations make them, and the labels in the order the
    receiver's operations take them (activations and gradients together: _label)."""
    p, last, where = table.ranks, table.stages - 1, table.placement
    made: dict[tuple[int, int], list] = collections.defaultdict(list)
    taken: dict[tuple[int, int], list] = collections.defaultdict(list)
    for rank, row in enumerate(table.rows):
        for slot, op in enumerate(row):
            if op is None:
                continue
            forward = op.kind == "F"
            if (op.stage < last) if forward else (op.kind in "BI" and op.stage > 0):
                to = stage_rank(where, p, op.stage + (1 if forward else -1))
                if to != rank:
                    made[(rank, to)].append((slot, _label(op.stage, op.kind, op.micro)))
            if (op.stage > 0) if forward else (op.kind in "BI" and op.stage < last):
                source = op.stage - 1 if forward else op.stage + 1
                frm = stage_rank(where, p, source)
                if frm != rank:
                    taken[(frm, rank)].append(_label(source, op.kind, op.micro))
    return made, taken


def send_plan(table: Table) -> list[list[list[tuple[int, str]]]]:
    """Per rank, per slot of its row: the messages (receiver, _label) to post right after that
    slot's operation. NCCL matches two ranks' point-to-point messages by their order alone
    (gloo by tag too), so each rank posts its messages to a receiver in the order the receiver
    takes them: a message as soon as it and every message the receiver takes before it from
    this rank are made. Holding one back delays nothing: its receiver takes the earlier ones
    first. The loop schedules make their messages in that order already (the plan posts each
    right after its operation); ZB-V's and DualPipeV's two streams interleave differently at
    the two ends (untagged_order_problem), and there the plan holds a message back."""
    made, taken = _messages(table)
    plan: list[list[list[tuple[int, str]]]] = [[[] for _ in row] for row in table.rows]
    for (frm, to), order in sorted(taken.items()):
        slot_of = {label: slot for slot, label in made[(frm, to)]}
        ready = -1
        for label in order:
            ready = max(ready, slot_of[label])
            plan[frm][ready].append((to, label))
    return plan


def posted_orders(table: Table) -> dict[tuple[int, int], tuple[list[str], list[str]]]:
    """Per ordered pair (sender, receiver): the labels in the order send_plan posts them and in
    the order the receiver takes them; equal for every pair of every checked table."""
    _, taken = _messages(table)
    posted: dict[tuple[int, int], list[str]] = collections.defaultdict(list)
    for rank, row in enumerate(send_plan(table)):
        for after in row:
            for to, label in after:
                posted[(rank, to)].append(label)
    return {pair: (posted[pair], order) for pair, order in sorted(taken.items())}


def untagged_order_problem(table: Table) -> str | None:
    """Where two ranks' messages, posted as each operation makes them, would be matched wrongly
    if tags were ignored (NCCL matches a pair's point-to-point messages by order alone; gloo
    by tag too): the first ordered pair whose messages, activations and gradients together,
    are made in another order than the receiver takes them. None when every pair's orders agree
    (gpipe, 1f1b, interleaved, zb do; ZB-V's and DualPipeV's interleave the two streams
    differently at the two ends). The executor posts by send_plan, which holds such messages
    back: this says where it has to."""
    made, taken = _messages(table)
    for (frm, to), order in sorted(made.items()):
        for k, ((_, mine), theirs) in enumerate(zip(order, taken[(frm, to)])):
            if mine != theirs:
                return (f"rank {frm}'s message {k} to rank {to} is {mine} but rank {to} takes {theirs} as its "
                        f"message {k} from rank {frm} (<stage>F<micro-batch>: activations, B: gradients)")
    return None


# ---------------------------------------------------------------------------------------------
# Published bubbles
