"""Search the strategy space, keep what fits, rank by predicted throughput, say why.

The space: tensor-parallel degree (within a node), context-parallel degree (within a node, for
sequences whose activations matter), pipeline stages, data parallelism as
dp_replicate x dp_shard (full sharding, or sharding within a node and replicating across),
ZeRO stage, offload tiers, activation recomputation, and the micro-batch / gradient-accumulation
split of a fixed global batch. Offload and recomputation are tried only when the cheaper choice
does not fit (they never make a step faster). `plan_for_run` is what the trainer calls;
`predict_local` is what bench/bench_planner.py compares with measurements.
"""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass, field, replace

from shardlm.config.schema import Config, ParallelConfig
from shardlm.config.model import ModelConfig
from shardlm.errors import ConfigError
from shardlm.hardware.catalog import Cluster, choose_compute, local_cpu, parse_cluster
from shardlm.planner.explain import explain
from shardlm.planner.in_situ import calibrate_command
from shardlm.planner.memory import Memory, estimate_memory
from shardlm.planner.candidates import (AUTO, EVERYTHING, RUNTIME, Supported,  # noqa: F401 (re-exported)
                                        activation_choices, divisors, offload_blocks, offload_tiers,
                                        rank_layouts)
from shardlm.planner.shapes import model_from_hf_config, model_from_params, preset_model
from shardlm.planner.timing import Timing, estimate_time
from shardlm.config.dims import ParallelDims
from shardlm.planner.workload import Dtypes, Strategy, Workload, schedule_takes, zero_ranks


KEPT = ("tp", "cp", "pp", "ep", "dp_replicate", "sequence_parallel", "zero_stage")
"""The [parallel] settings `strategy = "auto"` keeps where the run sets them (kept_settings)."""


def kept_settings(par: ParallelConfig) -> dict[str, int | bool]:
    """The KEPT settings of a run's [parallel] section that differ from their defaults: those the
    user set, which `auto` keeps and plans around. (A setting equal to its default, such as an
    explicit zero_stage = 0, cannot be told from an unset one: auto chooses it.)"""
    default = ParallelConfig()
    return {key: getattr(par, key) for key in KEPT if getattr(par, key) != getattr(default, key)}


@dataclass
class Plan:
    strategy: Strategy
    memory: Memory
    timing: Timing | None = None
    """None for a plan that does not fit (its time is not computed)."""

    @property
    def runtime_supported(self) -> bool:
        return self.not_runnable is None

    @property
    def not_runnable(self) -> str | None:
        """Why `shardlm train` cannot run this plan (None: it can). Every layout the planner
        models runs today (the last exception, ep beside tp or cp, went with the ep x tp grid's
        model); kept for `plan`'s report and its --json keys (runtime_supported, not_runnable)."""
        return None

    def overrides(self) -> dict[str, object]:
        """The config keys (and typed values) that run this plan: what `apply` sets, and what
        `shardlm plan` prints as command-line flags."""
        s, lay = self.strategy, self.strategy.layout
        out: dict[str, object] = {
            "parallel.zero_stage": s.zero_stage, "parallel.dp_replicate": lay.dp_replicate,
            "parallel.dp_shard": lay.dp_shard, "train.micro_batch": s.micro_batch,
            "train.grad_accum": s.grad_accum, "activation.checkpoint": s.recompute,
            "precision.compute": s.dtypes.precision, "precision.master": s.dtypes.master}
        if s.dtypes.reduce != "auto":
            out["precision.reduce"] = s.dtypes.reduce
        for key in ("tp", "cp", "pp", "ep"):
            if getattr(lay, key) > 1:
                out[f"parallel.{key}"] = getattr(lay, key)
        if lay.tp > 1:
            out["parallel.sequence_parallel"] = s.sequence_parallel
            if s.async_tp:
                out["parallel.async_tp"] = True
        if lay.cp > 1 and s.cp_mode != "ring":
            out["parallel.cp_mode"] = s.cp_mode
            if s.cp_ulysses:
                out["parallel.cp_ulysses"] = s.cp_ulysses
        if lay.pp > 1:
            out["parallel.pp_schedule"] = s.pp_schedule
            if s.pp_virtual > 1:
                out["parallel.pp_virtual"] = s.pp_virtual
            if s.pp_layers:
                out["parallel.pp_layers"] = s.pp_layers
        if s.offload_optimizer != "none":
            out["zero.offload_optimizer"] = s.offload_optimizer
        if s.offload_params != "none":
            out["zero.offload_params"] = s.offload_params
        if s.activation_offload != "none":
            out["activation.offload"] = s.activation_offload
            out["activation.offload_blocks"] = s.activation_offload_blocks
        return out

    def apply(self, cfg: Config) -> Config:
        """A new Config: `cfg` with this plan's keys set (typed values, no parsing), strategy
        'manual', validated. The plan's layout replaces the config's whole: tp, cp, pp, sequence
        parallelism, the pipeline keys, activation offload and the ZeRO offload tiers are set
        even at 1 / 'none' (overrides() leaves them out there, as command-line flags): a stage
        the plan lowers to 0 never meets an optimizer offload it cannot hold."""
        new = copy.deepcopy(cfg)
        s, lay = self.strategy, self.strategy.layout
        whole = {"parallel.tp": lay.tp, "parallel.cp": lay.cp, "parallel.pp": lay.pp, "parallel.ep": lay.ep,
                 "parallel.sequence_parallel": s.sequence_parallel and lay.tp > 1,
                 "parallel.async_tp": s.async_tp and s.sequence_parallel and lay.tp > 1,
                 "parallel.cp_mode": s.cp_mode if lay.cp > 1 else "ring",
                 "parallel.cp_ulysses": s.cp_ulysses if lay.cp > 1 else 0,
                 "parallel.pp_schedule": s.pp_schedule, "parallel.pp_virtual": s.pp_virtual,
                 "parallel.pp_layers": s.pp_layers, "activation.offload": s.activation_offload,
                 "activation.offload_blocks": s.activation_offload_blocks,
                 "zero.offload_optimizer": s.offload_optimizer, "zero.offload_params": s.offload_params}
        for key, value in {**self.overrides(), **whole, "parallel.strategy": "manual"}.items():
            section, _, name = key.partition(".")
            setattr(getattr(new, section), name, value)
        return new.validate()


@dataclass
class SearchResult:
    workload: Workload
    cluster: Cluster
    plans: list[Plan]
    """What fits, best first, the best micro-batch split per structural choice."""
    evaluated: int
    unfit: list[Plan] = field(default_factory=list)
    """What does not fit, least over capacity first (for the explanation)."""


def _first_fit(w: Workload, cluster: Cluster, strategies: list[Strategy]) -> tuple[Plan | None, list[Plan]]:
    """The first strategy that fits (they come cheapest first: offloading or recomputing more
    only slows a plan that already fits), and the ones before it that did not."""
    unfit = []
    for s in strategies:
        memory = estimate_memory(w, s, cluster)
        if memory.fits:
            return Plan(s, memory, estimate_time(w, s, cluster)), unfit
        unfit.append(Plan(s, memory))
    return None, unfit


def search(w: Workload, cluster: Cluster, dtypes: Dtypes, supported: Supported = EVERYTHING,
           layouts: list[ParallelDims] | None = None, sequence_parallel: bool = True,
           pipeline: Strategy | ParallelConfig | None = None) -> SearchResult:
    """Every candidate's memory; the time of those that fit; ranked by tokens/s. `layouts`
    restricts the rank layouts (estimate's suggestions keep the user's); `sequence_parallel`,
    for layouts with tp > 1 (a run's own setting, which auto keeps); `pipeline`, for layouts
    with pp > 1, a strategy whose pp_schedule, pp_virtual and pp_layers are kept (a run's own;
    default 1F1B, balanced)."""
    best: dict[tuple, Plan] = {}
    unfit: dict[tuple, Plan] = {}
    evaluated = 0
    key = lambda s: (s.layout, s.zero_stage, s.recompute, s.offload_optimizer, s.offload_params,  # noqa: E731
                     s.activation_offload, s.async_tp)
    over = lambda p: p.memory.peak / p.memory.capacity  # noqa: E731
    for lay in layouts or rank_layouts(w, cluster, supported, dtypes):
        per_rank = w.global_batch // lay.dp_size
        piped = {}
        if lay.pp > 1 and pipeline is not None:
            piped = dict(pp_schedule=pipeline.pp_schedule, pp_virtual=pipeline.pp_virtual,
                         pp_layers=pipeline.pp_layers)
        if lay.cp > 1:  # the mode the runtime's 'auto' resolves to, priced (cp_modes.choose_cp_mode),
            # or a run's own
            piped["cp_mode"] = getattr(pipeline, "cp_mode", "auto")
            piped["cp_ulysses"] = getattr(pipeline, "cp_ulysses", 0)
        # overlapped tp (timing._async_tp_overlap): a run's own parallel.async_tp kept (`auto`
        # must not turn on what its config may refuse: compile, QLoRA), else (`plan`) tried both
        # ways where the runtime has it (sequence parallelism; not with fp8)
        overlapped = (False,)
        if lay.tp > 1 and sequence_parallel and not dtypes.fp8:
            overlapped = (False, True) if pipeline is None else (bool(getattr(pipeline, "async_tp", False)),)
        for stage in supported.stages:
            if stage == 0 and lay.dp_replicate > 1:
                continue  # stage 0 reduces over all data-parallel ranks: the split is moot
            if stage == 3 and lay.pp > 1 and not supported.zero3_with_pp:
                continue
            offloads = offload_tiers(stage, cluster, supported)
            if zero_ranks(lay) == 1 and stage and len(supported.stages) > 1:
                offloads = offloads[1:]  # sharding over one rank only pays with offload (unless
                # the stage is the run's own: then it is kept, offloaded or not)
            for micro in divisors(per_rank):
                if lay.pp > 1 and not schedule_takes(piped.get("pp_schedule", ""), lay.pp,
                                                     piped.get("pp_virtual", 1), per_rank // micro):
                    continue  # a split the run's schedule cannot take (DualPipeV: >= 2·pp micro-batches)
                for (recompute, act), asy in itertools.product(activation_choices(cluster, supported), overlapped):
                    tries = [Strategy(lay, stage, micro, per_rank // micro, recompute, opt, params, dtypes,
                                      sequence_parallel, **piped, async_tp=asy, activation_offload=act,
                                      activation_offload_blocks=blocks)
                             for blocks in (offload_blocks(w, lay) if act != "none" else (0,))
                             for opt, params in offloads]
                    plan, misses = _first_fit(w, cluster, tries)
                    evaluated += len(misses) + (plan is not None)
                    for miss in misses:
                        if key(miss.strategy) not in unfit or over(miss) < over(unfit[key(miss.strategy)]):
                            unfit[key(miss.strategy)] = miss
                    if plan is None:
                        continue
                    # Micro-batches ascend: a tie (within 0.1%) goes to the larger one, with
                    # fewer micro-steps of the fixed overhead the model does not price.
                    held = best.get(key(plan.strategy))
                    if held is None or plan.timing.tokens_per_s > 0.999 * held.timing.tokens_per_s:
                        best[key(plan.strategy)] = plan
                    if act == "none":
                        break  # more recomputation only slows a micro-batch that already fits
                    # offloaded activations fit: recomputing instead may still be faster (when
                    # the copies are not hidden behind compute), so that is tried too
    plans = sorted(best.values(), key=lambda p: (-p.timing.tokens_per_s, not p.runtime_supported,
                                                 p.memory.peak))
    closest = sorted((p for k, p in unfit.items() if k not in best), key=over)
    return SearchResult(w, cluster, plans, evaluated, closest)


# ---------------------------------------------------------------------------------------------
# Entry points for the trainer and the validation benchmark


def default_dtypes(cluster: Cluster, compute: str = "auto", master: str = "fp32",
                   reduce: str = "auto", fp8_all_gather: bool = False) -> Dtypes:
    """'auto' as a run resolves it (hardware.catalog.choose_compute). 'fp8' is kept (Dtypes.fp8):
    its parameters, gradients and activations are bf16, its blocks' matmuls at the device's fp8
    peak where the catalog has one (planner/timing.py); `fp8_all_gather` with it (Dtypes)."""
    peak = cluster.device.peak
    if compute == "fp8":
        return Dtypes("bf16", reduce, master, fp8=True, fp8_all_gather=fp8_all_gather)
    if compute == "auto":
        compute = choose_compute(cluster.device.kind, peak)
    if master == "bf16" and compute != "bf16":
        raise ConfigError(f"master bf16 (pure bf16) needs compute bf16, got {compute!r}")
    return Dtypes(compute, reduce, master)


def plan_for_run(model: ModelConfig, world_size: int, hardware: Cluster | str,
                 batch: int | tuple[int, int, int], supported: Supported = AUTO,
                 dtypes: Dtypes | None = None, seq_len: int | None = None,
                 parallel: ParallelConfig | None = None) -> list[Plan]:
    """Ranked plans (best first) that fit, for `strategy = "auto"`.

    `hardware`: a Cluster or a spec ('8xA100-80GB', 'cpu' = this machine's world_size ranks).
    `batch`: global tokens per step (with `seq_len`, default the model's max_seq_len), or
    (micro_batch, grad_accum, seq_len) of a run with world_size / (tp x cp x pp) data-parallel
    ranks, whose global batch is kept while the split may change. `parallel`: the run's own
    [parallel] section; what it sets (kept_settings: tp, cp, pp, ep, dp_replicate, sequence
    parallelism, the ZeRO stage) every plan keeps, with its pipeline schedule, pp_virtual and
    pp_layers; the search chooses the rest.
    Each plan's `overrides()` are the config keys to set. Raises ConfigError if the cluster's
    size is not world_size, or no layout keeps what the run set.
    """
    par = parallel or ParallelConfig(sequence_parallel=True)
    tp, cp, pp = par.tp, par.cp, par.pp
    kept = kept_settings(par) if parallel is not None else {}
    if isinstance(hardware, str):
        hardware = local_cpu(world_size) if hardware == "cpu" else parse_cluster(hardware)
    if hardware.world_size != world_size:
        raise ConfigError(f"{hardware.describe()} has {hardware.world_size} devices, the run "
                          f"{world_size} ranks")
    if world_size % (tp * cp * pp):
        raise ConfigError(f"tp ({tp}) x cp ({cp}) x pp ({pp}) = {tp * cp * pp} does not divide the "
                          f"{world_size} ranks")
    if isinstance(batch, tuple):
        micro, accum, seq = batch
        sequences = micro * accum * world_size // (tp * cp * pp)
    else:
        seq = seq_len or model.max_seq_len
        sequences = max(1, batch // seq)
    workload = Workload(model, seq, sequences)
    dtypes = dtypes or default_dtypes(hardware)
    if "zero_stage" in kept:  # the run's own stage (3 with its pipeline too: AUTO only never picks it)
        supported = replace(supported, stages=(par.zero_stage,), zero3_with_pp=True)
    layouts = None
    degrees = {key: value for key, value in kept.items() if key in ("tp", "cp", "pp", "ep", "dp_replicate")}
    if tp > 1 or cp > 1 or pp > 1 or degrees:
        pinned = {"tp": tp, "cp": cp, "pp": pp, **degrees}
        layouts = list(rank_layouts(workload, hardware, supported, dtypes, pinned=pinned))
        if not layouts:
            named = ", ".join(f"{key} = {value}" for key, value in pinned.items())
            raise ConfigError(f"no rank layout keeps {named} on {world_size} ranks with {sequences} "
                              f"sequences of {seq} tokens per step (tp must divide the heads, 2·cp "
                              f"the sequence, pp at most the layers; ep must divide dp_shard x cp, "
                              f"and ep x tp the experts; dp_replicate the data-parallel ranks)")
    result = search(workload, hardware, dtypes, supported, layouts, par.sequence_parallel, par)
    return result.plans


@dataclass
class LocalPrediction:
    """What bench/bench_planner.py compares with a measured run on this CPU."""

    model_state_bytes: dict[str, float]
    """Per rank: params, grads, optimizer held between steps in this process's memory — what
    `run.strategy.model_state_bytes()` reports after a step (on a CPU the cpu tier is this
    memory, nvme is not; one process has no gradients between steps)."""
    activation_bytes: float
    peak_process_bytes: float
    step_time_s: float
    tokens_per_s: float
    memory: Memory
    timing: Timing


def config_strategy(cfg: Config, cluster: Cluster) -> tuple[Workload, Strategy]:
    """The planner's view of one concrete (resolved) configuration on `cluster`: what
    `shardlm train --dry-run` predicts and `predict_local` checks against measurement: its
    layout (pp included), ZeRO stage, batch split, recomputation, offload, precision, sequence
    parallelism and pipeline schedule (pp_schedule, pp_virtual, pp_layers), prefetch. Assumes
    the default parallel.reshard_after_forward = true."""
    from shardlm.config.dims import resolve_dims

    dims = resolve_dims(cfg.parallel, cluster.world_size)
    dtypes = default_dtypes(cluster, cfg.precision.compute, cfg.precision.master, cfg.precision.reduce,
                            cfg.precision.fp8_all_gather)
    t, zero = cfg.train, cfg.zero
    par = cfg.parallel
    strategy = Strategy(dims, par.zero_stage, t.micro_batch, t.grad_accum, cfg.activation.checkpoint,
                        zero.offload_optimizer, zero.offload_params, dtypes,
                        sequence_parallel=par.sequence_parallel, async_tp=par.async_tp,
                        pp_schedule=par.pp_schedule,
                        pp_virtual=par.pp_virtual, pp_layers=par.pp_layers,
                        activation_offload=cfg.activation.offload,
                        activation_offload_blocks=cfg.activation.offload_blocks, prefetch=par.prefetch,
                        cp_mode=par.cp_mode, cp_ulysses=par.cp_ulysses,
                        local_sgd_every=t.local_sgd.every, local_sgd_outer=t.local_sgd.outer,
                        optimizer=t.optimizer)
    return Workload(cfg.model, t.seq_len, t.micro_batch * t.grad_accum * dims.dp_size), strategy


def predict_local(cfg: Config, n_ranks: int, mmap_threshold: int | None = None) -> LocalPrediction:
    """Predict one concrete configuration on this CPU with `n_ranks` local ranks (measures
    the CPU once, cached), its processes' malloc mmap threshold `mmap_threshold` (default: the
    config's run.malloc_mmap_threshold; the environment's wins, as in the run)."""
    cluster = local_cpu(n_ranks, cfg.run.malloc_mmap_threshold if mmap_threshold is None else mmap_threshold)
    workload, strategy = config_strategy(cfg, cluster)
    memory = estimate_memory(workload, strategy, cluster)
    timing = estimate_time(workload, strategy, cluster)
    # As the strategies' ledgers count between steps: one process sets param.grad to None
    # after each step (its gradients are transient, counted in the peak only).
    states = {"params": memory.category("parameters"),
              "grads": 0.0 if strategy.local else memory.category("gradients"),
              "optimizer": memory.category("optimizer states")}
    if strategy.optimizer == "muon" and not strategy.local:  # the engine counts it as optimizer state
        states["optimizer"] += memory.category("Muon momentum")
    if strategy.local_sgd_every:  # the engine's ledger counts the outer model apart
        states["local_sgd"] = memory.category("local SGD outer model")
    return LocalPrediction(states, memory.activations, memory.peak, timing.step,
                           timing.tokens_per_s, memory, timing)


def run_prediction(cfg: Config, hardware) -> dict:
    """The planner's prediction for one resolved run on the Cluster `hardware()` returns, as the
    trainer writes it in its first JSONL record under "predicted" (telemetry.MetricsLog) and
    compares at the end (telemetry.prediction_summary): step time, tokens/s, peak bytes per rank
    (the worst pipeline stage's; of it, runtime_reserve_bytes is outside torch's allocator: the
    CUDA context, or on a CPU the worker's baseline) and communication bytes per rank and step
    (as the engine's ledger counts them). Advisory: a run the planner cannot describe (a GPU not in the catalog,
    a model it has no shape for) gets {"unavailable": why} and a warning, and trains on."""
    import logging

    try:
        cluster = hardware()
        workload, strategy = config_strategy(cfg, cluster)
        memory = estimate_memory(workload, strategy, cluster)
        timing = estimate_time(workload, strategy, cluster)
    except Exception as err:  # noqa: BLE001 - a prediction never stops a run; its reason is kept
        logging.getLogger("shardlm").warning("planner: no prediction for this run: %s: %s",
                                             type(err).__name__, err)
        return {"unavailable": f"{type(err).__name__}: {err}"}
    out = {"step_time_s": timing.step, "tokens_per_s": timing.tokens_per_s,
           "peak_bytes_per_rank": memory.peak, "comm_bytes": sum(c.bytes for c in timing.comms),
           "exposed_comm_s": timing.exposed_comm, "mfu": timing.mfu,
           "runtime_reserve_bytes": cluster.calibration.runtime_reserve}
    # JSON has no NaN or infinity (the metrics log refuses them): an undefined figure is null
    return {**{k: v if math.isfinite(v) else None for k, v in out.items()}, "hardware": cluster.describe(),
            "calibration": timing.calibration,
            "calibrate_command": calibrate_command(workload, strategy, cluster) or None}


def alternatives(w: Workload, s: Strategy, cluster: Cluster, count: int = 3) -> list[Plan]:
    """For an estimate that does not fit: the fastest plans on the same rank layout (any
    stage, recomputation, offload, micro-batch split of the same global batch)."""
    found = search(w, cluster, s.dtypes, layouts=[s.layout], sequence_parallel=s.sequence_parallel,
                   pipeline=s)
    return found.plans[:count]


__all__ = ["EVERYTHING", "RUNTIME", "LocalPrediction", "Plan", "SearchResult", "Supported",
           "alternatives", "config_strategy", "default_dtypes", "kept_settings", "model_from_hf_config", "explain",
           "model_from_params", "plan_for_run", "predict_local", "preset_model", "run_prediction", "search"]
