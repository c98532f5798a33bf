"""The ZeRO engine: one engine for stages 0-3 (what is sharded over the dp_shard group)."""
