"""The ZeRO engine, stages 0-3 (Rajbhandari et al. 2020): one engine, the stage says only what
is sharded over the dp_shard group.

    stage 0  nothing: gradients all-reduced, every rank steps every parameter
    stage 1  optimizer states and fp32 master: gradients reduce-scattered (the full gradient
             buffer stays), each rank steps its shard, updated parameters all-gathered
    stage 2  + gradients: a unit's full gradient exists only until its reduce-scatter
    stage 3  + parameters: a unit's parameters are gathered before its forward and its backward
             and freed after (parallel/data/zero/params.py). With parallel.reshard_after_forward = false they
             stay from the forward's gather until the unit's backward is done: stage 2's
             communication (one all-gather and one reduce-scatter of Ψ per step) with the
             parameters sharded between steps — FSDP2's fully_shard(reshard_after_forward=
             False), FSDP1's SHARD_GRAD_OP

Each unit (a transformer block, or the root: embeddings, final norm, head) keeps its parameters
in one flat, padded buffer in the compute dtype; the module's parameters are views of it, so
every collective is one large call. Gradients accumulate in param.grad as autograd does it;
post-accumulate-grad hooks count arrivals, and when a unit's last gradient arrives (and this
micro-step synchronises) its gradients are copied into the unit's flat gradient and its
reduction starts at once, overlapping the rest of backward. At stages 2-3 the gradient shards
exist from a unit's reduction to the end of the step (as FSDP2's sharded gradients do): the
root unit's is not allocated yet when the tied embedding's gradient peaks at the end of
backward. The optimizer is
torch's AdamW over this rank's master shards — contiguous fp32 slices, one per (unit, weight-
decay group) — or over views of the parameters themselves when master and compute dtypes agree.
With train.optimizer = 'muon', parallel/data/zero/muon.py gathers each block's matrices around that step and
applies Muon's update to them (AdamW then moves them only by its weight decay).
With dp_replicate > 1 (hybrid), shards are reduced within the shard group and then averaged
across replicas — unless train.local_sgd keeps the replicas apart until its outer step
(parallel/data/zero/local_sgd.py). Under pipeline parallelism gradients are reduced after the step's last backward
(finish_backward), and stage 3 holds a stage's units gathered for the step (parallel/data/zero/params.py).
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from shardlm.checkpoint.sharded import StateSlice
from shardlm.config.schema import TrainConfig
from shardlm.comm.mesh import Mesh
from shardlm.models.init import Initializer, materialize_buffers
from shardlm.models.placement import Split
from shardlm.comm.collectives import Comm, CommLedger
from shardlm.comm.watchdog import CollectiveWatchdog, watched
from shardlm.parallel.data.zero.tiers import build_param_store, build_tier
from shardlm.parallel.data.zero.partition import model_state_bytes
from shardlm.parallel.data.zero.slices import engine_state_slices
from shardlm.parallel.data.zero.units import Unit, ZeroOptions, collect_units

log = logging.getLogger("shardlm")

# Stages 2-3: how many units' reductions may run while backward continues. Each holds a transient
# full gradient, so this bounds peak memory; the oldest completes before the next unit's full
# gradient is allocated.
MAX_REDUCTIONS_IN_FLIGHT = 1


class ZeroEngine:
    """Owns the units, the hooks, the reductions and the sharded optimizer step."""

    def __init__(self, model: nn.Module, mesh: Mesh, opts: ZeroOptions, train: TrainConfig,
                 device: torch.device, watchdog: CollectiveWatchdog | None = None,
                 initializer: Initializer | None = None, ledger: CommLedger | None = None,
                 splits: dict[str, Split] | None = None, copies: frozenset[str] = frozenset(),
                 expert_splits: dict[str, Split] | None = None):
        """`splits`: the parameters tensor parallelism cut (placement.Split: where this rank's
        piece sits in the whole), for the global gradient norm and the checkpoint's slices;
        every other parameter is replicated across the tensor-parallel group. `copies`: names
        of parameters another pipeline stage owns (a tied embedding's copy on the last stage):
        neither saved nor counted in the norm here. `expert_splits`: the expert weights expert
        parallelism cut (parallel/expert/dispatch.py): each MoE block's experts form a unit of their own,
        reduced and sharded over the ranks holding the same experts (mesh.ep_shard_group /
        ep_dp_group) instead of the shard group."""
        self.model, self.opts, self.mesh = model, opts, mesh
        self.copies = copies
        self.ledger = ledger if ledger is not None else CommLedger()
        self.watchdog = watchdog
        self.splits = splits or {}
        self.expert_splits = expert_splits or {}
        # Local SGD (train.local_sgd, parallel/data/zero/local_sgd.py): gradients reduced within the replica
        # only; the replicas meet in its outer step, over the replicate group.
        apart = train.local_sgd.every > 0
        self._build_comms(apart)
        nvme_dir = opts.nvme_dir or Path("offload")
        self.tier = build_tier(opts.offload_optimizer, device, opts.master_dtype, nvme_dir,
                               opts.nvme_chunk_bytes, opts.nvme_buffers, opts.offload_params == "nvme")
        in_order = self._build_units(device, initializer)
        for unit in self.units:
            unit.attach_grads()
        materialize_buffers(model, device)
        self._build_norm_spans()
        self.tier.build_optimizer(train)
        self.optimizer = self.tier.optimizer
        self.local_sgd = None  # train.local_sgd: the outer model and step (the loop calls it)
        if apart:
            from shardlm.parallel.data.zero.local_sgd import LocalSGD

            self.local_sgd = LocalSGD(self, train.local_sgd)
        self.param_store = build_param_store(opts.offload_params, in_order, device, nvme_dir)
        self.sync = True
        self.in_flight: list[tuple[Unit, object]] = []
        if opts.stage == 3:
            from shardlm.parallel.data.zero.params import ParamSharding

            self.param_sharding = ParamSharding(in_order, opts, self.param_store, hold_for_step=mesh.dims.pp > 1)
        self.muon = None  # train.optimizer = 'muon': its gathers and updates around the tier's step
        if train.optimizer == "muon":
            from shardlm.parallel.data.zero.optim import muon_params
            from shardlm.parallel.data.zero.muon import ShardedMuon

            names = {id(p): n for n, p in model.named_parameters()}
            self.muon = ShardedMuon(self, {names[id(p)] for p in muon_params(model)}, train)
        self._log_setup(in_order)

    def _build_comms(self, apart: bool) -> None:
        """The engine's groups: the shard group (stage 0: every data-parallel rank), the
        replicas, tensor parallelism's, and the experts' shard / data-parallel group and ep."""
        mesh, sharded, watchdog = self.mesh, self.opts.stage >= 1, self.watchdog
        # Stage 0 all-reduces over every data- and context-parallel rank: the world, unless
        # tensor parallelism takes a factor of it (or local SGD keeps the replicas apart).
        everyone = mesh.dp_shard_group if apart else mesh.dp_group
        self.shard_comm = Comm(mesh.dp_shard_group if sharded else everyone,
                               "dp_shard" if sharded else "dp", self.ledger, watchdog)
        self.tp_comm = Comm(mesh.tp_group, "tp", self.ledger, watchdog)
        self.replicate_comm = Comm(mesh.dp_replicate_group if sharded or apart else None,
                                   "dp_replicate", self.ledger, watchdog)
        # The ranks holding the same experts: of this replica (sharded, or local SGD), else of all.
        self.expert_comm = Comm(mesh.ep_shard_group if sharded or apart else mesh.ep_dp_group,
                                "ep_shard" if sharded else "ep_dp", self.ledger, watchdog)
        self.ep_comm = Comm(mesh.ep_group, "ep", self.ledger, watchdog)

    def _build_units(self, device: torch.device, initializer: Initializer | None) -> list[Unit]:
        """The sharded build, one unit at a time, so setup never holds more than one unit's
        temporary fp32 copy: each unit's flat parameter, its hooks and its master segments in the
        tier; at stage 3 only the shard stays. Returns every unit in forward order (stage 3
        gathers them so)."""
        opts, sharded = self.opts, self.opts.stage >= 1
        shard_rank = self.mesh.shard_rank if sharded else 0
        expert_shard_rank = self.mesh.ep_shard_rank if sharded else 0
        self.units: list[Unit] = []
        self.frozen: list[Unit] = []
        """Units of parameters that do not train (a LoRA run's base): no hooks, gradients,
        reductions or optimizer segments; at stage 3 gathered like the others."""
        in_order: list[Unit] = []
        # The optimizer's segments: pieces of this rank's shard, one per (unit, decay group).
        self.segments: list[tuple[Unit, slice]] = []
        expert_modules = {n.rsplit(".", 1)[0] for n in self.expert_splits}
        for spec in collect_units(self.model, opts.unit_classes, sorted(expert_modules),
                                  opts.fp8_all_gather and opts.stage == 3):
            expert = spec.name.split("[")[0] in expert_modules  # "….experts[frozen]" too (LoRA)
            unit = (Unit(spec, self.expert_comm, expert_shard_rank, opts, device, initializer, True) if expert
                    else Unit(spec, self.shard_comm, shard_rank, opts, device, initializer))
            unit.bind_params()
            in_order.append(unit)
            if unit.frozen:
                del unit.initial_shard
                if opts.stage == 3:
                    unit.flat_param.untyped_storage().resize_(0)
                self.frozen.append(unit)
                continue
            for param in unit.params:
                param.register_post_accumulate_grad_hook(self._grad_hook(unit))
            for seg in unit.segments:  # the master starts from the fp32 values, not a rounded cast
                local = slice(seg.start - unit.lo, seg.end - unit.lo)
                self.tier.add(unit.shard_param[local], unit.initial_shard[local], seg.decay)
                self.segments.append((unit, local))
            del unit.initial_shard
            if opts.stage == 3:  # only the shard stays; parallel/data/zero/params.py gathers on demand
                unit.flat_param.untyped_storage().resize_(0)
            self.units.append(unit)
        return in_order

    def _build_norm_spans(self) -> None:
        """Where each trained parameter sits in its unit, in model order, and the ranges of it
        this rank counts in the global norm. A parameter replicated across the tensor-parallel
        group counts once (on its tp rank 0); a cut one (experts spread over ep × tp included)
        counts on every rank (each holds a different piece), but for the ranges of it every rank
        holds (placement.Split.copies), counted on tp rank 0."""
        model, tp_rank = self.model, self.mesh.tp_rank
        spans = {id(p): (u, off, p.numel()) for u in self.units for p, off in zip(u.params, u.layout.offsets)}
        self._param_spans = [spans[id(p)] for p in model.parameters() if id(p) in spans]
        names = {id(p): n for n, p in model.named_parameters()}
        self._norm_spans = [[] if names[id(p)] in self.copies
                            else self.splits[names[id(p)]].owned(tp_rank) if names[id(p)] in self.splits
                            else [(0, p.numel())] if tp_rank == 0 or names[id(p)] in self.expert_splits
                            else []
                            for p in model.parameters() if id(p) in spans]

    def _log_setup(self, in_order: list[Unit]) -> None:
        opts = self.opts
        shard_world = self.shard_comm.size if opts.stage >= 1 else 1
        fp8_units = [u for u in in_order if u.fp8_gather is not None]
        if fp8_units:  # precision.fp8_all_gather (parallel/data/zero/fp8_gather.py)
            log.info("zero: %d FP8 linear weights in %d units gathered in E4M3 (1 byte per element, one "
                     "scale per weight from an all-reduce(max) of their amaxes)",
                     sum(len(u.params) for u in fp8_units), len(fp8_units))
        log.info("zero: stage %d over %d shard rank(s) x %d replica(s), %d units (+%d frozen), %s "
                 "compute, %s reduce, %s master", opts.stage, shard_world, self.replicate_comm.size,
                 len(self.units), len(self.frozen), opts.compute_dtype, opts.reduce_dtype,
                 opts.master_dtype)

    # -- backward ----------------------------------------------------------------------------

    def _grad_hook(self, unit: Unit):
        # Gradients accumulate in param.grad, autograd's own way (across micro-steps too, as the
        # local strategy does); the hook only counts arrivals, so that a unit's full gradient
        # buffer exists from its last gradient until its reduction — not through all of backward.
        def hook(param: torch.Tensor) -> None:
            unit.arrived += 1
            if unit.arrived == len(unit.params):
                self._unit_done(unit)
        return hook

    def _unit_done(self, unit: Unit) -> None:
        unit.arrived = 0
        if self.opts.stage == 3:  # free the gathered parameters before the reduction allocates
            self.param_sharding.after_backward(unit)
        if self.sync and not unit.reduced:
            self._reduce(unit)

    def _flatten_grads(self, unit: Unit) -> torch.Tensor:
        """Copy the unit's gradients into its flat buffer (a parameter without one, unused in
        this step, contributes zeros) and release them."""
        buffer = unit.full_grad_buffer()
        for param, offset in zip(unit.params, unit.layout.offsets):
            target = buffer[offset:offset + param.numel()]
            if param.grad is None:
                target.zero_()
            elif param.grad.data_ptr() != target.data_ptr():  # not already a view of it
                target.copy_(param.grad.view(-1))
                param.grad = None
        return buffer

    def _reduce(self, unit: Unit) -> None:
        unit.reduced = True
        if self.opts.stage >= 2:  # bound the transient full gradients alive at once
            while len(self.in_flight) >= MAX_REDUCTIONS_IN_FLIGHT:
                self._complete(*self.in_flight.pop(0))
        full_grad = self._flatten_grads(unit)
        if self.opts.stage == 0:
            handle = unit.comm.all_reduce(full_grad)
        else:  # the flat gradient is scratch: gloo then reduces it in place, with no copy
            handle = unit.comm.reduce_scatter(unit.grad_shard(), full_grad, scratch_input=True)
        self.in_flight.append((unit, handle))

    def _complete(self, unit: Unit, handle) -> None:
        handle.wait()
        if self.opts.stage >= 2:
            unit.full_grad = None

    def micro_step(self, sync: bool) -> None:
        """Call before each micro-batch's backward: only the last one synchronises gradients
        (inner micro-steps just accumulate locally — no communication)."""
        self.sync = sync
        for unit in self.units:
            unit.arrived = 0

    def finish_backward(self) -> None:
        """After the last micro-step: reduce units whose gradients never all arrived (unused
        parameters), wait for every reduction, then average shards across replicas."""
        for unit in self.units:
            if not unit.reduced:
                if self.opts.stage == 3:
                    self.param_sharding.after_backward(unit)
                self._reduce(unit)
        while self.in_flight:
            self._complete(*self.in_flight.pop(0))
        if self.opts.stage == 3:
            self.param_sharding.release_all()
        handles = ([] if self.local_sgd else  # local SGD: no gradient crosses replicas
                   [self.replicate_comm.all_reduce(u.grad_shard()) for u in self.units])
        for h in handles:
            h.wait()
        for unit in self.units:
            unit.reduced = False

    # -- step --------------------------------------------------------------------------------

    def grads(self) -> list[torch.Tensor]:
        return [unit.grad_shard() for unit in self.units]

    def _param_grad_slices(self, for_norm: bool = False, experts: bool | None = None) -> list[torch.Tensor]:
        """This rank's gradient, cut at parameter boundaries (padding left out), in the model's
        parameter order: torch's clip_grad_norm_ stacks the per-parameter norms in that order,
        and the order of that sum shows in the norm's last bit. `experts`: only the expert
        units' (True), only the others' (False), all (None)."""
        slices = []
        for (unit, offset, numel), counted in zip(self._param_spans, self._norm_spans):
            if experts is not None and unit.expert != experts:
                continue
            for lo, hi in (counted if for_norm else [(0, numel)]):
                start, end = max(offset + lo, unit.lo), min(offset + hi, unit.hi)
                if start < end:
                    slices.append(unit.grad_shard()[start - unit.lo:end - unit.lo])
        return slices

    def clip_grad_norm(self, max_norm: float) -> float:
        """Global L2 norm, clipped as torch's clip_grad_norm_ does it — norms per parameter, the
        norm of those, coefficient max_norm / (norm + 1e-6) clamped at 1, all in fp32 tensors —
        so that with whole gradients on every rank (stage 0, or one rank) the result is bitwise
        torch's. Sharded, each rank's partial norm is squared and summed over the shard group
        (replicas hold the same shards). A non-finite norm on any rank is non-finite on all:
        the fp16 skip decision and train.on_nonfinite's stop / skip are the same everywhere.

        The norm is computed (and all-reduced) every step even with clipping off
        (max_norm = inf): it is the non-finite check of every precision, the same on every
        rank, and the logged grad_norm. What is skipped is the multiplication by a coefficient
        of exactly 1 (clipping off, or a norm within max_norm): the norm is then finite, so
        every gradient is, and x * 1 is x — one pass over the gradient shard saved, no bit
        changed."""
        # Stage 0 with expert parallelism: each rank holds whole gradients of the dense part but
        # only its slice of the experts': the experts' squares are summed over the ep group.
        apart = self.opts.stage == 0 and self.ep_comm.group is not None
        slices = self._param_grad_slices(for_norm=True, experts=False if apart else None)
        norms = torch._foreach_norm(slices) if slices else []
        local = (torch.linalg.vector_norm(torch.stack(norms)) if norms
                 else torch.zeros((), device=self.units[0].flat_param.device))
        if apart:  # no expert slices when the experts are frozen (LoRA): a zero square
            slices = self._param_grad_slices(for_norm=True, experts=True)
            expert_norms = torch._foreach_norm(slices) if slices else []
            squares = torch.stack(expert_norms).float().pow(2).sum() if expert_norms else torch.zeros_like(local, dtype=torch.float32)
            with watched(self.watchdog, "all_reduce(grad norm)", "ep", 4):
                dist.all_reduce(squares, group=self.ep_comm.group)
            local = (local.float().pow(2) + squares).sqrt()
        groups = [(g, name) for g, name in ((self.shard_comm.group if self.opts.stage >= 1 else None, "dp_shard"),
                                            (self.tp_comm.group, "tp"), (self.mesh.pp_group, "pp"))
                  if g is not None]
        if groups:  # partial norms -> squares summed over the ranks holding different pieces
            local = local.float().pow(2)
            for group, name in groups:
                with watched(self.watchdog, "all_reduce(grad norm)", name, 4):
                    dist.all_reduce(local, group=group)
            local = local.sqrt()
        if self.local_sgd is not None and self.replicate_comm.group is not None:
            # Local SGD: each replica clips by its own norm, but a non-finite one on any replica
            # is non-finite on all, so every rank takes the same skip / stop decision.
            bad = (~torch.isfinite(local)).float()
            with watched(self.watchdog, "all_reduce(grad norm)", "dp_replicate", 4):
                dist.all_reduce(bad, group=self.replicate_comm.group)
            local = torch.where(bad > 0, torch.full_like(local, float("nan")), local)
        coef = torch.clamp(max_norm / (local + 1e-6), max=1.0)
        if float(coef) != 1.0:  # NaN included: the gradients become NaN, as torch's do
            torch._foreach_mul_(self.grads(), coef.to(self.opts.reduce_dtype))
        return float(local)

    def step(self) -> None:
        """The tier updates the masters and this rank's parameter shard from the gradient
        shard; stages 1-2 then gather everyone's updated shards (every rank keeps whole
        parameters there)."""
        # A frozen unit (LoRA's base) does not step: its offloaded shard stays where it is.
        self.param_store.materialize_all(frozen=False)
        if self.muon is not None:
            self.muon.before_step()
        self.tier.step([unit.grad_shard()[local] for unit, local in self.segments])
        if self.muon is not None:
            self.muon.after_step()
        self.param_store.store_all(frozen=False)
        self._gather_params()

    def _gather_params(self) -> None:
        if self.opts.stage in (1, 2):
            handles = [u.comm.all_gather(u.flat_param, u.shard_param) for u in self.units]
            for h in handles:
                h.wait()

    def zero_grad(self) -> None:
        """Stages 0-1: the flat gradient buffers zeroed and the parameters' gradients viewing
        them again (Unit.attach_grads; else every step's flatten overwrites each slot, the
        padding zeroed once). Stages 2-3 dropped their transient full gradients already and
        drop the gradient shards now (FSDP2's zero_grad(set_to_none=True)): until the next
        step's reductions, no gradient exists."""
        for unit in self.units:
            unit.shard_grad = None
            unit.attach_grads()

    @contextlib.contextmanager
    def full_parameters(self) -> Iterator[None]:
        """Every parameter whole while inside (stage 3 gathers and frees again after)."""
        if self.opts.stage != 3:
            yield
            return
        with self.param_sharding.all_gathered():
            yield

    # -- checkpoints -------------------------------------------------------------------------

    @property
    def writes_checkpoint(self) -> bool:
        """Stage 0: every rank holds everything and rank 0 writes it; sharded: the first
        replica group writes its shards. Local SGD: every replica writes its own state
        (parallel/data/zero/local_sgd.py)."""
        mesh = self.mesh
        replica = mesh.replica_rank == 0 or self.local_sgd is not None
        return replica and (self.opts.stage > 0 or mesh.shard_rank == 0
                            or (bool(self.expert_splits) and mesh.ep_shard_rank == 0))

    def state_slices(self, saving: bool = False) -> list[StateSlice]:
        """This rank's checkpoint slices in the whole tensors' coordinates (parallel/data/zero/slices.py)."""
        slices = engine_state_slices(self, saving) + (self.muon.state_slices() if self.muon else [])
        return self.local_sgd.state_slices(slices, saving) if self.local_sgd else slices

    def after_load(self) -> None:
        self.param_store.materialize_all()
        self.tier.refresh_targets()
        self.param_store.store_all()
        self._gather_params()

    # -- accounting --------------------------------------------------------------------------

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds at the optimizer step, by category (transient gathers and full
        gradients excluded; stages 2-3 hold their gradient shards from backward to the step)."""
        nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
        params = sum(nbytes(u.shard_param if self.opts.stage == 3 else u.flat_param)
                     for u in self.units + self.frozen)
        grads = sum(u.layout.shard_size * u.grad_dtype.itemsize if self.opts.stage >= 2
                    else nbytes(u.full_grad) for u in self.units)
        if self.opts.offload_params == "nvme":
            params = 0
        optim = sum(v for k, v in self.tier.held_bytes().items() if k != "nvme")
        if self.muon is not None:  # its momentum, beside the tier's (zero) AdamW moments
            optim += self.muon.held_bytes()
        outer = {"local_sgd": self.local_sgd.held_bytes()} if self.local_sgd else {}
        return {"params": params, "grads": grads, "optimizer": optim, **outer}

    def offload_report(self) -> dict:
        """Bytes per tier and what the last optimizer step moved (JSONL)."""
        stats = self.tier.stats
        report = {"optimizer_bytes_by_tier": self.tier.held_bytes(), "optimizer_step_s": stats.step_s}
        if self.opts.offload_params != "none":  # the gathers' reads and the step's writes
            report["params_bytes_by_tier"] = self.param_store.held_bytes()
            report["params_disk_read_bytes"], report["params_disk_write_bytes"] = self.param_store.take_io_bytes()
        if stats.read_bytes or stats.write_bytes:
            report.update(disk_read_bytes=stats.read_bytes, disk_write_bytes=stats.write_bytes,
                          disk_bytes_per_s=(stats.read_bytes + stats.write_bytes) / max(stats.step_s, 1e-9),
                          optimizer_io_wait_s=stats.io_wait_s)
        return report

    def predicted_state_bytes(self) -> dict[str, float]:
        """The ZeRO formula for this run's dtypes (Ψ without padding): K = 2 Adam moments in
        the master dtype, plus the master copy itself when it is not the parameters."""
        o = self.opts
        size = lambda dtype: torch.empty((), dtype=dtype).element_size()  # noqa: E731
        k = size(o.master_dtype) * (2 if o.master_dtype == o.compute_dtype else 3)
        if o.offload_optimizer == "nvme":  # none of it in memory
            k = 0
        out: dict[str, float] = {}
        for expert, comm in ((False, self.shard_comm), (True, self.expert_comm)):
            numel = sum(u.layout.total for u in self.units if u.expert == expert)
            part = model_state_bytes(numel, comm.size if o.stage else 1, o.stage,
                                     size(o.compute_dtype), size(o.reduce_dtype), k)
            out = {key: out.get(key, 0.0) + value for key, value in part.items()}
        # Parameters only, sharded at stage 3; a quantised base (lora.quantize) as its bytes.
        frozen = sum(u.layout.total * u.flat_param.element_size() for u in self.frozen)
        if frozen:
            out["params"] = out.get("params", 0.0) + frozen / (
                self.shard_comm.size if o.stage == 3 else 1)
        if self.muon is not None:  # fp32 momentum of the Muon matrices' elements, sharded
            out["optimizer"] = out.get("optimizer", 0.0) + 4 * self.muon.numel / (
                self.shard_comm.size if o.stage else 1)
        if self.local_sgd:  # θ_outer (+ momentum) of this rank's shard, fp32
            out["local_sgd"] = self.local_sgd.predicted_bytes(self.numel,
                                                              self.shard_comm.size if o.stage else 1)
        return out

    @property
    def numel(self) -> int:
        """Ψ: parameters without padding."""
        return sum(u.layout.total for u in self.units)
