"""parallel.fault_tolerant in a training run: a replica's mesh, its step's average over the live
replicas, the state a joining replica receives (parallel/data/fault_tolerant/quorum.py is the quorum and its group;
parallel/data/fault_tolerant/launcher.py the launcher).

A replica is a world of N = pp × dp_shard × cp × tp ranks (N = 1: one process) whose mesh says
dp_replicate = R and its place in the whole — so rank i of replica r reads its own share of every
global batch and divides its loss by the global number of micro-batches, as the rank at its
stage, replica and place of an ordinary hybrid run does (replica_setup) — with process groups
over its own ranks only (ZeRO shards over them): its gradient shard reaches the other replicas'
rank i (the same stage, shard and experts) only through the quorum's group of local rank i.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from shardlm.comm.collectives import CommLedger
from shardlm.comm.mesh import Mesh, build_mesh
from shardlm.parallel.data.fault_tolerant.quorum import ReplicaGroup
from shardlm.config.schema import Config, ParallelConfig
from shardlm.config.dims import resolve_dims
from shardlm.errors import ConfigError
from shardlm.parallel.data.fault_tolerant.launcher import ReplicaIdentity, replica_identity
from shardlm.launch.runtime import Runtime
from shardlm.parallel.build import StepState
from shardlm.train.resolve import decide
from shardlm.train.run import Run
from shardlm.parallel.data.zero.optim import adam_steps, set_adam_steps

log = logging.getLogger("shardlm")


@dataclass(frozen=True)
class Replica:
    """This process as one replica of a fault-tolerant run: who it is and its mesh."""

    identity: ReplicaIdentity
    mesh: Mesh
    """dp_replicate = R at this replica's position; groups over this replica's ranks only."""
    device: torch.device
    rank: int
    """This process's rank in its replica's world."""
    ranks: int

    def resolve(self, cfg: Config, checkpoint: Path | None) -> Config:
        """Every 'auto' decided for the replicas' world, here alone (resolve.resolve_config's
        broadcast has no group to go through)."""
        return decide(cfg, self.mesh.dims.world_size, self.device, checkpoint).validate()

    def eval_share(self) -> dict:
        """The validation loader's data-parallel position: the replica's own data-parallel ranks
        (dp_shard of them; its tp, cp and pp ranks read the same windows) deal the whole
        validation set among themselves (its sums never leave the replica), so every replica
        evaluates the windows one run would."""
        shards = self.mesh.dims.dp_shard
        return {"dp_rank": self.mesh.dp_rank % shards, "dp_size": shards}

    def open(self, par: ParallelConfig, ledger: CommLedger) -> ReplicaGroup:
        """The quorum's store and group, its bytes in the run's `ledger`."""
        return ReplicaGroup(self.identity, ledger, par.quorum_timeout_s, par.collective_timeout_s,
                            self.rank, self.ranks)


def replica_setup(parallel: ParallelConfig, runtime: Runtime) -> Replica | None:
    """With parallel.fault_tolerant: this process's replica (parallel/data/fault_tolerant/launcher.py set who it is);
    None otherwise."""
    if not parallel.fault_tolerant:
        return None
    identity = replica_identity()
    if identity is None:
        raise ConfigError("parallel.fault_tolerant = true runs under `shardlm train --nproc N` "
                          "(N = parallel.dp_replicate replicas × their ranks), not in one process "
                          "or under your own torchrun")
    if identity.replicas != parallel.dp_replicate:
        raise ConfigError(f"parallel.fault_tolerant: {identity.replicas} replicas were launched "
                          f"for parallel.dp_replicate = {parallel.dp_replicate}")
    n = runtime.world_size
    dims = resolve_dims(parallel, identity.replicas * n)
    # The replica's own groups (a world of n ranks, dp_replicate 1), seen as its place in the
    # whole: rank i of replica r, at stage q = i // (n / pp) and place j = i % (n / pp) in it, is
    # the hybrid run's rank at stage q, replica r, place j (pipeline stages outermost there).
    inside = build_mesh(dataclasses.replace(dims, dp_replicate=1), runtime.device, runtime.rank)
    per = n // dims.pp
    whole = (runtime.rank // per * identity.replicas + identity.replica) * per + runtime.rank % per
    mesh = dataclasses.replace(inside, dims=dims, rank=whole, dp_replicate_group=None)
    return Replica(identity, mesh, runtime.device, runtime.rank, n)


def average_step(run: Run, step: int, total: torch.Tensor, stop: bool,
                 counted: float | None = None) -> tuple[torch.Tensor, bool, bool]:
    """After backward: the step's gradients, its summed loss and the stop flag averaged over
    the live replicas (the loss as an ordinary run's all-reduce sums it), and True; or, when
    the step did not commit (a replica died during the all-reduce), the gradients dropped and
    False. `counted` (data whose targets may carry no loss: this replica's counted targets, as
    the loss-token count found them over its own ranks): each replica's loss and gradients are
    its own targets' mean, so they are weighted by `counted` and divided by its sum over the
    live replicas — the global batch's summed loss over its counted targets, as one process's."""
    shared = torch.stack([total.detach().to(torch.float32),
                          torch.tensor(float(stop), device=total.device),
                          torch.tensor(1.0 if counted is None else counted, device=total.device)])
    grads = run.strategy.grads()
    if counted is not None:
        torch._foreach_mul_(grads, counted)
        shared[0] *= counted
    if not run.replicas.average([*grads, *moe_sums(run), shared], step):
        run.strategy.zero_grad()
        return total, stop, False
    if counted is not None:  # (the live replicas' count, scaled by R / live as the sums are)
        torch._foreach_div_(grads, float(shared[2]))
        shared[0] /= shared[2]
    return shared[0].to(total.dtype), bool(shared[1] > 0), True


def moe_sums(run: Run) -> list[torch.Tensor]:
    """A mixture-of-experts model's step figures (models.moe.MoEStats.sums: the choices routed to
    each expert), summed over the live replicas with the gradients (scaled as they are), so that
    the loads bias balancing and expert re-placement move by are the whole step's on every
    replica, and every replica moves its biases and experts alike: rank i of each then holds the
    same experts and biases. [] without experts."""
    moe = run.moe
    if moe is None or not moe.layers:
        return []
    if moe.sums is None:  # a joiner, before its first forward: zeros of the same shape
        moe.sums = torch.zeros(len(moe.layers), moe.experts + 4, dtype=torch.float64,
                               device=run.runtime.device)
    return [moe.sums]


def add_step_hooks(run: Run) -> None:
    """The replicas' part in the training step (train/step.py): after backward, the mean over
    the live replicas (a step that did not commit is taken again); after the loss's
    all-reduce, a joining replica's state."""
    def average(state: StepState) -> bool:
        counted = None if state.denominator is None else state.denominator * state.global_micro_batches
        state.total, state.stop, committed = average_step(run, state.step, state.total, state.stop,
                                                          counted)
        return committed

    def share(state: StepState) -> None:
        after_step(run, state.step + 1, state.stepped)
    run.hooks.after_backward.append(average)
    run.hooks.after_reduce.append(share)


def state_tensors(run: Run, steps_done: int) -> list[torch.Tensor]:
    """Everything a replica's training state is, as tensors every replica lists in the same
    order: the step, the optimizer's step count, the data position and the loss scaler; the
    parameters and optimizer moments (the checkpoint's slices: one definition of the state);
    the routers' balancing biases (model.balance = 'bias'); the RNG."""
    scaler = run.precision.scaler.state_dict()
    meta = torch.tensor([steps_done, adam_steps(run.strategy.optimizer),
                         run.train_loader.samples_done(steps_done),
                         *(float(scaler.get(k, 0)) for k in ("scale", "clean_steps", "skipped_steps"))],
                        dtype=torch.float64)
    slices = [s.tensor for s in run.strategy.state_slices()]
    biases = [run.moe.biases[k] for k in sorted(run.moe.biases)] if run.moe is not None else []
    return [meta, *slices, *biases, torch.get_rng_state()]


def writes_checkpoint(run: Run) -> bool:
    """Whether this process writes the checkpoint due now: always, but with replicas, where
    only the lowest live replica of the step's quorum does (their states are the same, bit for
    bit) — into the replicas' common checkpoints/ (checkpointing.checkpoints_root)."""
    return run.replicas is None or run.replicas.writes_checkpoint()


def after_step(run: Run, steps_done: int, stepped: bool) -> None:
    """After a committed step: a quorum with joining replicas sends them this state."""
    quorum = run.replicas.quorum if stepped else None
    if quorum is not None and quorum.joining:
        run.replicas.share_state(state_tensors(run, steps_done))


def rejoin(run: Run) -> None:
    """A restarted replica: join the live replicas' next round, take their state and train from
    their next step (run.start_step). If the run finished before a round took it in, exit: it
    has nothing to train and no weights of its own to write."""
    if run.replicas is None or not run.replicas.joining:
        return
    zeros = [torch.zeros_like(t) for t in [*run.strategy.grads(), *moe_sums(run)]]
    zeros.append(torch.zeros(3, device=run.runtime.device))  # (loss, stop, counted targets)
    quorum = run.replicas.join(zeros, run.start_step)
    if quorum is None:
        log.warning("shardlm: replica %d: the run finished before it could rejoin; it stops "
                    "without training", run.replicas.identity.replica)
        raise SystemExit(0)
    tensors = state_tensors(run, run.start_step)
    if not run.replicas.share_state(tensors):
        raise RuntimeError("the live replicas' state did not arrive: this replica restarts again")
    meta, rng = tensors[0].tolist(), tensors[-1]
    run.strategy.after_load()
    set_adam_steps(run.strategy.optimizer, meta[1])
    if run.precision.scaler.state_dict():
        run.precision.scaler.load_state_dict({"scale": meta[3], "clean_steps": meta[4],
                                              "skipped_steps": meta[5]})
    run.start_step = int(meta[0])
    run.train_loader.resume_at(run.start_step, int(meta[2]))
    torch.set_rng_state(rng)
    run.replicas.joined()
    log.warning("shardlm: replica %d rejoined at step %d from replica %d's state (round %d)",
                run.replicas.identity.replica, run.start_step, quorum.live[0], quorum.round)
