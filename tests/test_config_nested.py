"""Nested config sections (a dataclass-typed field of a section: train.local_sgd): the same keys
from TOML (inline table or a [train.local_sgd] table) and the command line, clear errors for
unknown nested keys and for a section given a value, validation of the nested values, and a
round trip through everything that saves a config (Config.to_dict, a run's config.json)."""

import json

import pytest

from shardlm.config.schema import Config, valid_keys
from shardlm.config.load import describe, flatten, load_config, parse_overrides
from shardlm.config.load import config_from_dict
from shardlm.errors import ConfigError

NESTED = ["train.local_sgd.every", "train.local_sgd.outer", "train.local_sgd.outer_lr",
          "train.local_sgd.outer_momentum"]


def test_nested_keys_are_listed_and_documented():
    assert [k for k in valid_keys() if k.startswith("train.local_sgd")] == NESTED
    text = describe()
    assert "  # local_sgd: " in text and "  local_sgd.every = 0\n      With parallel.dp_replicate" in text


@pytest.mark.parametrize("toml", ['[train]\nlocal_sgd = {every = 4, outer = "diloco", outer_lr = 0.5}\n',
                                  '[train.local_sgd]\nevery = 4\nouter = "diloco"\nouter_lr = 0.5\n',
                                  '[train]\nlocal_sgd.every = 4\nlocal_sgd.outer = "diloco"\n'
                                  'local_sgd.outer_lr = 0.5\n'])
def test_toml_forms_and_the_command_line_agree(tmp_path, toml):
    path = tmp_path / "c.toml"
    path.write_text(toml)
    from_file = load_config(path)
    from_cli = load_config(overrides=parse_overrides(
        ["--train.local_sgd.every=4", "--train.local_sgd.outer", "diloco", "--train.local_sgd.outer_lr=0.5"]))
    assert from_file == from_cli
    assert (from_file.train.local_sgd.every, from_file.train.local_sgd.outer,
            from_file.train.local_sgd.outer_lr, from_file.train.local_sgd.outer_momentum) == (4, "diloco", 0.5, 0.9)
    # the command line beats the file, key by key
    both = load_config(path, {"train.local_sgd.every": "8"})
    assert both.train.local_sgd.every == 8 and both.train.local_sgd.outer == "diloco"


def test_unknown_nested_key_and_section_given_a_value(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config key 'train\.local_sgd\.evry'.*'train\.local_sgd\.every'"):
        load_config(overrides={"train.local_sgd.evry": "4"})
    with pytest.raises(ConfigError, match=r"'train\.local_sgd' is a section, not a value.*train\.local_sgd\.every"):
        load_config(overrides={"train.local_sgd": "4"})
    path = tmp_path / "c.toml"
    path.write_text("[train]\nlocal_sgd = {every = 4, outr = 'diloco'}\n")
    with pytest.raises(ConfigError, match=r"train\.local_sgd\.outr.*train\.local_sgd\.outer"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"train\.local_sgd\.every must be an int, got 'often'"):
        load_config(overrides={"train.local_sgd.every": "often"})


def test_nested_values_are_validated():
    cfg = load_config(overrides={"train.local_sgd.every": "-1", "train.local_sgd.outer": "adam",
                                 "train.local_sgd.outer_lr": "nan", "train.local_sgd.outer_momentum": "1"})
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    text = str(err.value)
    for fragment in ("train.local_sgd.every = -1 must be >= 0 (0 = off)",
                     "train.local_sgd.outer = 'adam'; choose one of diloco, average",
                     "train.local_sgd.outer_lr = nan must be a finite number",
                     "train.local_sgd.outer_momentum = 1.0 must be in [0, 1)"):
        assert fragment in text
    broken = Config()
    broken.train.local_sgd = 4  # built in Python: reported, not a crash
    with pytest.raises(ConfigError, match=r"train\.local_sgd must be a LocalSGDConfig, not int"):
        broken.validate()


def test_nested_section_round_trips_through_saved_configs(tmp_path):
    cfg = load_config(overrides={"train.local_sgd.every": "3", "train.local_sgd.outer_momentum": "0.5"})
    tree = cfg.to_dict()
    assert tree["train"]["local_sgd"] == {"every": 3, "outer": "diloco", "outer_lr": 0.7, "outer_momentum": 0.5}
    assert config_from_dict(json.loads(json.dumps(tree))) == cfg  # a run's config.json, a manifest
    assert load_config(overrides=flatten(tree)) == cfg
    from shardlm.checkpoint.weights import CONFIG, load_config_json  # what eval / export read back

    (tmp_path / CONFIG).write_text(json.dumps(tree, indent=2))
    assert load_config_json(tmp_path) == cfg
    from shardlm.train.tracking import flat_config  # trackers get scalars, nested keys dotted

    assert flat_config(tree)["train.local_sgd.every"] == 3
