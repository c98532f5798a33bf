"""Config errors are clear and early; precedence is defaults < preset < file < overrides."""

import pytest

from shardlm.config import Config, describe, load_config, parse_overrides, valid_keys
from shardlm.errors import ConfigError


def test_defaults_validate():
    load_config().validate()


def test_precedence_preset_file_override(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('[model]\npreset = "gpt2-124m"\nn_layers = 3\n[train]\nsteps = 7\nlr = 2e-4\n')
    cfg = load_config(toml, parse_overrides(["--train.steps=9", "--model.d_model", "384"]))
    assert cfg.model.n_heads == 12 and cfg.model.vocab_size == 50257  # from the preset
    assert cfg.model.n_layers == 3  # the file beats the preset
    assert cfg.train.steps == 9 and cfg.model.d_model == 384  # overrides beat the file
    assert cfg.train.lr == 2e-4


def test_unknown_key_names_the_closest():
    with pytest.raises(ConfigError, match=r"unknown config key 'train\.step'.*'train\.steps'"):
        load_config(overrides={"train.step": "5"})
    with pytest.raises(ConfigError, match=r"unknown config key 'trian\.lr'.*'train\.lr'"):
        load_config(overrides={"trian.lr": "1"})


def test_unknown_key_in_file(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text("[model]\nd_modle = 64\n")
    with pytest.raises(ConfigError, match="model.d_model"):
        load_config(toml)


def test_type_errors_name_key_and_value():
    with pytest.raises(ConfigError, match=r"train\.steps must be a int, got 'ten'"):
        load_config(overrides={"train.steps": "ten"})
    with pytest.raises(ConfigError, match=r"train\.compile must be a bool"):
        load_config(overrides={"train.compile": "maybe"})


def test_validate_lists_every_problem():
    cfg = load_config(overrides={"model.d_model": "100", "model.n_heads": "3",
                                 "train.seq_len": "4096", "precision.compute": "fp8"})
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    text = str(err.value)
    for fragment in ("d_model = 100 is not divisible by model.n_heads = 3",
                     "train.seq_len = 4096 exceeds model.max_seq_len = 256",
                     "precision.compute = 'fp8'; choose one of auto, fp32, bf16, fp16"):
        assert fragment in text


def test_unknown_preset_lists_the_choices():
    with pytest.raises(ConfigError, match="unknown model preset 'gpt5'.*gpt2-124m"):
        load_config(overrides={"model.preset": "gpt5"})


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="expected an override like --train.steps=100"):
        parse_overrides(["steps=3"])
    with pytest.raises(ConfigError, match="has no value"):
        parse_overrides(["--train.steps"])


def test_missing_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("nope.toml")


def test_every_field_is_documented():
    text = describe()
    assert text.count("\n      ") == len(valid_keys())  # one docstring line per key


def test_round_trip_through_dict():
    from shardlm.config import flatten

    cfg = load_config(overrides={"model.preset": "llama-tiny", "train.steps": "3"})
    again = load_config(overrides=flatten(cfg.to_dict()))
    assert again == cfg and isinstance(again, Config)


def test_example_configs_load():
    from pathlib import Path

    files = sorted((Path(__file__).parent.parent / "configs").glob("*.toml"))
    assert files, "configs/ should hold example configs"
    for f in files:
        load_config(f).validate()
