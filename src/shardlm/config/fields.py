"""What each config value may be: its choices (the names of tiers, modes, dtypes, formats,
families), its range and its type (rules.py runs them), the small parsers of text-valued keys,
and the registry of checks across fields (`_cross`: rules.py and layout_rules.py register into
it). Plain data and functions: nothing here imports schema.py, which imports this."""

from __future__ import annotations

import dataclasses
import math
import re
import types
from pathlib import Path
from typing import Any, Callable, NamedTuple, get_type_hints

from shardlm.config.families import FamilyChoices
from shardlm.parallel.pipeline.tables import NAMED

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
"""model.attention's kernels (shardlm.models.attention)."""
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
"""model.rope_type: transformers' ROPE_INIT_FUNCTIONS our decoder computes (models/decoder.py)."""

CHECKPOINT_FAMILIES = FamilyChoices()
"""model.family: '' and the transformers model_types with a name table (config/families/: the
registry, read when asked, so a family registered later is a choice too)."""


PACKED_FORMATS = ("chat", "prompt_completion")
"""data.format values whose rows pack several examples (data.document_mask 'auto' = on)."""


def document_mask_on(data: Any) -> bool:
    """data.document_mask resolved: 'on', 'off', or 'auto' = on for the packed formats."""
    return data.document_mask == "on" or (data.document_mask == "auto" and data.format in PACKED_FORMATS)


def compile_on(train: Any) -> bool:
    """train.compile resolved: only True compiles; 'auto' is decided before the run builds
    (train/resolve.py decide_compile) and trains eager wherever it was not."""
    return train.compile is True


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


class Leaf(NamedTuple):
    """One key of a section: `key` relative to the section ('local_sgd.every' in a nested one),
    `attrs` the attribute path to it ('local_sgd', 'every'), its type, and the dataclass that
    declares it (`owner`: where its docstring is)."""

    key: str
    attrs: tuple[str, ...]
    type: Any
    owner: type


def leaf_fields(cls: type) -> list[Leaf]:
    """A section's keys in declaration order; a field whose type is a dataclass is a nested
    section (train.local_sgd), whose keys appear as 'field.key' (TOML: an inline table, or a
    dotted key; the command line: --train.local_sgd.every=4)."""
    hints = get_type_hints(cls)
    out: list[Leaf] = []
    for f in dataclasses.fields(cls):
        typ = hints[f.name]
        if dataclasses.is_dataclass(typ):
            out += [Leaf(f"{key_of(f)}.{leaf.key}", (f.name, *leaf.attrs), leaf.type, leaf.owner)
                    for leaf in leaf_fields(typ)]
        else:
            out.append(Leaf(key_of(f), (f.name,), typ, cls))
    return out


LOCAL_SGD_OUTER = ("diloco", "average")
"""train.local_sgd.outer: Nesterov SGD on the pseudo-gradient (DiLoCo), or plain averaging."""


_CHOICES = {
    "train.optimizer": ("adamw", "muon"),
    "train.compile": (True, False, "auto"),
    "model.norm": ("layernorm", "rmsnorm"),
    "data.format": DATA_FORMATS,
    "data.document_mask": ("auto", "on", "off"),
    "model.attention": ATTENTION_BACKENDS,
    "model.position": ("learned", "rope"),
    "model.rope_type": ROPE_TYPES,
    "model.family": CHECKPOINT_FAMILIES,
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
    "precision.cpu_bf16_gemm": ("auto", "fp32", "native"),
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
    "lora.quantize_layout": ("auto", "rows", "columns"),
    "train.local_sgd.outer": LOCAL_SGD_OUTER,
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
    "train.warmup_fraction": _rule(lambda v: 0.0 <= v < 1.0, "must be in [0, 1) (0 = use train.warmup_steps)"),
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
    "train.local_sgd.every": _non_negative(" (0 = off)"),
    "train.local_sgd.outer_lr": _positive(),
    "train.local_sgd.outer_momentum": _rule(lambda v: 0.0 <= v < 1.0, "must be in [0, 1)"),
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
    "parallel.quorum_timeout_s": _positive(" (seconds a replica waits for a missing peer)"),
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
    None. Floats must also be finite: a NaN passes every comparison's negation unseen. A union
    (train.compile: bool | str) takes a value of any of its types."""
    if isinstance(typ, types.UnionType):
        if any(_type_problem(value, each) is None for each in typ.__args__):
            return None
        return f"must be {a_type(typ)}, not {type(value).__name__}"
    if typ is bool:
        ok = isinstance(value, bool)
    elif typ is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif typ is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, typ)
    if not ok:
        return f"must be {a_type(typ)}, not {type(value).__name__}"
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


def a_type(typ: type) -> str:
    """'an int', 'a float', 'a bool', 'a str': a type's name with its article, for messages
    ('a bool or a str' for a union)."""
    if isinstance(typ, types.UnionType):
        return " or ".join(a_type(each) for each in typ.__args__)
    return ("an " if typ.__name__[0] in "aeiou" else "a ") + typ.__name__
