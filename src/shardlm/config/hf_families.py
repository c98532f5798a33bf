"""A checkpoint's config.json read as our decoder's [model] keys, as transformers 5.x computes
its family (hf_shapes.py reads the file and dispatches here): the LLaMA-like reader, driven by
each registered family's record (config/families/: Llama, Mistral, Qwen2/3, Phi-3, OLMo-2,
Granite, SmolLM3, Gemma 1/2/3), with RoPE scalings and Qwen's sliding windows; and the families
not yet moved into a file: StarCoder2, GPT-NeoX, StableLM and the mixtures (Mixtral, Qwen3-MoE,
OLMoE). What a family sets that the decoder cannot compute is returned as a problem (the run then
takes the transformers path, or is refused). Plain data, no torch."""

from __future__ import annotations

import math
from typing import Any

from shardlm.config.families import Family, family, global_every


MOE_FAMILIES = ("mixtral", "qwen3_moe", "olmoe")
"""LLaMA-style mixtures of experts (hf_shape's _moe_shape): softmax routers over SwiGLU experts."""


TRAINING_DEFAULTS = ("aux_loss_coef", "z_loss_coef")
"""[model] values hf_shape reads from config.json as the run's defaults only: they shape
training, not the network (the balancing losses change no logits), so [model] may set others."""


PARTIAL_ROTARY = ("gpt_neox", "stablelm")
"""Legacy families whose transformers code rotates only partial_rotary_factor of each head (a
registered family says so itself: Family.partial_rotary); the others ignore the key, so a
checkpoint that sets it is refused."""


SCALED_ROPE = ("linear", "dynamic", "yarn", "llama3")
"""transformers rope types (ROPE_INIT_FUNCTIONS) our decoder computes: model.rope_type."""


TRAIN_ANY_MODEL = ("a transformers model can still be trained as it is through the Python API: "
                   "build_run(cfg, model=AutoModelForCausalLM.from_pretrained(DIR))")


def _llama_like_shape(hf: dict[str, Any], kind: str, shape: dict[str, Any], rope: dict[str, Any],
                      key: Any, problems: list[str], exact: bool) -> None:
    """The RMSNorm + RoPE + gated-MLP families into `shape`: LLaMA's keys, then each family's
    own (Qwen's biases and norms, OLMo-2's placement, Gemma's, Granite's multipliers, SmolLM3's
    NoPE blocks, sliding windows, head_dim, RoPE scaling); `key` reads a required key."""
    heads, fam = shape["n_heads"], family(kind)
    attention_bias, mlp_bias = bool(hf.get("attention_bias")), bool(hf.get("mlp_bias"))
    if fam is not None:
        shape.update(fam.shape)
        if fam.prepare is not None:
            rope = fam.prepare(hf, shape, rope, problems)
        attention_bias = _family_bias(fam, attention_bias, mlp_bias, problems)
    elif kind == "qwen3_moe":  # an RMSNorm on each query and key head; attention_bias: on q/k/v/o
        shape["qk_norm"] = True
        if attention_bias:
            problems.append(f"attention_bias = True ({kind}'s biases on q/k/v/o only; our "
                            "model.bias also puts them on the MLP)")
        attention_bias = False
    elif kind == "olmoe":  # q/k norms over whole projections
        shape.update(qk_norm=True, qk_norm_width="all")
        if attention_bias:
            problems.append(f"attention_bias = True ({kind}'s biases on q/k/v/o only; our "
                            f"model.bias also puts them on the MLP)")
        attention_bias = False
    elif attention_bias != mlp_bias:
        problems.append(f"attention_bias = {attention_bias} with mlp_bias = {mlp_bias} (our "
                        f"model.bias puts biases on every linear or none)")
    shape.update(n_kv_heads=int(key("num_key_value_heads", default=heads)),
                 d_ff=int(key("intermediate_size")), norm="rmsnorm", position="rope",
                 mlp="swiglu", bias=attention_bias,
                 tie_embeddings=bool(key("tie_word_embeddings", default=fam is not None and fam.tied)),
                 norm_eps=float(key("rms_norm_eps", default=1e-6)),
                 rope_theta=float(key("rope_theta", default=rope.get("rope_theta", 10000.0))))
    if kind in MOE_FAMILIES:
        _moe_shape(hf, kind, shape, problems)
    window = hf.get("sliding_window")
    windows = fam.windows if fam is not None else {"mixtral": "every", "qwen3_moe": "qwen"}.get(kind, "cap")
    if windows == "every" and window:  # every block slides: the window as a mask
        shape.update(sliding_window=int(window), global_every=0)
    elif windows == "qwen":
        _qwen_windows(hf, kind, shape, exact)
    elif windows == "cap" and exact and window and hf.get("use_sliding_window", True):
        # Qwen2/3's windows sit on the layers past max_window_layers: identical to full
        # attention on sequences no longer than the window, so the context is capped there.
        shape["max_seq_len"] = min(shape["max_seq_len"], int(window))
    if hf.get("hidden_act", "silu") != "silu" and (fam is None or fam.silu):
        problems.append(f"hidden_act = {hf['hidden_act']!r} (ours is 'silu')")
    head_dim = hf.get("head_dim")
    if head_dim and head_dim != shape["d_model"] // heads:
        no_key = not fam.has_head_dim if fam is not None else kind == "olmoe"
        if no_key:  # no head_dim in their configs: an export could not write it back
            problems.append(f"head_dim = {head_dim} ({kind}'s is hidden_size / "
                            f"num_attention_heads = {shape['d_model'] // heads})")
        shape["head_dim"] = int(head_dim)
    if fam is not None and fam.read is not None:  # the family's own keys
        fam.read(hf, shape, problems)
    max_positions = int(key("max_position_embeddings"))
    partial = fam.partial_rotary if fam is not None else kind in PARTIAL_ROTARY
    shape.update(_rope_shape(hf, rope, max_positions, problems, partial))
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


def _starcoder2_shape(hf: dict[str, Any], shape: dict[str, Any], rope: dict[str, Any],
                      problems: list[str]) -> None:
    """StarCoder2: GPT-2's LayerNorm (with biases) and GELU MLP (c_fc, c_proj) with LLaMA's RoPE
    and grouped-query attention, biases on every linear, a sliding window on every block."""
    shape.update(n_kv_heads=int(hf.get("num_key_value_heads") or shape["n_heads"]),
                 d_ff=int(hf["intermediate_size"]), norm="layernorm", position="rope", mlp="gelu",
                 bias=True, tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
                 norm_eps=float(hf.get("norm_epsilon", 1e-5)),
                 rope_theta=float(hf.get("rope_theta") or rope.get("rope_theta", 10000.0)))
    if not hf.get("use_bias", True):  # its LayerNorms keep their biases; ours follow model.bias
        problems.append("use_bias = False (StarCoder2's LayerNorms keep biases; ours would not)")
    if hf.get("hidden_act", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_new"):
        problems.append(f"hidden_act = {hf['hidden_act']!r} (ours is GELU's tanh form)")
    if hf.get("sliding_window"):  # a mask on every block
        shape.update(sliding_window=int(hf["sliding_window"]), global_every=0)
    shape.update(_rope_shape(hf, rope, shape["max_seq_len"], problems))


def _neox_shape(hf: dict[str, Any], shape: dict[str, Any], rope: dict[str, Any],
                problems: list[str]) -> None:
    """GPT-NeoX (Pythia): LayerNorms and linears with biases, exact GELU, a parallel residual,
    partial rotary (rotary_pct), q/k/v fused per head (the name table reorders them)."""
    rope = dict(rope)
    rope.setdefault("rope_theta", hf.get("rotary_emb_base", 10000.0))  # transformers 4's keys
    rope.setdefault("partial_rotary_factor", hf.get("rotary_pct", 0.25))
    shape.update(n_kv_heads=0, d_ff=int(hf["intermediate_size"]), norm="layernorm", position="rope",
                 mlp="gelu", bias=True, tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                 norm_eps=float(hf.get("layer_norm_eps", 1e-5)), rope_theta=float(rope["rope_theta"]),
                 parallel_residual=bool(hf.get("use_parallel_residual", True)))
    act = hf.get("hidden_act", "gelu")
    if act not in ("gelu", "gelu_pytorch_tanh"):
        problems.append(f"hidden_act = {act!r} (ours: 'gelu' or 'gelu_pytorch_tanh')")
    shape["activation"] = "gelu" if act == "gelu" else "auto"
    if not hf.get("attention_bias", True):  # its MLP keeps biases; ours would drop them
        problems.append("attention_bias = False (GPT-NeoX's MLP keeps biases; ours would not)")
    shape.update(_rope_shape(hf, rope, shape["max_seq_len"], problems, partial_ok=True))


def _stablelm_shape(hf: dict[str, Any], shape: dict[str, Any], rope: dict[str, Any],
                    problems: list[str]) -> None:
    """StableLM: LLaMA's attention and SwiGLU MLP under LayerNorms with biases, biases on q/k/v
    (use_qkv_bias), partial rotary."""
    rope = dict(rope)
    rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    rope.setdefault("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    shape.update(n_kv_heads=int(hf.get("num_key_value_heads") or shape["n_heads"]),
                 d_ff=int(hf["intermediate_size"]), norm="layernorm", position="rope", mlp="swiglu",
                 bias=False, norm_bias=True, qkv_bias=bool(hf.get("use_qkv_bias", False)),
                 tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                 norm_eps=float(hf.get("layer_norm_eps", 1e-5)), rope_theta=float(rope["rope_theta"]))
    for flag in ("qk_layernorm", "use_parallel_residual"):
        if hf.get(flag):  # per-head LayerNorms of their own; one norm shared by attention and MLP
            problems.append(f"{flag} = True (not mapped onto our decoder yet)")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act = {hf['hidden_act']!r} (ours is 'silu')")
    shape.update(_rope_shape(hf, rope, shape["max_seq_len"], problems, partial_ok=True))


def _moe_shape(hf: dict[str, Any], kind: str, shape: dict[str, Any], problems: list[str]) -> None:
    """Mixtral's, Qwen3-MoE's and OLMoE's experts into `shape` (models/moe.py): a softmax router
    choosing num_experts_per_tok of the experts (renormalised over them where norm_topk_prob;
    Mixtral always), every block sparse but Qwen3-MoE's decoder_sparse_step (model.moe_every),
    dropless, no shared experts. The balancing loss is router_aux_loss_coef's (it shapes
    training, not the logits); none of the three has a router z-loss."""
    experts = hf.get("num_local_experts") if kind == "mixtral" else hf.get("num_experts")
    experts = experts if experts is not None else hf.get("num_local_experts", hf.get("num_experts"))
    if not experts:
        problems.append(f"num_experts = {experts!r} (a {kind} checkpoint without experts)")
        return
    width = hf.get("moe_intermediate_size") if kind == "qwen3_moe" else hf.get("intermediate_size")
    shape.update(experts=int(experts), top_k=int(hf.get("num_experts_per_tok", 2)),
                 expert_d_ff=int(width or shape["d_ff"]), shared_experts=0, capacity_factor=0.0,
                 router="softmax", balance="aux", z_loss_coef=0.0,
                 aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0) or 0.0),
                 router_topk_norm=kind == "mixtral" or bool(hf.get("norm_topk_prob", False)))
    if hf.get("router_jitter_noise"):  # Mixtral's training-time noise on the router's input
        problems.append(f"router_jitter_noise = {hf['router_jitter_noise']} (our router adds no "
                        f"noise; 0 maps)")
    if kind == "qwen3_moe":
        step = int(hf.get("decoder_sparse_step", 1) or 1)
        shape["moe_every"] = step
        if hf.get("mlp_only_layers"):
            problems.append(f"mlp_only_layers = {hf['mlp_only_layers']} (ours: dense blocks only "
                            f"between every decoder_sparse_step-th, model.moe_every)")
    if kind == "olmoe" and hf.get("clip_qkv") is not None:
        problems.append(f"clip_qkv = {hf['clip_qkv']} (our attention does not clamp q/k/v)")


def _qwen_windows(hf: dict[str, Any], kind: str, shape: dict[str, Any], exact: bool) -> None:
    """Qwen2's, Qwen3's and Qwen3-MoE's sliding windows as transformers' configs compute them
    (5.24): a window only with use_sliding_window (default false); Qwen2/3 slide the blocks
    layer_types names (by default those from max_window_layers, 28, on), Qwen3-MoE every block.
    Every block, or all but each n-th: the window as a mask (model.global_every); another
    pattern (full blocks first): the context capped at the window, where both agree."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    if not window:
        return
    n = shape["n_layers"]
    if kind == "qwen3_moe":
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


def _rope_shape(hf: dict[str, Any], rope: dict[str, Any], max_positions: int,
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
