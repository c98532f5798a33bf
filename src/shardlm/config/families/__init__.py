"""Checkpoint families as data: one file per transformers model_type (llama.py, gpt2.py,
mixtral.py, ...), each registering one `Family` that says how its config.json reads as our
[model] keys (hf_shapes + hf_families: LLaMA's reader driven by the record, or the family's own
`reader`), which tensor names its checkpoints use (checkpoint/hf_names.py: `names`, with GPT-2's
Conv1D transposes, GPT-NeoX's per-head q/k/v rows and a mixture's `experts`), what of our model
its transformers class can express, and which config keys an export writes (checkpoint/export.py).
Generic code reads the registry; adding a family is one new file here (and its test), listed in
BUILTIN (docs/architecture.md, "Adding a checkpoint family"). Plain data, no torch: the config
layer reads it; the hooks take a ModelConfig and plain dicts."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class Experts:
    """How a mixture-of-experts family holds its experts (models/moe.py): a softmax router choosing
    num_experts_per_tok of SwiGLU experts, dropless, no shared experts."""

    count_key: str
    """config.json's number of experts (Mixtral's num_local_experts, the others' num_experts)."""
    width_key: str = "intermediate_size"
    """config.json's expert width (Qwen3-MoE's moe_intermediate_size)."""
    renormalised: bool = False
    """Whether the top k's probabilities are always renormalised (Mixtral's), else as
    norm_topk_prob says (model.router_topk_norm)."""
    dense_blocks: bool = False
    """Whether dense blocks may sit between the sparse ones (Qwen3-MoE's decoder_sparse_step:
    model.moe_every)."""
    module: str = "mlp"
    """The block's module holding router ('gate') and experts in the checkpoint's files
    (Mixtral's block_sparse_moe)."""
    weights: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    """Each expert's gate, up and down tensors in the files (Mixtral's w1, w3, w2)."""
    read: Callable[[dict, dict, list], None] | None = None
    """The family's own expert keys: read(hf, shape, problems) (Qwen3-MoE's decoder_sparse_step)."""


@dataclass(frozen=True)
class Family:
    """One transformers model_type our decoder computes exactly, as the generic readers need it.
    The defaults are LLaMA's: a family states only where it differs."""

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
    and layer_types, hf_families._qwen_windows), 'flagged' (use_sliding_window, then a mask on
    every block: Qwen3-MoE), 'cap' (the context capped at the window), 'none' (the family's
    prepare reads it)."""
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
    """Our module -> the checkpoint's modules (no .weight / .bias), where they differ from LLaMA's
    (checkpoint/hf_names.LLAMA_NAMES): 'tok_emb', 'pos_emb', 'norm_f', 'head' and 'blocks' (the
    blocks' prefix, block i under '<prefix>.{i}') whole; a block's parts ('attn.qkv', 'mlp.fc',
    ...) relative to its block, several concatenated along our rows (Phi-3's fused qkv_proj is
    one, LLaMA's q/k/v three); 'post:<part>' / 'sandwich:<part>' where model.norm_placement
    renames a norm."""
    transposed: frozenset[str] = frozenset()
    """Parts whose weights the checkpoint holds as (in, out), the transpose of ours: GPT-2's Conv1D."""
    per_head: frozenset[str] = frozenset()
    """Parts whose rows the checkpoint groups by head, [q_h, k_h, v_h] for each head, where ours
    are [all q, all k, all v]: GPT-NeoX's query_key_value."""
    zero_biases: bool = False
    """Whether its class has a bias on every linear and norm, so an export writes zeros where our
    model has none (GPT-2's)."""
    in_memory_names: dict[str, str] = field(default_factory=dict)
    """A file tensor's name -> the name transformers gives it in memory, where its loading renames
    it (GPT-NeoX's embed_out is lm_head in transformers 5): what an export's load_state_dict needs."""
    experts: Experts | None = None
    """A mixture of experts: how its config.json, its checkpoints and its class hold them."""
    style: tuple[str, str, str] = ("rmsnorm", "rope", "swiglu")
    """(model.norm, model.position, model.mlp) its class computes (GPT-2's: layernorm, learned,
    gelu)."""
    reader: Callable[[dict, dict, dict, Callable, list], None] | None = None
    """Its whole config.json reader in place of LLaMA's (hf_families.read_llama_like, and the
    fields above that drive it): reader(hf, shape, rope, key, problems) fills `shape` (which holds
    the sizes already), `key` reading a required key."""
    sizable: bool = True
    """Whether the planner sizes it from a config.json (hf_shape without exact): the shapes its
    formulas know, LLaMA's and GPT-2's."""
    implied: Callable[[Any], bool] | None = None
    """Whether a model of ours without model.family, of this family's style, has this family's
    distinguishing fields (Qwen2's q/k/v-only biases, Gemma's (1 + w) norms, GPT-NeoX's
    parallel residual): it then exports as the last registered family whose `implied` holds,
    else as the style's first (hf_names.implied_family). None: never implied (Phi-3's fused
    names are its checkpoints' business, not a field of ours)."""
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
           "gemma2", "gemma3_text", "gpt2", "starcoder2", "gpt_neox", "stablelm", "mixtral",
           "qwen3_moe", "olmoe")
"""The families with a file here, imported when the registry is first read (in this order: the
order of model.family's choices)."""

SIZED_ONLY = ("olmo",)
"""model_types the planner sizes with LLaMA's reader whose weights do not load (OLMo 1)."""

_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add `family` to the registry (a family file calls it once, at import); returns it."""
    if family.name in _FAMILIES:
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
    """The registered Family of model_type `name`, or None (an unknown one)."""
    return registered().get(name)


def loadable() -> tuple[str, ...]:
    """model_type values whose weights our decoder computes exactly (model.hf_path)."""
    return tuple(registered())


def sizable() -> tuple[str, ...]:
    """model_type values the planner sizes from a config.json (Family.sizable, and SIZED_ONLY)."""
    return tuple(name for name, f in registered().items() if f.sizable) + SIZED_ONLY


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
