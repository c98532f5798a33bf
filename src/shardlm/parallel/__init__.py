"""Parallelism strategies: each `apply_*` transforms a plain model in place and logs what it did."""
