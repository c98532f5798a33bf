"""Checkpoint families as data: one file per transformers model_type (llama.py, qwen2.py, ...),
each registering one `Family` that says how its config.json reads as our [model] keys (hf_shapes
+ hf_families.read_llama_like), which tensor names its checkpoints use (checkpoint/hf_names.py)
and which config keys an export writes (checkpoint/export.py). Generic code reads the registry;
adding a LLaMA-like family is one new file here (and its test), listed in BUILTIN.

Families not yet moved into a file (GPT-2, StarCoder2, GPT-NeoX, StableLM and the mixtures)
are LEGACY: their readers are still branches in those modules. Plain data, no torch: the config
layer reads it; the hooks take a ModelConfig and plain dicts."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class Family:
    """One transformers model_type our decoder computes exactly, as the generic readers need it."""

    name: str
    """config.json's model_type (model.family)."""
    config_class: str
    """The transformers config class an export builds (`transformers.<config_class>`)."""
    model_class: str
    """The transformers class an export saves (`transformers.<model_class>`)."""
    shape: dict[str, Any] = field(default_factory=dict)
    """[model] values every checkpoint of the family has (Qwen2's qkv_bias, OLMo-2's norms)."""
    attention_bias: str = "linears"
    """config.json's attention_bias: 'linears' (with mlp_bias: model.bias, equal or refused),
    'qkv' (ignored: the family's q/k/v biases are `shape`'s qkv_bias), 'refused' (its biases sit
    on q/k/v/o only; ours would put them on the MLP too)."""
    title: str = ""
    """The family's name in messages (model_type's where empty)."""
    windows: str = "cap"
    """config.json's sliding_window: 'every' (a mask on every block), 'qwen' (use_sliding_window
    and layer_types, hf_families._qwen_windows), 'cap' (the context capped at the window), 'none'
    (the family's prepare reads it)."""
    silu: bool = True
    """Whether its MLP's hidden_act is SiLU (SwiGLU); Gemma's GeGLU is checked by its prepare."""
    tied: bool = False
    """tie_word_embeddings' default."""
    prepare: Callable[[dict, dict, dict, list], dict] | None = None
    """The family's keys read before LLaMA's: prepare(hf, shape, rope, problems) -> the rope
    parameters LLaMA's keys then read (Gemma 3's global ones)."""
    has_head_dim: bool = True
    """Whether the config has a head_dim key (without one it is hidden_size / heads)."""
    partial_rotary: bool = False
    """Whether its transformers code rotates only partial_rotary_factor of each head."""
    read: Callable[[dict, dict, list], None] | None = None
    """The family's own config.json keys into the shape: read(hf, shape, problems)."""
    names: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Our block's part -> the checkpoint's tensors (relative to model.layers.{i}), where they
    differ from LLaMA's (checkpoint/hf_names.LLAMA_NAMES): Phi-3's fused qkv_proj."""
    expresses: frozenset[str] = frozenset()
    """Our fields beyond LLaMA's core its class has a key for (hf_names.EXTRA_FIELDS)."""
    required: dict[str, Any] = field(default_factory=dict)
    """Our fields its class fixes (defaults to `shape`)."""
    biased: bool = False
    """Whether model.bias (a bias on every attention and MLP linear) maps."""
    problems: Callable[[Any], list[str]] | None = None
    """What else its class cannot express of a ModelConfig: problems(m) -> messages."""
    checks: Callable[[Any], list[str]] | None = None
    """Its own check of a ModelConfig in place of the LLaMA-field one (expresses, required,
    biased, problems): checks(m) -> messages (Gemma's)."""
    export: Callable[[Any, dict, list[str]], dict] | None = None
    """config_class's keyword arguments: export(m, llama_keys, layer_types), llama_keys being
    LLaMA's (hidden_size ... rope_parameters, head_dim, sliding_window, tokens)."""


BUILTIN = ("llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2", "granite", "smollm3", "gemma",
           "gemma2", "gemma3_text")
"""The families with a file here, imported when the registry is first read."""

LEGACY = ("gpt2", "starcoder2", "gpt_neox", "stablelm", "mixtral", "qwen3_moe", "olmoe")
"""Loadable families whose readers are still branches of the generic modules (not yet moved)."""

LEGACY_LLAMA_LIKE = ("olmo", "mixtral", "qwen3_moe", "olmoe")
"""Of those (and OLMo 1, sized only), the ones with LLaMA's shape: what the planner can size."""

_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add `family` to the registry (a family file calls it once, at import); returns it."""
    if family.name in _FAMILIES or family.name in LEGACY:
        raise ValueError(f"checkpoint family {family.name!r} is registered twice")
    _FAMILIES[family.name] = family
    return family


def registered() -> dict[str, Family]:
    """model_type -> Family, the built-in files imported on first use."""
    for name in BUILTIN:
        if name not in _FAMILIES:
            importlib.import_module(f"{__name__}.{name}")
    return _FAMILIES


def family(name: str) -> Family | None:
    """The registered Family of model_type `name`, or None (a legacy or unknown one)."""
    return registered().get(name)


def loadable() -> tuple[str, ...]:
    """model_type values whose weights our decoder computes exactly (model.hf_path)."""
    return tuple(registered()) + LEGACY


def sizable() -> tuple[str, ...]:
    """model_type values with LLaMA's shape (RMSNorm, RoPE, SwiGLU): what the planner can size."""
    return tuple(registered()) + LEGACY_LLAMA_LIKE


class FamilyChoices(Sequence):
    """model.family's choices, read from the registry when asked (a family registered after
    the config module was imported is a choice too): '' then every loadable model_type."""

    def __getitem__(self, index):
        return (("",) + loadable())[index]

    def __len__(self) -> int:
        return 1 + len(loadable())


def global_every(sliding: list[bool]) -> int | None:
    """n with block i global exactly when (i + 1) % n == 0 (0: every block slides; all global
    is 1), or None when no n describes `sliding`."""
    for n in range(len(sliding) + 1):
        if all(s == (n == 0 or (i + 1) % n != 0) for i, s in enumerate(sliding)):
            return n
    return None
