"""The ZeRO engine: one engine for stages 0-3 (what is sharded over the dp_shard group), its
offload tiers, and the optimizers it steps (optim.py: AdamW or Muon, the schedule; muon.py).
Part of data parallelism (parallel/data/): the engine that parallel/data/engine.py chooses
for any number of ranks."""
