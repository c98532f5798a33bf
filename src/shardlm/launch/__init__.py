"""A process and what it starts with: which rank it is and on which device and backend
(runtime.py, the one place that reads the launcher's environment variables), starting local
ranks (spawn.py) or a cluster's (torchrun.py, spec.py, targets.py: torchrun, SLURM, Kubernetes,
Vertex AI; trainjob.py: Kubeflow Trainer v2; skypilot.py; schema_check.py: against the schemas
vendored in schemas/), the C heap's policy (allocator.py), disk checks before a run
(preflight.py) and writes a reader never sees torn (files.py); caches read and written in one
place, atomically, a damaged one moved aside and measured again (cache_files.py); a dead rank
said in one line, the detail in the run's launcher.log (failures.py, relay.py: the ranks'
tracebacks held back from the console).

Imports `shardlm.errors` and `shardlm.config` only; every layer above may use it."""
