"""Our decoder's parameters <-> a transformers checkpoint's tensors, as a table: `hf_initializer`
reads a local HF directory into our initial values (model.hf_path); `export.hf_state_dict` writes
ours out through the same table (the experts of a mixture are its own business). `hf_family`
says which transformers class (if any) expresses a model of ours; export and the PEFT adapter
format (peft_adapter.py) both ask it.

Each of our parameters is one or more HF tensors concatenated along our first dimension:
`attn.qkv` is q_proj, k_proj, v_proj (rows q, then k, then v — GPT-2's c_attn is already fused);
SwiGLU's `mlp.gate_up` is gate_proj then up_proj. GPT-2's Conv1D stores its weight as (in, out),
the transpose of nn.Linear's. A mixture's router and experts (Mixtral, Qwen3-MoE, OLMoE) are
`moe_sources`: one file tensor per expert, stacked along our first dimension.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from shardlm.checkpoint.hf_dir import HFDirError, HFDirReader
from shardlm.config import ModelConfig
from shardlm.config.families import family as registered_family
from shardlm.errors import ConfigError
from shardlm.models.flops import expert_d_ff, head_dim, is_moe_block, moe_layers, resolved_d_ff
from shardlm.models.init import Initializer


GPT2_STYLE = {"norm": "layernorm", "position": "learned", "mlp": "gelu"}
STARCODER2_STYLE = {"norm": "layernorm", "position": "rope", "mlp": "gelu"}
STABLELM_STYLE = {"norm": "layernorm", "position": "rope", "mlp": "swiglu"}
"""StarCoder2's and GPT-NeoX's (model.family, or the NeoX-only fields, tells them apart)."""
LLAMA_STYLE = {"norm": "rmsnorm", "position": "rope", "mlp": "swiglu"}


# The LLaMA-style fields beyond the common core, with their defaults, and which of them each
# LLaMA-style family's transformers class has a key for (Family.expresses; Gemma's: its checks).
EXTRA_FIELDS = {"head_dim": 0, "qkv_bias": False, "qk_norm": False, "qk_norm_width": "head",
                "norm_placement": "pre", "activation": "auto", "embedding_multiplier": 1.0,
                "attention_scale": 0.0, "residual_multiplier": 1.0, "logits_divisor": 1.0,
                "attn_softcap": 0.0, "logit_softcap": 0.0, "sliding_window": 0, "global_every": 0,
                "rope_local_theta": 0.0, "nope_every": 0, "parallel_residual": False,
                "rope_fraction": 1.0, "norm_bias": False}
LEGACY_EXPRESSES = {
    "starcoder2": {"head_dim", "sliding_window"},  # not LLaMA-style in norm and MLP: STARCODER2_STYLE
    "gpt_neox": {"parallel_residual", "rope_fraction", "activation"},
    "stablelm": {"qkv_bias", "rope_fraction"},  # LayerNorms: STABLELM_STYLE
    # the mixtures of experts (their experts: _moe_family)
    "mixtral": {"head_dim", "sliding_window"},
    "qwen3_moe": {"head_dim", "qk_norm", "sliding_window"},  # a window on every block
    "olmoe": {"qk_norm", "qk_norm_width"},
}
"""What the families not yet in config/families/ express (a registered one: Family.expresses)."""
LEGACY_REQUIRED = {"stablelm": {"norm_bias": True}, "qwen3_moe": {"qk_norm": True},
                   "olmoe": {"qk_norm": True, "qk_norm_width": "all"}}
MOE_FAMILIES = ("mixtral", "qwen3_moe", "olmoe")
"""The LLaMA-style mixtures of experts: a softmax router over SwiGLU experts (moe_sources)."""
LEGACY_BIASED = ("starcoder2", "gpt_neox")
"""Legacy families whose attention and MLP linears may all have biases (model.bias)."""
LLAMA_NAMES = {"attn.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
               "mlp.gate_up": ("mlp.gate_proj", "mlp.up_proj")}
"""Our fused parts -> LLaMA's tensors under model.layers.{i} (a family's Family.names overrides)."""


def hf_family(m: ModelConfig) -> str:
    """The transformers model_type that computes exactly our model: model.family (a loaded
    checkpoint's own, so export writes it back), else the class the fields imply: 'gpt2',
    'llama' (Llama 1-3.3: any model.rope_type, model.head_dim), 'qwen2' (biases on q/k/v only),
    'qwen3' (per-head q/k norms), 'olmo2' (post-norms, whole-width q/k norms), 'granite'
    (multipliers), 'smollm3' (NoPE blocks), 'mistral' (a sliding window), 'gemma' / 'gemma2' /
    'gemma3_text' (model.norm_offset: plain, sandwich norms, and q/k norms); with experts
    'mixtral', 'qwen3_moe' (per-head q/k norms) or 'olmoe' (whole-width q/k norms). A
    ConfigError names every field the class cannot express."""
    chosen = {k: getattr(m, k) for k in GPT2_STYLE}
    if m.experts:
        return _moe_family(m, chosen)
    if chosen == GPT2_STYLE:
        if m.qkv_bias and not m.bias:
            raise ConfigError("cannot export to GPT2LMHeadModel: model.qkv_bias = true with model.bias "
                              "= false (biases on q/k/v only) has no GPT-2 equivalent; GPT-2 has "
                              "biases everywhere (model.bias = true)")
        kv = m.n_kv_heads or m.n_heads
        if kv != m.n_heads:
            raise ConfigError(f"cannot export to GPT2LMHeadModel: model.n_kv_heads = {m.n_kv_heads} "
                              f"(grouped-query attention) has no GPT-2 equivalent; only "
                              f"n_kv_heads = 0 or n_heads = {m.n_heads} maps")
        return "gpt2"
    if chosen == STARCODER2_STYLE:
        neox = (m.parallel_residual, m.rope_fraction, m.activation) != (False, 1.0, "auto")
        family = m.family or ("gpt_neox" if neox else "starcoder2")
        problems = _llama_problems(m, family)
        if not m.bias:
            problems.append(f"model.bias = false ({family}'s LayerNorms and MLP have biases)")
        if family == "gpt_neox" and (m.n_kv_heads or m.n_heads) != m.n_heads:
            problems.append(f"model.n_kv_heads = {m.n_kv_heads} (GPT-NeoX has one key/value head "
                            f"per query head)")
        if problems:
            raise ConfigError(f"cannot export this model to transformers' {family} class: "
                              + "; ".join(problems))
        return family
    if chosen == STABLELM_STYLE:  # LayerNorms (with biases) on LLaMA's attention and MLP
        problems = _llama_problems(m, "stablelm")
        if problems:
            raise ConfigError("cannot export this model to transformers' stablelm class: "
                              + "; ".join(problems))
        return "stablelm"
    if chosen == LLAMA_STYLE:
        family = m.family or _implied_llama_family(m)
        fam = registered_family(family)  # a family with its own check (Gemma's) runs it
        own = fam is not None and fam.checks is not None
        problems = fam.checks(m) if own else _llama_problems(m, family)
        if problems:
            raise ConfigError(f"cannot export this model to transformers' {family} class"
                              f"{' (model.family)' if m.family else ''}: " + "; ".join(problems))
        return family

    def describe(style: dict[str, str]) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in style.items())

    off_gpt2 = [f"model.{k} = {chosen[k]!r}" for k in GPT2_STYLE if chosen[k] != GPT2_STYLE[k]]
    off_llama = [f"model.{k} = {chosen[k]!r}" for k in LLAMA_STYLE if chosen[k] != LLAMA_STYLE[k]]
    raise ConfigError(f"cannot export this model to transformers: GPT2LMHeadModel needs "
                      f"{describe(GPT2_STYLE)} (not {', '.join(off_gpt2)}) and LlamaForCausalLM "
                      f"needs {describe(LLAMA_STYLE)} (not {', '.join(off_llama)})")


def _implied_llama_family(m: ModelConfig) -> str:
    """The LLaMA-style class a model of ours without model.family is most naturally: by its
    distinguishing fields (a model that mixes them is refused by the family's check)."""
    if m.norm_offset:
        return "gemma3_text" if m.qk_norm else "gemma2" if m.norm_placement == "sandwich" else "gemma"
    if m.qk_norm:
        return "olmo2" if m.qk_norm_width == "all" else "qwen3"
    if (m.embedding_multiplier, m.attention_scale, m.residual_multiplier, m.logits_divisor) != (1.0, 0.0, 1.0, 1.0):
        return "granite"
    if m.nope_every:
        return "smollm3"
    if m.sliding_window:
        return "mistral"
    return "qwen2" if m.qkv_bias and not m.bias else "llama"


def _llama_problems(m: ModelConfig, family: str) -> list[str]:
    """What `family`'s class (a LLaMA-style one) cannot express of our model, field by field."""
    fam = registered_family(family)
    own_check = fam is not None and fam.checks is not None  # Gemma's: not LLaMA's fields
    if own_check or (fam is None and family not in LEGACY_EXPRESSES):
        return [f"model.family = {family!r} is not a LLaMA-style class (the fields are "
                f"LLaMA's: rmsnorm, rope, swiglu)"]
    if fam is not None:
        expresses, required, biased = fam.expresses, fam.required or fam.shape, fam.biased
    else:
        expresses = LEGACY_EXPRESSES[family]
        required, biased = LEGACY_REQUIRED.get(family, {}), family in LEGACY_BIASED
    problems = []
    for field, default in EXTRA_FIELDS.items():
        value, want = getattr(m, field), required.get(field)
        if want is not None and value != want:
            problems.append(f"model.{field} = {value!r} ({family}'s is {want!r})")
        elif want is None and value != default and field not in expresses:
            problems.append(f"model.{field} = {value!r} ({family} has none: {default!r})")
    if m.norm_offset:
        problems.append(f"model.norm_offset = true ({family}'s RMSNorm multiplies by w itself)")
    if m.bias and not biased:
        problems.append(f"model.bias = true ({family}'s linears have no biases on every one)")
    if fam is not None and fam.problems is not None:
        problems += fam.problems(m)
    if m.sliding_window and m.global_every and "global_every" not in expresses:
        problems.append(f"model.global_every = {m.global_every} ({family} slides every block: 0)")
    return problems


def _moe_family(m: ModelConfig, chosen: dict[str, str]) -> str:
    """'mixtral', 'qwen3_moe' or 'olmoe' (model.family, else by the q/k norms), or a ConfigError
    listing every field of this mixture of experts that the class cannot express, and why.
    The router's z-loss and the balancing loss only shape training: they need no counterpart
    (router_aux_loss_coef is recorded for a fine-tune of the export)."""
    implied = ("olmoe" if m.qk_norm_width == "all" else "qwen3_moe") if m.qk_norm else "mixtral"
    family = m.family or implied
    if family not in MOE_FAMILIES:
        raise ConfigError(f"cannot export this mixture-of-experts model (model.experts = "
                          f"{m.experts}) to transformers' {family} class (model.family): it has "
                          f"no experts; {', '.join(MOE_FAMILIES)} have")
    name = {"mixtral": "Mixtral", "qwen3_moe": "Qwen3-MoE", "olmoe": "OLMoE"}[family]
    problems = [f"model.{k} = {chosen[k]!r} ({name} is LLaMA-style: {k}={v!r})"
                for k, v in LLAMA_STYLE.items() if chosen[k] != v]
    if chosen == LLAMA_STYLE:  # the attention's fields (the biases: below)
        problems += _llama_problems(replace(m, bias=False), family)
    if m.bias:
        problems.append(f"model.bias = True ({name}'s linears have no biases)")
    if m.router != "softmax":
        problems.append(f"model.router = {m.router!r} ({name}'s router is a softmax over all "
                        f"experts)")
    if family == "mixtral" and not m.router_topk_norm:
        problems.append("model.router_topk_norm = false (Mixtral always renormalises the top k's "
                        "probabilities; Qwen3-MoE and OLMoE have norm_topk_prob)")
    if m.balance == "bias":
        problems.append(f"model.balance = 'bias' (the balancing bias changes which experts are "
                        f"chosen; {name} chooses on the router's probabilities alone)")
    if m.shared_experts:
        problems.append(f"model.shared_experts = {m.shared_experts} ({name} has no shared "
                        f"experts: every token goes through its top k only)")
    dense = sorted(set(range(m.n_layers)) - set(moe_layers(m)))
    if dense and family != "qwen3_moe":  # Qwen3-MoE's decoder_sparse_step is model.moe_every
        problems.append(f"model.moe_every = {m.moe_every} (blocks {dense} are dense; every "
                        f"{name} block is a mixture of experts; Qwen3-MoE has dense ones)")
    if m.capacity_factor > 0:
        problems.append(f"model.capacity_factor = {m.capacity_factor:g} ({name} is dropless: an "
                        f"expert takes every token routed to it; 0 maps)")
    if problems:
        cls = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
               "olmoe": "OlmoeForCausalLM"}[family]
        raise ConfigError(f"cannot export this mixture-of-experts model to transformers' "
                          f"{cls}{' (model.family)' if m.family else ''}: "
                          + "; ".join(problems))
    return family


@dataclass(frozen=True)
class HFSource:
    """Where one of our parameters lives in a transformers checkpoint."""

    names: tuple[str, ...]
    """The HF tensors, concatenated along our dimension 0 in this order."""
    rows: tuple[int, ...]
    """How many of our rows (dimension 0) each one gives."""
    transposed: bool = False
    """GPT-2's Conv1D: the HF weight is (in, out), ours (out, in)."""
    per_head: int = 0
    """GPT-NeoX's query_key_value: rows grouped by head, [q_h, k_h, v_h] for each of this many
    heads; ours are [all q, all k, all v] (0 = the same order as ours)."""
    experts: int = 0
    """A mixture's stacked weight (E, ...): `names` are this many experts' tensors in turn (each
    expert's `len(names) / experts` of them), which fill our dimension 1, `rows` each."""


def heads_first(ours: torch.Tensor, heads: int) -> torch.Tensor:
    """Our [all q, all k, all v] rows as GPT-NeoX's [q_h, k_h, v_h] per head (export)."""
    return ours.reshape(3, heads, -1, *ours.shape[1:]).transpose(0, 1).reshape(ours.shape).contiguous()


def parts_first(theirs: torch.Tensor, heads: int) -> torch.Tensor:
    """GPT-NeoX's per-head [q_h, k_h, v_h] rows as ours, [all q, all k, all v] (load)."""
    return theirs.reshape(heads, 3, -1, *theirs.shape[1:]).transpose(0, 1).reshape(theirs.shape).contiguous()


def hf_sources(m: ModelConfig, family: str) -> dict[str, HFSource]:
    """Our parameter name -> its HF source, for every dense parameter of a 'gpt2', 'llama' or
    LLaMA-style model of shape `m` (a mixture's router and experts: moe_sources). Biases are
    listed only where ours has them; GPT-2's, always present there, are export's to fill with
    zeros."""
    hd = head_dim(m)
    q, kv, d = m.n_heads * hd, (m.n_kv_heads or m.n_heads) * hd, m.d_model
    out: dict[str, HFSource] = {}

    def add(ours: str, names: list[str], rows: list[int], transposed: bool = False,
            biases: bool = True, per_head: int = 0) -> None:
        out[f"{ours}.weight"] = HFSource(tuple(f"{n}.weight" for n in names), tuple(rows), transposed, per_head)
        if biases:
            out[f"{ours}.bias"] = HFSource(tuple(f"{n}.bias" for n in names), tuple(rows), False, per_head)

    if family == "gpt_neox":  # every linear and LayerNorm with biases; q/k/v fused per head
        out["tok_emb.weight"] = HFSource(("gpt_neox.embed_in.weight",), (m.vocab_size,))
        ff = resolved_d_ff(m)
        for i in range(m.n_layers):
            h, b = f"gpt_neox.layers.{i}", f"blocks.{i}"
            add(f"{b}.attn_norm", [f"{h}.input_layernorm"], [d], biases=m.bias)
            add(f"{b}.mlp_norm", [f"{h}.post_attention_layernorm"], [d], biases=m.bias)
            add(f"{b}.attn.qkv", [f"{h}.attention.query_key_value"], [q + 2 * kv], biases=m.bias,
                per_head=m.n_heads)
            add(f"{b}.attn.proj", [f"{h}.attention.dense"], [d], biases=m.bias)
            add(f"{b}.mlp.fc", [f"{h}.mlp.dense_h_to_4h"], [ff], biases=m.bias)
            add(f"{b}.mlp.proj", [f"{h}.mlp.dense_4h_to_h"], [d], biases=m.bias)
        add("norm_f", ["gpt_neox.final_layer_norm"], [d], biases=m.bias)
        out["head.weight"] = HFSource(("embed_out.weight",), (m.vocab_size,))
        return out
    if family == "starcoder2":  # LLaMA's names for attention and norms (LayerNorms: biases too)
        out["tok_emb.weight"] = HFSource(("model.embed_tokens.weight",), (m.vocab_size,))
        ff = resolved_d_ff(m)
        for i in range(m.n_layers):
            h, b, attn = f"model.layers.{i}", f"blocks.{i}", f"model.layers.{i}.self_attn"
            add(f"{b}.attn_norm", [f"{h}.input_layernorm"], [d], biases=m.bias)
            add(f"{b}.mlp_norm", [f"{h}.post_attention_layernorm"], [d], biases=m.bias)
            add(f"{b}.attn.qkv", [f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"], [q, kv, kv],
                biases=m.bias)
            add(f"{b}.attn.proj", [f"{attn}.o_proj"], [d], biases=m.bias)
            add(f"{b}.mlp.fc", [f"{h}.mlp.c_fc"], [ff], biases=m.bias)
            add(f"{b}.mlp.proj", [f"{h}.mlp.c_proj"], [d], biases=m.bias)
        add("norm_f", ["model.norm"], [d], biases=m.bias)
    elif family == "gpt2":
        out["tok_emb.weight"] = HFSource(("transformer.wte.weight",), (m.vocab_size,))
        out["pos_emb.weight"] = HFSource(("transformer.wpe.weight",), (m.max_seq_len,))
        ff = resolved_d_ff(m)
        for i in range(m.n_layers):
            h, b = f"transformer.h.{i}", f"blocks.{i}"
            add(f"{b}.attn_norm", [f"{h}.ln_1"], [d], biases=m.bias)
            add(f"{b}.attn.qkv", [f"{h}.attn.c_attn"], [q + 2 * kv], True, m.bias)
            add(f"{b}.attn.proj", [f"{h}.attn.c_proj"], [d], True, m.bias)
            add(f"{b}.mlp_norm", [f"{h}.ln_2"], [d], biases=m.bias)
            add(f"{b}.mlp.fc", [f"{h}.mlp.c_fc"], [ff], True, m.bias)
            add(f"{b}.mlp.proj", [f"{h}.mlp.c_proj"], [d], True, m.bias)
        add("norm_f", ["transformer.ln_f"], [d], biases=m.bias)
    else:
        fam = registered_family(family)
        names = {**LLAMA_NAMES, **(fam.names if fam is not None else {})}
        out["tok_emb.weight"] = HFSource(("model.embed_tokens.weight",), (m.vocab_size,))
        ff = resolved_d_ff(m)
        norm_biases = m.norm == "layernorm" and (m.bias or m.norm_bias)  # StableLM's LayerNorms
        for i in range(m.n_layers):
            h, b = f"model.layers.{i}", f"blocks.{i}"
            if m.norm_placement == "post":  # OLMo-2: the norms after attention and the MLP
                add(f"{b}.attn_norm", [f"{h}.post_attention_layernorm"], [d], biases=False)
                add(f"{b}.mlp_norm", [f"{h}.post_feedforward_layernorm"], [d], biases=False)
            else:
                add(f"{b}.attn_norm", [f"{h}.input_layernorm"], [d], biases=norm_biases)
            if m.norm_placement == "sandwich":  # Gemma 2/3: post_attention_layernorm is a post-norm
                add(f"{b}.attn_post_norm", [f"{h}.post_attention_layernorm"], [d], biases=False)
                add(f"{b}.mlp_norm", [f"{h}.pre_feedforward_layernorm"], [d], biases=False)
                add(f"{b}.mlp_post_norm", [f"{h}.post_feedforward_layernorm"], [d], biases=False)
            elif m.norm_placement == "pre":
                add(f"{b}.mlp_norm", [f"{h}.post_attention_layernorm"], [d], biases=norm_biases)
            attn = f"{h}.self_attn"
            qkv = names["attn.qkv"]  # one tensor: already fused as ours (rows q, k, v)
            add(f"{b}.attn.qkv", [f"{h}.{n}" for n in qkv], [q + 2 * kv] if len(qkv) == 1 else [q, kv, kv],
                biases=m.bias or m.qkv_bias)
            add(f"{b}.attn.proj", [f"{attn}.o_proj"], [d], biases=m.bias)
            if m.qk_norm:  # per head (Qwen3, Gemma 3: head_dim) or whole (OLMo-2: q, kv widths)
                whole = m.qk_norm_width == "all"
                add(f"{b}.attn.q_norm", [f"{attn}.q_norm"], [q if whole else hd], biases=False)
                add(f"{b}.attn.k_norm", [f"{attn}.k_norm"], [kv if whole else hd], biases=False)
            if not is_moe_block(m, i):  # a mixture's experts: moe_sources
                gate_up = names["mlp.gate_up"]  # one tensor: rows gate, then up, as ours
                add(f"{b}.mlp.gate_up", [f"{h}.{n}" for n in gate_up],
                    [2 * ff] if len(gate_up) == 1 else [ff, ff], biases=m.bias)
                add(f"{b}.mlp.down", [f"{h}.mlp.down_proj"], [d], biases=m.bias)
        add("norm_f", ["model.norm"], [d], biases=norm_biases)
    # Tied: the head is the embedding and is never asked for by its own name. A tied HF
    # checkpoint holds no lm_head.weight; export writes one anyway (from_pretrained ties it).
    out["head.weight"] = HFSource(("lm_head.weight",), (m.vocab_size,))
    return out


def moe_sources(m: ModelConfig, family: str) -> dict[str, HFSource]:
    """Our router and experts' parameter names -> their tensors in a 'mixtral', 'qwen3_moe' or
    'olmoe' checkpoint's files (one tensor per expert: Mixtral's w1 (gate), w3 (up) and w2
    (down), the others' gate_proj, up_proj and down_proj); {} for a dense family. transformers 5
    holds them stacked as ours in memory (export's _moe_experts) and writes these names."""
    if family not in MOE_FAMILIES:
        return {}
    f, d, out = expert_d_ff(m), m.d_model, {}
    mixtral = family == "mixtral"
    for i in moe_layers(m):
        h = f"model.layers.{i}.{'block_sparse_moe' if mixtral else 'mlp'}"
        gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        out[f"blocks.{i}.mlp.router.weight"] = HFSource((f"{h}.gate.weight",), (m.experts,))
        each = range(m.experts)
        out[f"blocks.{i}.mlp.experts.gate_up"] = HFSource(
            tuple(f"{h}.experts.{e}.{n}.weight" for e in each for n in (gate, up)), (f, f) * m.experts,
            experts=m.experts)
        out[f"blocks.{i}.mlp.experts.down"] = HFSource(
            tuple(f"{h}.experts.{e}.{down}.weight" for e in each), (d,) * m.experts, experts=m.experts)
    return out


def loaded_family(m: ModelConfig) -> str:
    """'gpt2' or a LLaMA-style family: the table to load with (hf_shapes.hf_shape refused what
    none computes): model.family, else what the fields imply (the names depend on them: q/k
    norms, sandwich norms)."""
    if m.family:
        return m.family
    if m.mlp != "swiglu":  # GPT-2 (learned positions) or StarCoder2 (RoPE)
        return "gpt2" if m.position == "learned" else "starcoder2"
    return "qwen3" if m.qk_norm else "qwen2" if m.qkv_bias and not m.bias else "llama"


def hf_initializer(directory: str | Path, model: nn.Module, m: ModelConfig) -> Initializer:
    """model.hf_path as an Initializer for `model` (our Decoder of shape `m`, still whole): our
    parameter `name` -> its values read from the directory's safetensors (renamed, fused,
    transposed; fp32), so every layout the sharded build supports (ZeRO-3, tensor and pipeline
    parallelism) loads a checkpoint unchanged. A tensor the table names and the files lack, or
    one of another shape, is a ConfigError naming it and the directory."""
    reader = HFDirReader(directory)
    family = loaded_family(m)
    sources = {**hf_sources(m, family), **moe_sources(m, family)}
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}  # before any split

    def present(hf_name: str) -> None:
        if hf_name not in reader.files:
            raise HFDirError(f"model.hf_path {str(directory)!r} has no tensor {hf_name!r}, which "
                             f"our decoder needs: the checkpoint is incomplete, or not the "
                             f"architecture its config.json names")

    def read(hf_name: str, shape: tuple[int, ...]) -> torch.Tensor:
        present(hf_name)
        flat = torch.empty(math.prod(shape), dtype=torch.float32)
        reader.read_range(hf_name, shape, 0, flat.numel(), flat)
        return flat.view(shape)

    def initial_value(name: str) -> torch.Tensor:
        assert name in sources, f"{name} has no HF source (hf_shape admitted an unmapped model)"
        source, inner = sources[name], shapes[name][1:]
        if source.experts:  # each expert's tensors fill our dimension 1: (E·rows, ...) -> (E, rows, ...)
            inner = shapes[name][2:]
            whole = torch.cat([read(n, (rows, *inner)) for n, rows in zip(source.names, source.rows)])
            return whole.view(shapes[name])
        parts = []
        for hf_name, rows in zip(source.names, source.rows):
            if source.transposed:
                parts.append(read(hf_name, (*inner, rows)).t())
            else:
                parts.append(read(hf_name, (rows, *inner)))
        whole = torch.cat(parts)
        return parts_first(whole, source.per_head) if source.per_head else whole.contiguous()

    def piece(name: str, split) -> torch.Tensor:
        """A tensor- or expert-parallel rank's part (placement.Split) of parameter `name`, read
        as blocks of the HF tensors it spans — its own rows of a column-parallel weight, its
        own columns of a row-parallel one — never the whole tensor (issue 27: a 70B directory
        does not pass through every rank's memory). GPT-2's transposed Conv1D and GPT-NeoX's
        per-head rows are read whole and cut."""
        source, shape = sources[name], shapes[name]
        if source.experts and split.dim == 0:  # expert parallelism: only this rank's experts
            per = len(source.names) // source.experts
            inner = shape[2:]
            for hf_name in source.names:
                present(hf_name)
            return torch.stack([torch.cat([reader.read_block(n, (rows, *inner), 0, 0, rows) for n, rows in
                                           zip(source.names[e * per:(e + 1) * per],
                                               source.rows[e * per:(e + 1) * per])])
                                for lo, hi in split.ranges for e in range(lo, hi)]).contiguous()
        if source.transposed or source.per_head or source.experts or split.dim > 1:
            return split.take(initial_value(name))
        for hf_name in source.names:
            present(hf_name)
        blocks = []
        for lo, hi in split.ranges:
            if split.dim == 1:  # the same columns of every HF tensor, stacked as ours are
                blocks.append(torch.cat([reader.read_block(n, (rows, *shape[1:]), 1, lo, hi)
                                         for n, rows in zip(source.names, source.rows)]))
                continue
            start = 0  # our rows [lo, hi) from the HF tensors holding them
            for hf_name, rows in zip(source.names, source.rows):
                a, b = max(lo, start), min(hi, start + rows)
                if a < b:
                    blocks.append(reader.read_block(hf_name, (rows, *shape[1:]), 0, a - start, b - start))
                start += rows
        return torch.cat(blocks, dim=split.dim).contiguous()

    initial_value.piece = piece
    initial_value.reader = reader
    return initial_value
