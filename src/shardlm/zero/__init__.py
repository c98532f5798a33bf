"""The ZeRO engine: one engine for stages 0-3 (what is sharded over the dp_shard group), its
offload tiers, and the optimizers it steps (optim.py: AdamW or Muon, the schedule; muon.py).
Imports every layer up to checkpoint; parallel and above use it."""
