"""The training loop: data → forward/backward → step → telemetry, read top to bottom.

`build_run` assembles everything from a validated Config (the variants — precision, activation
checkpointing, compile — are chosen here, once); `train` runs the loop. Model code knows nothing
of this file; strategies are applied to the plain model in `build_run`, in a fixed order. What a
run holds is run.py; its checkpoints (resume, save, restore) checkpointing.py.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, NamedTuple

import torch
from torch import nn

from shardlm.checkpoint.hf_dir import carry_identity
from shardlm.checkpoint.weights import save_weights
from shardlm.checkpoint.sharded import load_with_fallback
from shardlm.config import Config
from shardlm.config.fields import document_mask_on
from shardlm.errors import ConfigError
from shardlm.data import Loader, build_dataset
from shardlm.data.seq2seq import Seq2SeqInputs
from shardlm.data.sft import check_chat_template, template_for
from shardlm.data.corpus import check_text_files
from shardlm.data.tokenizer import hf_tokenizer
from shardlm.launch.runtime import Runtime, StopSignals, init_runtime, planned_fault
from shardlm.launch.run_dir import claim_run_dir
from shardlm.config.dims import resolve_dims
from shardlm.comm.mesh import build_mesh
from shardlm.models import build_model, flops_per_token, generate
from shardlm.models.attention import configure as configure_attention
from shardlm.models.hf import CausalLMAdapter, Seq2SeqAdapter
from shardlm.models.lora import check_rank, lora_layers
from shardlm.models.hf_build import build_hf_model, check_route, generate_causal
from shardlm.models.seq2seq import generate_seq2seq, user_model_flops_per_token
from shardlm.config.hf_shapes import causal_lm_config, encoder_decoder_config, transformers_config
from shardlm.zero.optim import lr_at, set_lr
from shardlm.parallel.build import parallelize
from shardlm.parallel.compile import compile_seconds
from shardlm.parallel.evaluation import global_target_counts, metrics_of
from shardlm.models.moe import bias_tensors
from shardlm.parallel.expert import finish_moe_step, moe_record
from shardlm.parallel.expert_balance import ExpertBalancer
from shardlm.parallel.pipeline import StepIO, gather_stages
from shardlm.parallel.pieces import whole_parameters
from shardlm.parallel.tensor_plan import check_tp_plan
from shardlm.comm.collectives import DeviceDone
from shardlm.comm.watchdog import CollectiveWatchdog, watched
from shardlm.models.precision import build_precision, is_finite
from shardlm.planner.search import run_prediction
from shardlm.train.checkpointing import checkpoint_writer, load_checkpoint, resume_source, save_checkpoint
from shardlm.train import fault_tolerance
from shardlm.train.resolve import local_hardware, resolve_config
from shardlm.train.run import Run, TrainResult
from shardlm.train.telemetry import (MetricsLog, ProgressDisplay, device_memory_record, peak_flops,
                               peak_rss_bytes, prediction_summary)
from shardlm.train.tracking import StepProfiler, StepTimes, device_synchronize, open_trackers, time_split_on

log = logging.getLogger("shardlm")


def make_run_dir(cfg: Config, runtime: Runtime) -> Path:
    # The run owns its directory: rank 0 creates it (a new, unique name unless run.name is given)
    # and holds its lock for the run's life; every rank gets rank 0's directory, or its error.
    return claim_run_dir(cfg.run.dir, cfg.run.name, runtime)


def check_inputs(cfg: Config, user_model: bool = False) -> None:
    """What a run reads that config validation cannot see, checked before anything is created
    (a mistake leaves no run directory behind; `shardlm train` also calls it before spawning):
    model.hf_path's tokenizer.json (readable, its vocabulary within the model's), the layers
    lora.targets picks and lora.rank against each one's dims (our decoder, built on the meta
    device; a `user_model` is checked by apply_lora), and data.source's text files (text, not
    binary bytes); with data.format chat, model.hf_path's chat template on the data's first
    conversation (data/sft.py check_chat_template); a model.hf_path that trains through
    transformers (models/hf_build.py): the axes that path cannot do, its base_model_tp_plan for
    parallel.tp, its LoRA layers. A ConfigError names the file, the layer or the setting."""
    if cfg.model.hf_path:
        tok, _ = hf_tokenizer(cfg.model.hf_path, cfg.model.vocab_size)
        check_chat_template(cfg.data, cfg.model.hf_path, tok)  # chat data: the checkpoint's template
    causal = causal_lm_config(cfg.model.hf_path) if not user_model else ""
    if causal:  # a causal LM through transformers: what it cannot do, then the model on meta
        check_route(cfg)
        hf = build_hf_model(causal, cfg.model.vocab_size, "meta")
        if cfg.parallel.tp > 1:
            check_tp_plan(hf, cfg.parallel.tp)
        if cfg.lora.rank:
            check_rank(cfg.lora.rank, lora_layers(hf, cfg.lora.targets, ""))
    elif cfg.lora.rank and not user_model and not encoder_decoder_config(cfg.model.hf_path,
                                                                         cfg.model.hf_config):
        check_rank(cfg.lora.rank, lora_layers(build_model(cfg.model, "meta"), cfg.lora.targets,
                                              cfg.model.mlp))
    check_text_files(cfg.data)


def build_run(cfg: Config, runtime: Runtime | None = None, model: nn.Module | None = None) -> Run:
    """Everything in the documented order: run directory → resolved config (every 'auto'
    decided once, on rank 0) → mesh → data → model on the meta device → parallelize
    (parallel/build.py: the strategies in order; the model is materialised there, a ZeRO unit
    at a time). `model`, if given, replaces the one cfg.model describes
    (e.g. a transformers model through shardlm.models.hf); it must be built identically on
    every rank, and its vocabulary must be cfg.model.vocab_size."""
    cfg.validate()
    if model is not None and cfg.model.hf_path:
        raise ConfigError(f"model.hf_path loads a checkpoint into our decoder, but build_run was "
                          f"also given a {type(model).__name__}: drop one (a transformers model "
                          f"loads its own weights with from_pretrained)")
    check_inputs(cfg, user_model=model is not None)  # before the run directory exists
    runtime = runtime or init_runtime(cfg.run.device, cfg.parallel.collective_timeout_s)
    run_dir = make_run_dir(cfg, runtime)
    carry_identity(cfg.model.hf_path, run_dir, write=runtime.is_main)  # tokenizer, template, ids
    source = resume_source(cfg, run_dir, runtime)
    replica = fault_tolerance.replica_setup(cfg, runtime)  # parallel.fault_tolerant: its own world
    cfg = replica.resolve(cfg, source) if replica else resolve_config(cfg, runtime, source)
    mesh = replica.mesh if replica else build_mesh(resolve_dims(cfg.parallel, runtime.world_size), runtime.device, runtime.rank)
    t = cfg.train
    torch.manual_seed(t.seed)
    given = hf_tokenizer(cfg.model.hf_path, cfg.model.vocab_size) if cfg.model.hf_path else None
    # small data: the validation split holds at least a micro-batch, if a global batch is left
    dataset = build_dataset(cfg.data, cfg.model.vocab_size, given, t.seq_len,
                            (t.micro_batch * t.grad_accum * mesh.dims.dp_size, t.micro_batch),
                            template_for(cfg.data.format, cfg.model.hf_path))
    if "chat_template" in (dataset.meta or {}):
        used = dataset.meta["chat_template"]
        log.info("data: chats rendered with the chat template %s ('%s', sha256 %s; assistant turns by %s)",
                 used["source"], used["name"], used["sha256"][:16], used["assistant"])
    precision = build_precision(cfg.precision, runtime.device, t.on_nonfinite == "stop")
    user_model = model is not None
    module_config = transformers_config(cfg.model.hf_path, cfg.model.hf_config)
    if user_model:  # on the meta device it stays there: parallelize materialises it
        if not any(p.is_meta for p in model.parameters()):
            model = model.to(runtime.device)
    elif module_config:  # transformers' own module (an encoder-decoder, or a causal LM our
        # decoder does not map): fresh, or hf_path's weights (models/hf_build.py)
        model, user_model = build_hf_model(module_config, cfg.model.vocab_size, "meta"), True
    else:
        model = build_model(cfg.model, "meta")  # materialised by parallelize, unit by unit
    if (dataset.source_len > 0) != isinstance(model, Seq2SeqAdapter):
        raise ConfigError(f"data.format = {cfg.data.format!r} with a {type(model).__name__}: "
                          f"data.format = 'seq2seq' goes with an encoder-decoder (model.hf_config, "
                          f"an encoder-decoder model.hf_path, or a models.hf.Seq2SeqAdapter), and "
                          f"an encoder-decoder with data.format = 'seq2seq' only")
    # Counted while the model is whole (on meta, or as given): ZeRO-3 rebinds its parameters.
    source_len = dataset.source_len
    user_flops = [user_model_flops_per_token(model, t.seq_len, source_len, mode) if user_model else 0.0
                  for mode in ("none", cfg.activation.checkpoint)]
    timeout = cfg.parallel.collective_timeout_s
    watchdog = (CollectiveWatchdog(timeout, runtime.rank, DeviceDone if runtime.device.type == "cuda" else None)
                if runtime.world_size > 1 and timeout else None)
    # data.document_mask: batches of PackedTokens, and the attention backend that runs them
    documents = document_mask_on(cfg.data)
    log.info(configure_attention(model, cfg.model.attention, runtime.device, documents, t.compile))
    built = parallelize(model, mesh, cfg, runtime.device, watchdog, run_dir)
    common = dict(seq_len=t.seq_len, micro_batch=t.micro_batch, seed=t.seed, source_len=source_len,
                  dp_rank=mesh.dp_rank, dp_size=mesh.dims.dp_size,
                  document_end=dataset.eot_id if documents else None)
    writer = checkpoint_writer(cfg, run_dir, runtime)
    run = Run(
        cfg=cfg, runtime=runtime, mesh=mesh, dataset=dataset, model=model, forward=built.forward,
        strategy=built.strategy, watchdog=watchdog, precision=precision,
        train_loader=Loader(dataset.train, grad_accum=t.grad_accum, mask=dataset.train_mask, **common),
        val_loader=Loader(dataset.val, grad_accum=1, mask=dataset.val_mask, split="val", **common),
        run_dir=run_dir, checkpoints=writer, loss=built.loss, token_sums=built.token_sums,
        schedule=built.schedule,
        peak_flops_per_device=peak_flops(runtime.device, precision.gemm),  # fp8: bf16's; bf16 in fp32 GEMMs: fp32's
        # A model we did not build: models.seq2seq.user_model_flops_per_token (an encoder-decoder
        # by its parts, else 6N). Ours: the exact count from its config.
        flops_per_token=(user_flops[0] if user_model else flops_per_token(cfg.model, t.seq_len)),
        # Recomputation counted: ours exactly (models.flops); a model we did not build, 8/6 of it
        # with 'full' (a second forward of everything, the usual approximation).
        hardware_flops_per_token=(user_flops[1] if user_model
                                  else flops_per_token(cfg.model, t.seq_len, cfg.activation.checkpoint)),
        balancer=ExpertBalancer(model, cfg.parallel.ep_rebalance_every) if mesh.dims.ep > 1 else None,
        fp8=built.fp8,
        times=StepTimes(built.strategy.ledger, time_split_on(cfg.run.time_split, runtime.device),
                        device_synchronize(runtime.device)),
        replicas=replica.open(cfg, built.strategy.ledger) if replica else None,
    )
    if source is not None:  # a checkpoint that fails to load: the next usable one, if allowed
        _, run.start_step = load_with_fallback(
            source, lambda path: load_checkpoint(run, path),
            lambda rejected: resume_source(cfg, run_dir, runtime, rejected))
    return run


def pipeline_io(run: Run, divisor: int = 1, denominator: float | None = None) -> StepIO:
    """What a pipeline schedule needs from the run: each micro-batch's loss (over `denominator`
    counted targets when given: train_step's global count) divided by `divisor`; gradients
    reduced after the step's last backward (finish_backward)."""
    device = run.runtime.device
    forward = run.times.timed("forward", lambda x, hidden: run.forward(x.to(device, non_blocking=True), hidden))
    return StepIO(model=run.model, forward=forward,
                  loss=run.times.timed("forward", lambda logits, y: run.loss(
                      logits, y.to(device, non_blocking=True), denominator) / divisor),
                  backward=lambda loss: run.precision.scaler.scale_loss(loss).backward(),
                  before_backward=lambda i: run.strategy.micro_step(sync=False),
                  autocast=run.precision.autocast, device=device)


def loss_of(run: Run, x: torch.Tensor, y: torch.Tensor,
            score: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
            denominator: float | None = None) -> torch.Tensor:
    """run.loss (over `denominator` counted targets when given), or `score` (run.token_sums),
    of the forward of one micro-batch."""
    device = run.runtime.device
    y = y.to(device, non_blocking=True)
    with run.precision.autocast():
        if isinstance(x, Seq2SeqInputs):  # an encoder-decoder's (source, source_mask, labels)
            logits = run.forward(*(part.to(device, non_blocking=True) for part in x))  # (B, T, vocab)
        else:  # (B, T, vocab), or this rank's vocabulary under tensor parallelism
            logits = run.forward(x.to(device, non_blocking=True))
    return score(logits, y) if score is not None else run.loss(logits, y, denominator)


class StepResult(NamedTuple):
    loss: float
    """Averaged over all data-parallel ranks."""
    grad_norm: float
    stepped: bool
    """False when the step was skipped (fp16 overflow, or a non-finite step under 'skip')."""
    stop: bool
    """Some rank was asked to stop (SIGTERM/SIGINT): every rank sees the same answer."""


def train_step(run: Run, step: int, stop_requested: bool = False) -> StepResult:
    """One optimizer step over grad_accum micro-batches."""
    with run.precision.kernels():  # precision.cpu_bf16_gemm = 'fp32': recomputation included
        return _train_step(run, step, stop_requested)


def _train_step(run: Run, step: int, stop_requested: bool) -> StepResult:
    strategy, scaler = run.strategy, run.precision.scaler
    run.times.start()
    set_lr(strategy.optimizer, lr_at(step, run.cfg.train))
    micro_batches = run.train_loader.micro_batches(step)
    # Every micro-batch's loss is divided by the global number of micro-batches and gradients
    # are summed across ranks: each rank's backward then computes exactly what one process
    # would for that micro-batch. Context parallelism: each rank's loss is the mean over its
    # 1/cp of the tokens. Local SGD (zero/local_sgd.py): a replica's gradient is its own data's
    # mean, not a share.
    outer = getattr(strategy, "local_sgd", None)
    replicas = run.mesh.dims.dp_replicate if outer is not None else 1
    global_micro_batches = len(micro_batches) * run.mesh.dims.dp_size * run.mesh.dims.cp // replicas
    # Targets of -100 (SFT formats' prompts, seq2seq padding): one objective whatever the split,
    # the global batch's summed loss over its counted targets (transformers' 2024 gradient-
    # accumulation fix). Each micro-batch's loss is its summed loss over `denominator` = the
    # global count's share per micro-batch, so the 1/global_micro_batches below leaves
    # sum / global count, however unevenly micro-batches, ranks, stages or cp shards hold them.
    denominator = None
    if run.train_loader.mask is not None or run.train_loader.source_len:
        kept, targets = global_target_counts(
            [y for _, y in micro_batches], run.mesh.dp_shard_group if outer is not None else run.mesh.dp_group,
            run.mesh.dims.cp, run.runtime.device, run.watchdog)
        run.loss_token_fraction = kept / targets
        denominator = max(kept, 1.0) / global_micro_batches  # a batch with no loss target: 0
    total = torch.zeros((), device=run.runtime.device)
    moe = getattr(run.model, "moe_stats", None)
    if moe is not None:  # the MoE layers' balancing losses get the language-model loss's scale
        moe.reset()
        moe.grad_scale = scaler.scale / global_micro_batches
    if run.fp8 is not None:  # delayed scaling's histories advance; the step's counts restart
        run.fp8.begin_step()
    if run.schedule is not None:  # the pipeline's order of forwards and backwards
        with run.times.phase("backward"):  # less its forwards (timed in pipeline_io) and waits
            total = run.schedule.run(pipeline_io(run, global_micro_batches, denominator), micro_batches)
        run.schedule.stage.sync_tied(run.model)
        micro_batches = []
    for i, (x, y) in enumerate(micro_batches):
        # Gradients are synchronised on the last micro-batch only (nanoGPT's no_sync reasoning:
        # reducing inner micro-steps would be pure waste).
        strategy.micro_step(sync=i == len(micro_batches) - 1)
        with run.times.phase("forward"):
            loss = loss_of(run, x, y, denominator=denominator) / global_micro_batches
        with run.times.phase("backward"):
            scaler.scale_loss(loss).backward()
        total += loss.detach()
    with run.times.phase("backward"):
        strategy.finish_backward()
    if run.replicas is not None:  # parallel.fault_tolerant: the mean over the live replicas
        total, stop_requested, committed = fault_tolerance.average_step(run, step, total, stop_requested)
        if not committed:  # a replica died during it: no optimizer step; the step again, without it
            return train_step(run, step, stop_requested)
    # One process without ZeRO: the optimizer is queued without a host sync, the step skipped on
    # the device if the norm is not finite; the norm is read with the loss below.
    on_device = getattr(strategy, "clip_and_step_on_device", None) if moe is None else None
    norm = None
    with run.times.phase("optimizer"):
        scaler.unscale_(strategy.grads())
        # The norm is computed every step (telemetry) and doubles as the overflow check; it is
        # global, so every rank takes the same skip decision.
        if on_device is not None:
            norm = on_device(run.cfg.train.grad_clip or float("inf"))
        else:
            grad_norm = strategy.clip_grad_norm(run.cfg.train.grad_clip or float("inf"))
            stepped = scaler.update(is_finite(grad_norm))
            if stepped:
                strategy.step()
        strategy.zero_grad()
        if outer is not None and outer.due(step, run.cfg.train.steps):  # the round ends: outer step
            outer.synchronize()
    if moe is not None:  # the step's routing summed over the ranks; the balancing biases moved
        m = run.cfg.model
        run.moe_sums = finish_moe_step(moe, m.balance if stepped else "none", m.bias_update_rate)
        if run.balancer is not None and run.moe_sums is not None:
            ranks = run.balancer.rank_imbalance(run.moe_sums)  # this step's placement, before a move
            run.moe_placement = {"moe_rank_imbalance": max(ranks, default=1.0), "moe_rank_imbalance_by_layer": ranks,
                                 "moe_replaced_blocks": run.balancer.step(step, run.moe_sums, strategy,
                                                                          run.mesh.dp_shard_group)}
    # The loss and the stop flag in one tensor: the logging scalar every step sums anyway
    # carries the agreement to stop (a signal may reach only some ranks, or at different steps).
    # Every rank of a tensor-parallel group holds the same loss: counted once.
    summed = torch.stack([total / run.mesh.dims.tp / replicas,
                          torch.tensor(float(stop_requested), device=total.device),
                          *([] if norm is None else [norm.to(total.dtype)])])
    fp8_stats = run.fp8.stats if run.fp8 is not None else None
    if fp8_stats is not None:  # the step's overflow / underflow counts ride on the same sum
        fp8_counts = fp8_stats.totals(total.device)
        summed = torch.cat([summed, fp8_counts])
    if run.runtime.world_size > 1:  # not model communication: not in the ledger
        with watched(run.watchdog, "all_reduce(loss)", "dp", 4 * len(summed)):
            torch.distributed.all_reduce(summed)
    if norm is not None:  # (one process: nothing was summed over ranks)
        grad_norm = float(summed[2])
        stepped = scaler.update(is_finite(grad_norm))
    if fp8_stats is not None:
        run.fp8_record = fp8_stats.record(summed[-len(fp8_counts):])
    if run.replicas is not None:  # a joining replica takes this state
        fault_tolerance.after_step(run, step + 1, stepped)
    run.times.stop()
    return StepResult(float(summed[0]), grad_norm, stepped, bool(summed[1] > 0))


@torch.no_grad()
def evaluate(run: Run) -> dict[str, float]:
    """val_loss, val_perplexity, val_token_accuracy over the first train.eval_batches
    micro-batches of validation windows, dealt to the data-parallel ranks (Loader.eval_batches).
    Each rank sums [cross-entropy, correct, targets] over its targets that carry loss, and the
    sums (not the ranks' means) are added over all ranks: every target weighs the same whatever
    rank or batch it fell in (parallel/evaluation.py)."""
    run.model.eval()
    batches = run.val_loader.eval_batches(run.cfg.train.eval_batches)
    device = run.runtime.device
    if run.schedule is not None:  # the head's stage's sums, shared with the whole pipeline
        io = replace(pipeline_io(run), loss=lambda logits, y: run.token_sums(
            logits, y.to(device, non_blocking=True)))
        sums = torch.stack(run.schedule.forward_only(io, list(batches), (3,), torch.float64)).sum(0)
    else:
        sums = sum((loss_of(run, x, y, run.token_sums) for x, y in batches),
                   torch.zeros(3, dtype=torch.float64, device=device))
    run.model.train()
    if run.runtime.world_size > 1:
        # dp ranks hold different windows and cp ranks different tokens of them: both add up.
        # tp ranks hold the same sums, and so do pp ranks after forward_only: counted once.
        with watched(run.watchdog, "all_reduce(eval)", "world", 8 * len(sums)):
            torch.distributed.all_reduce(sums)
        sums /= run.mesh.dims.tp * run.mesh.dims.pp
    return metrics_of(sums.tolist())


def step_record(run: Run, step: int, loss: float, grad_norm: float, seconds: float) -> dict:
    tokens = run.train_loader.global_batch * run.cfg.train.seq_len
    tokens_per_s = tokens / seconds
    peak = run.peak_flops_per_device * run.runtime.world_size
    mfu = tokens_per_s * run.flops_per_token / peak  # model FLOPs only (PaLM appendix B)
    hardware = run.flops_per_token if run.hardware_flops_per_token is None else run.hardware_flops_per_token
    hfu = tokens_per_s * hardware / peak  # + recomputation: what the hardware executed
    comm = run.strategy.ledger.snapshot()  # this step's collectives (reset before it began)
    pipeline = {}
    if run.schedule is not None:  # per stage: idle fraction (blocked on a neighbour), peak RSS
        idle, rss = run.schedule.by_stage([run.schedule.stage.wait_s / seconds, peak_rss_bytes()],
                                          run.runtime.device)
        pipeline = {"pp_bubble": sum(idle) / len(idle), "pp_bubble_by_stage": idle,
                    "pp_bubble_formula": run.schedule.bubble_formula(run.cfg.train.grad_accum),
                    "pp_peak_rss_bytes_by_stage": [int(b) for b in rss]}
    if run.moe_sums is not None:  # mixture of experts: balance, drops, traffic
        pipeline.update(moe_record(run.model.moe_stats, run.moe_sums, comm), **run.moe_placement)
    return {"step": step + 1, "world_size": run.runtime.world_size, "loss": loss,
            "lr": run.strategy.optimizer.param_groups[0]["lr"],
            "grad_norm": grad_norm, "tokens_per_s": tokens_per_s, "mfu": mfu,
            "hfu": hfu, "step_time_s": seconds, "peak_rss_bytes": peak_rss_bytes(),
            **device_memory_record(run.runtime.device), "loss_scale": run.precision.scaler.scale,
            "model_state_bytes": sum(run.strategy.model_state_bytes().values()),
            "comm_bytes": sum(comm.values()), "comm_bytes_by_op": comm,
            **run.strategy.offload_report(), **pipeline,
            **({} if run.loss_token_fraction is None else {"loss_token_fraction": run.loss_token_fraction}),
            **run.fp8_record, **run.times.record(seconds)}


def train(run: Run, on_step: Callable[[Run, dict], None] | None = None) -> TrainResult:
    """Train `run` to train.steps. `on_step(run, record)`, on every rank after each step is logged
    (and checkpointed: record['checkpoint_step']), before a planned fault strikes: a launcher's
    hook (integrations/ray.py reports to Ray Train)."""
    cfg, main = run.cfg, run.runtime.is_main
    fault_tolerance.rejoin(run)  # a restarted replica (parallel.fault_tolerant): the others' state
    tracker = open_trackers(cfg.run.tracker, run.run_dir, enabled=main)  # first: closed in finally
    profiler = StepProfiler(cfg.run.profile_steps, run.run_dir, run.runtime.rank, run.runtime.device)
    completed = False
    predicted = run_prediction(cfg, lambda: local_hardware(run.runtime.device, run.mesh.dims.world_size,
                                                                   cfg.run.malloc_mmap_threshold)) if main else {}
    # Said once, in the first record: the planner's prediction for this run, the chat template.
    first = {"predicted": predicted}
    if "chat_template" in (run.dataset.meta or {}):
        first["chat_template"] = run.dataset.meta["chat_template"]
    metrics = MetricsLog(run.run_dir / "metrics.jsonl" if main else None, first)
    steps, every = cfg.train.steps, cfg.checkpoint.every
    progress = ProgressDisplay(steps - run.start_step, cfg.run.progress, enabled=main)
    result = TrainResult(run.run_dir)
    fault = planned_fault()  # $SHARDLM_FAULT: the fault tests' injected crash, leave or pause
    speeds, mfus, hfus, step_times = [], [], [], []
    try:
        tracker.log_config(cfg.to_dict())  # resolved: every 'auto' decided
        with StopSignals() as signals:
            for step in range(run.start_step, steps):
                run.strategy.ledger.reset()  # evaluation's gathers are not a training step's
                compiling = cfg.train.compile and step == run.start_step  # the blocks compile now
                compiled_before = compile_seconds() if compiling else 0.0
                profiler.begin(step + 1)
                start = time.perf_counter()
                out = train_step(run, step, stop_requested=signals.requested is not None)
                record = step_record(run, step, out.loss, out.grad_norm, time.perf_counter() - start)
                profiler.end(step + 1)
                if compiling:
                    record["compile_s"] = compile_seconds() - compiled_before
                    log.info("compile: %.1f s of the first step's %.1f s", record["compile_s"],
                             record["step_time_s"])
                record["skipped"] = not out.stepped
                record.update(run.replicas.record() if run.replicas else {})  # fault tolerant: quorum
                result.losses.append(out.loss)
                result.skipped_steps += not out.stepped
                if step > run.start_step or steps - run.start_step == 1:
                    speeds.append(record["tokens_per_s"])
                    step_times.append(record["step_time_s"])
                    mfus.append(record["mfu"])
                    hfus.append(record["hfu"])
                last = step + 1 == steps
                if last or (cfg.train.eval_every and (step + 1) % cfg.train.eval_every == 0):
                    scores = evaluate(run)
                    record.update(scores)
                    result.val_loss = scores["val_loss"]
                    result.val_perplexity = scores["val_perplexity"]
                    result.val_token_accuracy = scores["val_token_accuracy"]
                due = out.stop or (every and (last or (step + 1) % every == 0))
                if due and fault_tolerance.writes_checkpoint(run):  # replicas: the lowest live one
                    if out.stop:  # the last checkpoint before exiting: written in full
                        run.checkpoints.asynchronous = False
                    run.checkpoints.interrupted = signals.watch()  # a signal during it: a rank died
                    report = save_checkpoint(run, step + 1)
                    result.saves.append(report)
                    record.update(checkpoint_step=step + 1, checkpoint_stall_s=report.stall_s,
                                  checkpoint_bytes=report.bytes)
                if out.stop or last or (step + 1) % cfg.train.log_every == 0:
                    metrics.write(record)
                    tracker.log_scalars(record["step"], record)
                progress.update(step - run.start_step, f"loss {out.loss:.3f}  "
                                f"{record['tokens_per_s']:,.0f} tok/s  MFU {record['mfu']:.1%} "
                                f"(HFU {record['hfu']:.1%})")
                if on_step is not None:
                    on_step(run, record)
                if fault is not None and fault.due(step + 1):
                    fault.strike()
                if out.stop:
                    result.stopped_by = signals.requested or "a signal to another rank"
                    break
            run.checkpoints.wait()  # an asynchronous save still writing
        completed = True
    finally:
        progress.close()
        profiler.close()  # a crash keeps what was traced and tracked
        tracker.close(failed=not completed)
        metrics.close()
    if speeds:
        result.tokens_per_s = sum(speeds) / len(speeds)
        result.mfu = sum(mfus) / len(mfus)
        result.hfu = sum(hfus) / len(hfus)
        if main:
            print(prediction_summary(predicted, step_times, run.runtime.device), flush=True)
    if result.stopped_by is None:
        with run.strategy.full_parameters():
            cut = run.mesh.dims.tp > 1 or run.mesh.dims.ep > 1
            weights = whole_parameters(run.model) if cut else run.model
            if run.schedule is not None:  # every stage's parameters, gathered
                whole = weights if isinstance(weights, dict) else whole_parameters(weights)
                shapes = {n: tuple(p.shape) for n, p in build_model(cfg.model, "meta").named_parameters()}
                weights = gather_stages(whole, shapes, next(iter(whole.values())).dtype,
                                        run.schedule.stage, run.runtime.device)
            if main:
                if isinstance(weights, dict):  # put together from pieces: the MoE routing state too
                    weights = {**weights, **bias_tensors(getattr(run.model, "moe_stats", None))}
                save_weights(run.run_dir, weights, cfg, run.dataset.tokenizer,
                             getattr(getattr(run.model, "model", None), "config", None))
    return result


def sample_text(run: Run, prompt: str, max_new_tokens: int) -> str:
    """The prompt continued (an encoder-decoder: the prompt is the source, the target printed)."""
    tokenizer = run.dataset.tokenizer
    idx = torch.tensor([tokenizer.encode(prompt).ids], device=run.runtime.device)
    generator = torch.Generator(device=run.runtime.device).manual_seed(run.cfg.train.seed)
    run.model.eval()
    with run.precision.autocast(), run.strategy.full_parameters():
        if run.dataset.source_len:  # the library's generate (its KV cache), sampling as below
            out = generate_seq2seq(run.model, idx, torch.ones_like(idx), max_new_tokens,
                                   run.dataset.eot_id, temperature=0.8, generator=generator)
        elif run.schedule is not None:  # through the pipeline's stages
            out = run.schedule.generate(pipeline_io(run), idx, max_new_tokens, generator=generator)
        elif isinstance(run.model, CausalLMAdapter):  # the library's generate, as for seq2seq
            out = generate_causal(run.model, idx, max_new_tokens, run.dataset.eot_id, 0.8,
                                  generator=generator)
        else:
            out = generate(run.model, idx, max_new_tokens, generator=generator)
    return tokenizer.decode(out[0].tolist())
