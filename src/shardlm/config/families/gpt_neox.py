"""GPT-NeoX (GPTNeoXForCausalLM, Pythia): LayerNorms and linears with biases, exact GELU, a
parallel residual, partial rotary (rotary_pct), one key/value head per query head; its
query_key_value holds q/k/v grouped by head ([q_h, k_h, v_h] for each head), which the name table
reorders into ours."""

from __future__ import annotations

from shardlm.config.families import Family, register
from shardlm.config.families.starcoder2 import bias_problems
from shardlm.config.hf_families import rope_shape


def reader(hf: dict, shape: dict, rope: dict, key, problems: list[str]) -> None:
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
    shape.update(rope_shape(hf, rope, shape["max_seq_len"], problems, partial_ok=True))


def problems(m) -> list[str]:
    out = bias_problems(m, "gpt_neox")
    if (m.n_kv_heads or m.n_heads) != m.n_heads:
        out.append(f"model.n_kv_heads = {m.n_kv_heads} (GPT-NeoX has one key/value head per query head)")
    return out


def implied(m) -> bool:
    """A LayerNorm + RoPE + GELU model of ours is GPT-NeoX's (not StarCoder2's) where it has a
    parallel residual, partial rotary or a chosen activation."""
    return (m.parallel_residual, m.rope_fraction, m.activation) != (False, 1.0, "auto")


def export(m, llama_keys: dict, layer_types: list[str]) -> dict:
    """GPTNeoXConfig's keys: biases everywhere, the parallel residual, no dropout."""
    act = {"auto": "gelu_pytorch_tanh", "gelu_tanh": "gelu_pytorch_tanh"}.get(m.activation, m.activation)
    keys = {k: v for k, v in llama_keys.items()
            if k not in ("head_dim", "rms_norm_eps", "hidden_act", "sliding_window", "num_key_value_heads")}
    return dict(hidden_act=act, layer_norm_eps=m.norm_eps, use_parallel_residual=m.parallel_residual,
                attention_bias=True, attention_dropout=0.0, hidden_dropout=0.0, pad_token_id=None,
                **keys)


register(Family(name="gpt_neox", config_class="GPTNeoXConfig", model_class="GPTNeoXForCausalLM",
                style=("layernorm", "rope", "gelu"), reader=reader, sizable=False, implied=implied,
                names={"tok_emb": ("gpt_neox.embed_in",), "blocks": ("gpt_neox.layers",),
                       "norm_f": ("gpt_neox.final_layer_norm",), "head": ("embed_out",),
                       "attn.qkv": ("attention.query_key_value",), "attn.proj": ("attention.dense",),
                       "mlp.fc": ("mlp.dense_h_to_4h",), "mlp.proj": ("mlp.dense_4h_to_h",)},
                per_head=frozenset({"attn.qkv"}),
                # transformers 5 renames the file's embed_out as it loads it (conversion_mapping.py)
                in_memory_names={"embed_out.weight": "lm_head.weight"},
                expresses=frozenset({"parallel_residual", "rope_fraction", "activation"}), biased=True,
                problems=problems, export=export))
