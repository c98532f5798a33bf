"""Local SGD and DiLoCo across the dp_replicate replicas (train.local_sgd).

Each replica (its dp_shard ranks, ZeRO-sharded as usual) trains on its own data with the inner
optimizer, its gradients reduced only within the replica (the engine leaves out the
cross-replica all-reduce). Every `every` steps, and at the run's last step, the replicas meet:

    Δ      = θ_outer − θ_local                   pseudo-gradient, this rank's shard (fp32)
    Δ      = all_reduce(Δ, dp_replicate) / R      the replicas' mean: the one cross-replica
                                                  collective, Ψ/N fp32 elements per rank
    'diloco':  b ← μ b + Δ;  θ_outer ← θ_outer − lr (Δ + μ b)   (SGD, Nesterov momentum)
    'average': θ_outer ← θ_outer − Δ = mean_r θ_r              (plain local SGD)
    θ_local ← θ_outer                             every replica restarts from the outer model

DiLoCo: Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language
Models" (inner AdamW, outer Nesterov SGD with lr 0.7 and momentum 0.9; the inner optimizer's
state stays with its replica across rounds). Plain averaging is local SGD (Stich 2019; Lin et al.
2020, "post-local SGD"); torchft's LocalSGD and DiLoCo wrappers hold the same two variants.

θ_outer and the outer momentum live where the inner optimizer's fp32 masters live: each rank keeps
the outer copy of exactly the shard it owns (the engine's master segments), so they add 4Ψ/N
bytes ('average') or 8Ψ/N ('diloco') per rank, N the replica's shard-group size.

With a mixture of experts and expert parallelism inside each replica, a rank's masters are the
dense part (its shard) and its own experts' (their shard over the replica's ranks holding the
same experts); the dp_replicate group pairs the ranks at the same place of every replica, which
hold the same experts, so each rank's outer step is on its own experts' pseudo-gradient. The
router's one state outside the masters, the balancing bias (model.balance = 'bias'), needs no
outer step: every rank moves it every step by the loads summed over every rank, replicas
included (parallel/expert/dispatch.py finish_moe_step), so it is the same on every replica.

The outer step is written as single-rounding element-wise operations (no fused multiply-add), so
any slicing of the parameters — one process's whole tensors, a rank's flat shard — gives the same
bits: what the test against one process checks.
"""

from __future__ import annotations

import dataclasses

import torch

from shardlm.checkpoint.sharded import StateSlice
from shardlm.config.schema import LocalSGDConfig
from shardlm.parallel.data.zero.slices import _unit_slices

REPLICA_PREFIX = "local_sgd/replica{}/"
"""A checkpoint's names for replica r >= 1's own state (its parameters and inner optimizer
moments differ from replica 0's between two outer steps); replica 0's keep the ordinary names,
so such a checkpoint also loads into a run without local SGD (taking replica 0's state)."""


class LocalSGD:
    """The outer model and optimizer of one rank's shard; `synchronize` is the outer step."""

    def __init__(self, engine, cfg: LocalSGDConfig):
        self.engine, self.every, self.outer = engine, cfg.every, cfg.outer
        diloco = cfg.outer == "diloco"  # 'average': lr 1, no momentum
        self.lr, self.momentum_coef = (cfg.outer_lr, cfg.outer_momentum) if diloco else (1.0, 0.0)
        self.comm = engine.replicate_comm  # the dp_replicate group: this shard on every replica
        self.replica = engine.mesh.replica_rank
        # θ_outer starts as the initial model (the masters are the fp32 initial values).
        self.outer_params = [m.detach().float().clone() for m in self._masters()]  # each (segment,)
        self.momentum = [torch.zeros_like(p) for p in self.outer_params] if diloco else []
        self.loading_synchronous = False
        """Set while a synchronous run's checkpoint loads (train/checkpointing.py): every replica
        reads the ordinary names, and there is no outer state to read (restart_from_masters)."""

    def _masters(self) -> list[torch.Tensor]:
        """θ_local: the inner optimizer's masters, one per segment of this rank's shard."""
        return [self.engine.tier.segment_state(i)[0] for i in range(len(self.engine.segments))]

    def due(self, step: int, steps: int) -> bool:
        """Whether step `step` (from 0) ends a round: every `every` steps, and the run's last."""
        return (step + 1) % self.every == 0 or step + 1 == steps

    @torch.no_grad()
    def synchronize(self) -> None:
        """The outer step (module docstring): one all-reduce of the pseudo-gradient over the
        replicas, the outer update, every replica's parameters set to the new outer model."""
        masters = self._masters()
        deltas = [outer - local.float() for outer, local in zip(self.outer_params, masters)]
        handles = [self.comm.all_reduce(delta) for delta in deltas]  # sum over replicas
        for handle in handles:
            handle.wait()
        for i, (outer, delta) in enumerate(zip(self.outer_params, deltas)):
            delta.div_(self.comm.size)  # the replicas' mean
            if self.momentum:  # Nesterov: b ← μ b + Δ, step Δ + μ b (torch.optim.SGD's)
                buf = self.momentum[i]
                buf.mul_(self.momentum_coef).add_(delta)
                delta.add_(buf * self.momentum_coef)
                delta.mul_(self.lr)
            outer.sub_(delta)
            masters[i].copy_(outer)
        # The masters were overwritten, as by a checkpoint load: the compute-dtype parameters
        # from them, and at stages 1-2 every rank's parameters gathered whole again.
        self.engine.after_load()

    # -- checkpoints -------------------------------------------------------------------------

    @torch.no_grad()
    def restart_from_masters(self) -> None:
        """After loading a synchronous run's checkpoint into every replica: θ_outer is that
        model, the outer momentum zero (DiLoCo's start from a pre-trained model)."""
        for outer, master in zip(self.outer_params, self._masters()):
            outer.copy_(master)
        for buf in self.momentum:
            buf.zero_()

    def state_slices(self, inner: list[StateSlice], saving: bool) -> list[StateSlice]:
        """The engine's slices (`inner`: this replica's parameters and moments; replica r >= 1's
        under REPLICA_PREFIX), and the outer model and momentum, which every replica holds
        alike: replica 0 writes them."""
        if self.loading_synchronous:
            return inner
        if self.replica:
            prefix = REPLICA_PREFIX.format(self.replica)
            inner = [dataclasses.replace(s, name=prefix + s.name) for s in inner]
            if saving:
                return inner
        return (inner + self._slices(self.outer_params, "local_sgd/outer/", saving)
                + self._slices(self.momentum, "local_sgd/momentum/", saving))

    def _slices(self, tensors: list[torch.Tensor], prefix: str, saving: bool) -> list[StateSlice]:
        """Per-segment tensors (as the masters are cut) as slices of whole tensors named
        prefix + the parameter's name (parallel/data/zero/slices.py's coordinates)."""
        engine = self.engine
        names = {id(p): n for n, p in engine.model.named_parameters()}
        out = []
        for tensor, (unit, local) in zip(tensors, engine.segments):
            lo, hi = unit.lo + local.start, unit.lo + local.stop  # in the unit's flat buffer
            out += [dataclasses.replace(s, name=prefix + s.name.removeprefix("model/"))
                    for s in _unit_slices(engine, unit, lo, hi, tensor, {}, names, saving)]
        return out

    # -- accounting --------------------------------------------------------------------------

    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.outer_params + self.momentum)

    def predicted_bytes(self, numel: int, shard_ranks: int) -> float:
        """4Ψ/N for θ_outer, as much again for the momentum ('diloco')."""
        return 4.0 * numel / shard_ranks * (2 if self.momentum else 1)
