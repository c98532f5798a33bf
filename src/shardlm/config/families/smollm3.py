"""SmolLM3 (SmolLM3ForCausalLM): LLaMA whose every no_rope_layer_interval-th block has no RoPE
(NoPE): model.nope_every."""

from __future__ import annotations

from shardlm.config.families import Family, global_every, register


def read(hf: dict, shape: dict, problems: list[str]) -> None:
    """Its NoPE blocks (no_rope_layers: 1 rotates, 0 does not) as model.nope_every."""
    interval = int(hf.get("no_rope_layer_interval") or 4)
    flags = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(shape["n_layers"])]
    every = global_every([bool(f) for f in flags])  # the same pattern: rotating = not every n-th
    if every is None:
        problems.append(f"no_rope_layers = {flags} (ours: every block rotates but each n-th: "
                        f"model.nope_every)")
    elif every:
        shape["nope_every"] = every
    if hf.get("use_sliding_window") and hf.get("sliding_window"):
        problems.append("use_sliding_window = True (SmolLM3's windows sit on its NoPE blocks; "
                        "ours on all but each n-th)")


def export(m, llama_keys: dict, layer_types: list[str]) -> dict:
    """SmolLM3Config's keys: no head_dim, RoPE in every block but each nope_every-th."""
    keys = {k: v for k, v in llama_keys.items() if k not in ("head_dim", "sliding_window")}
    return dict(keys, attention_bias=m.bias, mlp_bias=m.bias, use_sliding_window=False,
                no_rope_layers=[int(not m.nope_every or (i + 1) % m.nope_every != 0)
                                for i in range(m.n_layers)], pad_token_id=None)


register(Family(name="smollm3", config_class="SmolLM3Config", model_class="SmolLM3ForCausalLM",
                has_head_dim=False, read=read, biased=True, implied=lambda m: bool(m.nope_every),
                expresses=frozenset({"nope_every"}), export=export))
