"""Fault-tolerant replica groups (parallel.fault_tolerant): the quorum of live replicas at each
step and the gloo group over it, through which their gradients are averaged.

Every replica is a world of its own, so a dead one breaks no collective of the others'. They
meet in a store the launcher hosts (parallel/data/fault_tolerant/launcher.py). Each synchronisation is a *round*:

1. Each replica (its rank 0) registers in round n: `round/<n>/member/<r>` = 'incarnation:step:role' (role
   'live', or 'join' for a restarted replica that needs the others' state).
2. A live replica waits until every member of the last quorum has registered too, or was
   reported dead by the launcher (`deaths/<r>` beyond the incarnation it had), or
   parallel.quorum_timeout_s has passed; then it closes the round: the first `compare_set` of
   `round/<n>/quorum` wins, and every replica reads that one value — the quorum is the same
   on all of them, whoever closed it and whoever came late. A live replica left out (it came
   after the close) cannot rejoin silently: it raises `ReplicaLost` (its process exits, the
   launcher starts it again, and it rejoins).
3. The quorum's group is `ProcessGroupGloo(PrefixStore('round/<n>/group/<i>', store), index, size)`
   for local rank i (a replica of several ranks: rank i's shard meets the other replicas' rank i,
   which holds the same stage, shard and experts: train/fault_tolerance.py replica_setup)
   — no default group, nothing shared with the dead — reused while the members stay the same.
4. The gradients are all-reduced over it (summed: each replica's loss was divided by the
   global number of micro-batches, dp_replicate × grad_accum) and multiplied by dp_replicate /
   live, the mean over the replicas whose gradients were in it (a joining replica adds
   zeros; on data whose targets may carry no loss, each replica's share is weighted by its
   counted targets: train/fault_tolerance.py average_step). If the all-reduce fails (a peer died during it), the step is not committed — no
   optimizer step — and the replicas take it again in a new round (torchft's should_commit).
   A replica of several ranks commits as one: its ranks agree on the outcome (`_agreed`).
5. With a joining member, after the optimizer step the first live member broadcasts its whole
   state over the group (`share_state`) and the joiner takes it: it trains on from the next
   step, bit for bit the others' replica.

Bytes go to the byte ledger as group 'replicas' (all_reduce: 2× the tensor, broadcast: 1×).
Sources read: torchft (pytorch/torchft) Manager (start_quorum, allreduce, should_commit),
the Lighthouse's quorum, ProcessGroupGloo reconfigured per quorum, live recovery from a peer;
this is our own, much smaller, code: one store, one rule for a quorum, one group per member set.
"""

from __future__ import annotations

import datetime
import logging
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from shardlm.comm.collectives import CommLedger
from shardlm.parallel.data.fault_tolerant.launcher import DEATHS, DONE, JOINED, ReplicaIdentity

log = logging.getLogger("shardlm")

POLL_S = 0.01


class ReplicaLost(RuntimeError):
    """This replica was left out of a quorum the others went on with: it must restart and
    rejoin from their state."""


@dataclass(frozen=True)
class Member:
    replica: int
    incarnation: int
    step: int
    role: str
    """'live' (brings gradients) or 'join' (receives the state)."""

    def encode(self) -> str:
        return f"{self.replica}:{self.incarnation}:{self.step}:{self.role}"

    @staticmethod
    def decode(text: str) -> "Member":
        replica, incarnation, step, role = text.split(":")
        return Member(int(replica), int(incarnation), int(step), role)


@dataclass
class Quorum:
    round: int
    members: list[Member]
    """In replica order: a member's index is its rank in the round's group."""

    @property
    def live(self) -> list[int]:
        return [m.replica for m in self.members if m.role == "live"]

    @property
    def joining(self) -> list[int]:
        return [m.replica for m in self.members if m.role == "join"]


@dataclass
class ReplicaGroup:
    """This replica's view of the run's replicas: the store, the current quorum and its group."""

    identity: ReplicaIdentity
    ledger: CommLedger
    quorum_timeout_s: float
    collective_timeout_s: float
    rank: int = 0
    """This process's rank in its replica's own world (a replica of N ranks: ZeRO inside it)."""
    ranks: int = 1
    """The replica's ranks: its rank 0 registers in each round and closes it; every rank reads
    the round's one quorum from the store, and rank i all-reduces its gradient shard with rank i
    of the other replicas, over a group of its own per round (`group/<i>`)."""
    store: dist.Store = field(init=False)
    round: int = 0
    """The next round this replica takes part in."""
    last: list[tuple[int, int]] = field(default_factory=list)
    """(replica, incarnation) of the last quorum's members: whom the next round waits for."""
    quorum: Quorum | None = None
    retries: int = 0
    """Rounds of the current step that did not commit (so far)."""
    committed_retries: int = 0
    """Rounds the last committed step took that did not commit."""
    patient_round: int = -1
    """A round that waits for the last quorum as long as the first round does: the one after a
    checkpoint, whose writer may still be saving (a save is not a death)."""
    _group: dist.ProcessGroup | None = None
    _group_key: tuple = ()

    def __post_init__(self) -> None:
        timeout = datetime.timedelta(seconds=self.collective_timeout_s or 600.0)
        self.store = dist.TCPStore(self.identity.store_host, self.identity.store_port,
                                   is_master=False, timeout=timeout)
        # At the start every replica is awaited (for up to the collective timeout: they load
        # at different speeds); afterwards, the last quorum's members.
        self.last = [(r, 0) for r in range(self.identity.replicas)]

    @property
    def joining(self) -> bool:
        """A restarted replica: it takes the live replicas' state before training."""
        return self.identity.incarnation > 0

    # -- the quorum ----------------------------------------------------------------------

    def _key(self, n: int, what: str) -> str:
        return f"round/{n}/{what}"

    def _register(self, n: int, step: int, role: str) -> None:
        if self.rank:  # the replica's rank 0 speaks for it
            return
        me = Member(self.identity.replica, self.identity.incarnation, step, role)
        self.store.set(self._key(n, f"member/{me.replica}"), me.encode())

    def _present(self, n: int) -> dict[int, Member]:
        keys = {r: self._key(n, f"member/{r}") for r in range(self.identity.replicas)}
        return {r: Member.decode(self.store.get(k).decode()) for r, k in keys.items()
                if self.store.check([k])}

    def _dead(self, replica: int, incarnation: int) -> bool:
        return self.store.add(DEATHS.format(replica), 0) > incarnation

    def _close(self, n: int) -> Quorum:
        """Wait for the last quorum's members (each present, dead, or the timeout), then close
        round n with whoever registered; returns the round's quorum, the same on every replica."""
        patience = ((self.collective_timeout_s or 600.0) if n in (0, self.patient_round)
                    else self.quorum_timeout_s)
        deadline = time.monotonic() + patience
        closed = self._key(n, "quorum")
        while self.rank and not self.store.check([closed]):  # its rank 0 closes it (or dies:
            time.sleep(POLL_S)  # the launcher then stops the whole replica)
        while not self.store.check([closed]):
            present = self._present(n)
            awaited = [(r, i) for r, i in self.last
                       if (r not in present or present[r].incarnation != i) and not self._dead(r, i)]
            if not awaited or time.monotonic() > deadline:
                if awaited:
                    log.warning("shardlm: replicas: round %d goes on without replica(s) %s (not "
                                "here after %.1f s)", n, [r for r, _ in awaited], patience)
                text = ",".join(m.encode() for _, m in sorted(present.items()))
                self.store.compare_set(closed, "", text)  # the first close wins
                self.store.set("round/latest", str(n))
                break
            time.sleep(POLL_S)
        return self._read(n)

    def _read(self, n: int) -> Quorum:
        text = self.store.get(self._key(n, "quorum")).decode()
        return Quorum(n, [Member.decode(t) for t in text.split(",") if t])

    def _enter(self, q: Quorum) -> None:
        """Adopt `q`: the next round waits for its members; its group, built or reused."""
        self.quorum, self.round = q, q.round + 1
        self.last = [(m.replica, m.incarnation) for m in q.members]
        key = tuple(self.last)
        if len(q.members) == 1:
            self._group, self._group_key = None, key
        elif key != self._group_key or self._group is None:
            index = [m.replica for m in q.members].index(self.identity.replica)
            prefix = dist.PrefixStore(self._key(q.round, f"group/{self.rank}"), self.store)
            self._group = dist.ProcessGroupGloo(
                prefix, index, len(q.members),
                datetime.timedelta(seconds=self.collective_timeout_s or 600.0))
            self._group_key = key

    # -- what the training step calls ------------------------------------------------------

    def average(self, tensors: list[torch.Tensor], step: int) -> bool:
        """Step `step`'s gradients (and any other sums riding along) of this live replica,
        summed over the quorum and scaled to the mean over its live members. False when the
        all-reduce failed (a member died): the step is not committed; take it again."""
        n = self.round
        self._register(n, step, "live")
        q = self._close(n)
        if self.identity.replica not in q.live:
            raise ReplicaLost(f"replica {self.identity.replica} came to round {n} (step {step + 1}) "
                              f"after the others had gone on without it")
        ahead = max(m.step for m in q.members if m.role == "live")
        if step < ahead:  # the others committed a step whose all-reduce failed here
            raise ReplicaLost(f"replica {self.identity.replica} is at step {step + 1}, the others "
                              f"at {ahead + 1}: it restarts and rejoins from their state")
        if any(m.step != step for m in q.members if m.role == "live"):
            self.round, self.retries = n + 1, self.retries + 1  # a laggard restarts: again without it
            self.last = [(m.replica, m.incarnation) for m in q.members]
            return False
        error = ""
        try:
            self._enter(q)
            self._all_reduce(tensors)
        except RuntimeError as e:
            error = str(e).splitlines()[0][:200]
        if not self._agreed(not error, tensors[-1].device):
            self._group, self.retries = None, self.retries + 1
            log.warning("shardlm: replicas: step %d not committed (round %d, quorum %s: %s); "
                        "taking it again with the replicas alive", step + 1, n, q.live,
                        error or "another rank of this replica saw its all-reduce fail")
            return False
        self.committed_retries, self.retries = self.retries, 0
        replicas, live = self.identity.replicas, len(q.live)
        if live != replicas:  # the mean over the live replicas (x 1 would change no bit)
            torch._foreach_mul_(tensors, replicas / live)
        return True

    def _agreed(self, ok: bool, device: torch.device) -> bool:
        """Whether every rank of this replica all-reduced its shard (an all-reduce may fail on
        one rank and not another, as a peer replica dies): the replica commits as one."""
        if self.ranks == 1:
            return ok
        flag = torch.tensor([float(ok)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # the replica's own world
        return bool(flag.item() > 0)

    def join(self, zeros: list[torch.Tensor], step: int) -> Quorum | None:
        """A restarted replica: register as joining until a round takes it in, add zeros to
        that round's all-reduce (`zeros`: tensors shaped as the live replicas' gradients).
        None when the run finished meanwhile. Its rank 0 finds the round and tells the others
        through the store (`join/<replica>/<incarnation>`)."""
        told = f"join/{self.identity.replica}/{self.identity.incarnation}"
        if self.rank:
            while not self.store.check([told]):
                time.sleep(POLL_S)
            n = int(self.store.get(told))
            q = self._read(n) if n >= 0 else None
        else:
            q = self._join_round(step)
            self.store.set(told, str(q.round if q else -1))
        if q is not None:
            self._enter(q)
            self._all_reduce(zeros)
        return q

    def _join_round(self, step: int) -> Quorum | None:
        """Rank 0 of a restarted replica: register as joining until a round takes it in; that
        round's quorum, or None when the run finished meanwhile."""
        while True:
            if self.store.check([DONE]):
                return None
            latest = int(self.store.get("round/latest")) if self.store.check(["round/latest"]) else -1
            n = latest + 1
            if self.store.check([self._key(n, "quorum")]):  # closed: 'latest' moves next
                time.sleep(POLL_S)
                continue
            self._register(n, step, "join")
            log.warning("shardlm: replica %d waits to rejoin (round %d)", self.identity.replica, n)
            deadline = time.monotonic() + (self.collective_timeout_s or 600.0)
            while not self.store.check([self._key(n, "quorum")]):
                if self.store.check([DONE]) or time.monotonic() > deadline:
                    return None
                time.sleep(POLL_S)
            q = self._read(n)
            if self.identity.replica in q.joining:
                return q

    def joined(self) -> None:
        """A restarted replica holds the live replicas' state now: the launcher may count on it
        when the others die (parallel/data/fault_tolerant/launcher.py)."""
        self.store.set(JOINED.format(self.identity.replica), str(self.identity.incarnation))

    def share_state(self, tensors: list[torch.Tensor]) -> bool:
        """After a committed step of a quorum with joining members: the first live member's
        `tensors` (the whole training state, in an order every replica agrees on) broadcast to
        every member. False if a member died during it (a joiner then restarts again)."""
        q = self.quorum
        if q is None or not q.joining or self._group is None:
            return True
        root = [m.replica for m in q.members].index(q.live[0])
        try:
            works = []
            for t in tensors:
                self.ledger.add("broadcast", "replicas", t.numel() * t.element_size())
                opts = dist.BroadcastOptions()
                opts.rootRank = root
                works.append(self._group.broadcast([t], opts))
            for w in works:
                self.ledger.timed_wait(w)
        except RuntimeError as e:
            self._group = None
            log.warning("shardlm: replicas: the state for replica(s) %s was not sent (%s)",
                        q.joining, str(e).splitlines()[0][:200])
            return False
        return True

    def writes_checkpoint(self) -> bool:
        """At a checkpoint step, whether this replica writes it: the lowest live replica of the
        step's quorum. Every replica read the same quorum, so exactly one writes and the others
        skip; a writer that dies mid-save leaves an unpublished temporary directory, never a
        damaged checkpoint (checkpoint/sharded.py), and the next round waits for a writer still
        saving as long as the first round waits (`patient_round`)."""
        self.patient_round = self.round
        q = self.quorum
        return q is None or q.live[:1] == [self.identity.replica]

    def _all_reduce(self, tensors: list[torch.Tensor]) -> None:
        if self._group is None:
            return
        works = []
        for t in tensors:
            self.ledger.add("all_reduce", "replicas", 2 * t.numel() * t.element_size())
            works.append(self._group.allreduce([t]))
        for w in works:
            self.ledger.timed_wait(w)

    def record(self) -> dict:
        """The step's quorum for the JSONL: `quorum` (the replicas whose gradients were
        averaged), `quorum_joined` (replicas that rejoined after this step, from this state),
        `quorum_round` and `quorum_retries` (rounds of this step that did not commit)."""
        q = self.quorum
        return {"quorum": q.live if q else [], "quorum_joined": q.joining if q else [],
                "quorum_round": q.round if q else -1, "quorum_retries": self.committed_retries}
