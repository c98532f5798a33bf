"""The fault-tolerant replicas' quorum (parallel/data/fault_tolerant/quorum.py): its failure
paths, in one process: each replica a thread with its own ReplicaGroup, the store a real
TCPStore, the groups real gloo groups; the failure injected where it strikes. The spawned runs
(kills, rejoins, checkpoints, layouts inside a replica): tests/test_fault_tolerant.py."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch
import torch.distributed as dist

from shardlm.comm.collectives import CommLedger
from shardlm.launch import runtime
from shardlm.launch.local import loopback_interface
from shardlm.parallel.data.fault_tolerant.launcher import ReplicaIdentity
from shardlm.parallel.data.fault_tolerant.quorum import ReplicaGroup, ReplicaLost


def _replica_groups(monkeypatch, n: int = 2, **timeouts) -> tuple[dist.TCPStore, list]:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", loopback_interface())
    store = runtime.loopback_store("127.0.0.1", 0, True, datetime.timedelta(seconds=30))
    t = {"quorum_timeout_s": 2.0, "collective_timeout_s": 3.0, **timeouts}
    groups = [ReplicaGroup(ReplicaIdentity(r, n, 0, "127.0.0.1", store.port), CommLedger(),
                           t["quorum_timeout_s"], t["collective_timeout_s"]) for r in range(n)]
    return store, groups


def _in_threads(*calls):
    """Run each call in a thread of its own; their results (or exceptions) in order."""
    out: list = [None] * len(calls)

    def run(i, call):
        try:
            out[i] = call()
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            out[i] = e
    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_a_failed_all_reduce_is_not_committed_and_the_step_is_retaken(monkeypatch):
    """Replica 1 enters the round's group but never all-reduces (as if it died during it):
    replica 0's all-reduce fails after the collective timeout, the step is not committed (its
    gradients untouched), and once the launcher reports replica 1 dead the step is taken again
    by replica 0 alone (the mean over one replica: x2) and counts one retry."""
    store, (g0, g1) = _replica_groups(monkeypatch)
    g1._all_reduce = lambda tensors: None  # in the group, silent
    grads = [torch.ones(4)]
    assert _in_threads(lambda: g0.average(grads, 0), lambda: g1.average([torch.ones(4)], 0)) == [False, True]
    assert torch.equal(grads[0], torch.ones(4)) and g0.retries == 1
    store.add("deaths/1", 1)
    assert g0.average(grads, 0) is True
    assert torch.equal(grads[0], torch.full((4,), 2.0))  # summed alone, then x 2 / 1 live
    record = g0.record()
    assert (record["quorum"], record["quorum_joined"], record["quorum_retries"]) == ([0], [], 1)


def test_a_replica_left_out_of_a_quorum_is_lost(monkeypatch):
    """Replica 1 comes to round 0 after replica 0 closed it alone (its quorum timeout, 0.3 s):
    replica 1 raises ReplicaLost (its process exits and rejoins); and a replica a committed step
    behind the others is lost too."""
    store, (g0, g1) = _replica_groups(monkeypatch, quorum_timeout_s=0.3)
    g0.round, g1.round = 1, 1  # past round 0, which waits for everyone as long as a collective
    assert g0.average([torch.ones(2)], 0) is True
    with pytest.raises(ReplicaLost, match="after the others had gone on without it"):
        g1.average([torch.ones(2)], 0)
    # Round 2: replica 1, still at step 1, finds replica 0 registered at step 2.
    g1.round, g1.last = 2, [(0, 0), (1, 0)]
    g0._register(2, 1, "live")
    with pytest.raises(ReplicaLost, match="the others at 2"):
        g1.average([torch.ones(2)], 0)


def test_a_state_transfer_that_fails_leaves_the_joiner_without_state(monkeypatch):
    """Replica 1 rejoins; the live replica 0 takes part in the round but dies before it sends
    the state (here: never broadcasts): the joiner's share_state reports the failure after the
    collective timeout (train/fault_tolerance.rejoin then raises and the process restarts)."""
    store, (g0, _) = _replica_groups(monkeypatch)
    joiner = ReplicaGroup(ReplicaIdentity(1, 2, 1, "127.0.0.1", store.port), CommLedger(), 2.0, 3.0)
    store.add("deaths/1", 1)  # incarnation 0 died; round 0 waits for incarnation 0 no more
    g0.last = [(0, 0), (1, 1)]
    live, joined = _in_threads(lambda: g0.average([torch.ones(2)], 0),
                               lambda: joiner.join([torch.zeros(2)], 0))
    assert live is True and joined.joining == [1], (live, joined)
    received = [torch.zeros(3)]
    assert _in_threads(lambda: joiner.share_state(received)) == [False]
    assert torch.equal(received[0], torch.zeros(3)) and joiner._group is None
