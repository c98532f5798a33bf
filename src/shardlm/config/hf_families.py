"""A checkpoint's config.json read as our decoder's [model] keys, as transformers 5.x computes
its family (hf_shapes.py reads the file and dispatches here): LLaMA's reader, driven by each
registered family's record (config/families/: its own keys, norms, biases, sliding windows,
experts), with the RoPE scalings every family's reader shares (rope_shape). A family with a
reader of its own (GPT-2, StarCoder2, GPT-NeoX, StableLM) is read by it instead. What a family
sets that the decoder cannot compute is returned as a problem (the run then takes the
transformers path, or is refused). Plain data, no torch."""

from __future__ import annotations

import math
from typing import Any

from shardlm.config.families import Experts, Family, family, global_every


TRAINING_DEFAULTS = ("aux_loss_coef", "z_loss_coef")
"""[model] values hf_shape reads from config.json as the run's defaults only: they shape
training, not the network (the balancing losses change no logits), so [model] may set others."""


SCALED_ROPE = ("linear", "dynamic", "yarn", "llama3")
"""transformers rope types (ROPE_INIT_FUNCTIONS) our decoder computes: model.rope_type."""


TRAIN_ANY_MODEL = ("a transformers model can still be trained as it is through the Python API: "
                   "build_run(cfg, model=AutoModelForCausalLM.from_pretrained(DIR))")


def read_llama_like(hf: dict[str, Any], kind: str, shape: dict[str, Any], rope: dict[str, Any],
                    key: Any, problems: list[str], exact: bool) -> None:
    """The RMSNorm + RoPE + gated-MLP families into `shape`: LLaMA's keys, then each family's
    own as its record says (config/families/: Qwen's biases and norms, OLMo-2's placement,
    Gemma's, Granite's multipliers, SmolLM3's NoPE blocks, a mixture's experts, sliding windows,
    head_dim, RoPE scaling); a model_type without a record (OLMo 1, sized only) reads as LLaMA;
    `key` reads a required key."""
    heads, fam = shape["n_heads"], family(kind)
    attention_bias, mlp_bias = bool(hf.get("attention_bias")), bool(hf.get("mlp_bias"))
    if fam is not None:
        shape.update(fam.shape)
        if fam.prepare is not None:
            rope = fam.prepare(hf, shape, rope, problems)
        attention_bias = _family_bias(fam, attention_bias, mlp_bias, problems)
    elif attention_bias != mlp_bias:
        problems.append(f"attention_bias = {attention_bias} with mlp_bias = {mlp_bias} (our "
                        f"model.bias puts biases on every linear or none)")
    shape.update(n_kv_heads=int(key("num_key_value_heads", default=heads)),
                 d_ff=int(key("intermediate_size")), norm="rmsnorm", position="rope",
                 mlp="swiglu", bias=attention_bias,
                 tie_embeddings=bool(key("tie_word_embeddings", default=fam is not None and fam.tied)),
                 norm_eps=float(key("rms_norm_eps", default=1e-6)),
                 rope_theta=float(key("rope_theta", default=rope.get("rope_theta", 10000.0))))
    if fam is not None and fam.experts is not None:
        _experts_shape(hf, kind, fam.experts, shape, problems)
    window = hf.get("sliding_window")
    windows = fam.windows if fam is not None else "cap"
    if windows == "every" and window:  # every block slides: the window as a mask
        shape.update(sliding_window=int(window), global_every=0)
    elif windows in ("qwen", "flagged"):
        _qwen_windows(hf, windows == "flagged", shape, exact)
    elif windows == "cap" and exact and window and hf.get("use_sliding_window", True):
        # Qwen2/3's windows sit on the layers past max_window_layers: identical to full
        # attention on sequences no longer than the window, so the context is capped there.
        shape["max_seq_len"] = min(shape["max_seq_len"], int(window))
    if hf.get("hidden_act", "silu") != "silu" and (fam is None or fam.silu):
        problems.append(f"hidden_act = {hf['hidden_act']!r} (ours is 'silu')")
    head_dim = hf.get("head_dim")
    if head_dim and head_dim != shape["d_model"] // heads:
        if fam is not None and not fam.has_head_dim:  # no head_dim key: an export could not write it
            problems.append(f"head_dim = {head_dim} ({kind}'s is hidden_size / "
                            f"num_attention_heads = {shape['d_model'] // heads})")
        shape["head_dim"] = int(head_dim)
    if fam is not None and fam.read is not None:  # the family's own keys
        fam.read(hf, shape, problems)
    max_positions = int(key("max_position_embeddings"))
    partial = fam is not None and fam.partial_rotary
    shape.update(rope_shape(hf, rope, max_positions, problems, partial))
    if shape.get("rope_type") == "dynamic" and shape["max_seq_len"] != max_positions:
        problems.append(f"rope scaling 'dynamic' with the context capped at the sliding window "
                        f"({shape['max_seq_len']}): its base depends on max_position_embeddings "
                        f"({max_positions})")


def _family_bias(fam: Family, attention_bias: bool, mlp_bias: bool, problems: list[str]) -> bool:
    """A registered family's config.json attention_bias / mlp_bias as model.bias (Family.attention_bias)."""
    if fam.attention_bias == "refused":
        if attention_bias:
            problems.append(f"attention_bias = True ({fam.title or fam.name}'s biases on q/k/v/o only; our "
                            f"model.bias also puts them on the MLP)")
        return False
    if fam.attention_bias == "linears" and attention_bias != mlp_bias:
        problems.append(f"attention_bias = {attention_bias} with mlp_bias = {mlp_bias} (our "
                        f"model.bias puts biases on every linear or none)")
    return attention_bias


def _experts_shape(hf: dict[str, Any], kind: str, experts: Experts, shape: dict[str, Any],
                   problems: list[str]) -> None:
    """A mixture's experts into `shape` (models/moe.py; Family.experts says where its config.json
    keeps them): a softmax router choosing num_experts_per_tok of the experts (renormalised over
    them where norm_topk_prob, or always), every block sparse unless the family has dense ones,
    dropless, no shared experts. The balancing loss is router_aux_loss_coef's (it shapes
    training, not the logits); none of these families has a router z-loss."""
    count = hf.get(experts.count_key)
    count = count if count is not None else hf.get("num_local_experts", hf.get("num_experts"))
    if not count:
        problems.append(f"num_experts = {count!r} (a {kind} checkpoint without experts)")
        return
    width = hf.get(experts.width_key)
    shape.update(experts=int(count), top_k=int(hf.get("num_experts_per_tok", 2)),
                 expert_d_ff=int(width or shape["d_ff"]), shared_experts=0, capacity_factor=0.0,
                 router="softmax", balance="aux", z_loss_coef=0.0,
                 aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0) or 0.0),
                 router_topk_norm=experts.renormalised or bool(hf.get("norm_topk_prob", False)))
    if hf.get("router_jitter_noise"):  # Mixtral's training-time noise on the router's input
        problems.append(f"router_jitter_noise = {hf['router_jitter_noise']} (our router adds no "
                        f"noise; 0 maps)")
    if experts.read is not None:
        experts.read(hf, shape, problems)


def _qwen_windows(hf: dict[str, Any], every_block: bool, shape: dict[str, Any], exact: bool) -> None:
    """Qwen2's, Qwen3's and Qwen3-MoE's sliding windows as transformers' configs compute them
    (5.24): a window only with use_sliding_window (default false); Qwen2/3 slide the blocks
    layer_types names (by default those from max_window_layers, 28, on), Qwen3-MoE
    (`every_block`, Family.windows 'flagged') every block.
    Every block, or all but each n-th: the window as a mask (model.global_every); another
    pattern (full blocks first): the context capped at the window, where both agree."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    if not window:
        return
    n = shape["n_layers"]
    if every_block:
        sliding = [True] * n
    else:
        first = int(hf.get("max_window_layers", 28))
        types = hf.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                          for i in range(n)]
        sliding = [t == "sliding_attention" for t in types]
    every = global_every(sliding)
    if every is not None and any(sliding):
        shape.update(sliding_window=int(window), global_every=every)
    elif exact and any(sliding):
        shape["max_seq_len"] = min(shape["max_seq_len"], int(window))


def rope_shape(hf: dict[str, Any], rope: dict[str, Any], max_positions: int,
               problems: list[str], partial_ok: bool = False) -> dict[str, Any]:
    """config.json's RoPE scaling (transformers 5's rope_parameters or 4's rope_scaling) as
    model.rope_* values, read as transformers' ROPE_INIT_FUNCTIONS read them (their defaults
    included); what our decoder cannot compute goes to `problems`, naming the key."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    partial = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    fraction = {"rope_fraction": partial} if partial != 1.0 else {}
    if partial != 1.0 and not partial_ok:  # its transformers class would rotate the whole head
        problems.append(f"partial_rotary_factor = {partial} (this family's transformers code "
                        f"rotates the whole head)")
    if rope_type == "default":
        return fraction
    if rope_type not in SCALED_ROPE:
        problems.append(f"rope scaling {rope_type!r} (ours: default, {', '.join(SCALED_ROPE)})")
        return {}
    # transformers prefers a top-level original_max_position_embeddings (Phi-3's), then the
    # rope dict's, then max_position_embeddings
    original = int(hf.get("original_max_position_embeddings")
                   or rope.get("original_max_position_embeddings") or max_positions)
    factor = rope.get("factor")
    if factor is None and rope_type == "yarn":  # DeepSeek-V3's convention
        factor = max_positions / original
    if factor is None:
        problems.append(f"rope scaling {rope_type!r} without a 'factor'")
        return {}
    out: dict[str, Any] = {"rope_type": rope_type, "rope_factor": float(factor), **fraction}
    if rope_type == "llama3":
        missing = [k for k in ("low_freq_factor", "high_freq_factor") if rope.get(k) is None]
        if missing:
            problems.append(f"rope scaling 'llama3' without {' and '.join(missing)}")
            return {}
        out.update(rope_original_max_seq_len=original,
                   rope_low_freq_factor=float(rope["low_freq_factor"]),
                   rope_high_freq_factor=float(rope["high_freq_factor"]))
    if rope_type == "yarn":
        out.update(rope_original_max_seq_len=original,
                   rope_beta_fast=float(rope.get("beta_fast") or 32),
                   rope_beta_slow=float(rope.get("beta_slow") or 1),
                   rope_truncate=bool(rope.get("truncate", True)))
        attention_factor = rope.get("attention_factor")
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if attention_factor is None and mscale and mscale_all_dim:  # DeepSeek's ratio of scales

            def scale(m: float) -> float:
                return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
            attention_factor = float(scale(mscale) / scale(mscale_all_dim))
        if attention_factor is not None:
            out["rope_attention_factor"] = float(attention_factor)
    return out
