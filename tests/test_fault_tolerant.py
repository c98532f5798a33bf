"""parallel.fault_tolerant (parallel/data/fault_tolerant/quorum.py, parallel/data/fault_tolerant/launcher.py, train/fault_tolerance.py): two
replicas of one process each; replica 0 is SIGKILLed after step 2, replica 1 trains on alone,
the launcher restarts replica 0 and it rejoins from replica 1's state; then replica 0 kills the
launcher (the whole job lost) and the job resumes from the replicas' latest checkpoint.

Checked against one process (llama-tiny, fp32, the replicas' thread count), bit for bit: with
both replicas in the quorum, a step is the one-process step over both replicas' micro-batches
(grad_accum 2: the suite's reference for ordinary dp_replicate = 2 training, tests/test_zero.py);
with replica 1 alone, it is single-replica training from that same state — replica 1's
micro-batch, its loss not halved. Both replicas' final weights equal the reference's.

When replica 0 rejoins is not a matter of timing: replica 1 freezes itself (SIGSTOP) after step 5
and the test lets it go on (SIGCONT) once the restarted replica 0 says it waits to rejoin, so the
round after it always takes replica 0 in (or an earlier one, if replica 0 came back sooner:
the checks follow the quorum the log records).

Then: the same with 2-rank ZeRO-3 replicas; who writes a checkpoint (the lowest live
replica); the same rejoin with Muon and with LoRA, where the quorum
store listens (--quorum-endpoint), replicas with cp and ep inside, and the refusals. The
quorum's failure paths, in one process: tests/test_quorum.py.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from shardlm.config.load import load_config
from shardlm.errors import ConfigError
from shardlm.cli import train as cli_train
from shardlm.cli.main import main
from shardlm.launch import runtime
from shardlm.checkpoint.sharded import CheckpointWriter
from shardlm.parallel.data.fault_tolerant.launcher import (JOINED, REPLICA_FAULTS_ENV, fault_of, quorum_endpoint,
                                                          replica_faults, state_holders)
from shardlm.launch.failures import is_cut_off
from shardlm.launch.runtime import cpu_cores
from shardlm.models.moe import bias_tensors
from shardlm.train.build import build_run
from shardlm.train.step import evaluate, loss_of, train_step
from shardlm.parallel.data.zero.optim import lr_at, set_lr
from test_global_loss import CHATS

SRC = Path(__file__).resolve().parent.parent / "src"
STEPS = 9


def _overrides(tmp_path: Path) -> dict:
    return {"model.preset": "llama-tiny", "precision.compute": "fp32", "run.device": "cpu",
            "train.seq_len": 32, "train.micro_batch": 2, "train.grad_accum": 1,
            "train.steps": STEPS, "train.warmup_steps": 2, "train.eval_every": 0,
            "train.eval_batches": 1, "train.sample_tokens": 0, "data.max_bytes": 200_000,
            "run.dir": str(tmp_path / "runs"), "run.name": "ft", "run.progress": "off",
            "parallel.dp_replicate": 2, "parallel.fault_tolerant": True,
            "parallel.collective_timeout_s": 120}


@pytest.mark.parametrize("change, says", [
    ({"parallel.dp_replicate": 1}, "needs parallel.dp_replicate >= 2"),
    ({"parallel.dp_shard": 2, "parallel.zero_stage": 0}, "parallel.zero_stage = 0 (at ZeRO stage 0 "
                                                         "every rank of a replica holds the whole"),
    ({"train.local_sgd.every": 4}, "train.local_sgd.every = 4 (local SGD's replicas hold different"),
    ({"parallel.cp": 2}, "parallel.zero_stage = 0 (at ZeRO stage 0 every rank of a replica holds"),
    ({"model.preset": "moe-tiny", "parallel.dp_shard": 2, "parallel.ep": 2, "parallel.zero_stage": 1,
      "parallel.ep_rebalance_every": 2}, "parallel.ep_rebalance_every = 2 (experts move between"),
])
def test_what_fault_tolerance_does_not_compose_with_is_refused(tmp_path, change, says):
    cfg = load_config(None, {**_overrides(tmp_path), **change})
    with pytest.raises(ConfigError, match="fault_tolerant") as error:
        cfg.validate()
    assert says in str(error.value)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_replicas_of_several_ranks_shard_with_zero(tmp_path, stage):
    """Each replica a world of dp_shard ranks at ZeRO stages 1-3 (torchft's fault-tolerant
    HSDP) is accepted; the run itself: test_replicas_checkpoint_and_a_job_lost_whole_resumes_from_it."""
    load_config(None, {**_overrides(tmp_path), "parallel.dp_shard": 2,
                       "parallel.zero_stage": stage}).validate()


def test_replicas_of_several_ranks_at_stage_0_are_refused_before_spawning(tmp_path, monkeypatch,
                                                                           capsys):
    """dp_shard = -1 resolves only once --nproc is known: 4 ranks for 2 replicas at stage 0 is
    refused there (exit 2, a ConfigError), before any replica starts."""
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("a replica was started"))
    monkeypatch.setattr(cli_train, "probe_this_cpu", lambda *a, **k: None)  # not this test's
    assert main(["train", "--nproc", "4", "--parallel.dp_shard=-1",
                 *[f"--{k}={v}" for k, v in _overrides(tmp_path).items()]]) == 2
    assert "2 replicas of 2 ranks at parallel.zero_stage = 0" in capsys.readouterr().err


def test_replica_faults_name_their_replica_and_incarnation():
    assert replica_faults("1:kill@2, 0:stop@5", "", 2) == {1: ["kill@2"], 0: ["stop@5"]}
    assert replica_faults("", "kill@3", 2) == {0: ["kill@3"], 1: ["kill@3"]}
    with pytest.raises(ConfigError, match="REPLICA below 2"):
        replica_faults("2:kill@1", "", 2)
    faults = replica_faults("0:kill@2,0:leave@7/1", "", 2)[0]
    assert [fault_of(faults, i) for i in (0, 1, 2)] == ["kill@2", "leave@7/1", ""]


class _BindRecorder:
    """A socket whose bind records the address and fails: the store gets no further."""

    bound: list = []

    def __init__(self, family, kind):
        self.family = family

    def setsockopt(self, *args) -> None:
        pass

    def bind(self, address) -> None:
        _BindRecorder.bound.append((self.family, address))
        raise OSError("recorded, not bound")

    def close(self) -> None:
        pass


@pytest.mark.parametrize("flag, family, address", [
    ([], socket.AF_INET, ("127.0.0.1", 0)),  # one machine: loopback, a free port
    (["--quorum-endpoint", "10.9.8.7:29400"], socket.AF_INET, ("10.9.8.7", 29400)),
    (["--quorum-endpoint", "[fd00::5]:29400"], socket.AF_INET6, ("fd00::5", 29400)),
], ids=["default", "v4", "v6"])
def test_the_quorum_store_listens_where_the_launcher_is_told(tmp_path, monkeypatch, flag, family,
                                                              address):
    """`shardlm train --nproc 2 --quorum-endpoint HOST:PORT` (no real second machine): the
    address reaches the store's bind call, and nothing is spawned when it fails."""
    fake = types.SimpleNamespace(**{k: getattr(socket, k) for k in dir(socket) if k.isupper()},
                                 socket=_BindRecorder)
    monkeypatch.setattr(runtime, "socket", fake)
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("a replica was started"))
    monkeypatch.setattr(cli_train, "probe_this_cpu", lambda *a, **k: None)  # not this test's
    _BindRecorder.bound.clear()
    with pytest.raises(OSError, match="recorded"):
        main(["train", "--nproc", "2", *flag, *[f"--{k}={v}" for k, v in _overrides(tmp_path).items()]])
    assert _BindRecorder.bound == [(family, address)]


@pytest.mark.parametrize("endpoint, says", [
    ("0.0.0.0:29400", "not an address the replicas can connect to"),
    ("head-node", "write HOST:PORT"),
])
def test_a_quorum_endpoint_to_listen_on_but_not_to_reach_is_refused(endpoint, says):
    with pytest.raises(ConfigError, match=says):
        quorum_endpoint(endpoint)


def _replica_pids(launcher: int, replica: int) -> list[int]:
    """The live processes of `replica` (one per rank) among the launcher's children (their
    environment says)."""
    try:
        children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    except OSError:  # the launcher is gone
        return []
    pids = []
    for child in children:
        try:
            env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(e.startswith(f"SHARDLM_REPLICA={replica}/".encode()) for e in env):
            pids.append(int(child))
    return pids


def _stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


def _launch(overrides: dict, faults: str, lost: int | None, ranks: int = 1) -> tuple[int, str]:
    """`shardlm train --nproc 2·ranks --max-restarts 1` (2 replicas of `ranks` ranks) with
    $SHARDLM_REPLICA_FAULTS `faults`; the other replica than `lost`, paused (a stop fault: every
    rank of it), goes on once `lost` waits to rejoin."""
    env = dict(os.environ, PYTHONPATH=str(SRC), **{REPLICA_FAULTS_ENV: faults})
    argv = [sys.executable, "-m", "shardlm", "train", "--nproc", str(2 * ranks), "--max-restarts", "1",
            *[f"--{k}={v}" for k, v in overrides.items()]]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 480 * ranks  # a bound on a hang, not a timing the test depends on
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if lost is not None and any(f"replica {lost} waits to rejoin" in line for line in list(lines)):
                pids = _replica_pids(proc.pid, 1 - lost)
                if pids and all(_stopped(pid) for pid in pids):
                    for pid in pids:
                        os.kill(pid, signal.SIGCONT)
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(10)
    return proc.wait(), "".join(lines)


def _records(path: Path) -> list[dict]:
    """The step records; a record cut off by a SIGKILL mid-write (telemetry.is_cut_off) is not one."""
    return [r for r in map(json.loads, (line for line in path.read_text().splitlines() if not is_cut_off(line)))
            if "loss" in r]


def _reference(tmp_path: Path, quorums: list[list[int]], ranks: int = 1, extra: dict | None = None):
    """The one-process run the replicas' steps equal, at their thread count (1 each on 2
    cores): a step of both replicas is the global batch (grad_accum 2·ranks, as ordinary
    dp_replicate = 2 × dp_shard = ranks); a step of one replica alone is its ranks'
    micro-batches (rank i of replica r has the reference's (r·ranks + i)-th), the mean over one
    replica. `ranks`: a replica's data-parallel ranks (its cp ranks read one micro-batch);
    `extra`: the run's other settings (model, steps). Returns the run and its losses."""
    torch.set_num_threads(max(1, cpu_cores() // 2))
    ref_cfg = load_config(None, {**_overrides(tmp_path), **(extra or {}), "parallel.dp_replicate": 1,
                                 "parallel.fault_tolerant": False,
                                 "train.grad_accum": 2 * ranks * (extra or {}).get("train.grad_accum", 1),
                                 "run.name": "reference"})
    run = build_run(ref_cfg.validate())
    losses = []
    for step, quorum in enumerate(quorums):
        if len(quorum) == 2:
            losses.append(train_step(run, step).loss)
            continue
        set_lr(run.strategy.optimizer, lr_at(step, run.cfg.train))
        total = torch.zeros(())
        for x, y in run.train_loader.micro_batches(step)[quorum[0] * ranks:(quorum[0] + 1) * ranks]:
            loss = loss_of(run, x, y) / ranks  # (/ 1: exact)
            loss.backward()
            total += loss.detach()
        run.strategy.clip_grad_norm(run.cfg.train.grad_clip or float("inf"))
        run.strategy.step()
        run.strategy.zero_grad()
        losses.append(float(total))
    return run, losses


def _assert_final_weights(tmp_path: Path, run, rtol: float = 0.0, atol: float = 0.0) -> None:
    """Both replicas' final weights are the reference's, bit for bit (or within the tolerance),
    and each other's bit for bit (the same averaged shards, the same state taken on rejoin)."""
    reference = {**{n: p.detach() for n, p in run.model.named_parameters()},
                 **bias_tensors(run.moe)}  # model.balance = 'bias': the routers' biases, saved too
    saved = [load_file(tmp_path / "runs" / "ft" / f"replica-{r}" / "model.safetensors") for r in (0, 1)]
    for replica in (0, 1):
        assert saved[replica].keys() == reference.keys()
        assert all(torch.equal(saved[replica][n], saved[0][n]) for n in reference), replica
        assert all(torch.allclose(saved[replica][n], reference[n], rtol=rtol, atol=atol)
                   for n in reference), replica


@pytest.mark.parametrize("ranks, layout", [
    (1, {}),
    (2, {"parallel.dp_shard": 2, "parallel.zero_stage": 3}),
], ids=["one-rank-replicas", "zero3-2-rank-replicas"])
def test_replicas_checkpoint_and_a_job_lost_whole_resumes_from_it(tmp_path, ranks, layout):
    """checkpoint.every = 3 with replicas (of one process, or of 2 ranks at ZeRO-3: the issue's
    fault-tolerant HSDP): replica 0 is killed after step 2 and restarted
    (replica 1, the lowest live replica then, writes step 3); replica 1 pauses after step 5 until
    replica 0 waits to rejoin, so replica 0 is back by step 6. Once back, replica 0 kills the
    launcher after step 7 (a 'leave': the whole job lost at once, replica 1 with it, which
    cannot finish step 8 alone meanwhile: replica 0 is not reported dead). Launched again, the
    job resumes from step 6 and finishes; its losses and weights are the uninterrupted
    one-process reference's.

    The drop-out and the rejoin themselves (one-rank replicas): the quorum of every step the
    log records, the survivor's lone steps equal to single-replica training from the same state,
    and the bytes: an averaged step all-reduces every gradient and (loss, stop, counted
    targets), fp32, counted twice (reduce-scatter + all-gather); alone, nothing; the join sends
    the state (AdamW's values and moments, the step, the RNG)."""
    overrides = {**_overrides(tmp_path), "checkpoint.every": 3, **layout}
    code, output = _launch(overrides, "0:kill@2,1:stop@5,0:leave@7/1", lost=0, ranks=ranks)
    assert code == -signal.SIGKILL, output[-3000:]  # the launcher, killed by replica 0
    assert "replica 0 exited with -9: restarting it" in output, output[-3000:]
    assert "replica 0 rejoined at step" in output, output[-3000:]
    root = tmp_path / "runs" / "ft"
    assert sorted(p.name for p in (root / "checkpoints").glob("step-*")) == ["step-00000003",
                                                                            "step-00000006"]
    lost = {r: _records(root / f"replica-{r}" / "metrics.jsonl") for r in (0, 1)}
    survivor = lost[1][:6]  # replica 1 took every step up to 6 (7 maybe not logged: killed)
    assert [r["step"] for r in survivor] == list(range(1, 7)), lost[1]
    assert survivor[2]["quorum"] == [1]  # step 3: replica 1 alone, the lowest live replica
    # Each checkpoint was written once, by the lowest live replica of its step's quorum.
    written = sorted((r["checkpoint_step"], replica) for replica in (0, 1) for r in lost[replica]
                     if "checkpoint_step" in r)
    assert written == [(3, 1), (6, min(survivor[5]["quorum"]))], written

    code, output = _launch(overrides, "", lost=None, ranks=ranks)
    assert code == 0, output[-3000:]
    assert "resumed from" in output and "step-00000006" in output, output[-3000:]
    resumed = {r: _records(root / f"replica-{r}" / "metrics.jsonl")[len(lost[r]):] for r in (0, 1)}
    assert all([r["step"] for r in resumed[k]] == [7, 8, 9] for k in (0, 1)), resumed
    assert resumed[0][-1]["checkpoint_step"] == 9 and "checkpoint_step" not in resumed[1][-1]

    quorums = [r["quorum"] for r in survivor + resumed[1]]
    assert quorums[6:] == [[0, 1]] * 3, quorums
    joined = [r["step"] for r in survivor if r.get("quorum_joined") == [0]]
    assert len(joined) == 1 and 3 <= joined[0] <= 6, quorums  # stop@5: the round after at most
    rejoin = joined[0]
    assert quorums[:2] == [[0, 1]] * 2, quorums
    assert quorums[2:rejoin] == [[1]] * (rejoin - 2), quorums  # alone, the join round included
    assert quorums[rejoin:] == [[0, 1]] * (STEPS - rejoin), quorums
    run, losses = _reference(tmp_path, quorums, ranks)
    if ranks == 1:
        numel = sum(p.numel() for p in run.model.parameters())
        by_op = [r["comm_bytes_by_op"] for r in survivor]
        averaged = {"all_reduce/replicas": 2 * 4 * (numel + 3)}
        assert all(b == averaged for b in by_op[:2] + by_op[rejoin:]), by_op
        assert all(b == {} for b in by_op[2:rejoin - 1]), by_op
        state = 8 * 6 + 3 * 4 * numel + torch.get_rng_state().numel()  # meta, values + moments, RNG
        assert by_op[rejoin - 1] == {**averaged, "broadcast/replicas": state}, by_op
        # Bit for bit: each side adds the same two fp32 terms (a sum of two is the same in
        # either order), and a resume restores the fp32 weights, the moments and the Adam step
        # exactly; with more terms the sums' order differs and calls for a tolerance.
        assert [r["loss"] for r in survivor + resumed[1]] == losses
        assert [r["loss"] for r in resumed[0]] == losses[6:]
        _assert_final_weights(tmp_path, run)
        return
    # 2 x 2 ranks: a gradient is (a0 + a1) + (b0 + b1) (reduce-scatter in a replica, then the
    # quorum), the reference's ((a0 + a1) + b0) + b1, and the norm's squares are summed per
    # shard: fp32 reassociations of 4 terms, <= 3 ulp (2^-24 relative each) per element and
    # step, carried through 9 AdamW steps of at most ~lr (1e-3) per element. Measured here: the
    # losses (~6.2) within 5e-7 of the reference's. The bounds, 1e-4 on losses and 1e-5 on
    # weights, leave that margin and stay far below the ~1e-2 by which one step's loss differs
    # from the next (a rank's micro-batch left out of the mean is a change of that order). The
    # replicas among themselves: bit for bit (the same sums, the state taken whole).
    got = [r["loss"] for r in survivor + resumed[1]]
    assert max(abs(a - b) for a, b in zip(got, losses)) < 1e-4, (got, losses)
    assert [r["loss"] for r in resumed[0]] == got[6:]  # the replicas' own losses: the same sums
    _assert_final_weights(tmp_path, run, rtol=0.0, atol=1e-5)


CHAT = {"data.format": "chat", "data.max_bytes": 0, "data.val_fraction": 0.1}  # loss on assistant tokens
EP2_BIAS = {"model.preset": "moe-tiny", "model.balance": "bias", "model.bias_update_rate": 0.05}


# Replicas of 2 ranks with cp = 2 (on chat rows of uneven loss counts: the global batch's summed
# loss over its counted targets, whichever replica counted them), ep = 2 (routers balanced by
# bias: moved by the step's loads, the whole step's only through the replicas' all-reduce) or
# pp = 2 (rank i of a replica is the hybrid run's rank at its stage, replica and place: it reads
# that rank's data) inside, 3 steps, against one process of grad_accum 2 x the replica's
# data-parallel ranks x grad_accum. fp32 reassociations (cp halves and the ring's merged softmax,
# experts' rows combined elsewhere) as test_replicas_checkpoint_and_a_job_lost_whole_resumes_from_it
# bounds them, AdamW's eps 1e-4 as tests/test_context_parallel.py's ADAM_EPS says why. Measured:
# losses within 9.6e-7 (cp), 0 (ep), 4.8e-7 (pp); weights 1.2e-7, 6.3e-7, 1.2e-7. Failing ways,
# measured: rank i paired with rank 1 - i, 8.7e-3 / 5.0e-3; each replica's own counted targets,
# the loss 2x; each replica's own loads, weights 3.4e-3 apart; pp's rank i numbered r·N + i (the
# wrong data), 9.3e-3 / 4.9e-3.
@pytest.mark.parametrize("layout, extra, data_ranks", [
    ({"parallel.cp": 2, "parallel.zero_stage": 1}, CHAT, 1),
    ({"parallel.dp_shard": 2, "parallel.ep": 2, "parallel.zero_stage": 1}, EP2_BIAS, 2),
    ({"parallel.pp": 2}, {"train.grad_accum": 2}, 1),
], ids=["cp2-replicas", "ep2-replicas", "pp2-replicas"])
def test_replicas_with_cp_ep_or_pp_inside_equal_one_process(tmp_path, layout, extra, data_ranks):
    extra = {**extra, "train.steps": 3, "train.eps": 1e-4}
    if extra.get("data.format") == "chat":
        extra["data.source"] = str(tmp_path / "chat.jsonl")
        Path(extra["data.source"]).write_text("".join(json.dumps(c) + "\n" for _ in range(12) for c in CHATS))
    code, output = _launch({**_overrides(tmp_path), **extra, **layout}, "", lost=None, ranks=2)
    assert code == 0, output[-3000:]
    records = _records(tmp_path / "runs" / "ft" / "replica-0" / "metrics.jsonl")
    assert [r["quorum"] for r in records] == [[0, 1]] * 3, records
    run, losses = _reference(tmp_path, [[0, 1]] * 3, data_ranks, extra)
    got = [r["loss"] for r in records]
    assert max(abs(a - b) for a, b in zip(got, losses)) < 1e-4, (got, losses)
    _assert_final_weights(tmp_path, run, rtol=0.0, atol=1e-5)
    # The final validation: each replica deals the windows to its data-parallel ranks only (its
    # tp, cp, pp ranks see the same ones; dealt to every rank, pp's measured 6.2513 for 6.2172).
    assert abs(records[-1]["val_loss"] - evaluate(run)["val_loss"]) < 1e-4, records[-1]


@pytest.mark.parametrize("change, ranks", [({"train.optimizer": "muon", "lora.rank": 4}, 1),
                                           ({"parallel.tp": 2, "parallel.zero_stage": 1}, 2),
                                           ({**EP2_BIAS, "parallel.dp_shard": 2, "parallel.ep": 2,
                                             "parallel.zero_stage": 1}, 2)],
                         ids=["muon-lora", "tp2-replicas", "ep2-replicas"])
def test_a_rejoining_replica_takes_muon_and_lora_state(tmp_path, change, ranks):
    """Muon's momentum over LoRA's adapters, with the frozen base, go to a rejoining replica
    like AdamW's state (one run for both: Muon orthogonalises each adapter factor, so its
    momentum is the adapters' state): replica 1 killed after step 1, back by step 4 (replica 0
    pauses after step 3), and both replicas' final weights are the same, bit for bit — a joiner
    that missed any of the state (a zero momentum, an adapter at its initial zero) would take a
    different update at its first step. And
    replicas of tp = 2 ranks each: rank i (tp position i) takes its state from the live
    replica's rank i; and of ep = 2 (bias balancing): rank i takes the same experts' state and
    the routers' biases (a joiner with its initial biases would route differently)."""
    overrides = {**_overrides(tmp_path), "train.steps": 6, **change}
    code, output = _launch(overrides, "1:kill@1,0:stop@3", lost=1, ranks=ranks)
    assert code == 0, output[-3000:]
    assert "replica 1 rejoined at step" in output, output[-3000:]
    records = _records(tmp_path / "runs" / "ft" / "replica-0" / "metrics.jsonl")
    assert [r["quorum"] for r in records][-1] == [0, 1]
    weights = [load_file(tmp_path / "runs" / "ft" / f"replica-{r}" / "model.safetensors") for r in (0, 1)]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][n], weights[1][n]) for n in weights[0])


def test_each_replicas_writer_sweeps_only_its_own_leftovers(tmp_path):
    """Replicas write one checkpoints/ (whichever is the lowest live one): a restarted
    replica's writer removes its own crashed saves, never another replica's save in flight."""
    own_stale = tmp_path / ".step-00000004.replica-1-111-1.tmp"
    in_flight = tmp_path / ".step-00000006.replica-0-222-2.tmp"
    other_old = tmp_path / ".step-00000003.replica-0-222-2.old"
    for d in (own_stale, in_flight, other_old):
        d.mkdir()
    CheckpointWriter(tmp_path, 0, 1, keep=2, asynchronous=False, session="replica-1-333-3",
                     timeout_s=5.0, owner="replica-1-")
    assert not own_stale.exists() and in_flight.exists() and other_old.exists()


def test_the_launcher_counts_who_holds_the_state():
    """A first incarnation holds the state (fresh or from a checkpoint); a restarted replica
    only once it has rejoined; a dead one never: with no holder left the job stops."""
    store = dist.HashStore()
    alive = types.SimpleNamespace(poll=lambda: None)
    dead = types.SimpleNamespace(poll=lambda: -9)
    assert state_holders(store, {0: alive, 1: alive}, {0: 0, 1: 1}) == [0]
    store.set(JOINED.format(1), "1")
    assert state_holders(store, {0: dead, 1: alive}, {0: 0, 1: 1}) == [1]
    assert state_holders(store, {1: alive}, {0: 0, 1: 2}) == []  # rejoined as incarnation 1, not 2
