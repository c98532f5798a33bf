"""parallel.fault_tolerant: replicas, each its own world (one process, or pp x dp_shard x cp x tp
ranks: ZeRO shards over dp_shard x cp, experts over ep of them), averaged over the quorum of live
ones at every step (torchft's Lighthouse and Manager, our own smaller code). launcher.py is the
launcher half (the coordination store, each replica's processes, a dead replica restarted
whole); quorum.py the worker half (the round's quorum, its gloo group per local rank, commit or
retry). The training run's use of them (the step's average, the state a rejoining replica
receives) is train/fault_tolerance.py.

Collectives: the gradient (shard) all-reduce and the state broadcast over the quorum's group, in
quorum.py."""
