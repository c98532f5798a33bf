"""Data parallelism: the batch cut over the dp_replicate × dp_shard ranks, and what ZeRO shards
over dp_shard × cp. engine.py chooses the engine once (LocalEngine: one process, the reference;
or zero/'s ZeroEngine, stages 0-3 and its offload tiers, local SGD / DiLoCo); evaluation.py's
metrics are sums that add over ranks; fault_tolerant/ is parallel.fault_tolerant's replicas.

Collectives: the gradients' reduce-scatter / all-reduce and the parameters' all-gathers in
zero/engine.py and zero/params.py (fp8_gather.py, muon.py, local_sgd.py their variants), the
metric sums' all-reduce in evaluation.py, the live replicas' average in fault_tolerant/quorum.py."""
