"""What a valid configuration is: each field's type, choices and range, and the checks across
fields (shardlm.config.schema's `Config.validate()` runs them all and reports every problem at once).

Plain data and functions over a config object, below shardlm.config.schema in the import contract:
`cfg` is a shardlm.config.schema.Config, read by attribute; nothing here imports it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from dataclasses import fields
from typing import Any, Callable, get_type_hints

from shardlm.errors import ConfigError
from shardlm.config.pipeline_tables import NAMED

Config = Any
"""A shardlm.config.schema.Config (not imported: that module imports this one)."""

OFFLOAD_TIERS = ("none", "cpu", "nvme")
"""Where the ZeRO engine keeps optimizer state or parameter shards (zero.offload_*)."""
RECOMPUTE_MODES = ("none", "selective", "full")
"""Activation checkpointing per block (activation.checkpoint)."""
ACTIVATION_OFFLOAD_MODES = ("none", "cpu")
"""Where the chosen blocks' saved activations wait for backward (activation.offload)."""
COMPUTE_DTYPES = ("fp32", "bf16", "fp16")
"""Resolved compute dtypes; precision.compute may also be 'auto' (resolved once per run)."""
FP8_RECIPES = ("tensorwise", "delayed", "blockwise")
"""How precision.compute = 'fp8' scales each tensor into FP8's range (precision.fp8_recipe)."""
DATA_FORMATS = ("text", "chat", "prompt_completion", "seq2seq")
"""What data.source holds (shardlm.data.sft for the supervised fine-tuning formats,
shardlm.data.seq2seq for source -> target pairs of an encoder-decoder)."""
ATTENTION_BACKENDS = ("auto", "sdpa", "per_document", "flex", "math")

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")

CHECKPOINT_FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2",
                       "gemma3_text", "phi3", "olmo2", "granite", "smollm3", "starcoder2", "gpt_neox",
                       "stablelm", "mixtral", "qwen3_moe", "olmoe")
"""model.family: the transformers model_types checkpoint/hf_names.py has a name table for."""
"""model.rope_type: transformers' ROPE_INIT_FUNCTIONS our decoder computes (models/decoder.py)."""
"""model.attention's kernels (shardlm.models.attention)."""
PACKED_FORMATS = ("chat", "prompt_completion")
"""data.format values whose rows pack several examples (data.document_mask 'auto' = on)."""


def document_mask_on(data: Any) -> bool:
    """data.document_mask resolved: 'on', 'off', or 'auto' = on for the packed formats."""
    return data.document_mask == "on" or (data.document_mask == "auto" and data.format in PACKED_FORMATS)


TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
"""run.tracker's names -> the module each imports; each is installed by the shardlm extra of
its name (pyproject.toml; shardlm.train.tracking writes to them)."""


def tracker_install_hint(name: str) -> str:
    return f'pip install "shardlm[{name}]"'


def tracker_names(text: str) -> list[str]:
    """run.tracker as a list: 'none' (or '') -> []; 'tensorboard,wandb' -> both, in order."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    return [] if names == ["none"] else list(dict.fromkeys(names))


def profile_step_numbers(text: str) -> list[int]:
    """run.profile_steps '5-7' -> [5, 6, 7], '5,6' -> [5, 6], '2,5-6' -> [2, 5, 6], '' -> [];
    sorted, from 1. A ValueError says what is wrong."""
    steps: set[int] = set()
    for part in (p.strip() for p in text.split(",") if p.strip()):
        first, dash, last = part.partition("-")
        if not (first.strip().isdigit() and (not dash or last.strip().isdigit())):
            raise ValueError(f"{part!r} is not a step number or a range a-b")
        lo, hi = int(first), int(last) if dash else int(first)
        if lo < 1 or hi < lo:
            raise ValueError(f"{part!r}: steps count from 1 and a range a-b needs a <= b")
        steps.update(range(lo, hi + 1))
    return sorted(steps)


def key_of(f: dataclasses.Field) -> str:
    """A field's config key: its name, without the trailing underscore that lets a Python
    keyword be a field (checkpoint.async is the field async_)."""
    return f.name.rstrip("_")


_CHOICES = {
    "train.optimizer": ("adamw", "muon"),
    "model.norm": ("layernorm", "rmsnorm"),
    "data.format": DATA_FORMATS,
    "data.document_mask": ("auto", "on", "off"),
    "model.attention": ATTENTION_BACKENDS,
    "model.position": ("learned", "rope"),
    "model.rope_type": ROPE_TYPES,
    "model.family": ("",) + CHECKPOINT_FAMILIES,
    "model.mlp": ("gelu", "swiglu"),
    "model.activation": ("auto", "gelu_tanh", "gelu", "silu"),
    "model.norm_placement": ("pre", "sandwich", "post"),
    "model.qk_norm_width": ("head", "all"),
    "model.router": ("softmax", "sigmoid"),
    "model.balance": ("aux", "bias", "none"),
    "precision.compute": ("auto",) + COMPUTE_DTYPES + ("fp8",),
    "precision.fp8_recipe": FP8_RECIPES,
    "activation.checkpoint": RECOMPUTE_MODES,
    "activation.offload": ACTIVATION_OFFLOAD_MODES,
    "precision.reduce": ("auto",) + COMPUTE_DTYPES,
    "precision.master": ("fp32", "bf16"),
    "parallel.zero_stage": (0, 1, 2, 3),
    "parallel.strategy": ("manual", "auto"),
    "parallel.cp_mode": ("ring", "ulysses", "hybrid", "auto"),
    "run.progress": ("auto", "on", "off"),
    "run.time_split": ("auto", "on", "off"),
    "train.on_nonfinite": ("stop", "skip"),
    "checkpoint.readers": ("all", "one"),
    "zero.offload_optimizer": OFFLOAD_TIERS,
    "zero.offload_params": OFFLOAD_TIERS,
    "lora.quantize": ("none", "nf4", "int8"),
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


SFT_COLUMNS = ("messages", "prompt", "completion", "source", "target")
"""The fields data.columns may rename (data.format chat: messages; prompt_completion: prompt and
completion; seq2seq: source and target)."""


def parse_columns(text: str) -> dict[str, str]:
    """data.columns, e.g. 'prompt=question,completion=answer' -> {'prompt': 'question', ...}.
    ValueError for anything else (checked by validate(), so the data code sees it well-formed)."""
    names: dict[str, str] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, eq, column = (s.strip() for s in part.partition("="))
        if not eq or name not in SFT_COLUMNS or not column or name in names:
            raise ValueError(part)
        names[name] = column
    return names


def _columns_ok(text: str) -> bool:
    try:
        parse_columns(text)
    except ValueError:
        return False
    return True


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
    "model.rope_fraction": _rule(lambda v: 0.0 < v <= 1.0, "must be in (0, 1] (1 = the whole head)"),
    "model.rope_factor": _positive(" (1 = no scaling)"),
    "model.rope_original_max_seq_len": _non_negative(" (0 = model.max_seq_len)"),
    "model.rope_low_freq_factor": _positive(),
    "model.rope_high_freq_factor": _positive(),
    "model.rope_beta_fast": _positive(),
    "model.rope_beta_slow": _positive(),
    "model.rope_attention_factor": _non_negative(" (0 = YaRN's 0.1 ln(rope_factor) + 1)"),
    "model.head_dim": _non_negative(" (0 = model.d_model / model.n_heads)"),
    "model.embedding_multiplier": _positive(),
    "model.residual_multiplier": _positive(),
    "model.logits_divisor": _positive(),
    "model.nope_every": _non_negative(" (0 = RoPE in every block)"),
    "model.attention_scale": _non_negative(" (0 = 1/sqrt(head_dim))"),
    "model.attn_softcap": _non_negative(" (0 = off)"),
    "model.logit_softcap": _non_negative(" (0 = off)"),
    "model.sliding_window": _non_negative(" (0 = full attention)"),
    "model.global_every": _non_negative(" (0 = every block slides)"),
    "model.rope_local_theta": _non_negative(" (0 = model.rope_theta's RoPE)"),
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
    "model.hf_config": _rule(lambda v: not v or Path(v).is_file() or (Path(v) / "config.json").is_file(),
                             "must be '' or a local transformers config.json (or a directory "
                             "holding one); nothing is downloaded"),
    "data.source": _rule(lambda v: bool(v.strip()), "must name 'stdlib' or files / directories"),
    "data.source_len": _non_negative(" (0 = train.seq_len)"),
    "data.val_fraction": _rule(lambda v: 0.0 < v < 0.5, "must be in (0, 0.5)"),
    "data.max_bytes": _non_negative(" (0 = whole corpus)"),
    "data.columns": _rule(_columns_ok, f"must be '' or comma-separated name=column pairs, each name "
                                       f"once, from {', '.join(SFT_COLUMNS)} (e.g. "
                                       f"'prompt=question,completion=answer')"),
    "train.steps": _positive(),
    "train.micro_batch": _positive(),
    "train.grad_accum": _positive(),
    "train.global_batch": _non_negative(" (0 = micro_batch x grad_accum x data-parallel ranks)"),
    "train.seq_len": _positive(),
    "train.lr": _positive(),
    "train.min_lr_ratio": _rule(lambda v: 0.0 <= v <= 1.0, "must be in [0, 1]"),
    "train.warmup_steps": _non_negative(),
    "train.weight_decay": _non_negative(),
    "train.beta1": _rule(lambda v: 0.0 <= v < 1.0, "must be in [0, 1)"),
    "train.beta2": _rule(lambda v: 0.0 <= v < 1.0, "must be in [0, 1)"),
    "train.eps": _positive(),
    "train.grad_clip": _non_negative(" (0 disables clipping)"),
    "train.muon_momentum": _rule(lambda v: 0.0 <= v < 1.0, "must be in [0, 1)"),
    "train.muon_ns_steps": _positive(),
    "train.seed": _rule(lambda v: 0 <= v < SEED_LIMIT, "must be in [0, 2**63)"),
    "train.eval_every": _non_negative(" (0 = only at the end)"),
    "train.eval_batches": _positive(),
    "train.log_every": _positive(),
    "train.sample_tokens": _non_negative(" (0 = no sample)"),
    "precision.loss_scale_init": _positive(),
    "precision.loss_scale_growth_interval": _positive(),
    "precision.loss_scale_backoff": _rule(lambda v: 0.0 < v < 1.0, "must be in (0, 1)"),
    "precision.fp8_block": _positive(" (elements per tile side)"),
    "parallel.dp_replicate": _rule(lambda v: v >= 1, "must be >= 1"),
    "parallel.dp_shard": _rule(lambda v: v >= 1 or v == -1, "must be >= 1 or -1 (all remaining ranks)"),
    "parallel.tp": _positive(),
    "parallel.cp": _positive(),
    "parallel.cp_ulysses": _non_negative(" (0 = cp for 'ulysses', 2 for 'hybrid')"),
    "parallel.pp": _positive(),
    "parallel.pp_schedule": _rule(lambda v: v in NAMED or v.startswith("file:"),
                                  f"must be one of {', '.join(NAMED)}, or 'file:PATH' (a CSV table)"),
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
    "run.malloc_mmap_threshold": _rule(lambda v: 0 <= v <= 32 * 2**20,
                                       "must be in [0, 33554432] bytes (glibc's largest mmap "
                                       "threshold; 0 = its dynamic default)"),
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


@_cross("train.global_batch", "train.micro_batch")
def _global_batch_in_micro_batches(cfg: Config) -> list[str]:
    t = cfg.train
    return ([f"train.global_batch = {t.global_batch} is not a multiple of train.micro_batch = "
             f"{t.micro_batch}: each data-parallel rank runs whole micro-batches"]
            if t.global_batch and t.global_batch % t.micro_batch else [])


@_cross("model.d_model", "model.n_heads", "model.head_dim")
def _heads_divide_width(cfg: Config) -> list[str]:
    m = cfg.model
    return ([f"model.d_model = {m.d_model} is not divisible by model.n_heads = {m.n_heads}; "
             f"make it so, or set model.head_dim"]
            if not m.head_dim and m.d_model % m.n_heads else [])


@_cross("model.n_kv_heads", "model.n_heads")
def _kv_heads_divide_heads(cfg: Config) -> list[str]:
    m = cfg.model
    return ([f"model.n_kv_heads = {m.n_kv_heads} must divide model.n_heads = {m.n_heads}"]
            if m.n_kv_heads and m.n_heads % m.n_kv_heads else [])


@_cross("model.position", "model.d_model", "model.n_heads", "model.head_dim")
def _rope_head_dim(cfg: Config) -> list[str]:
    m = cfg.model
    head_dim = m.head_dim or m.d_model // m.n_heads
    return ([f"RoPE needs an even head dim; model.head_dim (or d_model/n_heads) = {head_dim}"]
            if m.position == "rope" and head_dim % 2 else [])


@_cross("model.position", "model.rope_type", "model.rope_factor", "model.rope_low_freq_factor",
        "model.rope_high_freq_factor", "model.rope_beta_fast", "model.rope_beta_slow")
def _rope_scaling(cfg: Config) -> list[str]:
    m, problems = cfg.model, []
    if m.rope_type != "default" and m.position != "rope":
        problems.append(f"model.rope_type = {m.rope_type!r} scales rotary positions: it needs "
                        f"model.position = 'rope' (not {m.position!r}); or rope_type = 'default'")
    if m.rope_type == "llama3" and m.rope_high_freq_factor <= m.rope_low_freq_factor:
        problems.append(f"model.rope_type = 'llama3': model.rope_high_freq_factor "
                        f"({m.rope_high_freq_factor:g}) must exceed model.rope_low_freq_factor "
                        f"({m.rope_low_freq_factor:g})")
    return problems


@_cross("model.attention", "model.attn_softcap", "model.sliding_window", "model.rope_local_theta",
        "model.norm_offset", "model.norm", "model.activation", "model.mlp", "model.experts",
        "parallel.cp", "parallel.cp_mode", "parallel.tp", "train.seq_len", "model.parallel_residual",
        "model.rope_fraction",
        "model.norm_placement", "model.residual_multiplier", "model.head_dim", "model.d_model",
        "model.n_heads", "model.position", "model.norm_bias")
def _family_features(cfg: Config) -> list[str]:
    """The checkpoint families' features (docs/finetuning.md): each where it is computed."""
    m, cp, problems = cfg.model, cfg.parallel.cp, []
    if m.attn_softcap and m.attention not in ("auto", "math"):
        problems.append(f"model.attn_softcap = {m.attn_softcap:g} with model.attention = "
                        f"{m.attention!r}: only 'math' writes the scores out to cap them; use "
                        f"'auto' (picks 'math') or 'math'")
    if m.sliding_window and m.attention in ("per_document", "flex"):
        problems.append(f"model.sliding_window = {m.sliding_window} with model.attention = "
                        f"{m.attention!r}: it has no window mask yet; use 'auto', 'sdpa' or 'math'")
    if m.rope_local_theta and not m.sliding_window:
        problems.append(f"model.rope_local_theta = {m.rope_local_theta:g} is the sliding blocks' "
                        f"RoPE base, and model.sliding_window = 0 (no block slides); set both or neither")
    kv_heads = m.n_kv_heads or m.n_heads
    if m.qk_norm and m.qk_norm_width == "all" and kv_heads % cfg.parallel.tp:
        problems.append(f"model.qk_norm_width = 'all' (OLMo-2) with parallel.tp = "
                        f"{cfg.parallel.tp} > the {kv_heads} key/value heads: the key norm spans "
                        f"every head, and tensor parallelism's copies of them are not cut; use a "
                        f"parallel.tp that divides {kv_heads}")
    if m.parallel_residual and (m.norm_placement != "pre" or m.residual_multiplier != 1.0):
        problems.append(f"model.parallel_residual = true with model.norm_placement = "
                        f"{m.norm_placement!r} / residual_multiplier = {m.residual_multiplier:g}: "
                        f"parallel blocks are pre-norm, unscaled; set 'pre' and 1")
    rotated = int((m.head_dim or m.d_model // m.n_heads) * m.rope_fraction)
    if m.rope_fraction != 1.0 and (m.position != "rope" or rotated % 2 or not rotated):
        problems.append(f"model.rope_fraction = {m.rope_fraction:g} rotates {rotated} features of "
                        f"each head: it needs model.position = 'rope' and an even, non-zero count")
    if m.norm_bias and m.norm != "layernorm":
        problems.append(f"model.norm_bias = true gives LayerNorms biases: it needs model.norm = "
                        f"'layernorm' (not {m.norm!r})")
    if m.norm_offset and m.norm != "rmsnorm":
        problems.append(f"model.norm_offset = true is Gemma's RMSNorm: it needs model.norm = "
                        f"'rmsnorm' (not {m.norm!r})")
    if m.activation != "auto" and m.experts:
        problems.append(f"model.activation = {m.activation!r} with model.experts = {m.experts}: "
                        f"the experts' activation is model.mlp's own; set model.activation = 'auto'")
    return problems


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
        "model.n_layers", "train.grad_accum")
def _pipeline_fits(cfg: Config) -> list[str]:
    from shardlm.config.dims import parse_layers
    from shardlm.config.pipeline_tables import V_SHAPED
    from shardlm.config.pipeline_schedules import table_for

    par, n = cfg.parallel, cfg.model.n_layers
    if par.pp == 1:
        return ["parallel.pp_layers is set but parallel.pp = 1: set parallel.pp to the number of "
                "stages, or leave pp_layers empty"] if par.pp_layers else []
    problems = []
    stages = par.pp * par.pp_virtual
    schedule, virtual, micro = par.pp_schedule, par.pp_virtual, cfg.train.grad_accum
    if schedule in V_SHAPED and virtual != 2:
        problems.append(f"parallel.pp_schedule = '{schedule}' places two chunks per rank in a V (rank r "
                        f"holds stages r and 2·pp-1-r): set parallel.pp_virtual = 2 (got {virtual})")
    elif schedule in ("gpipe", "1f1b", "zb") and virtual > 1:
        problems.append(f"parallel.pp_schedule = '{schedule}' with parallel.pp_virtual = {virtual}: "
                        f"'{schedule}' runs one chunk per rank (pp_virtual = 1); several: 'interleaved', "
                        f"or two in a V: 'zbv', 'dualpipev'")
    elif schedule == "interleaved" and virtual == 1:
        problems.append("parallel.pp_schedule = 'interleaved' with parallel.pp_virtual = 1: the "
                        "'interleaved' schedule runs pp_virtual >= 2 chunks per rank")
    elif schedule == "interleaved" and micro % par.pp:
        problems.append(f"parallel.pp_schedule = 'interleaved' sends micro-batches through each chunk "
                        f"in groups of pp = {par.pp}: train.grad_accum = {micro} must divide by it")
    elif schedule == "dualpipev" and micro < 2 * par.pp:
        problems.append(f"parallel.pp_schedule = 'dualpipev' needs at least 2·pp = {2 * par.pp} "
                        f"micro-batches (train.grad_accum = {micro}): raise grad_accum or use 'zbv'")
    elif schedule in NAMED or schedule.startswith("file:"):
        try:  # the table itself: built (or read) and simulated, as the run will execute it
            table_for(schedule, par.pp, virtual, micro)
        except ConfigError as e:
            problems.append(f"parallel.pp_schedule = '{schedule}': {e}")
    if stages > n:
        problems.append(f"parallel.pp × pp_virtual = {stages} stages exceed the model's {n} layers "
                        f"(model.n_layers): every stage needs at least one block")
    elif par.pp_layers:
        try:
            parse_layers(par.pp_layers, n, stages)
        except ConfigError as e:
            problems.append(str(e))
    return problems


@_cross("model.experts", "model.top_k", "parallel.ep", "parallel.tp", "parallel.cp", "parallel.dp_shard",
        "parallel.ep_rebalance_every")
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
        if par.dp_shard > 0 and (par.dp_shard * par.cp) % par.ep:
            problems.append(f"parallel.ep = {par.ep} must divide parallel.dp_shard × parallel.cp = "
                            f"{par.dp_shard} × {par.cp}: expert-parallel ranks are data- and "
                            f"context-parallel ranks of one shard group")
        if par.tp > 1 and par.ep_rebalance_every:
            problems.append(f"parallel.ep_rebalance_every = {par.ep_rebalance_every} with parallel.tp = "
                            f"{par.tp} is not built yet (re-placement moves experts within one ep group, "
                            f"not an ep × tp grid): set it to 0 or parallel.tp = 1")
    spread = par.tp * par.ep  # the experts are spread over the tp ranks and the ep ranks: ep × tp
    if m.experts and par.tp > 1 and m.experts % spread:
        problems.append(f"parallel.tp × parallel.ep = {par.tp} × {par.ep} must divide model.experts = "
                        f"{m.experts}: with tensor parallelism each of the ep × tp ranks holds "
                        f"experts / (ep × tp) of them")
    return problems


def cp_degrees(cp: int, mode: str, ulysses: int) -> tuple[int, int]:
    """(all-to-all degree, ring degree) of parallel.cp = `cp` attending by parallel.cp_mode =
    `mode` ('auto' is decided before a run: it counts as the ring here); their product is cp."""
    if mode == "ulysses":
        return cp, 1
    if mode == "hybrid":
        a2a = ulysses or 2
        return (a2a, cp // a2a) if a2a and cp % a2a == 0 else (1, cp)
    return 1, cp


@_cross("parallel.cp", "parallel.cp_mode", "parallel.cp_ulysses", "parallel.tp", "model.n_heads",
        "model.n_kv_heads")
def _cp_mode_fits(cfg: Config) -> list[str]:
    """Ulysses splits each tensor-parallel rank's heads over the all-to-all degree (parallel/
    ulysses.py): query heads must divide by it; key/value heads divide by it or, fewer than it,
    divide it (each then replicated on a2a / kv ranks, as tensor parallelism replicates them)."""
    par, m, problems = cfg.parallel, cfg.model, []
    mode, a2a = par.cp_mode, par.cp_ulysses
    if a2a and mode not in ("hybrid", "ulysses"):
        problems.append(f"parallel.cp_ulysses = {a2a} is the all-to-all degree of cp_mode = 'hybrid' "
                        f"(or 'ulysses'); with cp_mode = {mode!r} it has no effect: set it to 0")
    if mode == "ulysses" and a2a not in (0, par.cp):
        problems.append(f"parallel.cp_ulysses = {a2a} with cp_mode = 'ulysses': the all-to-all spans "
                        f"all parallel.cp = {par.cp} ranks; set cp_ulysses = 0, or cp_mode = 'hybrid'")
    if mode == "hybrid" and par.cp > 1 and not (1 < (a2a or 2) < par.cp and par.cp % (a2a or 2) == 0):
        problems.append(f"parallel.cp_mode = 'hybrid' with parallel.cp = {par.cp} and cp_ulysses = "
                        f"{a2a or 2}: the all-to-all degree must divide cp and lie strictly between 1 "
                        f"and cp (a ring of cp / cp_ulysses >= 2 groups); use cp_mode = 'ring' or "
                        f"'ulysses' for the ends, or e.g. cp = 4, cp_ulysses = 2")
    if par.cp == 1 or mode in ("ring", "auto") or problems:
        return problems
    a2a = cp_degrees(par.cp, mode, a2a)[0]
    heads, kv = m.n_heads // par.tp, max(1, (m.n_kv_heads or m.n_heads) // par.tp)
    if heads % a2a or (kv % a2a and a2a % kv):
        problems.append(f"parallel.cp_mode = {mode!r} splits each tensor-parallel rank's heads over "
                        f"{a2a} ranks (the all-to-all degree): its {heads} query heads (model.n_heads "
                        f"= {m.n_heads} / tp = {par.tp}) must divide by {a2a}, and its {kv} key/value "
                        f"heads divide by {a2a} or divide it (then replicated); use cp_mode = 'ring' "
                        f"(any head count) or a smaller all-to-all degree (cp_mode = 'hybrid', "
                        f"parallel.cp_ulysses)")
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


@_cross("train.optimizer", "parallel.tp", "parallel.pp", "parallel.cp", "parallel.ep",
        "parallel.dp_replicate", "zero.offload_optimizer", "zero.offload_params", "lora.rank")
def _muon_layout(cfg: Config) -> list[str]:
    """Muon orthogonalises whole matrices. ZeRO's flat shards are gathered per unit (zero/
    muon.py); what is not built: gathering tensor-parallel cuts, and the pp/cp/ep/hybrid and
    offload layouts, which no test has checked against one process; nor LoRA (its low-rank
    adapters are nn.Linear weights Muon would orthogonalise, which no reference does)."""
    par, z = cfg.parallel, cfg.zero
    apart = {k: v for k, v, alone in (("parallel.tp", par.tp, 1), ("parallel.pp", par.pp, 1),
                                      ("parallel.cp", par.cp, 1), ("parallel.ep", par.ep, 1),
                                      ("parallel.dp_replicate", par.dp_replicate, 1),
                                      ("zero.offload_optimizer", z.offload_optimizer, "none"),
                                      ("zero.offload_params", z.offload_params, "none"),
                                      ("lora.rank", cfg.lora.rank, 0))
             if v != alone}
    if cfg.train.optimizer != "muon" or not apart:
        return []
    return [f"train.optimizer = 'muon' runs on data parallelism only (ZeRO stages 0-3, no "
            f"offload, no LoRA): Muon orthogonalises whole matrices, and gathering tensor-parallel cuts "
            f"(or stepping offloaded masters) is not built; got "
            f"{', '.join(f'{k} = {v!r}' for k, v in apart.items())}. Use train.optimizer = "
            f"'adamw' for this layout, or drop those settings"]


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


@_cross("lora.rank", "parallel.tp", "lora.quantize", "model.hf_config", "model.n_kv_heads", "model.n_heads")
def _lora_layout(cfg: Config) -> list[str]:
    """LoRA's frozen base is ZeRO units like any other (zero/engine.py: gathered at stage 3,
    kept by the parameter store when zero.offload_params is set). Tensor parallelism cuts our
    decoder's adapters as it cuts the linears they wrap, and a quantised base (lora.quantize) as
    whole stored rows of its byte tables (parallel/tensor.py, models/quant.py); a transformers
    model's layers (model.hf_config) are not cut yet, nor a quantised base's key/value rows that
    every rank keeps when tp > n_kv_heads."""
    if not cfg.lora.rank or cfg.parallel.tp == 1:
        return []
    m, tp = cfg.model, cfg.parallel.tp
    kv = m.n_kv_heads or m.n_heads
    blocking = [f"{key} = {value!r} ({why})" for key, value, why, on in (
        ("lora.quantize", cfg.lora.quantize, f"with parallel.tp = {tp} > model.n_kv_heads = {kv} "
         f"every rank keeps all key/value rows, which are not cut from a quantised base yet; set "
         f"parallel.tp <= {kv} or lora.quantize = 'none'", cfg.lora.quantize != "none" and tp > kv),
        ("model.hf_config", cfg.model.hf_config, "tensor parallelism cuts only our decoder's "
         "adapters; use model.preset or model.hf_path of a supported family, or parallel.tp = 1",
         bool(cfg.model.hf_config)),
    ) if on]
    return ([f"lora.rank = {cfg.lora.rank} with parallel.tp = {cfg.parallel.tp} does not compose "
             f"with: {'; '.join(blocking)}"] if blocking else [])


@_cross("lora.quantize", "lora.rank", "model.hf_config")
def _qlora_composes(cfg: Config) -> list[str]:
    """lora.quantize stores our decoder's frozen block linears as packed bytes (models/quant.py)."""
    q = cfg.lora.quantize
    if q == "none":
        return []
    blocking = [f"{key} = {value!r} ({why})" for key, value, why, on in (
        ("lora.rank", cfg.lora.rank, "the quantised base is frozen: without adapters nothing "
         "trains; set lora.rank > 0", cfg.lora.rank == 0),
        ("model.hf_config", cfg.model.hf_config, "a transformers model's layers are not ours to "
         "quantise; use model.hf_path or model.preset", bool(cfg.model.hf_config)),
    ) if on]
    return ([f"lora.quantize = {q!r} does not compose with: {'; '.join(blocking)}"]
            if blocking else [])


@_cross("data.format", "model.hf_path", "model.hf_config", "parallel.tp", "parallel.pp", "lora.rank")
def _seq2seq_model(cfg: Config) -> list[str]:
    """data.format = 'seq2seq' and an encoder-decoder model go together; tensor parallelism and
    the pipeline (our decoder's layers and blocks) and LoRA (our decoder's linears) do not apply
    to one yet."""
    from shardlm.config.hf_shapes import encoder_decoder_config

    m, fmt = cfg.model, cfg.data.format
    enc_dec = bool(encoder_decoder_config(m.hf_path, m.hf_config))
    if fmt != "seq2seq":
        return ([f"model.hf_config / model.hf_path name an encoder-decoder, which trains on "
                 f"data.format = 'seq2seq' (source -> target pairs), not {fmt!r}"] if enc_dec else [])
    # Neither key: perhaps a model given through the Python API (build_run(cfg, model=...)),
    # which build_run checks; a decoder-only checkpoint is certainly wrong.
    out = [] if enc_dec or not m.hf_path else [
        "data.format = 'seq2seq' needs an encoder-decoder model: model.hf_config = a T5 / BART "
        "config.json (from scratch; configs/hf/) or model.hf_path = a saved "
        "T5ForConditionalGeneration / BartForConditionalGeneration directory"]
    if cfg.parallel.tp > 1:  # refused by the loss-masked-data rule until that went (issue 28)
        out.append(f"data.format = 'seq2seq' with parallel.tp = {cfg.parallel.tp}: tensor "
                   f"parallelism cuts our decoder's layers (or a causal LM's base_model_tp_plan), "
                   f"not an encoder-decoder's; use ZeRO (parallel.zero_stage)")
    if cfg.parallel.pp > 1:
        out.append(f"data.format = 'seq2seq' with parallel.pp = {cfg.parallel.pp}: pipeline stages "
                   f"cut our decoder's blocks, not an encoder-decoder; use ZeRO (parallel.zero_stage)")
    if cfg.lora.rank:
        out.append(f"data.format = 'seq2seq' with lora.rank = {cfg.lora.rank}: LoRA applies to our "
                   f"decoder only; set lora.rank = 0 (full fine-tuning, ZeRO-3 shards it)")
    return out


@_cross("data.document_mask", "data.format", "model.attention", "parallel.tp", "parallel.cp",
        "parallel.cp_mode", "train.compile")
def _attention_composes(cfg: Config) -> list[str]:
    """Document masks ride on the input ids (PackedTokens: shardlm/data/packed.py) into Decoder.forward,
    every pipeline stage included; context parallelism keeps the whole sequence's document
    positions on every rank (the ring masks each hop by them, Ulysses attends the whole
    sequence)."""
    par, attention, problems = cfg.parallel, cfg.model.attention, []
    if document_mask_on(cfg.data):
        why = f"data.document_mask = {cfg.data.document_mask!r} (on for data.format = {cfg.data.format!r})"
        if cfg.data.format == "seq2seq":
            problems.append(f"{why}: seq2seq examples are not packed; set data.document_mask = 'off' or 'auto'")
    if attention == "per_document" and cfg.train.compile:
        problems.append("model.attention = 'per_document' with train.compile = true: its document "
                        "lengths are data-dependent and cannot be one graph; use 'auto' (sdpa with "
                        "a mask when compiled) or 'sdpa'")
    if attention not in ("auto", "sdpa") and par.cp > 1 and par.cp_mode != "ulysses":
        problems.append(f"model.attention = {attention!r} with parallel.cp = {par.cp} and cp_mode = "
                        f"{par.cp_mode!r}: the ring runs its own per-block kernel; use 'auto' or "
                        f"'sdpa', or cp_mode = 'ulysses' (the whole sequence per head: any backend)")
    return problems


@_cross("activation.offload", "activation.offload_blocks", "model.n_layers")
def _activation_offload_composes(cfg: Config) -> list[str]:
    """activation.offload moves what each chosen block keeps for backward to host memory: its
    saved tensors, or with recomputation (activation.checkpoint) the checkpoint's kept inputs
    (parallel/activation.py)."""
    a, n = cfg.activation, cfg.model.n_layers
    if a.offload == "none":
        return ([f"activation.offload_blocks = {a.offload_blocks} has no effect with activation.offload "
                 f"= 'none'; set activation.offload = 'cpu' or leave offload_blocks at 0"]
                if a.offload_blocks else [])
    problems = []
    if a.offload_blocks > n:
        problems.append(f"activation.offload_blocks = {a.offload_blocks} exceeds the model's {n} "
                        f"blocks (model.n_layers); 0 offloads every block")
    return problems


@_cross("zero.nvme_chunk_mb", "zero.nvme_buffers")
def _nvme_ring_fits(cfg: Config) -> list[str]:
    z = cfg.zero
    ring = z.nvme_buffers * 4 * z.nvme_chunk_mb
    return ([f"zero.nvme_buffers x 4 x zero.nvme_chunk_mb = {z.nvme_buffers} x 4 x {z.nvme_chunk_mb}"
             f" MB of host memory for the nvme stream exceeds {NVME_RING_MAX_MB} MB (1 TiB)"]
            if ring > NVME_RING_MAX_MB else [])


@_cross("run.tracker")
def _trackers_installed(cfg: Config) -> list[str]:
    """Each tracker named is known and its package importable: found now, before any rank starts
    (shardlm.train.tracking imports it on rank 0 only)."""
    import importlib.util

    errors = []
    for name in tracker_names(cfg.run.tracker):
        if name not in TRACKERS:
            errors.append(f"run.tracker = {cfg.run.tracker!r}: unknown tracker {name!r}; use 'none' or "
                          f"a comma list of {', '.join(TRACKERS)}")
        elif importlib.util.find_spec(TRACKERS[name]) is None:
            errors.append(f"run.tracker = {cfg.run.tracker!r} needs the {TRACKERS[name]} package, which "
                          f"is not installed: {tracker_install_hint(name)}")
    return errors


@_cross("run.profile_steps", "train.steps")
def _profile_steps_run(cfg: Config) -> list[str]:
    try:
        steps = profile_step_numbers(cfg.run.profile_steps)
    except ValueError as e:
        return [f"run.profile_steps = {cfg.run.profile_steps!r}: {e} (e.g. '5-7' or '5,6')"]
    late = [s for s in steps if s > cfg.train.steps]
    return ([f"run.profile_steps = {cfg.run.profile_steps!r} names step(s) {late} beyond train.steps = "
             f"{cfg.train.steps}: they would never run"] if late else [])


@_cross("precision.master", "precision.compute")
def _pure_bf16(cfg: Config) -> list[str]:
    p = cfg.precision
    return ([f"precision.master = 'bf16' (pure bf16) needs precision.compute = 'bf16' (or 'fp8', "
             f"whose parameters are bf16), got {p.compute!r}"]
            if p.master == "bf16" and p.compute not in ("bf16", "fp8") else [])


@_cross("precision.compute", "precision.fp8_recipe", "precision.fp8_emulate", "precision.fp8_block",
        "run.device", "parallel.tp", "model.experts", "model.n_heads",
        "model.n_kv_heads", "lora.rank", "train.compile")
def _fp8_composes(cfg: Config) -> list[str]:
    """precision.compute = 'fp8' runs the blocks' matmuls through models/fp8.py fp8_linear: the
    plain linears, LoRA's base, the tensor-parallel linears, the experts (emulated; torchao on
    FP8 hardware converts plain linears only). What does not compose yet is refused by name.
    Whether the device has FP8 is checked where the device is known (models.fp8.check_fp8_device,
    before spawning)."""
    p, par = cfg.precision, cfg.parallel
    if p.compute != "fp8":
        unused = [f"{key} = {value!r}" for key, value, default in (
            ("precision.fp8_recipe", p.fp8_recipe, "tensorwise"), ("precision.fp8_emulate", p.fp8_emulate, False),
            ("precision.fp8_block", p.fp8_block, 128)) if value != default]
        return ([f"{', '.join(unused)} has no effect with precision.compute = {p.compute!r}; set "
                 f"precision.compute = 'fp8' or drop them"] if unused else [])
    problems = []
    if cfg.run.device == "cpu" and not p.fp8_emulate:
        problems.append("precision.compute = 'fp8' with run.device = 'cpu': a CPU has no FP8 matmuls. "
                        "Set precision.fp8_emulate = true to emulate the FP8 rounding with bf16 matmuls "
                        "(for numerics, not speed), or use precision.compute = 'bf16'")
    if p.fp8_block != 128 and p.fp8_recipe != "blockwise":
        problems.append(f"precision.fp8_block = {p.fp8_block} has no effect with precision.fp8_recipe = "
                        f"{p.fp8_recipe!r}; set fp8_recipe = 'blockwise' or drop fp8_block")
    kv = cfg.model.n_kv_heads or cfg.model.n_heads
    blocking = [f"{key} = {value!r} ({why})" for key, value, why, on in (
        ("parallel.tp", par.tp, "blockwise tiles would straddle the tensor-parallel cut; use "
         "fp8_recipe = 'tensorwise' or 'delayed'", par.tp > 1 and p.fp8_recipe == "blockwise"),
        ("parallel.tp", par.tp, f"more ranks than the {kv} key/value heads: the shared key/value "
         f"rows are not scaled as one process scales them; use parallel.tp <= {kv}",
         par.tp > kv),
        ("train.compile", cfg.train.compile, "'delayed' scaling's amax history is Python state the "
         "emulation updates inside the matmul, which a compiled block cannot trace; use fp8_recipe = "
         "'tensorwise' or 'blockwise' (those compile)", cfg.train.compile and p.fp8_emulate
         and p.fp8_recipe == "delayed"),
    ) if on]
    # On FP8 hardware torchao's Float8Linear converts plain nn.Linear layers only; the emulation
    # (models/fp8.py fp8_linear) also runs the layers that replace or wrap them.
    blocking += [f"{key} = {value!r} ({why}: set precision.fp8_emulate = true to study it "
                 f"numerically)" for key, value, why, on in (
        ("parallel.tp", par.tp, "torchao does not convert our tensor-parallel linears", par.tp > 1),
        ("model.experts", cfg.model.experts, "torchao does not convert the experts' batched "
         "weights", cfg.model.experts > 0),
        ("lora.rank", cfg.lora.rank, "torchao would convert LoRA's adapters, not its frozen base",
         cfg.lora.rank > 0),
    ) if on and not p.fp8_emulate]
    if blocking:
        problems.append(f"precision.compute = 'fp8' does not compose yet with: {'; '.join(blocking)}. "
                        f"Change those keys or use precision.compute = 'bf16'")
    return problems


def refusing_rules(cfg: Config) -> dict[str, list[str]]:
    """The checks across fields that object to `cfg`, by the rule's function name (e.g.
    '_fp8_composes') -> its error lines: which rule refuses a combination (bench/compose.py's
    composition matrix, tests/test_compose.py). Assumes each field passed its own checks."""
    found: dict[str, list[str]] = {}
    for _, check in _CROSS:
        problems = check(cfg)
        if problems:
            found[check.__name__] = problems
    return found


def validation_errors(cfg: Config, sections: dict[str, type]) -> list[str]:
    """Every problem with `cfg` (a shardlm.config.schema.Config; `sections`: its section classes by
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
