"""What a run is, before any process starts: the typed config tree (schema.py; its [model] and [lora]
sections model.py) and its reading (load.py),
what a valid config is (rules.py), the named model shapes (presets.py), a
transformers config.json as one (hf_shapes.py, by family hf_families.py and the registry
families/, one file per family), the degrees of
parallelism (dims.py). Pipeline schedules as data live with their axis (parallel/pipeline/tables.py,
schedules.py: torch-free, read from here as if at this layer).

Pure data and arithmetic: no torch import at module level, nothing here starts processes or
touches devices. Imports only `shardlm.errors` (and the pipeline's tables). Every other package imports a run's
config from the module that defines it (`from shardlm.config.schema import Config`)."""
