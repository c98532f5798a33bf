"""A run's config with every 'auto' decided — once, on one rank, the same for every rank and
every restart.

Two settings are decided from the machine: `parallel.strategy = "auto"` (the planner's best
plan, `Plan.apply`) and `precision.compute = "auto"` (hardware.catalog.choose_compute: on a CPU
by the measured matmul peaks, which no two processes measure identically). A decision taken on
every rank could differ between ranks or between a run and its restart, so rank 0 decides and
shares the resolved config; it is what config.json and every checkpoint record. A resumed run
keeps the compute dtype its checkpoint was trained in.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import NamedTuple

import torch

from shardlm.checkpoint.sharded import MANIFEST, parse_manifest
from shardlm.config.fields import compile_on
from shardlm.config.schema import Config
from shardlm.config.load import config_from_dict
from shardlm.config.dims import grad_accum_for
from shardlm.config.load import FINETUNE_LR, FINETUNE_WARMUP_FRACTION, finetune_mode
from shardlm.errors import ConfigError
from shardlm.hardware.catalog import DEVICES, Cluster, choose_compute, device_for_gpu_name, local_cpu, parse_cluster
from shardlm.hardware.machine import cpu_bf16_gemm
from shardlm.launch.runtime import Runtime, broadcast_text
from shardlm.models.fp8 import check_fp8_device
from shardlm.models.precision import carrier

log = logging.getLogger("shardlm")


def local_hardware(device: torch.device, world_size: int, mmap_threshold: int | None = None) -> Cluster:
    """The planner's view of this machine: the measured CPU (its processes' malloc mmap
    threshold: run.malloc_mmap_threshold, or the environment's), or the catalog's entry for
    this GPU (an unknown one is an error that lists the names the catalog has)."""
    if device.type == "cpu":
        return local_cpu(world_size, mmap_threshold)
    name = torch.cuda.get_device_name(device)
    known = device_for_gpu_name(name)  # torch's name ('NVIDIA H200') is no catalog name
    if known is None:
        catalog = ", ".join(d.name for d in DEVICES.values() if d.kind in ("cuda", "rocm"))
        raise ConfigError(f"the GPU {name!r} matches no GPU of the planner's catalog ({catalog})")
    return parse_cluster(f"{world_size}x{known.name}")


def _auto_compute(device: torch.device) -> str:
    if device.type == "cpu":
        return choose_compute("cpu", _cpu_peaks())
    known = device_for_gpu_name(torch.cuda.get_device_name(device))
    if known is not None:
        return choose_compute(known.kind, known.peak)
    return "bf16" if torch.cuda.is_bf16_supported() else "fp16"


def _saved_compute(checkpoint: Path | None) -> str | None:
    """The compute dtype a checkpoint's run was trained in (resolved), if it says."""
    if checkpoint is None or not (checkpoint / MANIFEST).is_file():
        return None
    manifest = parse_manifest(checkpoint, (checkpoint / MANIFEST).read_text())
    compute = manifest.get("config", {}).get("precision", {}).get("compute")
    return compute if compute not in (None, "auto") else None


FULL_FINETUNE_LR_LIMIT = 1e-4
"""Above this, a full fine-tune of a pretrained checkpoint is warned about (decide)."""


def finetune_note(cfg: Config) -> str:
    """The one start-up line of a model.hf_path run: the learning rate and warm-up it trains
    with, and which of them are the fine-tuning defaults (config/load.py); '' without hf_path."""
    if not cfg.model.hf_path:
        return ""
    t, mode = cfg.train, finetune_mode(cfg)
    what = "a full fine-tune" if mode == "full" else "QLoRA" if cfg.lora.quantize != "none" else "LoRA"
    lr = f"train.lr = {t.lr:g}" + (f" (the default for {what})" if t.lr == FINETUNE_LR[mode] else "")
    if t.warmup_fraction:
        default = " (the default)" if t.warmup_fraction == FINETUNE_WARMUP_FRACTION else ""
        warmup = (f"warm-up {t.warmup_steps} steps = train.warmup_fraction "
                  f"{t.warmup_fraction:g}{default} of {t.steps}")
    else:
        warmup = f"warm-up train.warmup_steps = {t.warmup_steps}"
    return (f"fine-tuning settings: {what} of {cfg.model.hf_path}: {lr}, {warmup} (set train.lr, "
            f"train.warmup_steps or train.warmup_fraction to choose)")


COMPILE_PAYS_AFTER_S = 600.0
"""train.compile = 'auto' compiles a LoRA / QLoRA run on a CPU whose eager time, counted at the machine's
measured matmul peak, is at least this long. The first step's compile costs tens of seconds (41 s
cold, 9-23 s from the cache, for the 135M instruct shape's block on 2 cores, 2026-11-30); the
fused element-wise work then saves 15-25% of each step (docs/finetuning.md), so a run of ten
minutes or more repays it several times over, and a short one (every test, the README's default
run) is not kept waiting."""


class CompileChoice(NamedTuple):
    on: bool
    why: str
    routine: bool
    """Off for a reason every short or non-LoRA run has (logged at debug), not one that stopped a
    run which would otherwise compile (logged at info, as the choice to compile is)."""


def decide_compile(cfg: Config, device: torch.device) -> CompileChoice:
    """train.compile = 'auto' decided for this run: (compile?, why). On for a LoRA or QLoRA
    fine-tune (where it was measured to pay: docs/finetuning.md) on a CPU (not yet measured on a
    GPU) whose run is long (COMPILE_PAYS_AFTER_S), whose settings compose with compilation
    (validate's rules, the transformers path's) and where Inductor builds a kernel (a C++
    compiler: tried on a one-line function)."""
    from shardlm.models.flops import flops_per_token
    from shardlm.models.hf_build import route_problems

    if device.type != "cpu":
        return CompileChoice(False, f"not measured on a {device.type} yet; set train.compile = true "
                                    f"to compile", True)
    if not cfg.lora.rank:
        return CompileChoice(False, "not a LoRA / QLoRA fine-tune: measured to gain there (a frozen "
                                    "base has no weight-gradient products, so fusing the element-wise "
                                    "rest saves a larger share), not elsewhere (gpt-mini pre-training "
                                    "0.95x); set train.compile = true", True)
    peak = _cpu_peaks()
    if (carrier(cfg.precision.compute) == "bf16" and cfg.precision.cpu_bf16_gemm != "native"
            and cpu_bf16_gemm(peak) == "fp32"):
        return CompileChoice(False, "this CPU's bf16 matmul is slower than its fp32 one: eager "
                                    "multiplies bf16 operands in fp32 GEMMs (precision.cpu_bf16_gemm), "
                                    "a compiled block in bf16", True)
    t = cfg.train
    tokens = t.micro_batch * t.grad_accum * t.seq_len  # one rank's, each step
    seconds = t.steps * tokens * flops_per_token(cfg.model, t.seq_len) / peak[carrier(cfg.precision.compute)]
    if seconds < COMPILE_PAYS_AFTER_S:
        return CompileChoice(False, f"a short run ({seconds:.0f} s of matmuls at this CPU's peak, "
                                    f"under {COMPILE_PAYS_AFTER_S:.0f} s: the compile would not pay)", True)
    on = copy.deepcopy(cfg)
    on.train.compile = True
    try:
        on.validate()
    except ConfigError as err:
        return CompileChoice(False, f"these settings do not compile: "
                                    f"{str(err).splitlines()[-1].strip(' -')}", False)
    if route_problems(on):
        return CompileChoice(False, "the transformers path is not compiled yet", False)
    broken = _inductor_broken()
    if broken:
        return CompileChoice(False, f"Inductor cannot build CPU kernels here ({broken}); install g++ "
                                    f"(or set CXX)", False)
    return CompileChoice(True, f"a long run ({seconds / 60:.0f} min of matmuls at this CPU's peak): the "
                               f"first step compiles each block (tens of seconds), the rest run fused; "
                               f"set train.compile = false to train eager", False)


def _cpu_peaks() -> dict[str, float]:
    """This CPU's measured matmul peaks, fp32 and bf16 (hardware/probe.py, cached)."""
    from shardlm.hardware.probe import cpu_peak_flops

    return {p: cpu_peak_flops(p) for p in ("fp32", "bf16")}


def _inductor_broken() -> str:
    """'' when torch.compile builds and runs a CPU kernel in this process, else why not."""
    try:
        torch.compile(lambda x: x * 2 + 1, fullgraph=True)(torch.ones(4))
    except Exception as err:  # noqa: BLE001 - any failure means: train eager, and say why
        return f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
    return ""


def with_global_batch(cfg: Config, world_size: int) -> Config:
    """With train.global_batch set: `cfg` with grad_accum = global_batch / (micro_batch x dp) at
    `world_size` ranks (a copy), so that a gang restarted at another size keeps the global batch,
    and with it the data each step reads and the step's meaning; else `cfg` itself."""
    grad_accum = grad_accum_for(cfg.train, cfg.parallel, world_size)
    if grad_accum != cfg.train.grad_accum:
        cfg = copy.deepcopy(cfg)
        cfg.train.grad_accum = grad_accum
        log.info("train.global_batch = %d on %d rank(s): grad_accum = %d", cfg.train.global_batch,
                 world_size, grad_accum)
    return cfg


def decide(cfg: Config, world_size: int, device: torch.device, checkpoint: Path | None = None,
           hardware: Cluster | None = None) -> Config:
    """`cfg` with its 'auto' settings decided for `world_size` ranks on `device` (one process's
    decision: `resolve_config` shares it). `checkpoint`: the one the run resumes from.
    `hardware`: decide for this cluster instead of this machine (`train --dry-run --gpus`)."""
    from shardlm.planner.search import default_dtypes, kept_settings, plan_for_run
    from shardlm.planner.explain import describe_strategy

    cfg = with_global_batch(cfg.validate(), world_size)
    note = finetune_note(cfg)
    if note:
        log.info(note)
    if cfg.model.hf_path and finetune_mode(cfg) == "full" and cfg.train.lr > FULL_FINETUNE_LR_LIMIT:
        log.warning("train.lr = %g on a full fine-tune of the pretrained %s: above %g, a "
                    "pre-training rate that can wash out what the checkpoint learned; fine-tuning "
                    "recipes use 1e-5 to 5e-5 (the default here: %g), or LoRA (lora.rank) at 2e-4",
                    cfg.train.lr, cfg.model.hf_path, FULL_FINETUNE_LR_LIMIT, FINETUNE_LR["full"])
    if hardware is None:  # fp8 needs FP8 hardware or precision.fp8_emulate: ConfigError otherwise
        check_fp8_device(cfg.precision, device)
    saved = _saved_compute(checkpoint) if cfg.precision.compute == "auto" else None
    if saved is not None:
        cfg = copy.deepcopy(cfg)
        cfg.precision.compute = saved
        log.info("precision.compute = auto: %s, as the checkpoint it resumes was trained", saved)
    if cfg.parallel.strategy == "auto":
        t, p = cfg.train, cfg.precision
        where = hardware or local_hardware(device, world_size, cfg.run.malloc_mmap_threshold)
        # What the run set itself (tp, cp, pp, ep, dp_replicate, sequence parallelism, the ZeRO
        # stage; the pipeline schedule) is kept; the plan chooses the rest around it: the
        # data-parallel split, ZeRO stage, micro-batch, recomputation and offload.
        par = cfg.parallel
        kept = kept_settings(par)
        plans = plan_for_run(cfg.model, world_size, where, (t.micro_batch, t.grad_accum, t.seq_len),
                             dtypes=default_dtypes(where, p.compute, p.master, p.reduce, p.fp8_all_gather), parallel=par)
        if not plans:
            raise ConfigError(f"parallel.strategy = 'auto': no strategy fits {cfg.model.preset} with "
                              f"{t.micro_batch * t.grad_accum * world_size // (par.tp * par.cp * par.pp)} x "
                              f"{t.seq_len} tokens per step on {world_size} rank(s); `shardlm "
                              f"estimate` shows where the memory goes")
        best = plans[0]
        cfg = best.apply(cfg)
        assert all(getattr(cfg.parallel, key) == value for key, value in kept.items()), (kept, cfg.parallel)
        said = ", ".join(f"{key}={value}" for key, value in kept.items())
        log.info("strategy auto: %schose %s — predicted %.0f tokens/s, peak %.2f GiB per rank (%d plans fit)",
                 f"kept {said} (set by you), " if kept else "", describe_strategy(best.strategy),
                 best.timing.tokens_per_s, best.memory.peak / 2**30, len(plans))
    if cfg.parallel.cp_mode == "auto":
        cfg = _decide_cp_mode(cfg, hardware or local_hardware(device, world_size, cfg.run.malloc_mmap_threshold))
    if cfg.precision.compute == "auto":
        compute = (choose_compute(hardware.device.kind, hardware.device.peak) if hardware
                   else _auto_compute(device))
        cfg = copy.deepcopy(cfg)
        cfg.precision.compute = compute
        log.info("precision.compute = auto: %s on this %s (decided once, recorded in the run's config)",
                 compute, device.type)
    if cfg.train.compile == "auto":
        choice = (CompileChoice(False, "deciding for another machine (--gpus)", True) if hardware
                  else decide_compile(cfg, device))
        cfg = copy.deepcopy(cfg)
        cfg.train.compile = choice.on
        (log.debug if choice.routine else log.info)("train.compile = auto: %s — %s",
                                                    "on" if choice.on else "off", choice.why)
    if cfg.precision.cpu_bf16_gemm == "auto":
        cfg = copy.deepcopy(cfg)
        cfg.precision.cpu_bf16_gemm = _auto_bf16_gemm(cfg, device if hardware is None else None)
    return cfg.validate()


def _auto_bf16_gemm(cfg: Config, cpu: torch.device | None) -> str:
    """precision.cpu_bf16_gemm = 'auto': 'fp32' for a bf16 run on a CPU whose torch bf16 matmul
    is slower than its fp32 one (hardware.machine.cpu_bf16_gemm, by the measured peaks), not compiled;
    'native' otherwise (a GPU, fp32 / fp16 compute, train.compile)."""
    if cpu is None or cpu.type != "cpu" or carrier(cfg.precision.compute) != "bf16" or compile_on(cfg.train):
        return "native"
    peak = _cpu_peaks()
    choice = cpu_bf16_gemm(peak)
    if choice == "fp32":
        log.info("precision.cpu_bf16_gemm = auto: fp32 — this CPU's bf16 matmul (%.1f GFLOP/s) is slower "
                 "than its fp32 one (%.1f): bf16 operands are multiplied in fp32 GEMMs and rounded to "
                 "bf16 (set 'native' for torch's bf16 kernels)", peak["bf16"] / 1e9, peak["fp32"] / 1e9)
    return choice


def _decide_cp_mode(cfg: Config, where: Cluster) -> Config:
    """parallel.cp_mode = 'auto': the mode (and hybrid degree) with the least exposed
    communication per micro-batch (planner/cp_modes.py), on the link the cp group spans."""
    from shardlm.planner.cp_modes import attention_seconds, choose_cp_mode
    from shardlm.planner.timing import group_link

    cfg = copy.deepcopy(cfg)
    par, m, t = cfg.parallel, cfg.model, cfg.train
    if par.cp == 1:
        par.cp_mode = "ring"
        return cfg
    bandwidth, latency, _ = group_link(where, par.cp, par.tp)
    compute = cfg.precision.compute if cfg.precision.compute in where.device.peak else "fp32"
    rate = where.device.peak.get(compute, max(where.device.peak.values())) * where.device.efficiency
    tokens = t.micro_batch * t.seq_len
    attention_s = attention_seconds(m, t.seq_len, t.micro_batch, par.tp, par.cp, rate,
                                    cfg.activation.checkpoint)
    e = 2 if compute in ("bf16", "fp16") else 4
    ranked = choose_cp_mode(m, tokens, par.cp, par.tp, e, cfg.activation.checkpoint, bandwidth, latency,
                            attention_s, where.calibration.overlap, where.calibration.factor("send_recv"))
    best = ranked[0]
    par.cp_mode, par.cp_ulysses = best.mode, best.ulysses if best.mode == "hybrid" else 0
    log.info("parallel.cp_mode = auto: %s — %s", best.mode, ", ".join(
        f"{r.mode}{f' {r.ulysses}' if r.mode == 'hybrid' else ''} {r.seconds * 1e3:.2f} ms, "
        f"{r.bytes / 2**20:.1f} MiB" for r in ranked) + " of cp communication per micro-batch")
    return cfg


def resolve_config(cfg: Config, runtime: Runtime, checkpoint: Path | None = None) -> Config:
    """`decide` on rank 0, shared with every rank: all ranks train with one resolved config."""
    text = json.dumps(decide(cfg, runtime.world_size, runtime.device, checkpoint).to_dict()) \
        if runtime.is_main else None
    return config_from_dict(json.loads(broadcast_text(text, runtime))).validate()
