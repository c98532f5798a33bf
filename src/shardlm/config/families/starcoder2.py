"""StarCoder2 (Starcoder2ForCausalLM): GPT-2's LayerNorms (with biases) and GELU MLP (c_fc,
c_proj) with LLaMA's RoPE, attention names and grouped-query attention, biases on every linear,
a sliding window on every block."""

from __future__ import annotations

from shardlm.config.families import Family, register
from shardlm.config.hf_families import rope_shape


def reader(hf: dict, shape: dict, rope: dict, key, problems: list[str]) -> None:
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
    shape.update(rope_shape(hf, rope, shape["max_seq_len"], problems))


def bias_problems(m, family: str) -> list[str]:
    """StarCoder2's and GPT-NeoX's LayerNorms and MLP have biases: model.bias = true."""
    return [] if m.bias else [f"model.bias = false ({family}'s LayerNorms and MLP have biases)"]


def export(m, llama_keys: dict, layer_types: list[str]) -> dict:
    """Starcoder2Config's keys: LLaMA's but the RMSNorm's and head_dim, no dropout."""
    keys = {k: v for k, v in llama_keys.items() if k not in ("head_dim", "rms_norm_eps", "hidden_act")}
    return dict(use_bias=True, hidden_act="gelu_pytorch_tanh", norm_epsilon=m.norm_eps,
                residual_dropout=0.0, embedding_dropout=0.0, attention_dropout=0.0,
                pad_token_id=None, **keys)


register(Family(name="starcoder2", config_class="Starcoder2Config", model_class="Starcoder2ForCausalLM",
                style=("layernorm", "rope", "gelu"), reader=reader, sizable=False, biased=True,
                names={"mlp.fc": ("mlp.c_fc",), "mlp.proj": ("mlp.c_proj",)},
                expresses=frozenset({"head_dim", "sliding_window"}),
                problems=lambda m: bias_problems(m, "starcoder2"), export=export))
