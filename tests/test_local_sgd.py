"""Local SGD / DiLoCo (train.local_sgd, parallel/data/zero/local_sgd.py) on 2 gloo ranks (dp_replicate = 2,
dp_shard = 1) against a single-process simulation of the two replicas written here: two one-process
runs (the plain local engine: torch's fused AdamW, the one-process reference of every parity test),
each fed the micro-batches the loader gives its replica's rank, and the outer step of the DiLoCo
paper (Nesterov SGD on the replicas' mean pseudo-gradient) or plain averaging, every H steps and
at the last one.

Tolerance: none. Each replica's inner steps are one process's (one micro-batch per rank, no
reduction), the mean of two pseudo-gradients is order-free, and the outer step is single-rounding
element-wise arithmetic on both sides: parameters and losses match bit for bit (llama-tiny, fp32).
That is the same operations on the same operands on any CPU, not one machine's luck, because:
the simulation runs at the ranks' thread count (LOCAL_WORLD_SIZE); with dp_shard = 1 each
replica's clipping norm is torch's per-tensor norms of its whole gradients, no squares summed
over a group (dp_shard_group is None); and fused AdamW, which the ranks run over flat segments
(parameters back to back) and the simulation per tensor, rounds its vector loop and its scalar
tail differently (FMA), but every llama-tiny parameter is a multiple of 64 elements, so no
element is in a tail on either side at any vector width up to AVX-512's 16 floats.
A mixture of experts (ep = 1, balanced by the routers' bias) is one more case of that world, bit
for bit too: the biases are moved by both replicas' summed loads on the ranks and in the simulation.
One spawned world also checks the byte ledger (one fp32 all-reduce of the parameters per round,
nothing across replicas on inner steps), the memory ledger, and a resume from a checkpoint taken
in the middle of a round (every replica's own state and the outer momentum restored: the resumed
run ends where the uninterrupted one does, bitwise).
"""

from __future__ import annotations

import os

import pytest
import torch

from conftest import tiny_overrides
from shardlm.checkpoint.sharded import CHECKPOINTS
from shardlm.config.load import load_config
from shardlm.data.loader import Loader
from shardlm.errors import ConfigError
from shardlm.launch.spawn import run_ranks
from shardlm.planner.traffic import local_sgd_comm_bytes
from shardlm.train.checkpointing import save_checkpoint
from shardlm.train.build import build_run
from shardlm.train.step import train_step
from zero_cases import train_case

STEPS, EVERY = 5, 2  # outer steps after steps 2, 4 and 5 (the last round is one step)
MOE = {"model.experts": 4, "model.top_k": 2, "model.router": "sigmoid", "model.balance": "bias",
       "model.bias_update_rate": 0.05}
"""Balanced by DeepSeek-V3's bias (the router's one state beside its weights) at 50x the default
rate, so that it changes the routing within STEPS (each replica's own loads alone: other losses)."""


def _base(tmp, **extra) -> dict:
    return {**tiny_overrides(tmp, model__preset="llama-tiny", train__micro_batch=4, train__steps=STEPS),
            "parallel.dp_replicate": 2, "parallel.dp_shard": 1, "train.local_sgd.every": EVERY, **extra}


def _train(overrides: dict, checkpoint_at: int = 0) -> dict:
    """Train to STEPS (from a checkpoint, if overrides name one) as the loop does (train_step; not
    train.loop.train, whose evaluation and planner probe cost seconds), saving a checkpoint after
    step `checkpoint_at`. Losses, each step's ledger by group, whole parameters, state bytes."""
    run = build_run(load_config(overrides=overrides).validate())
    out = {"start": run.start_step, "dir": run.run_dir, "losses": [], "comm_by_op": []}
    outer = run.strategy.local_sgd
    if outer is not None:  # at the start: is θ_outer the model, is the momentum zero?
        out["outer_is_model"] = all(torch.equal(o, m) for o, m in zip(outer.outer_params, outer._masters()))
        out["momentum_zero"] = all(not b.any() for b in outer.momentum)
    for step in range(run.start_step, STEPS):
        run.strategy.ledger.reset()
        out["losses"].append(train_step(run, step).loss)
        by_group: dict[str, int] = {}
        for key, nbytes in run.strategy.ledger.bytes.items():
            by_group[key.split("/", 1)[1]] = by_group.get(key.split("/", 1)[1], 0) + nbytes
        out["comm_by_op"].append(by_group)
        if step + 1 == checkpoint_at:
            save_checkpoint(run, checkpoint_at)
    out["state"], out["numel"] = run.strategy.model_state_bytes(), run.strategy.numel
    out["biases"] = _biases(run)
    with run.strategy.full_parameters():
        out["params"] = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    # a tp or ep rank's pieces (tp_cases.whole_params puts them together)
    out["splits"] = {n: s for cut in ("tp", "ep") for n, s in getattr(getattr(run.model, cut, None), "splits", {}).items()}
    return out


def _biases(run) -> dict[int, torch.Tensor]:
    """The routers' balancing biases by block (balance = 'bias'; else none)."""
    return {k: b.clone() for k, b in run.moe.biases.items()} if run.moe is not None else {}


def local_sgd_ranks(rank: int, world_size: int, cases: list[dict]) -> dict:
    """Each case; the first also checkpoints after step 3 (inside the round 3-4), and a second
    run resumes from that checkpoint and trains to the end."""
    torch.manual_seed(0)
    out = [_train(overrides, checkpoint_at=3 if i == 0 else 0) for i, overrides in enumerate(cases)]
    resumed = _train({**cases[0], "run.name": "resumed", "checkpoint.resume": str(out[0]["dir"] / CHECKPOINTS)})
    # an infinite gradient on replica 1 only, in the first step: each replica has its own norm
    poisoned = train_case({**cases[0], "run.name": "poisoned", "train.on_nonfinite": "skip"}, 2, poison_rank=1)
    # DiLoCo from a synchronous run's checkpoint (the paper's recipe): every replica its model
    ddp = _train({**cases[0], "run.name": "ddp", "train.local_sgd.every": 0}, checkpoint_at=3)
    from_ddp = _train({**cases[0], "run.name": "from_ddp",
                       "checkpoint.resume": str(sorted((ddp["dir"] / CHECKPOINTS).glob("step-*"))[0])})
    return {"cases": out, "resumed": resumed, "stepped": poisoned["stepped"], "ddp": ddp, "from_ddp": from_ddp}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("local_sgd")
    cases = [_base(tmp, **{"parallel.zero_stage": 1, "run.name": "stage1"}),  # diloco, the ZeRO group's path
             _base(tmp, **{"parallel.zero_stage": 0, "train.local_sgd.outer": "average"}),
             _base(tmp, **{"parallel.zero_stage": 3}),  # sharded parameters (shard_param)
             _base(tmp, **{"parallel.zero_stage": 1, **MOE, "run.name": "moe"})]  # experts, ep = 1
    return cases, run_ranks(local_sgd_ranks, 2, tmp, cases)


class _ReplicaData:
    """A replica of `shards` ranks as one process sees it: each rank's micro-batches in turn
    (accumulated, as the ranks' reduction sums them)."""

    def __init__(self, loaders: list):
        self.loaders, self.mask, self.source_len = loaders, loaders[0].mask, loaders[0].source_len

    def micro_batches(self, step: int) -> list:
        return [batch for loader in self.loaders for batch in loader.micro_batches(step)]


def _biases_moved_by_every_replica(runs: list, results: list, before: list[dict]) -> None:
    """balance = 'bias': the ranks move the biases by the loads summed over every rank, both replicas'
    (finish_moe_step), each one-process replica here by its own: restored, moved by the sum instead."""
    from shardlm.models.moe import update_biases

    if not before[0] or not results[0].stepped:
        return
    routed = sum(result.state.moe_sums[:, :runs[0].moe.experts] for result in results)
    for run, biases in zip(runs, before):
        for layer, bias in biases.items():
            run.moe.biases[layer].copy_(bias)
        update_biases(run.moe, routed, run.cfg.model.bias_update_rate)


def simulate(overrides: dict, steps: int, shards: int = 1) -> dict:
    """The two replicas in this process: each a one-process run (its model, its AdamW) fed the
    micro-batches the loader gives its `shards` ranks; the outer step written out as in the paper."""
    saved = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = str(2 * shards)  # the ranks' thread count: CPU kernels round by it
    try:
        one = {**overrides, "parallel.dp_replicate": 1, "parallel.dp_shard": -1, "parallel.zero_stage": 0,
               "parallel.ep": 1, "train.local_sgd.every": 0}
        runs = [build_run(load_config(overrides={**one, "run.name": f"replica{r}"}).validate()) for r in range(2)]
    finally:
        if saved is None:
            os.environ.pop("LOCAL_WORLD_SIZE")
        else:
            os.environ["LOCAL_WORLD_SIZE"] = saved
    t, sgd = runs[0].cfg.train, load_config(overrides=overrides).train.local_sgd
    for r, run in enumerate(runs):  # the loaders the replica's ranks build (dp_rank r·shards + k)
        run.train_loader = _ReplicaData([Loader(run.dataset.train, t.seq_len, t.micro_batch, t.grad_accum,
                                                t.seed, dp_rank=r * shards + k, dp_size=2 * shards,
                                                mask=run.dataset.train_mask) for k in range(shards)])
    params = [dict(run.model.named_parameters()) for run in runs]
    outer = {n: p.detach().clone() for n, p in params[0].items()}  # θ_outer, fp32
    momentum = {n: torch.zeros_like(p) for n, p in outer.items()}
    losses, diverged = [], False
    for step in range(steps):
        biases = [_biases(run) for run in runs]
        results = [train_step(run, step) for run in runs]
        _biases_moved_by_every_replica(runs, results, biases)
        replica_losses = [result.loss for result in results]
        # The logged loss: the mean of the replicas' (each rank's sum / 2, summed over ranks).
        losses.append(float(sum(torch.tensor(v, dtype=torch.float32) / 2 for v in replica_losses)))
        if (step + 1) % sgd.every and step + 1 != steps:
            diverged |= any(not torch.equal(params[0][n], params[1][n]) for n in outer)
            continue
        with torch.no_grad():
            for n, theta in outer.items():
                delta = (theta - params[0][n]) + (theta - params[1][n])  # Δ summed over replicas
                delta.div_(2)
                if sgd.outer == "diloco":  # b ← μ b + Δ;  θ ← θ − lr (Δ + μ b)
                    momentum[n].mul_(sgd.outer_momentum).add_(delta)
                    delta.add_(momentum[n] * sgd.outer_momentum)
                    delta.mul_(sgd.outer_lr)
                theta.sub_(delta)
                for p in params:
                    p[n].copy_(theta)
    assert diverged, "the replicas never differed between outer steps: nothing was tested"
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in params[0].items()},
            "biases": _biases(runs[0])}


@pytest.fixture(scope="module")
def simulations() -> dict[tuple, dict]:
    """Each outer step's (and model's) simulation, run once: it does not depend on the ZeRO stage."""
    return {}


@pytest.mark.parametrize("case", [0, 1, 2, 3], ids=["diloco-stage1", "average-stage0", "diloco-stage3", "moe-stage1"])
def test_matches_single_process_simulation(world, simulations, case):
    """The mixture of experts (case 3) too, bit for bit, its routers' biases included: moved every
    step by both replicas' summed loads, they are alike everywhere and the outer step leaves them."""
    cases, out = world
    key = (cases[case].get("train.local_sgd.outer", "diloco"), cases[case].get("model.experts", 0))
    if key not in simulations:
        simulations[key] = simulate(cases[case], STEPS)
    ref = simulations[key]
    assert all(p.numel() % 16 == 0 for p in ref["params"].values())  # no AdamW tail (docstring)
    assert bool(ref["biases"]) == (case == 3)
    for rank in range(2):
        got = out[rank]["cases"][case]
        assert got["losses"] == ref["losses"], rank
        for n, p in ref["params"].items():
            assert torch.equal(got["params"][n], p), (rank, n)
        assert got["biases"].keys() == ref["biases"].keys()
        assert all(torch.equal(got["biases"][k], b) for k, b in ref["biases"].items()), rank


def test_cross_replica_bytes_one_all_reduce_per_round(world):
    cases, out = world
    for case in range(len(cases)):
        got = out[0]["cases"][case]
        numel = got["numel"]
        for step, by_group in enumerate(got["comm_by_op"]):
            synced = (step + 1) % EVERY == 0 or step + 1 == STEPS
            # one all-reduce of this rank's fp32 pseudo-gradient: counted as 2 × 4 bytes × Ψ
            # (the ledger counts an all-reduce as a reduce-scatter plus an all-gather)
            assert by_group == ({"dp_replicate": 2 * 4 * numel} if synced else {}), (case, step, by_group)
    # the planner's term: the same bytes spread over a round
    assert local_sgd_comm_bytes(numel, 1, EVERY) * EVERY == 2 * 4 * numel


def test_outer_state_in_the_memory_ledger(world):
    _, out = world
    diloco, average = out[0]["cases"][0], out[0]["cases"][1]
    assert diloco["state"]["local_sgd"] == 2 * 4 * diloco["numel"]  # θ_outer + momentum, fp32
    assert average["state"]["local_sgd"] == 4 * average["numel"]  # θ_outer only


def test_the_planner_predicts_the_outer_model_and_the_round_s_all_reduce(world):
    """predict_local for each case's config: the outer model's bytes are the ledger's, and the one
    cross-replica collective is the rounds' all-reduce at the ledger's bytes per step, with no
    per-step gradient all-reduce across the replicas beside it."""
    from shardlm.planner.search import predict_local

    cases, out = world
    for case, got in zip(cases, out[0]["cases"]):
        predicted = predict_local(load_config(overrides=case).validate(), 2)
        assert predicted.model_state_bytes["local_sgd"] == got["state"]["local_sgd"], case
        _planner_sends_the_rank_s_masters(predicted.timing.comms, got)
        assert not any(c.name == "all-reduce gradients" for c in predicted.timing.comms)  # dp_shard = 1


def _planner_sends_the_rank_s_masters(comms: list, got: dict) -> None:
    """The planner's one collective across replicas: the round's all-reduce of got["numel"] masters."""
    across = [c for c in comms if "replica" in c.name]
    assert [c.name for c in across] == ["all-reduce pseudo-gradient across replicas (local SGD)"]
    assert across[0].bytes == local_sgd_comm_bytes(got["numel"], 1, EVERY)


AXES = ("tp", "cp", "pp", "ep")
"""Model parallelism inside each replica: one axis of 2 at a time, 2 replicas, 4 ranks (ep: the MoE
model on dp_shard = 2 ranks at ZeRO-0, its expert gradients reduced within the replica only)."""
AXIS_KEYS = {"ep": {**MOE, "parallel.dp_shard": 2, "parallel.zero_stage": 0}}


@pytest.fixture(scope="module")
def axes_world(tmp_path_factory):
    """DiLoCo over 2 replicas of each model-parallel axis of 2, ZeRO-1 inside the replica, in one
    spawned 4-rank world; and each case's tp = cp = pp = 1 simulation."""
    tmp = tmp_path_factory.mktemp("local_sgd_axes")
    cases = [_base(tmp, **{"parallel.zero_stage": 1, f"parallel.{axis}": 2, "run.name": axis,
                           **AXIS_KEYS.get(axis, {})}) for axis in AXES]
    out = run_ranks(local_sgd_cases, 4, tmp, cases)
    dense = simulate({**cases[0], "parallel.tp": 1}, STEPS)  # the same for every dense axis
    # ep: each replica's two ranks' micro-batches accumulated in one process
    return cases, out, {"ep": simulate(cases[AXES.index("ep")], STEPS, shards=2), **dict.fromkeys(AXES[:3], dense)}


@pytest.mark.parametrize("axis", AXES)
def test_model_parallelism_inside_each_replica_matches_the_simulation(axes_world, axis):
    """Each rank's masters are its piece of the model — a tp cut, a pipeline stage's blocks,
    (cp) a ZeRO-1 shard over the cp ranks, or (ep) the dense part whole and its own experts —
    so its θ_outer, momentum and pseudo-gradient are that piece, and the outer step's all-reduce
    runs over the ranks holding the same piece on the other replica (rank i of each: the same
    place in the grid, so the same experts). Against the one-process simulation above.
    Tolerance: tp sums each row-parallel product from two partial products, cp merges two
    attention blocks' softmaxes, pp and cp accumulate other micro-batch splits, ep computes an
    expert's weight gradient in one product over both ranks' tokens (the all-to-all joins them)
    where one process sums two micro-batches' products and the replica's norm from two ranks'
    partial squares: one more rounding here and there (~eps·sqrt(d) relative), so the losses
    agree within 1e-6 relative (measured: tp, cp 7.7e-8; ep 1.6e-7; pp 0) and the parameters
    within 1e-5 of each tensor's largest value — except where AdamW's scale-free update
    m/(sqrt(v) + eps) turned a near-zero gradient's rounding into a visible step (measured: tp 8
    of 150k elements, at most 1% of lr): at most 1 in 1,000 elements of a tensor, each within
    STEPS · lr (AdamW moves an element at most lr a step; the outer Nesterov step moves the
    replicas' mean, no more). The routers' balancing biases (ep) are exactly alike on every rank:
    moved by the same all-reduced integer loads."""
    from tp_cases import whole_params

    cases, out, refs = axes_world
    i, ref = AXES.index(axis), refs[axis]
    group = 2 if axis in ("tp", "cp", "ep") else 1  # ranks of one replica's group, side by side
    lr = load_config(overrides=cases[i]).train.lr
    for replica in (0, 1):
        ranks = [out[r][i] for r in range(4) if r // group % 2 == replica]
        for got in ranks:
            assert got["losses"] == pytest.approx(ref["losses"], rel=1e-6, abs=0), (axis, replica)
        whole = whole_params(ranks)  # tp: the cuts joined; pp: the stages' blocks; cp: whole on each
        assert whole.keys() == ref["params"].keys(), axis
        for name, want in ref["params"].items():
            off = (whole[name] - want).abs()
            loose = off > 1e-5 * want.abs().max()
            assert int(loose.sum()) <= want.numel() // 1000, (axis, name, int(loose.sum()))
            assert float(off.max()) <= STEPS * lr, (axis, name)
    if axis == "ep":
        experts = [n for n in ref["params"] if ".experts." in n]
        for r in range(4):  # each rank's experts, and its partner in the other replica's: the same
            assert {n: out[r][i]["splits"][n] for n in experts} == {n: out[r ^ 2][i]["splits"][n] for n in experts}
            assert out[r][i]["splits"] != out[r ^ 1][i]["splits"]  # and its replica peer's others
            assert out[r][i]["biases"].keys() == ref["biases"].keys()
            assert all(torch.equal(out[r][i]["biases"][k], b) for k, b in out[0][i]["biases"].items())
    # one fp32 all-reduce of the rank's piece per round across replicas (under cp the rank holds
    # the whole model, its masters a ZeRO-1 shard over the cp ranks: half); nothing across
    # replicas between rounds
    for rank in range(4):
        got = out[rank][i]
        piece = got["numel"] // (2 if axis == "cp" else 1)
        for step, by_group in enumerate(got["comm_by_op"]):
            synced = (step + 1) % EVERY == 0 or step + 1 == STEPS
            assert by_group.get("dp_replicate", 0) == (2 * 4 * piece if synced else 0), (axis, rank, step)


def test_the_planner_counts_an_expert_parallel_rank_s_own_experts(axes_world):
    """ep: the outer model and its all-reduce are the rank's dense part and its own experts' shard
    (over the N / ep ranks holding them). Bytes: a catalog cluster (predict_local probes the CPU)."""
    from shardlm.hardware.catalog import parse_cluster
    from shardlm.planner.memory import estimate_memory
    from shardlm.planner.search import config_strategy
    from shardlm.planner.timing import estimate_time

    cases, out, refs = axes_world
    i, cluster = AXES.index("ep"), parse_cluster("1x4xA100-80GB")
    got = out[0][i]  # ZeRO-0: the dense part whole and the rank's own experts (alike on every rank)
    assert got["state"]["local_sgd"] == 2 * 4 * got["numel"] and len({o[i]["numel"] for o in out}) == 1
    dense = sum(p.numel() for n, p in refs["ep"]["params"].items() if ".experts." not in n)
    # ZeRO-1: the dense part sharded over the replica's 2 ranks, the experts over the 1 holding them
    for stage, held in ((0, got["numel"]), (1, dense // 2 + got["numel"] - dense)):
        w, s = config_strategy(load_config(overrides={**cases[i], "parallel.zero_stage": stage}).validate(), cluster)
        assert estimate_memory(w, s, cluster).category("local SGD outer model") == 2 * 4 * held, stage
        _planner_sends_the_rank_s_masters(estimate_time(w, s, cluster).comms, {"numel": held})


def test_resume_inside_a_round_is_exact(world):
    _, out = world
    for rank in range(2):
        uninterrupted, resumed = out[rank]["cases"][0], out[rank]["resumed"]
        assert resumed["start"] == 3
        assert resumed["losses"] == uninterrupted["losses"][3:] and len(resumed["losses"]) == STEPS - 3
        for n, p in uninterrupted["params"].items():
            assert torch.equal(resumed["params"][n], p), (rank, n)


def test_starts_from_a_synchronous_checkpoint(world):
    """Both replicas load the synchronous run's model: the first step after the resume sees the
    same parameters on the same data as that run's own step 4, so its loss is that loss, bitwise
    (each replica's loss / 2, summed, either way); the run ends with the replicas in agreement."""
    _, out = world
    for rank in range(2):
        ddp, from_ddp = out[rank]["ddp"], out[rank]["from_ddp"]
        assert from_ddp["start"] == 3 and from_ddp["losses"][0] == ddp["losses"][3], rank
        assert from_ddp["outer_is_model"] and from_ddp["momentum_zero"], rank
        assert not out[rank]["resumed"]["outer_is_model"]  # inside a round: the saved outer model
        assert from_ddp["losses"][1:] != ddp["losses"][4:]  # then they part: local steps
    for n, p in out[0]["from_ddp"]["params"].items():
        assert torch.equal(out[1]["from_ddp"]["params"][n], p), n


def test_which_checkpoints_local_sgd_takes(world):
    """Its own kind of the same replica count exactly, a synchronous run's as a fresh start,
    a local-SGD one of another replica count refused naming both counts."""
    from types import SimpleNamespace

    from shardlm.checkpoint.sharded import CheckpointError
    from shardlm.train.checkpointing import _local_sgd_fresh_start

    _, out = world

    def fresh(run_dir, replicas: int) -> bool:
        run = SimpleNamespace(runtime=SimpleNamespace(is_main=True, world_size=1),
                              mesh=SimpleNamespace(dims=SimpleNamespace(dp_replicate=replicas)))
        return _local_sgd_fresh_start(run, sorted((run_dir / CHECKPOINTS).glob("step-*"))[0])

    assert fresh(out[0]["cases"][0]["dir"], 2) is False
    assert fresh(out[0]["ddp"]["dir"], 4) is True
    with pytest.raises(CheckpointError, match=r"dp_replicate = 2 replicas; this run has parallel\.dp_replicate = 4"):
        fresh(out[0]["cases"][0]["dir"], 4)


def test_non_finite_on_one_replica_skips_on_all(world):
    """Each replica clips by its own norm, but a non-finite one anywhere is non-finite everywhere:
    every rank takes the same skip decision (else the replicas would part ways for good)."""
    _, out = world
    assert out[0]["stepped"] == out[1]["stepped"] == [False, True]


def local_sgd_cases(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    torch.manual_seed(0)
    return [_train(case) for case in cases]


def test_validation_refuses_clearly(tmp_path):
    base = tiny_overrides(tmp_path)
    with pytest.raises(ConfigError, match=r"train\.local_sgd\.every = 4 .*parallel\.dp_replicate = 1.*"
                                          r"Set parallel\.dp_replicate"):
        load_config(overrides={**base, "train.local_sgd.every": "4"}).validate()
    moe = {**base, "train.local_sgd.every": "4", "parallel.dp_replicate": "2", "parallel.dp_shard": "2",
           "model.experts": "4", "parallel.ep": "2"}
    load_config(overrides=moe).validate()  # experts, ep inside each replica: the axes test
    with pytest.raises(ConfigError, match=r"parallel\.ep_rebalance_every = 2: re-placing experts moves.*"
                                          r"not the outer model and momentum"):
        load_config(overrides={**moe, "parallel.ep_rebalance_every": "2"}).validate()
    load_config(overrides={**base, "train.local_sgd.every": "4", "parallel.dp_replicate": "2"}).validate()


FEATURES = {"lora": {"lora.rank": 4},
            "offload-cpu-stage3": {"parallel.zero_stage": 3, "zero.offload_optimizer": "cpu",
                                   "zero.offload_params": "cpu"},
            "offload-nvme": {"zero.offload_optimizer": "nvme"}}
"""Features beside local SGD, each on 2 replicas of one rank (ZeRO-1 unless said)."""


@pytest.fixture(scope="module")
def features_world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("local_sgd_features")
    cases = [_base(tmp, **{"parallel.zero_stage": 1, **keys, "run.name": name,
                           "zero.nvme_path": str(tmp / f"nvme-{name}")}) for name, keys in FEATURES.items()]
    return cases, run_ranks(local_sgd_cases, 2, tmp, cases)


@pytest.mark.parametrize("feature", FEATURES)
def test_lora_and_offload_match_the_simulation(features_world, feature):
    """LoRA (the masters, and so the outer model and its all-reduce, are the adapters only) and
    the offload tiers (the masters on the host or streamed from disk; the outer step reads and
    writes them through the tier) against the simulation without offload. Tolerance: none —
    the same reasoning as the module docstring's (one micro-batch per rank, an order-free mean
    of two, single-rounding element-wise outer step; every adapter and parameter a multiple of
    16 elements): bit for bit."""
    cases, out = features_world
    i = list(FEATURES).index(feature)
    ref = simulate({**cases[i], "zero.offload_optimizer": "none", "zero.offload_params": "none"}, STEPS)
    for rank in range(2):
        got = out[rank][i]
        assert got["losses"] == ref["losses"], (feature, rank)
        assert all(torch.equal(got["params"][n], p) for n, p in ref["params"].items()), (feature, rank)
        for step, by_group in enumerate(got["comm_by_op"]):
            synced = (step + 1) % EVERY == 0 or step + 1 == STEPS
            assert by_group.get("dp_replicate", 0) == (2 * 4 * got["numel"] if synced else 0), (feature, step)
    if feature == "lora":  # the adapters only: a fraction of the model crosses the replicas
        assert out[0][i]["numel"] < sum(p.numel() for p in ref["params"].values()) / 10


def four_rank_check() -> None:
    """Not in the suite (4 ranks; CI's 2 cores run 2): dp_replicate = 2 x dp_shard = 2 at ZeRO
    stage 1 against the simulation, each replica's two ranks accumulated in one process.
    `PYTHONPATH=src python tests/test_local_sgd.py` from the repository root."""
    import tempfile
    from pathlib import Path

    tmp = Path(tempfile.mkdtemp())
    case = _base(tmp, **{"parallel.zero_stage": 1, "parallel.dp_shard": 2, "run.name": "four"})
    out = run_ranks(local_sgd_ranks, 4, tmp, [case])
    ref = simulate(case, STEPS, shards=2)
    for rank in range(4):
        got = out[rank]["cases"][0]
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-6, abs=0), rank
        worst = max(float((got["params"][n] - p).abs().max()) for n, p in ref["params"].items())
        bitwise = all(torch.equal(got["params"][n], p) for n, p in ref["params"].items())
        print(f"rank {rank}: losses {got['losses']} vs {ref['losses']}; parameters bitwise: {bitwise} "
              f"(largest difference {worst:.3g}); dp_replicate bytes per step "
              f"{[g.get('dp_replicate', 0) for g in got['comm_by_op']]}, dp_shard "
              f"{[g.get('dp_shard', 0) for g in got['comm_by_op']]}; resumed inside a round bitwise: "
              f"{all(torch.equal(out[rank]['resumed']['params'][n], p) for n, p in got['params'].items())}")


def test_outer_settings_are_refused_not_ignored_with_the_plain_average(tmp_path):
    """outer = 'average' takes no outer lr or momentum: setting either is an error that says so
    (issue 42), while the defaults (not set) and 'diloco' with them pass."""
    base = tiny_overrides(tmp_path, train__local_sgd__every=2, train__local_sgd__outer="average")
    for key in ("train.local_sgd.outer_lr", "train.local_sgd.outer_momentum"):
        with pytest.raises(ConfigError, match=rf"{key} = 0.5 with train.local_sgd.outer = 'average'"):
            load_config(overrides={**base, key: 0.5})
    load_config(overrides=base)
    load_config(overrides={**base, "train.local_sgd.outer": "diloco", "train.local_sgd.outer_lr": 0.5})


if __name__ == "__main__":
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # conftest, zero_cases
    four_rank_check()
