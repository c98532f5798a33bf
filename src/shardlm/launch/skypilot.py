"""`shardlm launch --target skypilot`: a SkyPilot task (for `sky launch` or `sky jobs launch`,
SkyPilot 0.14): `num_nodes` machines with G accelerators each, a setup that installs shardlm, and
a run script that starts one torchrun agent per node. SkyPilot gives every node
SKYPILOT_NODE_IPS (one address a line, the head node first), SKYPILOT_NODE_RANK and
SKYPILOT_NUM_GPUS_PER_NODE: the c10d rendezvous is on the first address, port 29500, hosted by
node rank 0 (`--rdzv-conf=is_host`, so no agent has to guess from its hostname); the line is
otherwise the one every target writes (torchrun_argv). The run directory is a bucket mounted on
every node (MOUNT_CACHED: written locally, uploaded behind), or a SkyPilot volume (--volume: a
shared file system, e.g. a Kubernetes PVC), so a recovered job finds its checkpoints. Checked
offline against SkyPilot's task schema (schema_check)."""

from __future__ import annotations

import shlex

from shardlm.launch.spec import RDZV_PORT, LaunchSpec, shell_line

SKYPILOT_ACCELERATOR = "A100"
ENDPOINT_ARG = f'--rdzv-endpoint="$head_node:{RDZV_PORT}"'
IS_HOST_ARG = '--rdzv-conf=is_host="$is_host"'
BUCKET_MODE = "MOUNT_CACHED"


def default_bucket(job_name: str) -> str:
    return f"{job_name}-runs"


def run_script(spec: LaunchSpec) -> str:
    """The task's `run`: every node checks that the cluster is the N x G the config was checked
    for, then execs its torchrun agent."""
    n, g = spec.nodes, spec.gpus_per_node
    return "\n".join([
        'head_node=$(echo "$SKYPILOT_NODE_IPS" | head -n 1)',
        f'if [ "$SKYPILOT_NUM_NODES" != {n} ] || [ "$SKYPILOT_NUM_GPUS_PER_NODE" != {g} ]; then',
        f'  echo "shardlm: this cluster is $SKYPILOT_NUM_NODES node(s) x $SKYPILOT_NUM_GPUS_PER_NODE '
        f'GPU(s); the job was checked for {n} x {g}" >&2',
        "  exit 1",
        "fi",
        'is_host=$([ "$SKYPILOT_NODE_RANK" = 0 ] && echo 1 || echo 0)',
        "exec " + shell_line(spec, ENDPOINT_ARG, after_endpoint=IS_HOST_ARG),
        "",
    ])


def skypilot_task(spec: LaunchSpec) -> dict:
    """The task as a mapping (written as YAML). `workdir: .` is synced to every node (the config
    path is passed as given, relative to it); setup pip-installs spec.install unless it is ''."""
    resources = {"accelerators": f"{spec.accelerator}:{spec.gpus_per_node}"}
    if spec.image:
        resources["image_id"] = f"docker:{spec.image}"
    task = {"name": spec.job_name, "num_nodes": spec.nodes, "resources": resources, "workdir": "."}
    if spec.volume:
        task["volumes"] = {spec.run_mount: spec.volume}
    else:
        task["file_mounts"] = {spec.run_mount: {"name": spec.bucket, "mode": BUCKET_MODE, "persistent": True}}
    if spec.install:
        task["setup"] = f"pip install {shlex.quote(spec.install)}"
    task["run"] = run_script(spec)
    return task


def problems(spec: LaunchSpec, task) -> list[str]:
    """What is wrong with the parsed task: SkyPilot's schema, then what it cannot say."""
    from shardlm.launch.schema_check import skypilot_errors

    out = skypilot_errors(task)
    if out:
        return out
    if task.get("num_nodes") != spec.nodes:
        out.append(f"num_nodes {task.get('num_nodes')}, expected {spec.nodes}")
    accelerators = task.get("resources", {}).get("accelerators", "")
    if not isinstance(accelerators, str) or not accelerators.endswith(f":{spec.gpus_per_node}"):
        out.append(f"resources.accelerators {accelerators!r}: not {spec.gpus_per_node} per node")
    if spec.volume and task.get("volumes", {}).get(spec.run_mount) != spec.volume:
        out.append(f"no volume {spec.volume!r} at {spec.run_mount}")
    if not spec.volume and task.get("file_mounts", {}).get(spec.run_mount, {}).get("name") != spec.bucket:
        out.append(f"no bucket {spec.bucket!r} at {spec.run_mount}")
    lines = task.get("run", "").splitlines()
    runs = [ln for ln in lines if ln.startswith("exec torchrun ")]
    if len(runs) != 1:
        return out + [f"{len(runs)} torchrun line(s) in run"]
    argv = shlex.split(runs[0])[1:]
    want = [f"--nnodes={spec.nodes}", f"--nproc-per-node={spec.gpus_per_node}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=$head_node:{RDZV_PORT}", "--rdzv-conf=is_host=$is_host"]
    out += [f"run: missing {w}" for w in want if w not in argv]
    if argv[-len(spec.train_args) - 3:] != ["-m", "shardlm", "train", *spec.train_args]:
        out.append("run: the train command is not the last")
    if 'head_node=$(echo "$SKYPILOT_NODE_IPS" | head -n 1)' not in lines:
        out.append("run: the head node is not SKYPILOT_NODE_IPS' first line")
    return out
