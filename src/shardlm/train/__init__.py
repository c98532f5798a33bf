"""The run: `build_run` (build.py), the training step (step.py: the features' parts by their
hooks) and the loop (loop.py, read top to bottom), the run's checkpoints as the loop saves and
resumes them, every 'auto' decided once (resolve.py), a saved run's evaluation (evaluate.py),
what a run reports (telemetry.py: JSONL, progress, peaks) and where else it reports it
(tracking.py: TensorBoard / W&B / MLflow, profiler, time split).

The top of the library: imports every package below it except `studies` and `cli`."""
