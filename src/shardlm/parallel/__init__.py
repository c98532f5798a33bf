"""Parallelism strategies: each `apply_*` transforms a plain model in place and logs what it did
(build.py's parallelize applies them in order). Imports every layer up to checkpoint; the planner
and train use it. One folder per axis (tensor/, context/, pipeline/, expert/, data/ with ZeRO in data/zero/ and
fault tolerance in data/fault_tolerant/), and blocks/ (activation checkpointing, offload,
compile); each folder's __init__ says what its axis cuts and where its collectives are.
parallel/pipeline/{tables,schedules}.py are torch-free and sit at the config layer, which reads them:
this __init__ imports nothing."""
