"""Reading a config: defaults < preset < a checkpoint's config.json < TOML file < command-line
overrides (with model.hf_path, the fine-tuning defaults for train.lr and the warm-up where the
TOML file and the overrides leave them unset: FINETUNE_LR), each key checked (an unknown key names the closest valid one) and typed as the schema
declares (schema.py); and the `--help-config` text from the fields' docstrings.

Keys are 'section.key'; a nested section (a dataclass-typed field of a section, fields.leaf_fields:
train.local_sgd) adds one level, 'section.nested.key' — in TOML an inline table
(`local_sgd = {every = 4}` under [train]) or a [train.local_sgd] table, which `flatten` turns
into the same dotted keys."""

from __future__ import annotations

import difflib
import tomllib
import types
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, get_type_hints

from shardlm.config.schema import Config, field_docs, sections, valid_keys

from shardlm.config.model import ModelConfig
from shardlm.config.fields import Leaf, a_type, key_of, leaf_fields
from shardlm.errors import ConfigError


def describe() -> str:
    """Every key with its default and docstring: the text of `--help-config`. A nested section's
    keys (train.local_sgd.every) are listed in their section as dotted keys (valid TOML), after
    a comment line with the nested section's own docstring."""
    lines = []
    default = Config()
    for name in sections():
        lines.append(f"[{name}]")
        lines += _describe_section(getattr(default, name))
    return "\n".join(lines)


def _describe_section(section: Any, prefix: str = "") -> list[str]:
    lines, docs = [], field_docs(type(section))
    for f in fields(section):
        key, value = prefix + key_of(f), getattr(section, f.name)
        if is_dataclass(value):
            lines.append(f"  # {key}: {docs.get(f.name, '')}")
            lines += _describe_section(value, key + ".")
            continue
        lines.append(f"  {key} = {value!r}")
        if f.name in docs:
            lines.append(f"      {docs[f.name]}")
    return lines


def _unknown_key(key: str) -> ConfigError:
    nested = sorted(k for k in valid_keys() if k.startswith(key + "."))
    if nested:  # a nested section given a plain value: `--train.local_sgd=4`
        return ConfigError(f"config key '{key}' is a section, not a value: set its keys, "
                           f"{', '.join(nested)} (e.g. --{nested[0]}=..., or in TOML under "
                           f"[{key.partition('.')[0]}]: {key.partition('.')[2]} = {{...}})")
    close = difflib.get_close_matches(key, valid_keys(), n=1, cutoff=0.5)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return ConfigError(f"unknown config key '{key}'.{hint} (`shardlm train --help-config` lists all keys)")


def _coerce(key: str, value: Any, typ: type) -> Any:
    """Turn a TOML value or a command-line string into the field's type, or explain why not. A
    union (train.compile: bool | str) takes the first of its types the value parses as."""
    if isinstance(typ, types.UnionType):
        for each in typ.__args__:
            try:
                return _coerce(key, value, each)
            except ConfigError:
                continue
        raise ConfigError(f"{key} must be {a_type(typ)}, got {value!r} ({type(value).__name__})")
    if isinstance(value, str) and typ is not str:
        text = value.strip()
        try:
            if typ is bool:
                if text.lower() in ("true", "1", "yes", "on"):
                    return True
                if text.lower() in ("false", "0", "no", "off"):
                    return False
                raise ValueError
            if typ is int and "e" in text.lower():  # 1e6 is an int; 1.5e0 and 1e400 are not
                number = float(text)
                if not number.is_integer():
                    raise ValueError
                return int(number)
            return typ(text)
        except (ValueError, OverflowError):
            raise ConfigError(f"{key} must be {a_type(typ)}, got {value!r}") from None
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ConfigError(f"{key} must be {a_type(typ)}, got {value!r} ({type(value).__name__})")
    return value


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            flat.update(flatten(v, key + "."))
        else:
            flat[key] = v
    return flat


def parse_overrides(args: list[str]) -> dict[str, str]:
    """`--a.b=value` or `--a.b value` pairs into {'a.b': 'value'}."""
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(f"expected an override like --train.steps=100, got {arg!r}")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
        elif i + 1 < len(args):
            key, value = arg[2:], args[i + 1]
            i += 1
        else:
            raise ConfigError(f"override {arg!r} has no value; write {arg}=VALUE")
        out[key] = value
        i += 1
    return out


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Build the Config: defaults < model preset < TOML file < overrides. Does not validate."""
    from shardlm.config.presets import get_preset

    values: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {str(p)!r} is not UTF-8 text (byte {e.start}: {e.reason}); "
                              f"TOML files are UTF-8") from None
        except OSError as e:
            raise ConfigError(f"config file {str(p)!r} cannot be read: {e.strerror or e}") from None
        try:
            values.update(flatten(tomllib.loads(text)))
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: not valid TOML: {e}") from None
    values.update(overrides or {})

    _check_keys(values)
    if values.get("model.hf_path") or values.get("model.hf_config"):
        ordered = _hf_shape_layer(values)
    else:
        preset = values.get("model.preset", Config().model.preset)
        ordered = {f"model.{k}": v for k, v in get_preset(str(preset)).items()}
        ordered["model.preset"] = preset
    ordered.update(values)
    return _unused_given(_warmup_from_fraction(_finetune_defaults(_build(ordered), set(values)), set(values)),
                         set(values))


FINETUNE_LR = {"full": 2e-5, "lora": 2e-4}
"""train.lr for a model.hf_path run that does not set it: torchtune's full fine-tuning rate
(HF Trainer's default is 5e-5) and the LoRA / QLoRA papers' 2e-4 — not the 1e-3 of
pre-training from scratch, 20-50x what a pretrained checkpoint tolerates."""
FINETUNE_WARMUP_FRACTION = 0.03
"""train.warmup_fraction for a model.hf_path run that sets neither it nor warmup_steps (HF
Trainer recipes' warmup_ratio 0.03): warm-up scales with the run, not 30 steps whatever it is."""


def finetune_mode(cfg: Config) -> str:
    """'lora' (lora.rank > 0: LoRA or QLoRA) or 'full'."""
    return "lora" if cfg.lora.rank else "full"


def _finetune_defaults(cfg: Config, given: set[str]) -> Config:
    """With model.hf_path (a pretrained checkpoint), the fine-tuning defaults for the keys the
    TOML file and the overrides leave unset: FINETUNE_LR, FINETUNE_WARMUP_FRACTION.
    train.resolve.finetune_note says which were chosen."""
    if not cfg.model.hf_path:
        return cfg
    if "train.lr" not in given:
        cfg.train.lr = FINETUNE_LR[finetune_mode(cfg)]
    if not given & {"train.warmup_steps", "train.warmup_fraction"}:
        cfg.train.warmup_fraction = FINETUNE_WARMUP_FRACTION
    return cfg


def _warmup_from_fraction(cfg: Config, given: set[str]) -> Config:
    """train.warmup_fraction > 0 sets train.warmup_steps (rules.fraction_warmup_steps); both
    given is a ConfigError (which one would win is not obvious)."""
    from shardlm.config.rules import fraction_warmup_steps

    t = cfg.train
    if not 0 < t.warmup_fraction < 1:  # 0: warmup_steps as set; >= 1: validate() names it
        return cfg
    if {"train.warmup_steps", "train.warmup_fraction"} <= given:
        raise ConfigError(f"train.warmup_steps = {t.warmup_steps} and train.warmup_fraction = "
                          f"{t.warmup_fraction:g} both set the warm-up: set one of them")
    t.warmup_steps = fraction_warmup_steps(t.warmup_fraction, t.steps)
    return cfg


def _unused_given(cfg: Config, given: set[str]) -> Config:
    """Keys the user set that the rest of the config makes unused are refused, not ignored:
    train.local_sgd.outer_lr / outer_momentum with outer = 'average' (the plain average is an
    outer step of lr 1 without momentum)."""
    local = cfg.train.local_sgd
    unused = sorted(given & {"train.local_sgd.outer_lr", "train.local_sgd.outer_momentum"})
    if local.outer == "average" and unused:
        raise ConfigError(f"{' and '.join(f'{k} = {getattr(local, k.rpartition(chr(46))[2]):g}' for k in unused)} "
                          f"with train.local_sgd.outer = 'average': the plain average has no outer "
                          f"learning rate or momentum (θ ← mean of the replicas' θ); drop "
                          f"{'them' if len(unused) > 1 else 'it'}, or set outer = 'diloco'")
    return cfg


def _hf_shape_layer(values: dict[str, Any]) -> dict[str, Any]:
    """model.hf_path's config.json in the preset's place (our decoder's shape, or what our config
    keeps of a transformers module's: an encoder-decoder, or a causal LM our decoder does not
    map, models/hf_build.py). A [model] shape key the user also set
    must agree with it: the checkpoint's weights have that shape, so a different value could
    only fail later (or, for a value like norm_eps, silently train another network)."""
    from shardlm.config.hf_shapes import (causal_lm_config, causal_lm_shape, encoder_decoder_config, hf_shape, seq2seq_shape)
    from shardlm.config.hf_families import TRAINING_DEFAULTS

    option = "model.hf_config" if values.get("model.hf_config") else "model.hf_path"
    path = str(values[option])
    if values.get("model.hf_config") and values.get("model.hf_path"):
        raise ConfigError(f"model.hf_config = {path!r} and model.hf_path = "
                          f"{values['model.hf_path']!r}: choose one (a checkpoint's directory "
                          f"holds its config.json)")
    seq2seq = encoder_decoder_config(str(values.get("model.hf_path", "")), str(values.get("model.hf_config", "")))
    # A decoder-only model_type our decoder does not map trains as transformers' own module.
    causal = causal_lm_config(path) if option == "model.hf_path" and not seq2seq else ""
    named = (seq2seq_shape(seq2seq or path, option) if seq2seq or option == "model.hf_config"
             else causal_lm_shape(path, option) if causal
             else {**hf_shape(path, option, exact=True),
                   "preset": f"{Path(path).name} (transformers checkpoint, shardlm's decoder)"})
    shape = {f"model.{k}": v for k, v in named.items()}
    if "model.preset" in values:
        raise ConfigError(f"model.preset = {values['model.preset']!r} and {option} = {path!r} "
                          f"both give the model's shape: drop model.preset (the shape comes from "
                          f"{path}/config.json)")
    hints = get_type_hints(ModelConfig)
    conflicts = [f"{k} = {values[k]!r} (config.json: {v!r})" for k, v in shape.items()
                 if k in values and k.partition('.')[2] not in TRAINING_DEFAULTS
                 and _coerce(k, values[k], hints[k.partition('.')[2]]) != v]
    if conflicts:
        raise ConfigError(f"{option} = {path!r}: these [model] keys disagree with its "
                          f"config.json, which gives the model's shape: {'; '.join(conflicts)}; drop them")
    return shape


def config_from_dict(tree: dict[str, Any]) -> Config:
    """The inverse of Config.to_dict (a saved run's config.json, a checkpoint's manifest, the
    resolved config rank 0 shares): every key checked and typed; no preset is re-applied, the
    tree holds the values. Does not validate."""
    values = flatten(tree)
    _check_keys(values)
    return _build(values)


def _leaves() -> dict[str, tuple[str, Leaf]]:
    """'section.key' (nested: 'section.nested.key') -> (section, its fields.Leaf)."""
    return {f"{name}.{leaf.key}": (name, leaf) for name, cls in sections().items()
            for leaf in leaf_fields(cls)}


def _check_keys(values: dict[str, Any]) -> None:
    leaves = _leaves()
    for key in values:
        if key not in leaves:
            raise _unknown_key(key)


def typed_overrides(values: dict[str, Any]) -> dict[str, Any]:
    """{'section.key': value} with each value in its field's type (strings from a command line
    parsed as load_config parses them); an unknown key or a bad value is a ConfigError."""
    _check_keys(values)
    leaves = _leaves()
    return {key: _coerce(key, value, leaves[key][1].type) for key, value in values.items()}


def _build(values: dict[str, Any]) -> Config:
    cfg, leaves = Config(), _leaves()
    for key, value in typed_overrides(values).items():
        name, leaf = leaves[key]
        holder = getattr(cfg, name)
        for attr in leaf.attrs[:-1]:  # into a nested section (train.local_sgd)
            holder = getattr(holder, attr)
        setattr(holder, leaf.attrs[-1], value)
    return cfg
