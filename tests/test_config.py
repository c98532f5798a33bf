"""Config errors are clear and early; precedence is defaults < preset < file < overrides."""

import pytest

from shardlm.config.schema import Config, valid_keys
from shardlm.config.load import describe, load_config, parse_overrides
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
    with pytest.raises(ConfigError, match=r"train\.steps must be an int, got 'ten'"):
        load_config(overrides={"train.steps": "ten"})
    with pytest.raises(ConfigError, match=r"parallel\.sequence_parallel must be a bool"):
        load_config(overrides={"parallel.sequence_parallel": "maybe"})
    # a union (bool | str): the words of a bool are one, 'auto' the other; anything else is named
    assert load_config(overrides={"train.compile": "off"}).train.compile is False
    assert load_config(overrides={"train.compile": "auto"}).train.compile == "auto"
    with pytest.raises(ConfigError, match=r"train\.compile = 'maybe'; choose one of true, false, auto"):
        load_config(overrides={"train.compile": "maybe"}).validate()
    with pytest.raises(ConfigError, match=r"train\.compile must be a bool or a str, got 3"):
        load_config(overrides={"train.compile": 3})


def test_validate_lists_every_problem():
    cfg = load_config(overrides={"model.d_model": "100", "model.n_heads": "3",
                                 "train.seq_len": "4096", "precision.compute": "fp4"})
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    text = str(err.value)
    for fragment in ("d_model = 100 is not divisible by model.n_heads = 3",
                     "train.seq_len = 4096 exceeds model.max_seq_len = 256",
                     "precision.compute = 'fp4'; choose one of auto, fp32, bf16, fp16, fp8"):
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
    from shardlm.config.load import flatten

    cfg = load_config(overrides={"model.preset": "llama-tiny", "train.steps": "3"})
    again = load_config(overrides=flatten(cfg.to_dict()))
    assert again == cfg and isinstance(again, Config)


def test_example_configs_load():
    from pathlib import Path

    files = sorted((Path(__file__).parent.parent / "configs").glob("*.toml"))
    assert files, "configs/ should hold example configs"
    for f in files:
        load_config(f).validate()


# -- validation: every value checked, every error reported, the validator never crashes ---------

# (overrides, text the error must contain): one bad value each.
BAD_VALUES = [
    ({"parallel.zero_stage": "5"}, "parallel.zero_stage = 5; choose one of 0, 1, 2, 3"),
    ({"train.lr": "nan"}, "train.lr = nan must be a finite number"),
    ({"train.lr": "inf"}, "train.lr = inf must be a finite number"),
    ({"model.init_std": "nan"}, "model.init_std = nan must be a finite number"),
    ({"model.rope_theta": "-inf"}, "model.rope_theta = -inf must be a finite number"),
    ({"data.val_fraction": "nan"}, "data.val_fraction = nan must be a finite number"),
    ({"parallel.collective_timeout_s": "inf"}, "parallel.collective_timeout_s = inf must be a finite"),
    ({"train.eps": "-1"}, "train.eps = -1.0 must be > 0"),
    ({"model.norm_eps": "0"}, "model.norm_eps = 0.0 must be > 0"),
    ({"train.weight_decay": "-0.1"}, "train.weight_decay = -0.1 must be >= 0"),
    ({"precision.loss_scale_backoff": "1"}, "precision.loss_scale_backoff = 1.0 must be in (0, 1)"),
    ({"model.d_ff": "-5"}, "model.d_ff = -5 must be >= 0"),
    ({"model.ffn_multiple_of": "0"}, "model.ffn_multiple_of = 0 must be > 0"),
    ({"zero.nvme_chunk_mb": str(100 * 1024**2)},  # 100 TB written in MB
     "zero.nvme_chunk_mb = 104857600 must be in [1, 65536]"),
    ({"zero.nvme_chunk_mb": "65536", "zero.nvme_buffers": "5"},
     "zero.nvme_buffers x 4 x zero.nvme_chunk_mb = 5 x 4 x 65536 MB of host memory"),
    ({"run.device": "tpu"}, "run.device = 'tpu' is not a device: use 'auto', 'cpu', 'cuda' or 'cuda:N'"),
    ({"run.device": "cuda:x"}, "run.device = 'cuda:x' is not a device"),
    ({"train.eval_every": "-1"}, "train.eval_every = -1 must be >= 0 (0 = only at the end)"),
    ({"train.seed": "-1"}, "train.seed = -1 must be in [0, 2**63)"),
    ({"train.seed": str(2**64)}, f"train.seed = {2**64} must be in [0, 2**63)"),
    ({"train.sample_tokens": "-1"}, "train.sample_tokens = -1 must be >= 0"),
    ({"train.sample_prompt": ""}, "train.sample_prompt = '' gives the sample nothing to continue"),
    ({"checkpoint.keep": "0"}, "checkpoint.keep = 0 must be >= 1"),
    ({"checkpoint.resume": ""}, "checkpoint.resume = '' must be 'auto', 'never' or a path"),
    ({"parallel.dp_shard": "0"}, "parallel.dp_shard = 0 must be >= 1 or -1"),
    ({"data.source": " "}, "data.source = ' ' must name 'stdlib' or files / directories"),
    ({"run.name": "latest"}, "run.name = 'latest' is reserved"),
]


@pytest.mark.parametrize("overrides, message", BAD_VALUES, ids=[m.split(" ")[0] for _, m in BAD_VALUES])
def test_bad_value_is_reported(overrides, message):
    cfg = load_config(overrides=overrides)
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    assert message in str(err.value)


def test_every_bad_value_is_reported_at_once():
    # Every row that is one field's own error (the last of a key's rows wins), with the value
    # that once crashed the validator, and a cross-field error on top.
    overrides = {k: v for case, message in BAD_VALUES for k, v in case.items()
                 if len(case) == 1 and message.startswith(f"{k} = ")
                 and k != "train.sample_prompt"}  # a cross-field check: sample_tokens is bad too
    overrides.update({"parallel.zero_stage": "5", "model.d_model": "100", "model.n_heads": "3"})
    with pytest.raises(ConfigError) as err:
        load_config(overrides=overrides).validate()
    lines = str(err.value).splitlines()[1:]
    for fragment in ("parallel.zero_stage = 5; choose one of 0, 1, 2, 3",  # once crashed the rest
                     "train.lr = inf", "model.init_std = nan", "train.eps = -1.0", "model.d_ff = -5",
                     "run.device = 'cuda:x'", "train.eval_every = -1", "zero.nvme_chunk_mb = 104857600",
                     "model.d_model = 100 is not divisible by model.n_heads = 3"):
        assert sum(fragment in line for line in lines) == 1, (fragment, lines)
    # one line per bad key (d_model and n_heads are fine alone: they add the one cross line)
    assert len(lines) == len(overrides) - 1, lines
    assert len(lines) >= 20


def test_every_float_field_must_be_finite():
    """Walks the dataclasses: a float field added tomorrow is checked without a new rule."""
    for key in valid_keys():
        if not isinstance(_default(key), float):
            continue
        for bad in ("nan", "inf", "-inf"):
            with pytest.raises(ConfigError, match=rf"{key} = {bad} must be a finite number"):
                load_config(overrides={key: bad}).validate()


def test_every_number_has_a_range():
    from shardlm.config.fields import _CHOICES, _RULES

    numbers = [k for k in valid_keys() if type(_default(k)) in (int, float)]
    assert len(numbers) > 30
    assert not [k for k in numbers if k not in _RULES and k not in _CHOICES]


def _default(key: str):
    value = Config()
    for name in key.split("."):  # 'train.local_sgd.every': a nested section's key too
        value = getattr(value, {"async": "async_"}.get(name, name))
    return value


def test_good_values_pass():
    for device in ("auto", "cpu", "cuda", "cuda:0", "cuda:12"):
        load_config(overrides={"run.device": device}).validate()
    load_config(overrides={"model.d_ff": "0", "train.eval_every": "0", "zero.nvme_chunk_mb": "65536",
                           "train.sample_prompt": "", "train.sample_tokens": "0",
                           "train.seed": str(2**63 - 1), "train.grad_clip": "0"}).validate()


def test_validator_survives_wrong_types():
    """A Config built in Python skips parsing: wrong types are reported, never a crash, and
    the other checks still run."""
    cfg = Config()
    cfg.train.lr = "fast"
    cfg.model.n_heads = None
    cfg.model.bias = 1
    cfg.parallel.zero_stage = 7
    cfg.run = None
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    text = str(err.value)
    for fragment in ("train.lr = 'fast' must be a float, not str",
                     "model.n_heads = None must be an int, not NoneType",
                     "model.bias = 1 must be a bool, not int",
                     "parallel.zero_stage = 7; choose one of 0, 1, 2, 3",
                     "[run] must be a RunConfig, not NoneType"):
        assert fragment in text
    assert "could not check" not in text  # checks reading a bad field are skipped, not crashed


def test_non_utf8_file_names_the_file(tmp_path):
    toml = tmp_path / "latin1.toml"
    toml.write_bytes('[run]\nname = "caf\u00e9"\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1\.toml' is not UTF-8 text"):
        load_config(toml)


def test_numbers_that_are_not_ints():
    for text in ("1e400", "1.5e0", "nan"):
        with pytest.raises(ConfigError, match=r"train\.steps must be an int"):
            load_config(overrides={"train.steps": text})
    assert load_config(overrides={"train.steps": "1e3"}).train.steps == 1000


def test_space_separated_overrides_are_not_taken_for_the_config_file():
    """`shardlm train --model.hf_path DIR` (the issue's form): DIR is the key's value, not the
    optional TOML positional; a positional after a complete override stays the config file."""
    from shardlm.cli.main import joined_overrides

    assert joined_overrides(["--model.hf_path", "llama", "--lora.rank=8", "--nproc", "2"]) == [
        "--model.hf_path=llama", "--lora.rank=8", "--nproc", "2"]
    assert joined_overrides(["--train.steps=5", "run.toml"]) == ["--train.steps=5", "run.toml"]
    assert joined_overrides(["--train.compile", "--dry-run"]) == ["--train.compile", "--dry-run"]
