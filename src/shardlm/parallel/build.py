"""parallelize(model, mesh, cfg): the one ordered composition of every strategy.

A plain model — ours built on the meta device, or any nn.Module — goes through the steps in a
fixed order, each a function that logs what it applied:

    LoRA (apply_lora: adapters beside the chosen linears, everything else frozen; with
    lora.quantize the frozen block linears stored as packed bytes, models/quant.py)  →
    FP8 (apply_fp8, precision.compute = 'fp8': the blocks' linears swapped, same parameters)  →
    tensor parallelism (apply_tp, or apply_tp_plan for a transformers model: layers replaced
    by their tensor-parallel versions, still on the meta device)  →  context parallelism
    (apply_cp: the sequence split, attention by ring)  →  expert parallelism (apply_ep)  →  pipeline stages (apply_pp: the
    blocks outside this rank's stage dropped, still on meta)  →  activation checkpointing (apply_ac)
    →  activation offload (apply_offload: saved-tensor hooks per chosen block)  →  data parallelism / ZeRO (apply_data_parallel: the sharded build materialises the model
    here, one unit at a time, each parameter initialised whole and cut to this rank's piece)
    →  compile (apply_compile: each block's forward, regionally, the strategies' hooks left
    eager around it)

Expert parallelism (apply_ep: each MoE block's experts cut to this rank's E / ep, tokens
exchanged by all-to-all) goes between context parallelism and the pipeline; under tensor
parallelism apply_tp spreads the experts over the tp ranks instead, or with ep > 1 too, apply_ep
over the ep × tp ranks.

parallelize also returns each feature's part in the training step (step_hooks → StepHooks: the
loss-token count, MoE's loss scale, biases and balancer, FP8's histories and counts, local
SGD's outer step), so train/step.py calls hooks and names no feature; and the optimizer step's
variant (decided on the device or on the host), chosen here once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from shardlm.comm.collectives import Comm, CommLedger
from shardlm.comm.watchdog import CollectiveWatchdog
from shardlm.config.fields import compile_on
from shardlm.config.schema import Config
from shardlm.config.model import ModelConfig
from shardlm.data.packed import counted_targets
from shardlm.data.sft import IGNORE
from shardlm.comm.mesh import Mesh
from shardlm.parallel.blocks.activation import apply_ac, apply_offload
from shardlm.parallel.blocks.compile import apply_compile
from shardlm.parallel.context.attention import CPState, apply_cp
from shardlm.parallel.data.evaluation import global_target_counts, token_sums
from shardlm.parallel.expert.dispatch import apply_ep, finish_moe_step, share_over_cp, spread_over_tp
from shardlm.parallel.expert.balance import ExpertBalancer
from shardlm.parallel.pipeline.executor import Schedule, schedule_for
from shardlm.parallel.pipeline.stages import Stage, apply_pp
from shardlm.parallel.pipeline.schedules import table_for
from shardlm.parallel.pipeline.weight_grads import make_deferrable
from shardlm.models.flops import pipeline_split
from shardlm.checkpoint.hf_dir import module_initializer
from shardlm.checkpoint.hf_names import hf_initializer
from shardlm.models.init import Initializer, initializer_for
from shardlm.models.lora import DEFAULT_TARGETS, apply_lora, with_adapters
from shardlm.models.quant import by_columns, quantizable, quantize_base
from shardlm.models.fp8 import Fp8State, apply_fp8
from shardlm.models.moe import MoEStats
from shardlm.errors import ConfigError
from shardlm.parallel.data.engine import DataParallelEngine, LocalEngine, apply_data_parallel
from shardlm.models.decoder import Decoder
from shardlm.models.hf import CausalLMAdapter
from shardlm.parallel.tensor.pieces import sliced
from shardlm.parallel.tensor.decoder import apply_tp
from shardlm.parallel.tensor.layers import VocabParallelHead, vocab_parallel_cross_entropy
from shardlm.parallel.tensor.regions import TPState
from shardlm.parallel.tensor.plan import apply_tp_plan

log = logging.getLogger("shardlm")


@dataclass
class StepState:
    """One training step as the step (train/step.py) and the features' hooks share it: made at
    the step's start, returned in its StepResult; nothing of it stays in the run."""

    step: int
    """The step, from 0."""
    targets: list[torch.Tensor]
    """This rank's micro-batches' targets."""
    global_micro_batches: int
    """How many micro-batches one gradient sums: each micro-batch's loss is divided by it."""
    loss_scale: float
    """The loss scaler's scale as the step starts (fp16: the backward's; else 1)."""
    stop: bool
    """A signal asked this rank to stop (the loss's all-reduce makes it every rank's answer)."""
    denominator: float | None = None
    """The global batch's counted targets per micro-batch (set by the loss-token count), or
    None: each micro-batch's loss is the mean over its own targets."""
    total: torch.Tensor | None = None
    """This rank's micro-batches' summed loss, once backward is done."""
    grad_norm: float | None = None
    stepped: bool | None = None
    """Whether the optimizer stepped: known after the optimizer phase, or (a step decided on
    the device) after the loss's all-reduce."""
    loss_token_fraction: float | None = None
    """data.format chat / prompt_completion: the fraction of the global batch's targets that
    carry loss (not -100); logged as `loss_token_fraction`."""
    moe_sums: torch.Tensor | None = None
    """The step's mixture-of-experts figures summed over the ranks (parallel/expert/dispatch.py)."""
    moe_placement: dict = field(default_factory=dict)
    """The step's expert-parallel rank loads and re-placements (ExpertBalancer)."""
    fp8_record: dict = field(default_factory=dict)
    """fp8_overflow / fp8_underflow (fractions of every rank's quantised elements, and by
    tensor): models.fp8.Fp8Stats.record; empty without the fp8 emulation."""


Summed = tuple[Callable[[torch.device], torch.Tensor], Callable[[StepState, torch.Tensor], None]]
"""A feature's figures that ride on the step's loss all-reduce: (its values on a device, what
it reads from their sum over the ranks)."""


@dataclass
class StepHooks:
    """Each feature's part in the training step (train/step.py), at the points of the step,
    each list called in the order parallelize registered it: the step itself names no feature."""

    before_forward: list[Callable[[StepState], None]] = field(default_factory=list)
    """Before the first forward: the loss-token count, the MoE losses' scale, FP8's histories."""
    after_backward: list[Callable[[StepState], bool]] = field(default_factory=list)
    """After the last backward; False: the step did not commit, and is taken again (the
    fault-tolerant replicas' average, added by train/build.py)."""
    after_optimizer: list[Callable[[StepState], None]] = field(default_factory=list)
    """Inside the optimizer phase, after zero_grad: local SGD's outer step."""
    after_update: list[Callable[[StepState], None]] = field(default_factory=list)
    """After the optimizer phase, before the loss's all-reduce: MoE biases and balancer."""
    summed: list[Summed] = field(default_factory=list)
    """What rides on the loss's all-reduce: FP8's overflow / underflow counts."""
    after_reduce: list[Callable[[StepState], None]] = field(default_factory=list)
    """After the loss's all-reduce (`stepped` known on every rank): a joining replica's state."""


def count_targets(mesh: Mesh, device: torch.device, watchdog: CollectiveWatchdog | None,
                  local_sgd: bool) -> Callable[[StepState], None]:
    """Targets of -100 (SFT formats' prompts, seq2seq padding): one objective whatever the split,
    the global batch's summed loss over its counted targets (transformers' 2024 gradient-
    accumulation fix). Each micro-batch's loss is its summed loss over `denominator` = the
    global count's share per micro-batch, so the 1/global_micro_batches the step divides by
    leaves sum / global count, however unevenly micro-batches, ranks, stages or cp shards hold
    them. Counted over the ranks whose gradients are summed (under local SGD, one replica's)."""
    group = mesh.dp_shard_group if local_sgd else mesh.dp_group

    def count(state: StepState) -> None:
        kept, targets = global_target_counts(state.targets, group, mesh.dims.cp, device, watchdog)
        state.loss_token_fraction = kept / targets
        state.denominator = max(kept, 1.0) / state.global_micro_batches  # a batch with no loss target: 0
    return count


def moe_hooks(hooks: StepHooks, moe: MoEStats, balancer: ExpertBalancer | None, model_cfg: ModelConfig,
              strategy: DataParallelEngine, mesh: Mesh) -> None:
    """The MoE layers' balancing losses get the language-model loss's scale; after the step,
    its routing summed over the ranks and the balancing biases moved (only if it stepped); with
    ep > 1, the ranks' loads, and the balancer's moves (parallel/expert/balance.py)."""
    def scale_balancing_losses(state: StepState) -> None:
        moe.reset()
        moe.grad_scale = state.loss_scale / state.global_micro_batches

    def finish(state: StepState) -> None:
        m = model_cfg
        state.moe_sums = finish_moe_step(moe, m.balance if state.stepped else "none", m.bias_update_rate)
        if balancer is not None and state.moe_sums is not None:
            ranks = balancer.rank_imbalance(state.moe_sums)  # this step's placement, before a move
            state.moe_placement = {"moe_rank_imbalance": max(ranks, default=1.0),
                                   "moe_rank_imbalance_by_layer": ranks,
                                   "moe_replaced_blocks": balancer.step(state.step, state.moe_sums, strategy,
                                                                        mesh.dp_shard_group)}
    hooks.before_forward.append(scale_balancing_losses)
    hooks.after_update.append(finish)


def fp8_hooks(hooks: StepHooks, fp8: Fp8State) -> None:
    """Delayed scaling's histories advance and the step's counts restart before it; its
    overflow / underflow counts ride on the loss's all-reduce (the emulation counts them)."""
    hooks.before_forward.append(lambda state: fp8.begin_step())
    stats = fp8.stats
    if stats is not None:
        def read(state: StepState, summed: torch.Tensor) -> None:
            state.fp8_record = stats.record(summed)
        hooks.summed.append((stats.totals, read))


def local_sgd_hook(hooks: StepHooks, outer, steps: int) -> None:
    """train.local_sgd: when a round ends (every `every` steps, and the run's last), the outer
    step across the replicas (parallel/data/zero/local_sgd.py)."""
    def outer_step(state: StepState) -> None:
        if outer.due(state.step, steps):
            outer.synchronize()
    hooks.after_optimizer.append(outer_step)


@dataclass
class Parallelized:
    model: nn.Module
    """The plain model, transformed in place: what is saved and exported."""
    forward: nn.Module
    """What the training step calls: the model, or its compiled wrapper."""
    strategy: DataParallelEngine
    """Gradient synchronisation, clipping and the optimizer step (local or ZeRO)."""
    tp: TPState | None = None
    """The tensor-parallel group, when there is one."""
    cp: CPState | None = None
    """The context-parallel group, when there is one."""
    pipeline: Stage | None = None
    """This rank's pipeline stage, when there is a pipeline."""
    schedule: Schedule | None = None
    """The pipeline's schedule (parallel.pp_schedule)."""
    fp8: Fp8State | None = None
    """precision.compute = 'fp8': the swapped layers, delayed scaling's state, the step's counts."""
    moe: MoEStats | None = None
    """A mixture-of-experts model's routing state (models/moe.py): biases saved and restored."""
    hooks: StepHooks = field(default_factory=StepHooks)
    """Each feature's part in the training step (step_hooks)."""
    step_on_device: bool = False
    """One process without ZeRO or MoE: the optimizer is queued without a host sync, the step
    skipped on the device if the norm is not finite (LocalEngine.clip_and_step_on_device)."""
    replicas_apart: int = 1
    """Replicas whose gradient is their own data's mean, not a share of one (train.local_sgd:
    dp_replicate; else 1): the loss's and the micro-batches' divisor."""

    def loss(self, logits: torch.Tensor, targets: torch.Tensor,
             denominator: float | None = None) -> torch.Tensor:
        """Mean cross-entropy in fp32 (a bf16/fp16 softmax over 50k classes loses the small
        probabilities); vocabulary-parallel when the head is. Under context parallelism, the
        sum over this rank's tokens divided by the whole sequence's count over cp (the targets
        cut as the forward cut the inputs): the trainer divides by cp once more, so the cp
        ranks' summed gradient is the whole sequence's mean's, as in one process. Targets of
        -100 (data.format chat / prompt_completion) are ignored. `denominator` (the trainer's
        share of the global batch's counted targets per micro-batch, train/step.py): the sum
        over this rank's kept targets divided by it, so that every counted target of the
        global batch weighs the same whatever micro-batch, rank or cp shard holds it;
        without it, the mean over this micro-batch's kept targets."""
        count = None
        if denominator is not None:
            # A cp rank whose forward saw the whole sequence (not sharded) sums every target
            # and its loss is divided by cp once more: its share is cp times larger.
            scale = self.cp.size if self.cp is not None and not self.cp.sharded else 1
            count = torch.tensor(denominator * scale, device=logits.device)
            if self.cp is not None:
                targets = self.cp.local(targets)
        elif self.cp is not None:
            # every cp rank holds the whole targets: their count needs no communication. Text:
            # count = T / cp exactly, this rank's own count, so the loss is its tokens' mean.
            count = (targets != IGNORE).sum() / (self.cp.size if self.cp.sharded else 1)
            targets = self.cp.local(targets)
        head = getattr(self.model, "head", None)
        if isinstance(head, VocabParallelHead):  # a transformers model's head stays whole
            return vocab_parallel_cross_entropy(logits, targets, head, count)
        targets = counted_targets(logits, targets, IGNORE)  # the head on counted positions only
        logits = logits.float().flatten(0, 1)
        if count is None:
            return torch.nn.functional.cross_entropy(logits, targets.flatten())
        return torch.nn.functional.cross_entropy(logits, targets.flatten(), reduction="sum") / count

    def token_sums(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Evaluation: [summed cross-entropy, correct argmax, targets] over this rank's targets
        that carry loss (parallel/data/evaluation.py), cut as `loss` cuts them under context
        parallelism. A vocabulary-parallel head's logits are gathered whole first (no gradient:
        one (B, T, vocab) fp32 tensor per evaluation micro-batch), so argmax sees every id."""
        if self.cp is not None:
            targets = self.cp.local(targets)
        head = getattr(self.model, "head", None)
        if isinstance(head, VocabParallelHead):
            logits = head.gather(logits)
        return token_sums(logits, targets)


def apply_tensor_parallel(model: nn.Module, comm: Comm, sequence_parallel: bool,
                          spread_experts: bool = True) -> TPState | None:
    """Our Decoder's layers by apply_tp; any other model (a transformers one) by its config's
    base_model_tp_plan, or a clear error; a MoE block's experts spread over the tp ranks
    (expert.spread_over_tp; with parallel.ep > 1 apply_ep spreads them over ep × tp). Chosen here: tensor_plan and expert build on tensor's layers, so
    tensor cannot call them."""
    if isinstance(model, Decoder):
        tp = apply_tp(model, comm, sequence_parallel)
        if tp is not None:
            spread_over_tp(model, tp, spread_experts)
        return tp
    return apply_tp_plan(model, comm, sequence_parallel)


def initial_values(model: nn.Module, model_cfg: ModelConfig, seed: int) -> Initializer:
    """Where the parameters' first values come from: model.hf_path's checkpoint (our decoder,
    read from safetensors, or the transformers module build_run built from it: its tensors by
    name; LoRA adapters are new), or the model's own initialisation at train.seed."""
    own = initializer_for(model, seed)
    if model_cfg.hf_path and not isinstance(model, Decoder):  # build_run's transformers module
        return with_adapters(module_initializer(model_cfg.hf_path, model), own)
    if model_cfg.hf_path and isinstance(model, Decoder):  # build_run refuses any other model
        # The checkpoint for its tensors; LoRA adapters are new: the model's own initial values.
        return with_adapters(hf_initializer(model_cfg.hf_path, model, model_cfg), own)
    return own


def step_hooks(model: nn.Module, mesh: Mesh, cfg: Config, device: torch.device,
               watchdog: CollectiveWatchdog | None, strategy: DataParallelEngine,
               moe: MoEStats | None, fp8: Fp8State | None, masked: bool) -> StepHooks:
    """The step's hooks of the features this run has: the loss-token count (`masked`: the
    data has targets that carry no loss), MoE, FP8, local SGD."""
    hooks = StepHooks()
    outer = strategy.local_sgd
    if masked:
        hooks.before_forward.append(count_targets(mesh, device, watchdog, outer is not None))
    if moe is not None:
        balancer = ExpertBalancer(model, cfg.parallel.ep_rebalance_every) if mesh.dims.ep > 1 else None
        moe_hooks(hooks, moe, balancer, cfg.model, strategy, mesh)
    if fp8 is not None:
        fp8_hooks(hooks, fp8)
    if outer is not None:
        local_sgd_hook(hooks, outer, cfg.train.steps)
    return hooks


def parallelize(model: nn.Module, mesh: Mesh, cfg: Config, device: torch.device,
                watchdog: CollectiveWatchdog | None = None, run_dir: Path = Path("runs"),
                masked: bool = False) -> Parallelized:
    """Apply every configured strategy to `model` in the documented order, and gather the
    features' step hooks (step_hooks; `masked`: the data has targets that carry no loss). `cfg`
    is resolved (resolve.resolve_config: no 'auto' left); `mesh` holds the process groups."""
    ledger = CommLedger()
    if cfg.lora.rank:  # first: adapters are parameters like any other for every later step
        if not isinstance(model, (Decoder, CausalLMAdapter)):
            raise ConfigError(f"lora.rank = {cfg.lora.rank}: LoRA applies to our decoder and to a "
                              f"causal LM in models.hf.CausalLMAdapter, not to a "
                              f"{type(model).__name__} (use model.hf_path or model.preset)")
        lora = cfg.lora
        mlp = cfg.model.mlp if isinstance(model, Decoder) else ""  # '': every linear but the head
        apply_lora(model, lora.rank, lora.alpha, lora.dropout, lora.targets, mlp, cfg.train.seed)
    # Taken before any step replaces a layer: initial values are those of the whole model.
    initializer = (initial_values(model, cfg.model, cfg.train.seed) if any(p.is_meta for p in model.parameters())
                   else None)
    if cfg.lora.quantize != "none":  # QLoRA: the frozen linears' bytes, made from those values
        dense = DEFAULT_TARGETS[cfg.model.mlp].split(",")
        _, initializer = quantize_base(model, cfg.lora.quantize, quantizable(model, dense), initializer,
                                       by_columns(cfg.lora.quantize_layout, cfg.parallel.tp))
    # The same Parameter objects under the same names: every later step sees a plain model.
    fp8 = apply_fp8(model, cfg.precision, device) if cfg.precision.compute == "fp8" else None
    if mesh.dims.ep > 1 and mesh.dims.tp > 1 and not isinstance(model, Decoder):
        raise ConfigError(f"parallel.ep = {mesh.dims.ep} with parallel.tp = {mesh.dims.tp}: a transformers "
                          f"model's tp plan leaves its tokens whole on every tp rank, so its experts cannot "
                          f"be spread over ep × tp ranks (our Decoder's can); set parallel.tp = 1 or ep = 1")
    tp = apply_tensor_parallel(model, Comm(mesh.tp_group, "tp", ledger, watchdog),
                               cfg.parallel.sequence_parallel, mesh.dims.ep == 1) if mesh.dims.tp > 1 else None
    if tp is not None:
        initializer = sliced(initializer, tp.splits)
        tp.async_tp = cfg.parallel.async_tp  # parallel/tensor/async_tp.py (validate: sequence-parallel)
    cp = apply_cp(model, Comm(mesh.cp_group, "cp", ledger, watchdog), cfg.parallel.cp_mode,
                  cfg.parallel.cp_ulysses) if mesh.dims.cp > 1 else None
    if cp is not None:
        share_over_cp(model, cp)
    experts = apply_ep(model, Comm(mesh.expert_group, "ep", ledger, watchdog)) if mesh.dims.ep > 1 else {}
    if experts:
        initializer = sliced(initializer, experts)
    stage = None
    if mesh.dims.pp > 1:
        par = cfg.parallel
        table = table_for(par.pp_schedule, mesh.dims.pp, par.pp_virtual, cfg.train.grad_accum)
        placement = table.placement
        split = pipeline_split(cfg.model, cfg.train.seq_len, mesh.dims.pp * par.pp_virtual, par.pp_layers,
                               par.pp_virtual, placement)
        stage = apply_pp(model, Comm(mesh.pp_group, "pp", ledger, watchdog), split, mesh.pp_ends_group,
                         par.pp_virtual, placement)
        kept = {name for name, _ in model.named_parameters()}
        for name in [n for n in experts if n not in kept]:  # other stages' experts (one dict: model.ep's)
            del experts[name]
    apply_ac(model, cfg.activation.checkpoint, compiled=compile_on(cfg.train))
    # Before the engine: its ZeRO-3 gather hooks then run inside the offload hooks' scope, so the
    # gathered parameters are recognised (and never copied) at pack time.
    apply_offload(model, cfg.activation.offload, cfg.activation.offload_blocks)
    strategy = apply_data_parallel(model, mesh, cfg, device, watchdog, run_dir, initializer, ledger,
                                   tp.splits if tp else None, stage.copies if stage else frozenset(),
                                   experts)
    schedule = schedule_for(cfg.parallel.pp_schedule, stage, cfg.train.grad_accum) if stage else None
    if schedule is not None and schedule.splits_backward:  # weight gradients computed apart
        log.info("split backward (I, W): %d linear layers with deferrable weight gradients",
                 make_deferrable(model, stage.weight_grads))
    moe: MoEStats | None = getattr(model, "moe_stats", None)  # ours, or a CausalLMAdapter's
    return Parallelized(model, apply_compile(model, compile_on(cfg.train)), strategy, tp, cp, stage, schedule,
                        fp8, moe, step_hooks(model, mesh, cfg, device, watchdog, strategy, moe, fp8, masked),
                        step_on_device=isinstance(strategy, LocalEngine) and moe is None,
                        replicas_apart=mesh.dims.dp_replicate if strategy.local_sgd is not None else 1)
