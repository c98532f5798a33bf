"""A transformers config.json as a shape (--model.hf_path / --model.hf_config, and the planner's
--model DIR): read it, say which path a checkpoint takes (our decoder, mapped by family in
config/families/ and hf_families.py; an encoder-decoder; or transformers' own module) and what
the decoder cannot compute of it. Plain data, no torch."""

from __future__ import annotations

from typing import Any

from shardlm.config.families import family, loadable, sizable
from shardlm.config.hf_families import TRAIN_ANY_MODEL, read_llama_like
from shardlm.errors import ConfigError


def _read_hf_config(path: str, option: str) -> tuple[dict[str, Any], str]:
    import json
    from pathlib import Path

    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    if not file.is_file():
        raise ConfigError(f"{option} {path}: no config.json there ({file} is missing); point it at "
                          f"a local transformers directory (config.json + safetensors)")
    try:
        return json.loads(file.read_text()), file.parent.name or file.name
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{option} {path}: cannot read {file} as a transformers config ({e})") from None


def hf_shape(path: str, option: str = "--model", exact: bool = False) -> dict[str, Any]:
    """A transformers config.json (or its directory) as [model] field values: GPT-2's and the
    LLaMA family's key names (GQA, SwiGLU width, tied head, vocabulary, context, epsilons, RoPE
    base). The planner sizes any LLaMA-shaped family (families.sizable()); `exact` (loading weights, model.hf_path)
    also refuses what our decoder would compute differently, naming the key, so a checkpoint
    never loads into a network that only resembles it (model.hf_path sends such a checkpoint
    the transformers way instead: decoder_problems, causal_lm_config)."""
    shape, problems, kind, name = _decoder_shape(path, option, exact)
    if exact and problems:
        raise ConfigError(f"{option} {path}: {name}/config.json describes a {kind} our decoder "
                          f"does not compute exactly: {'; '.join(problems)}. {TRAIN_ANY_MODEL}")
    return shape


def decoder_problems(hf_path: str) -> list[str]:
    """What our decoder would compute differently from a mapped model_type's config.json (each
    naming its key; [] when it maps exactly, and for a file hf_shape itself will report)."""
    try:
        return _decoder_shape(hf_path, "model.hf_path", True)[1]
    except ConfigError:
        return []


def _decoder_shape(path: str, option: str, exact: bool) -> tuple[dict[str, Any], list[str], str, str]:
    """hf_shape's work: (the [model] values, what our decoder would compute differently, the
    model_type, the directory's name)."""
    hf, name = _read_hf_config(path, option)
    kind = str(hf.get("model_type", ""))
    mapped = loadable() if exact else sizable()
    if kind not in mapped:
        raise ConfigError(f"{option} {path}: model_type {kind!r} is not one that maps onto our "
                          f"decoder; supported: {', '.join(mapped)}. "
                          + (TRAIN_ANY_MODEL if exact else
                             "give --params N with --layers/--hidden/--heads"))

    def key(*names: str, default: Any = None) -> Any:
        for n in names:
            if hf.get(n) is not None:
                return hf[n]
        if default is None:
            raise ConfigError(f"{option} {path}: config.json has none of {', '.join(names)} "
                              f"(model_type {kind!r})")
        return default

    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}  # transformers 5 / 4
    shape: dict[str, Any] = dict(
        vocab_size=int(key("vocab_size")), n_layers=int(key("num_hidden_layers", "n_layer")),
        n_heads=int(key("num_attention_heads", "n_head")),
        d_model=int(key("hidden_size", "n_embd", "d_model")),
        max_seq_len=int(key("max_position_embeddings", "n_positions", "n_ctx")))
    problems: list[str] = []
    if kind in loadable():
        shape["family"] = kind
    fam = family(kind)
    if fam is not None and fam.reader is not None:  # a family with a reader of its own (GPT-2's)
        fam.reader(hf, shape, rope, key, problems)
    else:
        read_llama_like(hf, kind, shape, rope, key, problems, exact)
    return shape, problems, kind, name


def encoder_decoder_config(hf_path: str, hf_config: str) -> str:
    """The config.json of the encoder-decoder transformers model a [model] section names, or ''.
    model.hf_config (fresh weights) always names one (load_config refuses anything else);
    model.hf_path names one when its config.json says `is_encoder_decoder` (T5, BART, ...),
    otherwise it loads into our decoder. Reads one small JSON file, no transformers import."""
    import json
    from pathlib import Path

    if hf_config:
        path = Path(hf_config)
        return str(path / "config.json" if path.is_dir() else path)
    if hf_path:
        file = Path(hf_path) / "config.json"
        try:
            if json.loads(file.read_text()).get("is_encoder_decoder"):
                return str(file)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return ""  # hf_shape reports the unreadable file
    return ""


def causal_lm_config(hf_path: str) -> str:
    """The config.json of a model.hf_path that trains through transformers as a causal LM (its
    own module in models/hf.CausalLMAdapter: models/hf_build.py), or '': a decoder-only
    checkpoint whose model_type does not map onto our decoder (not in families.loadable()), or does but
    with a feature our decoder does not compute (decoder_problems: Phi-3.5's longrope, say).
    Exactly mapped ones load into our decoder, encoder-decoders go the seq2seq way (encoder_decoder_config). Reads
    one small JSON file, no transformers import; an unreadable one is hf_shape's to report."""
    import json
    from pathlib import Path

    if not hf_path:
        return ""
    file = Path(hf_path) / "config.json"
    try:
        hf = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return ""
    if not isinstance(hf, dict) or hf.get("is_encoder_decoder"):
        return ""
    if hf.get("model_type", "") in loadable() and not decoder_problems(hf_path):
        return ""
    return str(file) if hf.get("model_type") else ""


def transformers_config(hf_path: str, hf_config: str) -> str:
    """The config.json of the transformers module a [model] section trains as it is (an
    encoder-decoder, or a causal LM our decoder does not map), or '' for our decoder."""
    return encoder_decoder_config(hf_path, hf_config) or causal_lm_config(hf_path)


def causal_lm_shape(path: str, option: str) -> dict[str, Any]:
    """A causal LM's config.json (one causal_lm_config admits) as [model] values: what our config
    keeps of a model it does not build (the vocabulary for the tokenizer, the context for
    train.seq_len, width and depth for the log and the planner's rough size); the class and its
    arithmetic are the library's (models/hf_build.py)."""
    from pathlib import Path

    hf, name = _read_hf_config(path, option)
    kind = str(hf.get("model_type", ""))

    def first(*names: str, default: Any = None) -> Any:
        for n in names:
            if isinstance(hf.get(n), int):
                return hf[n]
        if default is None:
            raise ConfigError(f"{option} {path}: config.json has none of {', '.join(names)} "
                              f"(model_type {kind!r})")
        return default

    d_model = first("hidden_size", "n_embd", "d_model", "n_embed", "model_dim")
    heads = first("num_attention_heads", "n_head", "n_heads", "num_heads", default=1)
    heads = heads if d_model % heads == 0 else 1
    kv = first("num_key_value_heads", "num_kv_heads", "n_head_kv", default=heads)
    arch = (hf.get("architectures") or [kind])[0]
    return {"vocab_size": first("vocab_size"), "d_model": d_model,
            "n_layers": first("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
            "n_heads": heads, "n_kv_heads": kv if kv and heads % kv == 0 else 0,
            "d_ff": first("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size", default=0),
            # ALiBi (BLOOM) or rotary positions with no table have no length limit of their own.
            "max_seq_len": first("max_position_embeddings", "n_positions", "seq_length",
                                 "max_seq_len", default=1 << 20),
            "preset": f"{Path(path).name or name} ({arch}, transformers)"}


def seq2seq_shape(path: str, option: str) -> dict[str, Any]:
    """An encoder-decoder config.json (T5, BART families) as [model] values: what our config
    keeps of a model it does not build (vocabulary for the tokenizer, width and depth for the
    log); the transformers model itself is built from the file (models/hf.build_seq2seq)."""
    from pathlib import Path

    hf, name = _read_hf_config(path, option)
    name = Path(path).stem if Path(path).is_file() and Path(path).name != "config.json" else name
    kind = str(hf.get("model_type", ""))
    if not hf.get("is_encoder_decoder"):
        raise ConfigError(f"{option} {path}: model_type {kind!r} is not an encoder-decoder "
                          f"(config.json has no is_encoder_decoder = true); model.hf_config builds "
                          f"T5 / BART-family models for data.format = 'seq2seq'. A decoder-only "
                          f"checkpoint: model.hf_path; from scratch: model.preset")
    if not hf.get("architectures"):
        raise ConfigError(f"{option} {path}: config.json names no 'architectures' (e.g. "
                          f"[\"T5ForConditionalGeneration\"]): the class to build is unknown")

    def first(*names: str, default: Any = None) -> Any:
        for n in names:
            if hf.get(n) is not None:
                return hf[n]
        if default is None:
            raise ConfigError(f"{option} {path}: config.json has none of {', '.join(names)}")
        return default

    d_model = int(first("d_model", "hidden_size"))
    heads = int(first("num_heads", "encoder_attention_heads", default=1))
    layers = int(first("num_layers", "encoder_layers")) + int(
        first("num_decoder_layers", "decoder_layers", "num_layers", "encoder_layers"))
    return {"vocab_size": int(first("vocab_size")), "d_model": d_model, "n_layers": layers,
            "n_heads": heads if d_model % heads == 0 else 1, "n_kv_heads": 0,
            "d_ff": int(first("d_ff", "encoder_ffn_dim", default=0)),
            # T5's relative positions have no limit; BART's learned table does.
            "max_seq_len": int(first("max_position_embeddings", default=1 << 20)),
            "preset": f"{name} ({hf['architectures'][0]})"}
