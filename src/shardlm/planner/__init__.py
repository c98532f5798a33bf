"""The planner: predict memory and speed before a run, choose the strategy, explain why.

workload.py  what is planned (Workload, Strategy on a dims.ParallelDims, Dtypes), its
             validation, and the parameters each rank holds (shared by memory.py and timing.py)
memory.py    per-rank memory by category (ZeRO formulas, buffers, host memory)
activations.py  saved activations per block and their peak (Korthikanti et al. 2022)
timing.py    time per step (compute at the measured or catalog rate, communication with
             overlap, pipeline bubble, optimizer)
traffic.py   bytes the tp / cp / ep / pp groups move, as the runtime's ledger counts them
search.py    the strategy search, plan_for_run (the trainer) and predict_local (the
             validation benchmark)
explain.py   why the winner wins: the sentences under `shardlm plan`'s table
report.py    text tables and JSON for `shardlm estimate` and `shardlm plan`
cost.py      time to train, cost, energy and CO2 of a token budget; ranking by cost
shapes.py    models from the command line: presets, config.json, --params N in a --family

(`search` is the module; its function is shardlm.planner.search.search.)
Pure functions: no torch import (except for measuring this CPU), no process group, no
allocation. Formulas and sources: docs/planner.md.
"""
