"""GPT-2 (GPT2LMHeadModel): LayerNorms and biases everywhere, learned positions, a GELU (tanh
form) MLP; its Conv1D linears store their weights as (in, out), the transpose of ours, and its
c_attn is q/k/v already fused as ours (rows q, k, v)."""

from __future__ import annotations

from shardlm.config.families import Family, register
from shardlm.config.presets import _gpt2

TOKENS = ("bos_token_id", "eos_token_id", "vocab_size", "tie_word_embeddings")
"""The export's keys every family shares (export.hf_config's `tokens`)."""


def reader(hf: dict, shape: dict, rope: dict, key, problems: list[str]) -> None:
    """GPT2Config's keys (n_inner, layer_norm_epsilon, activation_function, its attention
    scalings) on GPT-2's preset shape."""
    shape.update(_gpt2(shape["n_layers"], shape["n_heads"], shape["d_model"], shape["vocab_size"],
                       shape["max_seq_len"]),
                 d_ff=int(key("n_inner", default=0) or 0),
                 tie_embeddings=bool(key("tie_word_embeddings", default=True)),
                 norm_eps=float(key("layer_norm_epsilon", default=1e-5)))
    act = key("activation_function", default="gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):  # ours is GELU's tanh form
        problems.append(f"activation_function = {act!r} (ours is 'gelu_new')")
    for flag, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False)):
        if key(flag, default=want) != want:
            problems.append(f"{flag} = {hf[flag]!r} (ours: {want})")


def problems(m) -> list[str]:
    """What GPT2LMHeadModel cannot hold: biases on q/k/v only, grouped-query attention, and an
    exact-GELU or SiLU MLP (its export writes gelu_new)."""
    out = []
    if m.qkv_bias and not m.bias:
        out.append("model.qkv_bias = true with model.bias = false (biases on q/k/v only) has no "
                   "GPT-2 equivalent; GPT-2 has biases everywhere (model.bias = true)")
    if (m.n_kv_heads or m.n_heads) != m.n_heads:
        out.append(f"model.n_kv_heads = {m.n_kv_heads} (grouped-query attention) has no GPT-2 "
                   f"equivalent; only n_kv_heads = 0 or n_heads = {m.n_heads} maps")
    if m.activation not in ("auto", "gelu_tanh"):
        out.append(f"model.activation = {m.activation!r} (GPT-2's MLP is GELU's tanh form: 'auto')")
    return out


def export(m, llama_keys: dict, layer_types: list[str]) -> dict:
    """GPT2Config's keys. No dropout: ours has none, and a fine-tune of the export should train
    the same network."""
    return dict(n_embd=m.d_model, n_layer=m.n_layers, n_head=m.n_heads,
                n_inner=llama_keys["intermediate_size"], n_positions=m.max_seq_len,
                layer_norm_epsilon=m.norm_eps, activation_function="gelu_new", resid_pdrop=0.0,
                embd_pdrop=0.0, attn_pdrop=0.0, **{k: llama_keys[k] for k in TOKENS})


LINEARS = frozenset({"attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"})

register(Family(name="gpt2", config_class="GPT2Config", model_class="GPT2LMHeadModel",
                style=("layernorm", "learned", "gelu"), reader=reader, biased=True,
                names={"tok_emb": ("transformer.wte",), "pos_emb": ("transformer.wpe",),
                       "blocks": ("transformer.h",), "norm_f": ("transformer.ln_f",),
                       "attn_norm": ("ln_1",), "mlp_norm": ("ln_2",), "attn.qkv": ("attn.c_attn",),
                       "attn.proj": ("attn.c_proj",), "mlp.fc": ("mlp.c_fc",),
                       "mlp.proj": ("mlp.c_proj",)},
                transposed=LINEARS, zero_biases=True,
                expresses=frozenset({"qkv_bias", "norm_bias", "activation"}), problems=problems,
                export=export))
