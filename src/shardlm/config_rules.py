"""What a valid configuration is: each field's type, choices and range, and the checks across
fields (shardlm.config's `Config.validate()` runs them all and reports every problem at once).

Plain data and functions over a config object, below shardlm.config in the import contract:
`cfg` is a shardlm.config.Config, read by attribute; nothing here imports it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from dataclasses import fields
from typing import Any, Callable, get_type_hints

from shardlm.errors import ConfigError

Config = Any
"""A shardlm.config.Config (not imported: that module imports this one)."""

OFFLOAD_TIERS = ("none", "cpu", "nvme")
"""Where the ZeRO engine keeps optimizer state or parameter shards (zero.offload_*)."""
RECOMPUTE_MODES = ("none", "selective", "full")
"""Activation checkpointing per block (activation.checkpoint)."""
ACTIVATION_OFFLOAD_MODES = ("none", "cpu")
"""Where the chosen blocks' saved activations wait for backward (activation.offload)."""
COMPUTE_DTYPES = ("fp32", "bf16", "fp16")
"""Resolved compute dtypes; precision.compute may also be 'auto' (resolved once per run)."""
DATA_FORMATS = ("text", "chat", "prompt_completion")
"""What data.source holds (shardlm.data.sft for the supervised fine-tuning formats)."""


def key_of(f: dataclasses.Field) -> str:
    """A field's config key: its name, without the trailing underscore that lets a Python
    keyword be a field (checkpoint.async is the field async_)."""
    return f.name.rstrip("_")


_CHOICES = {
    "model.norm": ("layernorm", "rmsnorm"),
    "data.format": DATA_FORMATS,
    "model.position": ("learned", "rope"),
    "model.mlp": ("gelu", "swiglu"),
    "model.router": ("softmax", "sigmoid"),
    "model.balance": ("aux", "bias", "none"),
    "precision.compute": ("auto",) + COMPUTE_DTYPES,
    "activation.checkpoint": RECOMPUTE_MODES,
    "activation.offload": ACTIVATION_OFFLOAD_MODES,
    "precision.reduce": ("auto",) + COMPUTE_DTYPES,
    "precision.master": ("fp32", "bf16"),
    "parallel.zero_stage": (0, 1, 2, 3),
    "parallel.strategy": ("manual", "auto"),
    "run.progress": ("auto", "on", "off"),
    "train.on_nonfinite": ("stop", "skip"),
    "checkpoint.readers": ("all", "one"),
    "zero.offload_optimizer": OFFLOAD_TIERS,
    "zero.offload_params": OFFLOAD_TIERS,
}

NVME_CHUNK_MB_MAX = 64 * 1024
"""zero.nvme_chunk_mb's bound: 64 GiB per chunk. The stream holds nvme_buffers x 4 chunks in host
memory, so at the smallest ring (3 buffers) a larger chunk needs more than 768 GiB of RAM — more
than a host has; the measured runs use 64 MiB (docs/benchmarks.md). A value above it is a unit
mistake (bytes or KiB written as MB), caught before any memory is asked for."""
NVME_RING_MAX_MB = 1024 * 1024
"""The stream's whole ring (nvme_buffers x 4 x nvme_chunk_mb) is bounded at 1 TiB of host memory
for the same reason (with the default 4 buffers that is exactly the chunk bound)."""
SEED_LIMIT = 2**63
"""train.seed is in [0, 2**63): numpy's SeedSequence (the data order) refuses negative seeds and
torch.manual_seed a seed beyond 64 bits."""
DEVICE_SYNTAX = re.compile(r"auto|cpu|cuda(:\d+)?")


def _rule(test: Callable[[Any], bool], requirement: str) -> tuple[Callable[[Any], bool], str]:
    return test, requirement


def _positive(meaning: str = "") -> tuple[Callable[[Any], bool], str]:
    return _rule(lambda v: v > 0, "must be > 0" + meaning)


def _non_negative(meaning: str = "") -> tuple[Callable[[Any], bool], str]:
    return _rule(lambda v: v >= 0, "must be >= 0" + meaning)


_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    # Each field's own range, checked after its type (and, for floats, finiteness). Every int and
    # float field has a rule here or a list in _CHOICES: tests/test_config.py holds that, so a new
    # numeric field cannot go unchecked.
    "model.vocab_size": _positive(),
    "model.n_layers": _positive(),
    "model.n_heads": _positive(),
    "model.n_kv_heads": _non_negative(" (0 = model.n_heads)"),
    "model.d_model": _positive(),
    "model.d_ff": _non_negative(" (0 = the default width for model.mlp)"),
    "model.max_seq_len": _positive(),
    "model.rope_theta": _positive(),
    "model.norm_eps": _positive(),
    "model.ffn_multiple_of": _positive(),
    "model.init_std": _positive(),
    "model.experts": _non_negative(" (0 = a dense model)"),
    "model.top_k": _positive(),
    "model.expert_d_ff": _non_negative(" (0 = model.d_ff)"),
    "model.shared_experts": _non_negative(),
    "model.moe_every": _positive(),
    "model.capacity_factor": _non_negative(" (0 = dropless)"),
    "model.aux_loss_coef": _non_negative(),
    "model.z_loss_coef": _non_negative(),
    "model.bias_update_rate": _non_negative(),
    "model.hf_path": _rule(lambda v: not v or Path(v).is_dir(),
                           "must be '' or a local transformers directory (config.json, safetensors, "
                           "tokenizer.json); nothing is downloaded"),
    "data.source": _rule(lambda v: bool(v.strip()), "must name 'stdlib' or files / directories"),
    "data.val_fraction": _rule(lambda v: 0.0 < v < 0.5, "must be in (0, 0.5)"),
    "data.max_bytes": _non_negative(" (0 = whole corpus)"),
    "train.steps": _positive(),
    "train.micro_batch": _positive(),
    "train.grad_accum": _positive(),
    "train.seq_len": _positive(),
    "train.lr": _positive(),
    "train.min_lr_ratio": _rule(lambda v: 0.0 <= v <= 1.0, "must be in [0, 1]"),
    "train.warmup_steps": _non_negative(),
    "train.weight_decay": _non_negative(),
    "train.beta1": _rule(lambda v: 0.0 <= v < 1.0, "must be in [0, 1)"),
    "train.beta2": _rule(lambda v: 0.0 <= v < 1.0, "must be in [0, 1)"),
    "train.eps": _positive(),
    "train.grad_clip": _non_negative(" (0 disables clipping)"),
    "train.seed": _rule(lambda v: 0 <= v < SEED_LIMIT, "must be in [0, 2**63)"),
    "train.eval_every": _non_negative(" (0 = only at the end)"),
    "train.eval_batches": _positive(),
    "train.log_every": _positive(),
    "train.sample_tokens": _non_negative(" (0 = no sample)"),
    "precision.loss_scale_init": _positive(),
    "precision.loss_scale_growth_interval": _positive(),
    "precision.loss_scale_backoff": _rule(lambda v: 0.0 < v < 1.0, "must be in (0, 1)"),
    "parallel.dp_replicate": _rule(lambda v: v >= 1, "must be >= 1"),
    "parallel.dp_shard": _rule(lambda v: v >= 1 or v == -1, "must be >= 1 or -1 (all remaining ranks)"),
    "parallel.tp": _positive(),
    "parallel.cp": _positive(),
    "parallel.pp": _positive(),
    "parallel.pp_schedule": _rule(lambda v: v in ("gpipe", "1f1b", "interleaved", "zb"),
                                  "must be 'gpipe', '1f1b', 'interleaved' or 'zb'"),
    "parallel.pp_virtual": _positive(),
    "parallel.ep": _positive(),
    "parallel.ep_rebalance_every": _non_negative(" (0 = never)"),
    "parallel.collective_timeout_s": _non_negative(" (0 disables the watchdog)"),
    "zero.nvme_chunk_mb": _rule(lambda v: 1 <= v <= NVME_CHUNK_MB_MAX,
                                f"must be in [1, {NVME_CHUNK_MB_MAX}] (MB per chunk; the stream "
                                f"holds nvme_buffers x 4 chunks in host memory)"),
    "zero.nvme_buffers": _rule(lambda v: v >= 3, "must be >= 3"),
    "activation.offload_blocks": _non_negative(" (0 = every block)"),
    "lora.rank": _non_negative(" (0 = off)"),
    "lora.alpha": _positive(),
    "lora.dropout": _rule(lambda v: 0.0 <= v < 1.0, "must be in [0, 1)"),
    "checkpoint.every": _non_negative(" (0 = no periodic saves)"),
    "checkpoint.keep": _rule(lambda v: v >= 1, "must be >= 1"),
    "checkpoint.resume": _rule(lambda v: bool(v.strip()), "must be 'auto', 'never' or a path"),
    "run.name": _rule(lambda v: v not in ("latest", ".", ".."),
                      "is reserved (run.dir/latest links to the newest run); choose another name"),
    "run.device": _rule(lambda v: DEVICE_SYNTAX.fullmatch(v) is not None,
                        "is not a device: use 'auto', 'cpu', 'cuda' or 'cuda:N'"),
}


def _type_problem(value: Any, typ: type) -> str | None:
    """Why `value` cannot be a `typ` field's value (a Config built in Python is not parsed), or
    None. Floats must also be finite: a NaN passes every comparison's negation unseen."""
    if typ is bool:
        ok = isinstance(value, bool)
    elif typ is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif typ is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, typ)
    if not ok:
        return f"must be a {typ.__name__}, not {type(value).__name__}"
    if typ is float and not math.isfinite(value):
        return "must be a finite number"
    return None


_CROSS: list[tuple[tuple[str, ...], Callable[[Config], list[str]]]] = []


def _cross(*keys: str) -> Callable:
    """Register a check across fields: it runs only when each of `keys` passed its own checks
    (so it may compare them freely), and whatever it raises becomes an error line."""
    def register(check: Callable[[Config], list[str]]) -> Callable[[Config], list[str]]:
        _CROSS.append((keys, check))
        return check
    return register


@_cross("model.d_model", "model.n_heads")
def _heads_divide_width(cfg: Config) -> list[str]:
    m = cfg.model
    return ([f"model.d_model = {m.d_model} is not divisible by model.n_heads = {m.n_heads}"]
            if m.d_model % m.n_heads else [])


@_cross("model.n_kv_heads", "model.n_heads")
def _kv_heads_divide_heads(cfg: Config) -> list[str]:
    m = cfg.model
    return ([f"model.n_kv_heads = {m.n_kv_heads} must divide model.n_heads = {m.n_heads}"]
            if m.n_kv_heads and m.n_heads % m.n_kv_heads else [])


@_cross("model.position", "model.d_model", "model.n_heads")
def _rope_head_dim(cfg: Config) -> list[str]:
    m = cfg.model
    return ([f"RoPE needs an even head dim; d_model/n_heads = {m.d_model // m.n_heads}"]
            if m.position == "rope" and (m.d_model // m.n_heads) % 2 else [])


@_cross("parallel.tp", "model.n_heads", "model.n_kv_heads")
def _tp_divides_heads(cfg: Config) -> list[str]:
    tp, m = cfg.parallel.tp, cfg.model
    kv = m.n_kv_heads or m.n_heads
    return ([f"parallel.tp = {tp} must divide model.n_heads = {m.n_heads}, and either divide the "
             f"key/value heads ({kv}) or be a multiple of them (each key/value head is then "
             f"replicated on tp / n_kv_heads ranks): each rank computes whole heads"]
            if tp > 1 and (m.n_heads % tp or (kv % tp and tp % kv)) else [])


@_cross("parallel.sequence_parallel", "parallel.tp")
def _sequence_parallel_needs_tp(cfg: Config) -> list[str]:
    par = cfg.parallel
    return (["parallel.sequence_parallel = true splits the sequence inside the tensor-parallel group: "
             "it needs parallel.tp > 1"] if par.sequence_parallel and par.tp == 1 else [])


@_cross("parallel.pp", "parallel.pp_layers", "parallel.pp_schedule", "parallel.pp_virtual",
        "model.n_layers", "parallel.zero_stage", "train.grad_accum")
def _pipeline_fits(cfg: Config) -> list[str]:
    from shardlm.dims import parse_layers

    par, n = cfg.parallel, cfg.model.n_layers
    if par.pp == 1:
        return ["parallel.pp_layers is set but parallel.pp = 1: set parallel.pp to the number of "
                "stages, or leave pp_layers empty"] if par.pp_layers else []
    problems = []
    stages = par.pp * par.pp_virtual
    if (par.pp_schedule == "interleaved") != (par.pp_virtual > 1):
        problems.append(f"parallel.pp_schedule = '{par.pp_schedule}' with parallel.pp_virtual = "
                        f"{par.pp_virtual}: the 'interleaved' schedule runs pp_virtual >= 2 chunks per "
                        f"rank, the others one (pp_virtual = 1)")
    elif par.pp_virtual > 1 and cfg.train.grad_accum % par.pp:
        problems.append(f"parallel.pp_schedule = 'interleaved' sends micro-batches through each chunk "
                        f"in groups of pp = {par.pp}: train.grad_accum = {cfg.train.grad_accum} must "
                        f"divide by it")
    if stages > n:
        problems.append(f"parallel.pp × pp_virtual = {stages} stages exceed the model's {n} layers "
                        f"(model.n_layers): every stage needs at least one block")
    elif par.pp_layers:
        try:
            parse_layers(par.pp_layers, n, stages)
        except ConfigError as e:
            problems.append(str(e))
    if par.zero_stage == 3:
        problems.append("parallel.zero_stage = 3 with parallel.pp > 1: ZeRO-3 gathers a unit's "
                        "parameters for each forward and backward, and a pipeline stage runs many "
                        "micro-batches' forwards and backwards interleaved; not supported yet: use "
                        "zero_stage <= 2 (stage 2 shards gradients after the last micro-batch)")
    return problems


@_cross("model.experts", "model.top_k", "parallel.ep", "parallel.tp", "parallel.cp", "parallel.dp_shard")
def _experts_fit(cfg: Config) -> list[str]:
    m, par, problems = cfg.model, cfg.parallel, []
    if m.experts and m.top_k > m.experts:
        problems.append(f"model.top_k = {m.top_k} exceeds model.experts = {m.experts}: a token "
                        f"cannot choose more experts than there are")
    if par.ep > 1:
        if not m.experts or m.experts % par.ep:
            problems.append(f"parallel.ep = {par.ep} must divide model.experts = {m.experts}: each "
                            f"expert-parallel rank holds experts / ep of them"
                            + ("" if m.experts else " (this model has none: set model.experts)"))
        if par.dp_shard > 0 and par.dp_shard % par.ep:
            problems.append(f"parallel.ep = {par.ep} must divide parallel.dp_shard = {par.dp_shard}: "
                            f"expert-parallel ranks are data-parallel ranks")
        if par.tp > 1:
            problems.append(f"parallel.ep = {par.ep} with parallel.tp = {par.tp}: under tensor "
                            f"parallelism the experts are spread over the tp ranks already; set "
                            f"parallel.ep = 1")
        if par.cp > 1:
            problems.append(f"parallel.ep = {par.ep} with parallel.cp = {par.cp} is not supported yet: "
                            f"use one of them")
    if m.experts and par.tp > 1 and m.experts % par.tp:
        problems.append(f"parallel.tp = {par.tp} must divide model.experts = {m.experts}: with tensor "
                        f"parallelism each tp rank holds experts / tp of them")
    return problems


@_cross("parallel.cp", "train.seq_len")
def _cp_divides_sequence(cfg: Config) -> list[str]:
    cp, t = cfg.parallel.cp, cfg.train.seq_len
    return ([f"parallel.cp = {cp} cuts each sequence into 2·cp = {2 * cp} chunks (one from the front "
             f"and one from the back per rank, for load balance), so train.seq_len = {t} must divide "
             f"by {2 * cp}; try train.seq_len = {max(2 * cp, t // (2 * cp) * 2 * cp)}"]
            if cp > 1 and t % (2 * cp) else [])


@_cross("train.seq_len", "model.max_seq_len")
def _sequence_fits(cfg: Config) -> list[str]:
    t, m = cfg.train, cfg.model
    return ([f"train.seq_len = {t.seq_len} exceeds model.max_seq_len = {m.max_seq_len}; "
             f"lower train.seq_len or raise model.max_seq_len"] if t.seq_len > m.max_seq_len else [])


@_cross("train.sample_tokens", "train.sample_prompt")
def _sample_has_prompt(cfg: Config) -> list[str]:
    t = cfg.train
    return (["train.sample_prompt = '' gives the sample nothing to continue; write a prompt or set "
             "train.sample_tokens = 0"] if t.sample_tokens > 0 and not t.sample_prompt else [])


@_cross("zero.offload_optimizer", "parallel.zero_stage")
def _optimizer_offload_stage(cfg: Config) -> list[str]:
    z, par = cfg.zero, cfg.parallel
    return ([f"zero.offload_optimizer = {z.offload_optimizer!r} needs parallel.zero_stage >= 1 "
             f"(stage 1 shards, and offloads, the optimizer state; one process may use it)"]
            if z.offload_optimizer != "none" and par.zero_stage == 0 else [])


@_cross("zero.offload_params", "parallel.zero_stage")
def _param_offload_stage(cfg: Config) -> list[str]:
    z, par = cfg.zero, cfg.parallel
    return ([f"zero.offload_params = {z.offload_params!r} needs parallel.zero_stage = 3 (only "
             f"stage 3 shards the parameters), got {par.zero_stage}"]
            if z.offload_params != "none" and par.zero_stage != 3 else [])


@_cross("lora.rank", "parallel.tp", "zero.offload_params")
def _lora_layout(cfg: Config) -> list[str]:
    if not cfg.lora.rank:
        return []
    out = []
    if cfg.parallel.tp > 1:
        out.append(f"lora.rank = {cfg.lora.rank} with parallel.tp = {cfg.parallel.tp}: tensor "
                   f"parallelism does not split LoRA layers yet; use ZeRO (parallel.zero_stage = 3 "
                   f"shards the frozen base)")
    if cfg.zero.offload_params != "none":
        out.append(f"lora.rank = {cfg.lora.rank} with zero.offload_params = "
                   f"{cfg.zero.offload_params!r}: frozen parameters are not offloaded yet; "
                   f"zero.offload_optimizer works")
    return out


@_cross("data.format", "parallel.tp", "parallel.cp")
def _sft_layout(cfg: Config) -> list[str]:
    fmt, par = cfg.data.format, cfg.parallel
    if fmt == "text":
        return []
    return ([f"data.format = {fmt!r} with parallel.{key} = {value}: the loss-masked targets (-100) "
             f"are not supported by the {what} yet; use data or pipeline parallelism / ZeRO"
             for key, value, what in (("tp", par.tp, "vocabulary-parallel cross-entropy"),
                                      ("cp", par.cp, "context-parallel loss (a mean per rank's tokens)"))
             if value > 1])


@_cross("activation.offload", "activation.offload_blocks", "activation.checkpoint", "model.n_layers")
def _activation_offload_composes(cfg: Config) -> list[str]:
    a, n = cfg.activation, cfg.model.n_layers
    if a.offload == "none":
        return ([f"activation.offload_blocks = {a.offload_blocks} has no effect with activation.offload "
                 f"= 'none'; set activation.offload = 'cpu' or leave offload_blocks at 0"]
                if a.offload_blocks else [])
    problems = []
    if a.checkpoint != "none":
        problems.append(f"activation.offload = {a.offload!r} with activation.checkpoint = "
                        f"{a.checkpoint!r}: offload moves the activations a block keeps, recomputation "
                        f"keeps fewer and rebuilds them inside backward (outside the offload hooks); "
                        f"choose one: activation.checkpoint = 'none' or activation.offload = 'none'")
    if a.offload_blocks > n:
        problems.append(f"activation.offload_blocks = {a.offload_blocks} exceeds the model's {n} "
                        f"blocks (model.n_layers); 0 offloads every block")
    return problems


@_cross("train.compile", "parallel.tp", "parallel.cp", "parallel.pp", "parallel.ep", "model.experts",
        "activation.checkpoint", "activation.offload")
def _compile_composes(cfg: Config) -> list[str]:
    """train.compile compiles each block (parallel/compile.py) with fullgraph: what runs a
    collective or a data-dependent shape inside a block cannot be one graph yet."""
    if not cfg.train.compile:
        return []
    par, m = cfg.parallel, cfg.model
    blocking = [f"{key} = {value!r} ({why})" for key, value, why, on in (
        ("parallel.tp", par.tp, "collectives inside each block", par.tp > 1),
        ("parallel.cp", par.cp, "ring attention's exchanges inside each block", par.cp > 1),
        ("parallel.pp", par.pp, "not verified with the pipeline schedules yet", par.pp > 1),
        ("parallel.ep", par.ep, "all-to-all inside each MoE block", par.ep > 1),
        ("model.experts", m.experts, "the router's data-dependent token counts break the graph", m.experts > 0),
        ("activation.checkpoint", cfg.activation.checkpoint, "its op policy sees aten ops, a compiled "
         "block runs fused kernels; 'full' composes", cfg.activation.checkpoint == "selective"),
        ("activation.offload", cfg.activation.offload, "saved-tensor hooks around a compiled block "
         "are not verified", cfg.activation.offload != "none"),
    ) if on]
    return ([f"train.compile = true does not compose yet with: {'; '.join(blocking)}. It works with "
             f"ZeRO stages 0-3, offload and activation.checkpoint = 'full'; set train.compile = false "
             f"or change those keys"] if blocking else [])


@_cross("zero.nvme_chunk_mb", "zero.nvme_buffers")
def _nvme_ring_fits(cfg: Config) -> list[str]:
    z = cfg.zero
    ring = z.nvme_buffers * 4 * z.nvme_chunk_mb
    return ([f"zero.nvme_buffers x 4 x zero.nvme_chunk_mb = {z.nvme_buffers} x 4 x {z.nvme_chunk_mb}"
             f" MB of host memory for the nvme stream exceeds {NVME_RING_MAX_MB} MB (1 TiB)"]
            if ring > NVME_RING_MAX_MB else [])


@_cross("zero.offload_optimizer", "checkpoint.async")
def _nvme_sync_checkpoints(cfg: Config) -> list[str]:
    return (["checkpoint.async = true with zero.offload_optimizer = 'nvme' would copy the "
             "on-disk optimizer state into memory; use synchronous checkpoints"]
            if cfg.zero.offload_optimizer == "nvme" and cfg.checkpoint.async_ else [])


@_cross("precision.master", "precision.compute")
def _pure_bf16(cfg: Config) -> list[str]:
    p = cfg.precision
    return ([f"precision.master = 'bf16' (pure bf16) needs precision.compute = 'bf16', "
             f"got {p.compute!r}"] if p.master == "bf16" and p.compute != "bf16" else [])


def validation_errors(cfg: Config, sections: dict[str, type]) -> list[str]:
    """Every problem with `cfg` (a shardlm.config.Config; `sections`: its section classes by
    name), one line each; never raises. Each field: its type (and finiteness), then its choices
    or range; then the checks across fields whose fields passed."""
    errors: list[str] = []
    bad: set[str] = set()

    def report(key: str, message: str) -> None:
        errors.append(message)
        bad.add(key)

    for name, cls in sections.items():
        section, hints = getattr(cfg, name, None), get_type_hints(cls)
        if not isinstance(section, cls):
            report(name, f"[{name}] must be a {cls.__name__}, not {type(section).__name__}")
            bad.update(f"{name}.{key_of(f)}" for f in fields(cls))
            continue
        for f in fields(cls):
            key, value = f"{name}.{key_of(f)}", getattr(section, f.name)
            problem = _type_problem(value, hints[f.name])
            if problem:
                report(key, f"{key} = {value!r} {problem}")
                continue
            choices = _CHOICES.get(key)
            if choices is not None and value not in choices:
                report(key, f"{key} = {value!r}; choose one of {', '.join(map(str, choices))}")
                continue
            rule = _RULES.get(key)
            if rule is not None and not rule[0](value):
                report(key, f"{key} = {value!r} {rule[1]}")
    for keys, check in _CROSS:
        if bad.intersection(keys):
            continue  # a field it reads is already reported
        try:
            errors += check(cfg)
        except Exception as e:  # a check must not hide the others' errors
            errors.append(f"could not check {', '.join(keys)}: {type(e).__name__}: {e}")
    return errors
