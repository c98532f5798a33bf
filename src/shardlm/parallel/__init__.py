"""Parallelism strategies: each `apply_*` transforms a plain model in place and logs what it did
(build.py's parallelize applies them in order). Imports every layer up to zero; the planner
and train use it."""
