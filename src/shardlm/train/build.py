"""A run assembled from a validated Config, in the documented order (build_run): the variants
— precision, activation checkpointing, compile, each feature's step hooks — are chosen here,
once. Model code knows nothing of this file; strategies are applied to the plain model by
parallelize (parallel/build.py), in a fixed order. What a run holds is run.py.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from shardlm.checkpoint.hf_dir import carry_identity
from shardlm.checkpoint.sharded import load_with_fallback
from shardlm.comm.collectives import DeviceDone
from shardlm.comm.mesh import Mesh, build_mesh
from shardlm.comm.watchdog import CollectiveWatchdog
from shardlm.config.schema import Config, RunConfig
from shardlm.config.dims import resolve_dims
from shardlm.config.fields import compile_on, document_mask_on
from shardlm.config.hf_shapes import causal_lm_config, encoder_decoder_config, transformers_config
from shardlm.data.loader import Dataset, Loader, build_dataset
from shardlm.data.corpus import check_text_files
from shardlm.data.sft import check_chat_template, template_for
from shardlm.data.tokenizer import hf_tokenizer
from shardlm.errors import ConfigError
from shardlm.launch.run_dir import claim_run_dir
from shardlm.launch.runtime import Runtime, init_runtime
from shardlm.models.decoder import build_model
from shardlm.models.flops import flops_per_token
from shardlm.models.attention import configure as configure_attention
from shardlm.models.hf import Seq2SeqAdapter
from shardlm.models.hf_build import build_hf_model, check_route
from shardlm.models.lora import check_rank, lora_layers
from shardlm.models.precision import build_precision
from shardlm.models.seq2seq import user_model_flops_per_token
from shardlm.parallel.build import parallelize
from shardlm.parallel.tensor.plan import check_tp_plan
from shardlm.train import fault_tolerance
from shardlm.train.checkpointing import checkpoint_writer, load_checkpoint, resume_source
from shardlm.train.resolve import resolve_config
from shardlm.train.run import Run
from shardlm.train.telemetry import peak_flops
from shardlm.train.tracking import StepTimes, device_synchronize, time_split_on

log = logging.getLogger("shardlm")


def make_run_dir(run: RunConfig, runtime: Runtime) -> Path:
    # The run owns its directory: rank 0 creates it (a new, unique name unless run.name is given)
    # and holds its lock for the run's life; every rank gets rank 0's directory, or its error.
    return claim_run_dir(run.dir, run.name, runtime)


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
    at a time; each feature's step hooks). `model`, if given, replaces the one cfg.model
    describes (e.g. a transformers model through shardlm.models.hf); it must be built
    identically on every rank, and its vocabulary must be cfg.model.vocab_size."""
    cfg.validate()
    if model is not None and cfg.model.hf_path:
        raise ConfigError(f"model.hf_path loads a checkpoint into our decoder, but build_run was "
                          f"also given a {type(model).__name__}: drop one (a transformers model "
                          f"loads its own weights with from_pretrained)")
    check_inputs(cfg, user_model=model is not None)  # before the run directory exists
    runtime = runtime or init_runtime(cfg.run.device, cfg.parallel.collective_timeout_s)
    run_dir = make_run_dir(cfg.run, runtime)
    carry_identity(cfg.model.hf_path, run_dir, write=runtime.is_main)  # tokenizer, template, ids
    source = resume_source(cfg, run_dir, runtime)
    replica = fault_tolerance.replica_setup(cfg.parallel, runtime)  # parallel.fault_tolerant: its own world
    cfg = replica.resolve(cfg, source) if replica else resolve_config(cfg, runtime, source)
    mesh = replica.mesh if replica else build_mesh(resolve_dims(cfg.parallel, runtime.world_size), runtime.device, runtime.rank)
    t = cfg.train
    torch.manual_seed(t.seed)
    dataset = build_data(cfg, mesh)
    precision = build_precision(cfg.precision, runtime.device, t.on_nonfinite == "stop")
    model, user_model = build_plain_model(cfg, model, runtime.device, dataset)
    # Counted while the model is whole (on meta, or as given): ZeRO-3 rebinds its parameters.
    flops = run_flops(cfg, model if user_model else None, dataset.source_len)
    timeout = cfg.parallel.collective_timeout_s
    watchdog = (CollectiveWatchdog(timeout, runtime.rank, DeviceDone if runtime.device.type == "cuda" else None)
                if runtime.world_size > 1 and timeout else None)
    # data.document_mask: batches of PackedTokens, and the attention backend that runs them
    documents = document_mask_on(cfg.data)
    log.info(configure_attention(model, cfg.model.attention, runtime.device, documents, compile_on(t)))
    built = parallelize(model, mesh, cfg, runtime.device, watchdog, run_dir,
                        masked=dataset.train_mask is not None or bool(dataset.source_len))
    common = dict(seq_len=t.seq_len, micro_batch=t.micro_batch, seed=t.seed, source_len=dataset.source_len,
                  dp_rank=mesh.dp_rank, dp_size=mesh.dims.dp_size,
                  document_end=dataset.eot_id if documents else None)
    writer = checkpoint_writer(cfg, run_dir, runtime)
    run = Run(
        cfg=cfg, runtime=runtime, mesh=mesh, dataset=dataset, model=model, forward=built.forward,
        strategy=built.strategy, watchdog=watchdog, precision=precision,
        train_loader=Loader(dataset.train, grad_accum=t.grad_accum, mask=dataset.train_mask, **common),
        val_loader=Loader(dataset.val, grad_accum=1, mask=dataset.val_mask, split="val",
                          **{**common, **(replica.eval_share() if replica else {})}),
        run_dir=run_dir, checkpoints=writer, loss=built.loss, token_sums=built.token_sums,
        schedule=built.schedule, hooks=built.hooks, step_on_device=built.step_on_device,
        replicas_apart=built.replicas_apart, moe=built.moe,
        peak_flops_per_device=peak_flops(runtime.device, precision.gemm),  # fp8: bf16's; bf16 in fp32 GEMMs: fp32's
        flops_per_token=flops[0], hardware_flops_per_token=flops[1],
        times=StepTimes(built.strategy.ledger, time_split_on(cfg.run.time_split, runtime.device),
                        device_synchronize(runtime.device)),
        replicas=replica.open(cfg.parallel, built.strategy.ledger) if replica else None,
    )
    if run.replicas is not None:  # the mean over the live replicas; a joining replica's state
        fault_tolerance.add_step_hooks(run)
    if source is not None:  # a checkpoint that fails to load: the next usable one, if allowed
        _, run.start_step = load_with_fallback(
            source, lambda path: load_checkpoint(run, path),
            lambda rejected: resume_source(cfg, run_dir, runtime, rejected))
    return run


def build_data(cfg: Config, mesh: Mesh) -> Dataset:
    """The tokenized splits; small data: the validation split holds at least a micro-batch, if
    a global batch is left. With data.format chat, the chat template used is logged."""
    t = cfg.train
    given = hf_tokenizer(cfg.model.hf_path, cfg.model.vocab_size) if cfg.model.hf_path else None
    dataset = build_dataset(cfg.data, cfg.model.vocab_size, given, t.seq_len,
                            (t.micro_batch * t.grad_accum * mesh.dims.dp_size, t.micro_batch),
                            template_for(cfg.data.format, cfg.model.hf_path))
    if "chat_template" in (dataset.meta or {}):
        used = dataset.meta["chat_template"]
        log.info("data: chats rendered with the chat template %s ('%s', sha256 %s; assistant turns by %s)",
                 used["source"], used["name"], used["sha256"][:16], used["assistant"])
    return dataset


def build_plain_model(cfg: Config, model: nn.Module | None, device: torch.device,
                      dataset: Dataset) -> tuple[nn.Module, bool]:
    """(the model before any strategy, whether it is a model we did not build): the given one
    (on the meta device it stays there: parallelize materialises it), transformers' own module
    (an encoder-decoder, or a causal LM our decoder does not map: fresh, or hf_path's weights,
    models/hf_build.py), or our decoder on the meta device (materialised by parallelize, unit
    by unit). An encoder-decoder goes with data.format = 'seq2seq' and only with it."""
    user_model = model is not None
    module_config = transformers_config(cfg.model.hf_path, cfg.model.hf_config)
    if user_model:
        if not any(p.is_meta for p in model.parameters()):
            model = model.to(device)
    elif module_config:
        model, user_model = build_hf_model(module_config, cfg.model.vocab_size, "meta"), True
    else:
        model = build_model(cfg.model, "meta")
    if (dataset.source_len > 0) != isinstance(model, Seq2SeqAdapter):
        raise ConfigError(f"data.format = {cfg.data.format!r} with a {type(model).__name__}: "
                          f"data.format = 'seq2seq' goes with an encoder-decoder (model.hf_config, "
                          f"an encoder-decoder model.hf_path, or a models.hf.Seq2SeqAdapter), and "
                          f"an encoder-decoder with data.format = 'seq2seq' only")
    return model, user_model


def run_flops(cfg: Config, user_model: nn.Module | None, source_len: int) -> tuple[float, float]:
    """(model FLOPs per token, hardware FLOPs per token). A model we did not build (`user_model`):
    models.seq2seq.user_model_flops_per_token (an encoder-decoder by its parts, else 6N), and
    with recomputation 8/6 of it under 'full' (a second forward of everything, the usual
    approximation). Ours: the exact counts from its config (models.flops)."""
    seq_len, checkpoint = cfg.train.seq_len, cfg.activation.checkpoint
    if user_model is not None:
        return tuple(user_model_flops_per_token(user_model, seq_len, source_len, mode)
                     for mode in ("none", checkpoint))
    return flops_per_token(cfg.model, seq_len), flops_per_token(cfg.model, seq_len, checkpoint)
