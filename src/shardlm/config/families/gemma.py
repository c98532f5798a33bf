"""Gemma 1 (GemmaForCausalLM): LLaMA with (1 + w) RMSNorms, embeddings times sqrt(hidden_size)
and GeGLU (GELU's tanh form); a tied head by default. What Gemma 2 and 3 share with it lives
here too (gemma2.py, gemma3_text.py import it)."""

from __future__ import annotations


from shardlm.config.families import Family, register


def read_gelu(hf: dict, shape: dict, problems: list[str], act_key: str, allowed: tuple[str, ...]) -> None:
    """(1 + w) norms, sqrt(d)-scaled embeddings, GeGLU: every Gemma's."""
    act = hf.get(act_key) or "gelu_pytorch_tanh"
    if act not in allowed:
        problems.append(f"{act_key} = {act!r} (ours is GELU's tanh form, 'gelu_pytorch_tanh')")
    shape.update(norm_offset=True, activation="gelu_tanh",
                 embedding_multiplier=float(shape["d_model"] ** 0.5))


def prepare(hf: dict, shape: dict, rope: dict, problems: list[str]) -> dict:
    """Gemma 1's keys; transformers reads its legacy hidden_act 'gelu' as the tanh form
    (GemmaConfig says so). Returns the rope parameters unchanged."""
    read_gelu(hf, shape, problems, "hidden_act", ("gelu_pytorch_tanh", "gelu"))
    return rope


def gemma_problems(m, family: str, own: list[str]) -> list[str]:
    """What `family`'s class (Gemma 1, 2 or 3) cannot express of our model: the fields every
    Gemma fixes, then `own` (the version's own problems), then a second RoPE base."""
    want = {"norm_offset": True, "activation": "gelu_tanh",
            "embedding_multiplier": m.d_model ** 0.5, "bias": False, "qkv_bias": False,
            "qk_norm": family == "gemma3_text", "qk_norm_width": "head",
            "norm_placement": "pre" if family == "gemma" else "sandwich", "residual_multiplier": 1.0,
            "logits_divisor": 1.0, "nope_every": 0}
    problems = [f"model.{k} = {getattr(m, k)!r} ({family}'s is {v!r})" for k, v in want.items()
                if getattr(m, k) != v] + own
    if m.rope_local_theta and family != "gemma3_text":
        problems.append(f"model.rope_local_theta = {m.rope_local_theta:g} (only Gemma 3 has a "
                        f"second RoPE base)")
    return problems


def checks(m) -> list[str]:
    gemma1 = {"model.attention_scale": m.attention_scale, "model.attn_softcap": m.attn_softcap,
              "model.logit_softcap": m.logit_softcap, "model.sliding_window": m.sliding_window}
    return gemma_problems(m, "gemma", [f"{k} = {v:g} (Gemma 1 has none; Gemma 2 and 3 have sandwich "
                                       f"norms)" for k, v in gemma1.items() if v])


def common_keys(llama_keys: dict) -> dict:
    """Every Gemma config's keys: LLaMA's but the window, activation and RoPE (each version's)."""
    own = ("sliding_window", "hidden_act", "rope_parameters")
    keys = {k: v for k, v in llama_keys.items() if k not in own}
    return dict(keys, attention_bias=False, pad_token_id=None)


def export(m, llama_keys: dict, layer_types: list[str]) -> dict:
    return dict(common_keys(llama_keys), hidden_act="gelu_pytorch_tanh",
                rope_parameters=llama_keys["rope_parameters"])


register(Family(name="gemma", config_class="GemmaConfig", model_class="GemmaForCausalLM",
                title="Gemma", attention_bias="refused", windows="none", silu=False, tied=True,
                prepare=prepare, implied=lambda m: m.norm_offset, checks=checks, export=export))
