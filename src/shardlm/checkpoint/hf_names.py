"""Our decoder's parameters <-> a transformers checkpoint's tensors, as a table: `hf_initializer`
reads a local HF directory into our initial values (model.hf_path); `export.hf_state_dict` writes
ours out through the same table (the experts of a mixture are its own business). `hf_family`
says which transformers class (if any) expresses a model of ours; export and the PEFT adapter
format (peft_adapter.py) both ask it. Everything a family has of its own is its record in
config/families/ (Family: its names, style, the fields it expresses, its experts); the code here
reads records, never a family's name.

Each of our parameters is one or more HF tensors concatenated along our first dimension:
`attn.qkv` is q_proj, k_proj, v_proj (rows q, then k, then v — GPT-2's c_attn is already fused);
SwiGLU's `mlp.gate_up` is gate_proj then up_proj. GPT-2's Conv1D stores its weight as (in, out),
the transpose of nn.Linear's (Family.transposed); GPT-NeoX groups q/k/v rows by head
(Family.per_head). A mixture's router and experts (Mixtral, Qwen3-MoE, OLMoE) are
`moe_sources`: one file tensor per expert, stacked along our first dimension.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from shardlm.checkpoint.hf_dir import HFDirError, HFDirReader
from shardlm.config.model import ModelConfig
from shardlm.config.families import Family, registered
from shardlm.config.families import family as registered_family
from shardlm.errors import ConfigError
from shardlm.models.flops import expert_d_ff, head_dim, is_moe_block, moe_layers, resolved_d_ff
from shardlm.models.init import Initializer


STYLE = ("norm", "position", "mlp")
"""The fields a family's style fixes (Family.style)."""
GPT2_STYLE = {"norm": "layernorm", "position": "learned", "mlp": "gelu"}
LLAMA_STYLE = {"norm": "rmsnorm", "position": "rope", "mlp": "swiglu"}


# The fields beyond the common core, with their defaults: a family's class has a key for those
# in its Family.expresses (or fixes them: Family.required); Gemma's check is its own.
EXTRA_FIELDS = {"head_dim": 0, "qkv_bias": False, "qk_norm": False, "qk_norm_width": "head",
                "norm_placement": "pre", "activation": "auto", "embedding_multiplier": 1.0,
                "attention_scale": 0.0, "residual_multiplier": 1.0, "logits_divisor": 1.0,
                "attn_softcap": 0.0, "logit_softcap": 0.0, "sliding_window": 0, "global_every": 0,
                "rope_local_theta": 0.0, "nope_every": 0, "parallel_residual": False,
                "rope_fraction": 1.0, "norm_bias": False}
LLAMA_NAMES = {"tok_emb": ("model.embed_tokens",), "blocks": ("model.layers",), "norm_f": ("model.norm",),
               "head": ("lm_head",), "attn_norm": ("input_layernorm",),
               "mlp_norm": ("post_attention_layernorm",),
               "attn.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
               "attn.proj": ("self_attn.o_proj",), "attn.q_norm": ("self_attn.q_norm",),
               "attn.k_norm": ("self_attn.k_norm",), "mlp.gate_up": ("mlp.gate_proj", "mlp.up_proj"),
               "mlp.down": ("mlp.down_proj",),
               # OLMo-2's norms after attention and the MLP; Gemma 2/3's sandwich around both
               "post:attn_norm": ("post_attention_layernorm",),
               "post:mlp_norm": ("post_feedforward_layernorm",),
               "sandwich:attn_post_norm": ("post_attention_layernorm",),
               "sandwich:mlp_norm": ("pre_feedforward_layernorm",),
               "sandwich:mlp_post_norm": ("post_feedforward_layernorm",)}
"""Our modules -> LLaMA's (Family.names says what a family renames)."""
BLOCK_NORMS = {"pre": ("attn_norm", "mlp_norm"), "post": ("attn_norm", "mlp_norm"),
               "sandwich": ("attn_norm", "attn_post_norm", "mlp_norm", "mlp_post_norm")}
"""Each model.norm_placement's norms in a block."""


def hf_family(m: ModelConfig) -> str:
    """The transformers model_type that computes exactly our model: model.family (a loaded
    checkpoint's own, so export writes it back), else the class the fields imply
    (implied_family). A ConfigError names every field the class cannot express."""
    chosen = {k: getattr(m, k) for k in STYLE}
    if m.experts:
        return _moe_family(m, chosen)
    family = m.family or implied_family(m)
    if not family:
        def describe(style: dict[str, str]) -> str:
            return ", ".join(f"{k}={v!r}" for k, v in style.items())

        off_gpt2 = [f"model.{k} = {chosen[k]!r}" for k in GPT2_STYLE if chosen[k] != GPT2_STYLE[k]]
        off_llama = [f"model.{k} = {chosen[k]!r}" for k in LLAMA_STYLE if chosen[k] != LLAMA_STYLE[k]]
        raise ConfigError(f"cannot export this model to transformers: GPT2LMHeadModel needs "
                          f"{describe(GPT2_STYLE)} (not {', '.join(off_gpt2)}) and LlamaForCausalLM "
                          f"needs {describe(LLAMA_STYLE)} (not {', '.join(off_llama)})")
    fam = registered_family(family)
    problems = _style_problems(m, fam, chosen, "")
    if not problems:
        problems = fam.checks(m) if fam.checks is not None else _field_problems(m, fam)
    if problems:
        raise ConfigError(f"cannot export this model to transformers' {family} class"
                          f"{' (model.family)' if m.family else ''}: " + "; ".join(problems))
    return family


def implied_family(m: ModelConfig) -> str:
    """The family a model of ours without model.family is most naturally, or '' where no
    registered family has its style (model.norm, position, mlp) and experts or none: of those
    that do, the last registered whose Family.implied holds (a later family is the more
    specific: Gemma 3 over Gemma, GPT-NeoX over StarCoder2, OLMoE over Mixtral), else the first
    registered (the style's base: Llama, GPT-2, StarCoder2, StableLM, Mixtral). A model that
    mixes several families' fields is refused by the chosen one's check."""
    chosen = {k: getattr(m, k) for k in STYLE}
    styled = [f for f in registered().values() if (f.experts is not None) == bool(m.experts)
              and (m.experts or dict(zip(STYLE, f.style)) == chosen)]
    if not styled:
        return ""
    return next((f.name for f in reversed(styled) if f.implied is not None and f.implied(m)),
                styled[0].name)


def _style_problems(m: ModelConfig, fam: Family, chosen: dict[str, str], title: str) -> list[str]:
    """Our style's fields `fam`'s class does not compute (model.family names another style)."""
    want = dict(zip(STYLE, fam.style))
    if title:
        return [f"model.{k} = {chosen[k]!r} ({title} is LLaMA-style: {k}={v!r})"
                for k, v in want.items() if chosen[k] != v]
    return [f"model.{k} = {chosen[k]!r} ({fam.name}'s is {v!r})" for k, v in want.items() if chosen[k] != v]


def _field_problems(m: ModelConfig, fam: Family) -> list[str]:
    """What `fam`'s class cannot express of our model, field by field (Family.expresses,
    required, biased, problems)."""
    family, expresses, biased = fam.name, fam.expresses, fam.biased
    required = fam.required or fam.shape
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
    if fam.problems is not None:
        problems += fam.problems(m)
    if m.sliding_window and m.global_every and "global_every" not in expresses:
        problems.append(f"model.global_every = {m.global_every} ({family} slides every block: 0)")
    return problems


def _moe_family(m: ModelConfig, chosen: dict[str, str]) -> str:
    """A mixture-of-experts family (model.family, else by Family.implied: the q/k norms), or a
    ConfigError listing every field of this mixture of experts that the class cannot express,
    and why. The router's z-loss and the balancing loss only shape training: they need no
    counterpart (router_aux_loss_coef is recorded for a fine-tune of the export)."""
    mixtures = [f for f in registered().values() if f.experts is not None]
    family = m.family or implied_family(m)
    fam = registered_family(family)
    if fam is None or fam.experts is None:
        raise ConfigError(f"cannot export this mixture-of-experts model (model.experts = "
                          f"{m.experts}) to transformers' {family} class (model.family): it has "
                          f"no experts; {', '.join(f.name for f in mixtures)} have")
    name, experts = fam.title or fam.name, fam.experts
    problems = _style_problems(m, fam, chosen, name)
    if not problems:  # the attention's fields (the biases: below)
        problems += _field_problems(replace(m, bias=False), fam)
    if m.bias:
        problems.append(f"model.bias = True ({name}'s linears have no biases)")
    if m.router != "softmax":
        problems.append(f"model.router = {m.router!r} ({name}'s router is a softmax over all "
                        f"experts)")
    if experts.renormalised and not m.router_topk_norm:
        problems.append(f"model.router_topk_norm = false ({name} always renormalises the top k's "
                        f"probabilities)")
    if m.balance == "bias":
        problems.append(f"model.balance = 'bias' (the balancing bias changes which experts are "
                        f"chosen; {name} chooses on the router's probabilities alone)")
    if m.shared_experts:
        problems.append(f"model.shared_experts = {m.shared_experts} ({name} has no shared "
                        f"experts: every token goes through its top k only)")
    dense = sorted(set(range(m.n_layers)) - set(moe_layers(m)))
    if dense and not experts.dense_blocks:  # Qwen3-MoE's decoder_sparse_step is model.moe_every
        with_dense = [f.title or f.name for f in mixtures if f.experts.dense_blocks]
        problems.append(f"model.moe_every = {m.moe_every} (blocks {dense} are dense; every "
                        f"{name} block is a mixture of experts"
                        + (f"; {', '.join(with_dense)} has dense ones)" if with_dense else ")"))
    if m.capacity_factor > 0:
        problems.append(f"model.capacity_factor = {m.capacity_factor:g} ({name} is dropless: an "
                        f"expert takes every token routed to it; 0 maps)")
    if problems:
        raise ConfigError(f"cannot export this mixture-of-experts model to transformers' "
                          f"{fam.model_class}{' (model.family)' if m.family else ''}: "
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
    """Our parameter name -> its HF source, for every dense parameter of a model of shape `m` in
    `family`'s checkpoints (LLAMA_NAMES renamed by its Family.names; a mixture's router and
    experts: moe_sources). Biases are listed only where ours has them; a class with biases
    everywhere (Family.zero_biases: GPT-2) has the others filled with zeros by export."""
    fam = registered_family(family)
    names = {**LLAMA_NAMES, **fam.names}
    hd = head_dim(m)
    q, kv, d, ff = m.n_heads * hd, (m.n_kv_heads or m.n_heads) * hd, m.d_model, resolved_d_ff(m)
    norm_biases = m.norm == "layernorm" and (m.bias or m.norm_bias)  # StableLM's: norms only
    out: dict[str, HFSource] = {}

    def add(ours: str, hf: list[str], rows: list[int], biases: bool, part: str = "") -> None:
        per_head = m.n_heads if part in fam.per_head else 0
        out[f"{ours}.weight"] = HFSource(tuple(f"{n}.weight" for n in hf), tuple(rows),
                                         part in fam.transposed, per_head)
        if biases:
            out[f"{ours}.bias"] = HFSource(tuple(f"{n}.bias" for n in hf), tuple(rows), False, per_head)

    def add_part(i: int, part: str, rows: list[int], biases: bool) -> None:
        """Block i's `part`: its HF tensors split `rows` (one fused tensor: their sum)."""
        hf = [f"{names['blocks'][0]}.{i}.{n}" for n in names[part]]
        add(f"blocks.{i}.{part}", hf, rows if len(hf) == len(rows) else [sum(rows)], biases, part)

    out["tok_emb.weight"] = HFSource((f"{names['tok_emb'][0]}.weight",), (m.vocab_size,))
    if m.position == "learned":
        out["pos_emb.weight"] = HFSource((f"{names['pos_emb'][0]}.weight",), (m.max_seq_len,))
    placement = m.norm_placement
    for i in range(m.n_layers):
        for norm in BLOCK_NORMS[placement]:
            renamed = f"{placement}:{norm}" in names  # a post- or sandwich-norm: an RMSNorm's
            hf = [f"{names['blocks'][0]}.{i}.{n}" for n in names[f"{placement}:{norm}" if renamed else norm]]
            add(f"blocks.{i}.{norm}", hf, [d], norm_biases and not renamed)
        add_part(i, "attn.qkv", [q, kv, kv], m.bias or m.qkv_bias)
        add_part(i, "attn.proj", [d], m.bias)
        if m.qk_norm:  # per head (Qwen3, Gemma 3: head_dim) or whole (OLMo-2: q, kv widths)
            whole = m.qk_norm_width == "all"
            add_part(i, "attn.q_norm", [q if whole else hd], False)
            add_part(i, "attn.k_norm", [kv if whole else hd], False)
        if is_moe_block(m, i):  # a mixture's experts: moe_sources
            continue
        if m.mlp == "swiglu":  # gate_up: rows gate, then up, as ours
            add_part(i, "mlp.gate_up", [ff, ff], m.bias)
            add_part(i, "mlp.down", [d], m.bias)
        else:
            add_part(i, "mlp.fc", [ff], m.bias)
            add_part(i, "mlp.proj", [d], m.bias)
    add("norm_f", list(names["norm_f"]), [d], norm_biases)
    # Tied: the head is the embedding and is never asked for by its own name. A tied HF
    # checkpoint holds no lm_head.weight; export writes one anyway (from_pretrained ties it).
    out["head.weight"] = HFSource((f"{names['head'][0]}.weight",), (m.vocab_size,))
    return out


def moe_sources(m: ModelConfig, family: str) -> dict[str, HFSource]:
    """Our router and experts' parameter names -> their tensors in a mixture's checkpoint files
    (Family.experts: one tensor per expert, e.g. Mixtral's block_sparse_moe.experts.{e}.w1 (gate),
    w3 (up) and w2 (down), the others' mlp.experts.{e}.gate_proj, up_proj and down_proj); {} for
    a dense family. transformers 5 holds them stacked as ours in memory (export's _moe_experts)
    and writes these names."""
    experts = registered_family(family).experts
    if experts is None:
        return {}
    f, d, out = expert_d_ff(m), m.d_model, {}
    gate, up, down = experts.weights
    for i in moe_layers(m):
        h = f"model.layers.{i}.{experts.module}"
        out[f"blocks.{i}.mlp.router.weight"] = HFSource((f"{h}.gate.weight",), (m.experts,))
        each = range(m.experts)
        out[f"blocks.{i}.mlp.experts.gate_up"] = HFSource(
            tuple(f"{h}.experts.{e}.{n}.weight" for e in each for n in (gate, up)), (f, f) * m.experts,
            experts=m.experts)
        out[f"blocks.{i}.mlp.experts.down"] = HFSource(
            tuple(f"{h}.experts.{e}.{down}.weight" for e in each), (d,) * m.experts, experts=m.experts)
    return out


def loaded_family(m: ModelConfig) -> str:
    """The family whose table loads a checkpoint: model.family (hf_shapes.hf_shape sets it to
    config.json's model_type, and refused what no family computes), else the one the fields
    imply (implied_family)."""
    family = m.family or implied_family(m)
    assert family, f"no family's table holds a model of style {m.norm}/{m.position}/{m.mlp}"
    return family


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
