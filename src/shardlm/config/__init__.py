"""What a run is, before any process starts: the typed config tree (schema.py; its [model] and [lora]
sections model.py) and its reading (load.py),
what a valid config is (rules.py), the named model shapes (presets.py), a
transformers config.json as one (hf_shapes.py, by family hf_families.py and the registry
families/, one file per family), the degrees of
parallelism (dims.py) and pipeline schedules as data (pipeline_tables.py).

Pure data and arithmetic: no torch import at module level, nothing here starts processes or
touches devices. Imports only `shardlm.errors`. Every other package reads a run's config through
this package's names (`from shardlm.config import Config, load_config`)."""

from shardlm.config.load import (config_from_dict, describe, flatten, load_config, parse_overrides,
                                 typed_overrides)
from shardlm.config.model import LoRAConfig, ModelConfig
from shardlm.config.schema import (OFFLOAD_TIERS, ActivationConfig, CheckpointConfig, Config,
                                   DataConfig, LocalSGDConfig, ParallelConfig, PrecisionConfig, RunConfig,
                                   TrainConfig, ZeroConfig, field_docs, sections, valid_keys)

__all__ = ["OFFLOAD_TIERS", "ActivationConfig", "CheckpointConfig", "Config", "DataConfig",
           "LoRAConfig", "LocalSGDConfig", "ModelConfig", "ParallelConfig", "PrecisionConfig", "RunConfig",
           "TrainConfig", "ZeroConfig", "config_from_dict", "describe", "field_docs", "flatten",
           "load_config", "parse_overrides", "sections", "typed_overrides", "valid_keys"]
