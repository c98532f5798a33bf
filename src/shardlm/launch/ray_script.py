"""`shardlm launch --target ray`: a Python script that runs the config as a Ray Train
`TorchTrainer` (shardlm.integrations.ray.fit) with N x G workers, one rank each, and up to
--max-restarts restarts (Ray's FailureConfig(max_failures)). Run where `ray.init()` finds the
cluster: on its head node, through `ray job submit`, or with RAY_ADDRESS set; `--submit` runs it
here. Text only, like every target: no ray or torch import; checked by parsing it back (ast)."""

from __future__ import annotations

import ast

from shardlm.launch.spec import LaunchSpec

ENTRY = "from shardlm.integrations.ray import fit"


def render(spec: LaunchSpec) -> str:
    args = "".join(f"    {a!r},\n" for a in spec.train_args)
    return (
        "#!/usr/bin/env python3\n"
        f'"""shardlm launch --target ray: {spec.nodes} node(s) x {spec.gpus_per_node} workers = '
        f"world size {spec.world_size},\n"
        "as a Ray Train TorchTrainer: each worker is one rank of `shardlm train` (GPUs when the\n"
        "config's run.device asks for them or, 'auto', when the cluster has them).\n\n"
        "Run it where ray.init() finds the cluster: on its head node (python THIS.py), through the\n"
        "Jobs API (ray job submit --working-dir . -- python THIS.py), or with RAY_ADDRESS set. The run\n"
        "directory (run.dir / run.name, Ray's experiment directory) must be one path on every node (a\n"
        "shared file system): a restarted worker group resumes there from the newest checkpoint.\n"
        "A run that fails more than MAX_FAILURES times raises ray.train.TrainingFailedError.\n"
        '"""\n'
        f"{ENTRY}\n\n"
        f"TRAIN_ARGS = [  # what follows `shardlm train`\n{args}]\n"
        f"NUM_WORKERS = {spec.world_size}\n"
        f"MAX_FAILURES = {spec.max_restarts}  # worker-group restarts, each from the latest checkpoint\n\n"
        'if __name__ == "__main__":\n'
        "    result = fit(TRAIN_ARGS, num_workers=NUM_WORKERS, max_failures=MAX_FAILURES)\n"
        '    print(f"shardlm: Ray Train run {result.path}: {result.metrics}; checkpoint {result.checkpoint}")\n')


def problems(spec: LaunchSpec, text: str) -> list[str]:
    """What is wrong with the script: it parses, imports the entry, and says the train arguments,
    the world size and the restarts of the spec."""
    try:
        tree = ast.parse(text)
    except SyntaxError as e:
        return [f"does not parse: {e}"]
    values = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                values[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                pass
    out = [] if ENTRY in text.splitlines() else ["no import of shardlm.integrations.ray.fit"]
    want = {"TRAIN_ARGS": spec.train_args, "NUM_WORKERS": spec.world_size, "MAX_FAILURES": spec.max_restarts}
    out += [f"{k} is {values.get(k)!r}, expected {v!r}" for k, v in want.items() if values.get(k) != v]
    return out
