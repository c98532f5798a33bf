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
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from shardlm.comm.collectives import Comm, CommLedger
from shardlm.comm.watchdog import CollectiveWatchdog
from shardlm.config import Config
from shardlm.data.packed import counted_targets
from shardlm.data.sft import IGNORE
from shardlm.comm.mesh import Mesh
from shardlm.parallel.activation import apply_ac, apply_offload
from shardlm.parallel.compile import apply_compile
from shardlm.parallel.context import CPState, apply_cp
from shardlm.parallel.evaluation import token_sums
from shardlm.parallel.expert import apply_ep, share_over_cp, spread_over_tp
from shardlm.parallel.pipeline import Schedule, Stage, apply_pp, schedule_for
from shardlm.config.pipeline_schedules import table_for
from shardlm.parallel.weight_grads import make_deferrable
from shardlm.models.flops import pipeline_split
from shardlm.checkpoint.hf_dir import module_initializer
from shardlm.checkpoint.hf_names import hf_initializer
from shardlm.models.init import Initializer, initializer_for
from shardlm.models.lora import DEFAULT_TARGETS, apply_lora, with_adapters
from shardlm.models.quant import quantizable, quantize_base
from shardlm.models.fp8 import Fp8State, apply_fp8
from shardlm.errors import ConfigError
from shardlm.parallel.data import DataParallelEngine, apply_data_parallel
from shardlm.models.decoder import Decoder
from shardlm.models.hf import CausalLMAdapter
from shardlm.parallel.pieces import sliced
from shardlm.parallel.tensor import apply_tp
from shardlm.parallel.tensor_layers import VocabParallelHead, vocab_parallel_cross_entropy
from shardlm.parallel.tensor_regions import TPState
from shardlm.parallel.tensor_plan import apply_tp_plan

log = logging.getLogger("shardlm")


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

    def loss(self, logits: torch.Tensor, targets: torch.Tensor,
             denominator: float | None = None) -> torch.Tensor:
        """Mean cross-entropy in fp32 (a bf16/fp16 softmax over 50k classes loses the small
        probabilities); vocabulary-parallel when the head is. Under context parallelism, the
        sum over this rank's tokens divided by the whole sequence's count over cp (the targets
        cut as the forward cut the inputs): the trainer divides by cp once more, so the cp
        ranks' summed gradient is the whole sequence's mean's, as in one process. Targets of
        -100 (data.format chat / prompt_completion) are ignored. `denominator` (the trainer's
        share of the global batch's counted targets per micro-batch, train/loop.py): the sum
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
        that carry loss (parallel/evaluation.py), cut as `loss` cuts them under context
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


def initial_values(model: nn.Module, cfg: Config) -> Initializer:
    """Where the parameters' first values come from: model.hf_path's checkpoint (our decoder,
    read from safetensors, or the transformers module build_run built from it: its tensors by
    name; LoRA adapters are new), or the model's own initialisation at train.seed."""
    own = initializer_for(model, cfg.train.seed)
    if cfg.model.hf_path and not isinstance(model, Decoder):  # build_run's transformers module
        return with_adapters(module_initializer(cfg.model.hf_path, model), own)
    if cfg.model.hf_path and isinstance(model, Decoder):  # build_run refuses any other model
        # The checkpoint for its tensors; LoRA adapters are new: the model's own initial values.
        return with_adapters(hf_initializer(cfg.model.hf_path, model, cfg.model), own)
    return own


def parallelize(model: nn.Module, mesh: Mesh, cfg: Config, device: torch.device,
                watchdog: CollectiveWatchdog | None = None, run_dir: Path = Path("runs")) -> Parallelized:
    """Apply every configured strategy to `model` in the documented order. `cfg` is resolved
    (resolve.resolve_config: no 'auto' left); `mesh` holds the process groups."""
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
    initializer = (initial_values(model, cfg) if any(p.is_meta for p in model.parameters())
                   else None)
    if cfg.lora.quantize != "none":  # QLoRA: the frozen linears' bytes, made from those values
        dense = DEFAULT_TARGETS[cfg.model.mlp].split(",")
        _, initializer = quantize_base(model, cfg.lora.quantize, quantizable(model, dense), initializer)
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
        tp.async_tp = cfg.parallel.async_tp  # parallel/async_tp.py (validate: sequence-parallel)
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
    apply_ac(model, cfg.activation.checkpoint, compiled=cfg.train.compile)
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
    return Parallelized(model, apply_compile(model, cfg.train.compile), strategy, tp, cp, stage, schedule,
                        fp8)
