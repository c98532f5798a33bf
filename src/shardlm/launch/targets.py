"""`shardlm launch --target T`: the same config and overrides as `shardlm train`, written out as
what a cluster runs — torchrun lines for each node, a SLURM sbatch script, a Kubeflow PyTorchJob
manifest, a Kubeflow Trainer v2 TrainJob (trainjob.py), a Vertex AI CustomJob or a SkyPilot task
(skypilot.py) or a Ray Train script (ray_script.py) — and optionally submitted (sbatch, kubectl,
the Vertex AI SDK, sky; the Ray script is run). Every target but ray starts one torchrun agent per
node (`torchrun_argv`, the one builder of the multi-node command
line) with a c10d rendezvous; the agents start --gpus-per-node workers each.

Nothing here imports torch: generating a spec is text. The config is validated by the caller
(cli.cmd_launch) before anything is written. See docs/launch.md.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

from shardlm.errors import ConfigError
from shardlm.launch import ray_script, skypilot, trainjob
from shardlm.launch.spec import (DNS_LABEL, RDZV_PLACEHOLDER, RDZV_PORT, RUNS_MOUNT,  # noqa: F401
                                 VERTEX_ACCELERATOR, LaunchSpec, run_dir_args, shell, shell_line)
from shardlm.launch.torchrun import torchrun_argv

TARGETS = ("torchrun", "slurm", "k8s", "trainjob", "vertex", "skypilot", "ray")
PYTORCHJOB_API = "kubeflow.org/v1"
VERTEX_MACHINES = {1: "a2-highgpu-1g", 2: "a2-highgpu-2g", 4: "a2-highgpu-4g", 8: "a2-highgpu-8g",
                   16: "a2-megagpu-16g"}
"""--machine-type's default for NVIDIA_TESLA_A100 by GPUs per node (Compute Engine's A2 series)."""
ACCELERATORS = {"vertex": VERTEX_ACCELERATOR, "skypilot": skypilot.SKYPILOT_ACCELERATOR}
"""--accelerator's default by target (the targets that name one)."""
CONTAINER_TARGETS = ("k8s", "trainjob", "vertex")
_RFC1035 = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def check_spec(spec: LaunchSpec) -> None:
    """Refuse what no target could run: raised before anything is written."""
    if spec.target not in TARGETS:
        raise ConfigError(f"--target {spec.target!r}: choose one of {', '.join(TARGETS)}")
    if spec.nodes < 1 or spec.gpus_per_node < 1:
        raise ConfigError(f"--nodes {spec.nodes} and --gpus-per-node {spec.gpus_per_node} must be >= 1")
    if spec.max_restarts < 0:
        raise ConfigError(f"--max-restarts {spec.max_restarts} must be >= 0")
    if spec.min_nodes and spec.target != "torchrun":
        raise ConfigError(f"--min-nodes (an elastic job) is for --target torchrun; {spec.target} "
                          f"runs a fixed number of nodes")
    if not 0 <= spec.min_nodes <= spec.nodes:
        raise ConfigError(f"--min-nodes {spec.min_nodes} must be in [1, --nodes {spec.nodes}]")
    if spec.min_nodes and spec.min_nodes < spec.nodes and not spec.max_restarts:
        raise ConfigError(f"--min-nodes {spec.min_nodes} < --nodes {spec.nodes}: a node that leaves "
                          f"fails the other nodes' workers, which go on only by a restart; give "
                          f"--max-restarts K (at least the departures to survive)")
    if not DNS_LABEL.match(spec.job_name):
        raise ConfigError(f"--job-name {spec.job_name!r}: use lowercase letters, digits and '-' "
                          f"(at most 63, starting and ending with a letter or digit: a Kubernetes "
                          f"name, valid for every target)")
    if spec.target in CONTAINER_TARGETS and not spec.image:
        raise ConfigError(f"--target {spec.target} needs --image IMAGE: a container image with "
                          f"shardlm installed (and the config file, unless --inline)")
    if spec.target == "trainjob" and not _RFC1035.match(spec.job_name):
        raise ConfigError(f"--job-name {spec.job_name!r}: a TrainJob's name starts with a letter "
                          f"(an RFC 1035 label: the Trainer's CRD refuses any other)")
    if spec.target == "trainjob" and not DNS_LABEL.match(spec.volume):
        raise ConfigError(f"--volume {spec.volume!r}: a PersistentVolumeClaim name (lowercase letters, "
                          f"digits and '-')")
    if spec.target == "skypilot" and not spec.volume and not _BUCKET.match(spec.bucket):
        raise ConfigError(f"--bucket {spec.bucket!r}: a bucket name of 3 to 63 lowercase letters, "
                          f"digits, '-' and '.'")
    if spec.rdzv_endpoint and spec.target != "torchrun":
        raise ConfigError(f"--rdzv-endpoint is for --target torchrun; {spec.target} finds the "
                          f"first node itself (docs/launch.md)")
    if spec.rdzv_endpoint and not re.match(r"^[^\s:]+:\d+$", spec.rdzv_endpoint):
        raise ConfigError(f"--rdzv-endpoint {spec.rdzv_endpoint!r}: write HOST:PORT")
    if spec.target == "vertex" and not spec.machine_type and spec.gpus_per_node not in VERTEX_MACHINES:
        raise ConfigError(f"--gpus-per-node {spec.gpus_per_node} has no default Vertex machine type "
                          f"(defaults exist for {sorted(VERTEX_MACHINES)} x A100): give --machine-type")


# -- the targets ----------------------------------------------------------------------------


def render_torchrun(spec: LaunchSpec) -> str:
    endpoint = spec.rdzv_endpoint or RDZV_PLACEHOLDER
    line = shell(torchrun_argv(spec.nodes, spec.gpus_per_node, endpoint, spec.train_args,
                                spec.job_name, spec.max_restarts, spec.min_nodes))
    host = endpoint.rsplit(":", 1)[0]
    elastic = (f" (elastic: {spec.min_nodes} to {spec.nodes} nodes, world size "
               f"{spec.min_nodes * spec.gpus_per_node} to {spec.world_size})"
               if spec.nnodes != str(spec.nodes) else "")
    out = [f"# shardlm launch --target torchrun: {spec.nodes} node(s) x {spec.gpus_per_node} "
           f"processes = world size {spec.world_size}{elastic}",
           f"# c10d rendezvous at {endpoint}: the agent on {host} hosts it, the others join; start "
           f"one line on each node (any order)."]
    if endpoint == RDZV_PLACEHOLDER:
        out.append("# HEAD_NODE is a placeholder: replace it with node 0's address (or pass "
                   "--rdzv-endpoint HOST:PORT).")
    for node in range(spec.nodes):
        out += [f"# node {node}" + (f" ({host})" if node == 0 else ""), line]
    return "\n".join(out) + "\n"


def render_slurm(spec: LaunchSpec) -> str:
    endpoint = f'--rdzv-endpoint="$head_node:{RDZV_PORT}"'
    rdzv_id = '--rdzv-id="$SLURM_JOB_ID"'
    line = shell_line(spec, endpoint, rdzv_id)
    return "\n".join([
        "#!/bin/bash",
        f"# shardlm launch --target slurm: {spec.nodes} node(s) x {spec.gpus_per_node} GPUs = "
        f"world size {spec.world_size}; one torchrun agent per node (srun, one task per node)",
        f"#SBATCH --job-name={spec.job_name}",
        f"#SBATCH --nodes={spec.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={spec.gpus_per_node}",
        f"#SBATCH --output={spec.job_name}-%j.out",
        "set -euo pipefail",
        "# the c10d rendezvous is hosted by the agent on the job's first node",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "srun " + line,
        "",
    ])


def k8s_manifest(spec: LaunchSpec) -> dict:
    """A Kubeflow training-operator PyTorchJob: one pod per node (Master 1, Worker nodes - 1),
    each running a torchrun agent whose rendezvous is the operator's MASTER_ADDR:MASTER_PORT
    (Kubernetes expands $(VAR) in a container's command from its environment)."""
    command = torchrun_argv(spec.nodes, spec.gpus_per_node, "$(MASTER_ADDR):$(MASTER_PORT)",
                            spec.train_args, spec.job_name, spec.max_restarts)

    def replica(count: int) -> dict:
        return {"replicas": count, "restartPolicy": "OnFailure", "template": {"spec": {"containers": [{
            "name": "pytorch", "image": spec.image, "command": list(command),
            "resources": {"limits": {"nvidia.com/gpu": spec.gpus_per_node}}}]}}}

    replicas = {"Master": replica(1)}
    if spec.nodes > 1:
        replicas["Worker"] = replica(spec.nodes - 1)
    return {"apiVersion": PYTORCHJOB_API, "kind": "PyTorchJob",
            "metadata": {"name": spec.job_name, "labels": {"app.kubernetes.io/created-by": "shardlm"}},
            "spec": {"nprocPerNode": str(spec.gpus_per_node), "pytorchReplicaSpecs": replicas}}


def vertex_job(spec: LaunchSpec) -> dict:
    """A Vertex AI CustomJob (REST form, as `gcloud ai custom-jobs create --config` and the API
    take it): worker pool 0 the primary replica, pool 1 the other nodes. Vertex sets MASTER_ADDR
    and MASTER_PORT (the primary replica) in every replica; a shell expands them into the
    torchrun agent's rendezvous."""
    line = shell_line(spec, f'--rdzv-endpoint="$MASTER_ADDR:${{MASTER_PORT:-{RDZV_PORT}}}"')
    machine = {"machineType": spec.machine_type or VERTEX_MACHINES[spec.gpus_per_node],
               "acceleratorType": spec.accelerator, "acceleratorCount": spec.gpus_per_node}

    def pool(count: int) -> dict:
        return {"machineSpec": dict(machine), "replicaCount": count,
                "containerSpec": {"imageUri": spec.image, "command": ["sh", "-c", "exec " + line]}}

    pools = [pool(1)] + ([pool(spec.nodes - 1)] if spec.nodes > 1 else [])
    return {"displayName": spec.job_name, "jobSpec": {"workerPoolSpecs": pools}}


def _yaml(docs: list[dict]) -> str | None:
    """YAML documents ('---' between them); a string of several lines as a literal block (a
    SkyPilot run script reads as the script)."""
    try:
        import yaml
    except ImportError:
        return None

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper, value: str):
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)

    Dumper.add_representer(str, text)
    return yaml.dump_all(docs, Dumper=Dumper, sort_keys=False, default_flow_style=False, width=100)


def render(spec: LaunchSpec, as_json: bool = False) -> str:
    """The target's text. k8s, trainjob, skypilot: YAML when pyyaml is installed (and not
    `as_json`), else JSON (kubectl and sky take either; trainjob's documents as a v1 List)."""
    check_spec(spec)
    if spec.target == "torchrun":
        return render_torchrun(spec)
    if spec.target == "slurm":
        return render_slurm(spec)
    if spec.target == "ray":
        return ray_script.render(spec)
    if spec.target == "vertex":
        return json.dumps(vertex_job(spec), indent=2) + "\n"
    docs = {"k8s": lambda: [k8s_manifest(spec)], "trainjob": lambda: trainjob.trainjob_docs(spec),
            "skypilot": lambda: [skypilot.skypilot_task(spec)]}[spec.target]()
    text = None if as_json else _yaml(docs)
    if text is not None:
        return text
    return json.dumps(docs[0] if len(docs) == 1 else trainjob.as_list(docs), indent=2) + "\n"


# -- offline checks ---------------------------------------------------------------------------


def validate_text(spec: LaunchSpec, text: str) -> None:
    """Check the written text parses and says what it should (world size, rendezvous, command);
    an AssertionError-free pass is what `launch` requires before printing or writing."""
    problems = _problems(spec, text)
    if problems:
        raise ConfigError(f"the generated {spec.target} spec is not valid (a bug in shardlm): "
                          + "; ".join(problems))


def _problems(spec: LaunchSpec, text: str) -> list[str]:
    if spec.target == "ray":
        return ray_script.problems(spec, text)
    out: list[str] = []
    want = [f"--nnodes={spec.nnodes}", f"--nproc-per-node={spec.gpus_per_node}", "--rdzv-backend=c10d"]
    if spec.target in ("torchrun", "slurm"):
        lines = text.splitlines()
        runs = [ln for ln in lines if ln.startswith(("torchrun ", "srun torchrun "))]
        if len(runs) != (spec.nodes if spec.target == "torchrun" else 1):
            out.append(f"{len(runs)} torchrun line(s)")
        for ln in runs:
            argv = shlex.split(ln)
            out += [f"missing {w}" for w in want if w not in argv]
            if argv[-len(spec.train_args) - 3:] != ["-m", "shardlm", "train", *spec.train_args]:
                out.append("the train command is not the last")
        if spec.target == "slurm":
            if lines[0] != "#!/bin/bash":
                out.append("no shebang")
            for d in (f"--nodes={spec.nodes}", "--ntasks-per-node=1", f"--gpus-per-node={spec.gpus_per_node}"):
                if f"#SBATCH {d}" not in lines:
                    out.append(f"no #SBATCH {d}")
        return out
    if spec.target in ("trainjob", "skypilot"):
        try:
            docs = _load_documents(text)
        except ValueError as e:
            return [f"does not parse: {e}"]
        if spec.target == "skypilot":
            return skypilot.problems(spec, docs[0]) if len(docs) == 1 else [f"{len(docs)} documents"]
        return trainjob.problems(spec, docs)
    if spec.target == "k8s":
        tree = _load_yaml_or_json(text)
        if tree.get("apiVersion") != PYTORCHJOB_API or tree.get("kind") != "PyTorchJob":
            out.append("not a kubeflow.org/v1 PyTorchJob")
        if not DNS_LABEL.match(str(tree.get("metadata", {}).get("name", ""))):
            out.append("metadata.name is not a DNS label")
        job = tree.get("spec", {})
        if job.get("nprocPerNode") != str(spec.gpus_per_node):
            out.append("nprocPerNode")
        reps = job.get("pytorchReplicaSpecs", {})
        counts = {k: v.get("replicas") for k, v in reps.items()}
        expected = {"Master": 1, **({"Worker": spec.nodes - 1} if spec.nodes > 1 else {})}
        if counts != expected:
            out.append(f"replicas {counts}, expected {expected}")
        for name, rep in reps.items():
            containers = rep.get("template", {}).get("spec", {}).get("containers", [])
            if len(containers) != 1 or not containers[0].get("image"):
                out.append(f"{name}: one container with an image")
                continue
            c = containers[0]
            out += [f"{name}: missing {w}" for w in want if w not in c.get("command", [])]
            if c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu") != spec.gpus_per_node:
                out.append(f"{name}: nvidia.com/gpu limit")
        return out
    tree = json.loads(text)
    pools = tree.get("jobSpec", {}).get("workerPoolSpecs", [])
    if [p.get("replicaCount") for p in pools] != [1] + ([spec.nodes - 1] if spec.nodes > 1 else []):
        out.append("replica counts")
    for p in pools:
        m = p.get("machineSpec", {})
        if not m.get("machineType") or m.get("acceleratorCount") != spec.gpus_per_node:
            out.append("machineSpec")
        command = p.get("containerSpec", {}).get("command", [])
        if not p.get("containerSpec", {}).get("imageUri") or command[:2] != ["sh", "-c"]:
            out.append("containerSpec")
        elif any(w not in shlex.split(command[2]) for w in want):
            out.append("the torchrun line")
    return out


def _load_documents(text: str) -> list:
    """JSON (one document, or a v1 List's items) or YAML documents."""
    try:
        tree = json.loads(text)
    except json.JSONDecodeError:
        import yaml  # only YAML when pyyaml wrote it

        try:
            return list(yaml.safe_load_all(text))
        except yaml.YAMLError as e:
            raise ValueError(str(e)) from None
    if isinstance(tree, dict) and tree.get("kind") == "List" and tree.get("apiVersion") == "v1":
        return list(tree.get("items", []))
    return [tree]


def _load_yaml_or_json(text: str) -> dict:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        import yaml  # only YAML when pyyaml wrote it

        return yaml.safe_load(text)


# -- --inline: the config file's settings as overrides ----------------------------------------


def inline_args(config: str | None, overrides: list[str]) -> list[str]:
    """The train arguments without the config file: its settings as --section.key=value overrides
    before the given ones (so the workers need no copy of the file). Refused when an override
    cannot say a value the same way (checked: both forms load to the same config)."""
    from shardlm.config.load import flatten, load_config, parse_overrides

    if config is None:
        return list(overrides)
    values = flatten(tomllib.loads(Path(config).read_text(encoding="utf-8")))
    args = []
    for key, value in values.items():
        if isinstance(value, (list, dict)):
            raise ConfigError(f"--inline: {key} = {value!r} is not a plain value; ship the config "
                              f"file in the image or on a shared file system instead")
        text = str(value).lower() if isinstance(value, bool) else str(value)
        args.append(f"--{key}={text}")
    args += overrides
    same = (load_config(None, parse_overrides(args)).to_dict()
            == load_config(config, parse_overrides(overrides)).to_dict())
    if not same:
        raise ConfigError("--inline: the config file's values do not survive as overrides; ship the "
                          "file in the image or on a shared file system instead")
    return args


# -- submission -------------------------------------------------------------------------------

SUBMIT_TOOLS = {"slurm": ("sbatch", "SLURM's client tools (run it on the cluster's login node)"),
                "k8s": ("kubectl", "kubectl, configured for a cluster with the Kubeflow training "
                                   "operator (PyTorchJob)"),
                "trainjob": ("kubectl", "kubectl, configured for a cluster with Kubeflow Trainer v2 "
                                        "(TrainJob, v2.2 or later)"),
                "skypilot": ("sky", "SkyPilot's client (pip install skypilot, then `sky check`)")}


def check_submit(target: str) -> None:
    """Before anything is written: the tool --submit needs exists, or a clear error."""
    if target == "torchrun":
        raise ConfigError("--submit: --target torchrun has no scheduler to submit to; run the "
                          "printed line on each node")
    if target == "ray":
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            raise ConfigError("--submit --target ray runs the script here and needs Ray Train: pip "
                              "install 'shardlm[ray]'")
        return
    if target in SUBMIT_TOOLS:
        tool, what = SUBMIT_TOOLS[target]
        if shutil.which(tool) is None:
            raise ConfigError(f"--submit needs `{tool}` on PATH ({what}); without it, write the "
                              f"spec with --out FILE and submit it where {tool} is")
        return
    try:
        import google.cloud.aiplatform  # noqa: F401
    except ImportError:
        raise ConfigError("--submit --target vertex needs the Vertex AI SDK: pip install "
                          "'shardlm[vertex]' (google-cloud-aiplatform), then `gcloud auth "
                          "application-default login`") from None


def submit(spec: LaunchSpec, path: Path, project: str | None, region: str) -> str:
    """Submit the written spec at `path`; returns what the tool said. The Ray script is run here
    (its workers' output shows as it goes), to the end of the run."""
    if spec.target == "ray":
        import sys

        done = subprocess.run([sys.executable, str(path)])
        if done.returncode != 0:
            raise ConfigError(f"{sys.executable} {path} failed (status {done.returncode})")
        return f"ran {path}: the Ray Train run finished"
    if spec.target in SUBMIT_TOOLS:
        argv = {"slurm": ["sbatch", str(path)],
                "skypilot": ["sky", "jobs", "launch", "--yes", "--name", spec.job_name, str(path)],
                }.get(spec.target, ["kubectl", "create", "-f", str(path)])
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            raise ConfigError(f"{' '.join(argv)} failed (status {done.returncode}): "
                              f"{(done.stderr or done.stdout).strip()}")
        return done.stdout.strip()
    from google.cloud import aiplatform

    job = json.loads(path.read_text())
    aiplatform.init(project=project, location=region)
    custom = aiplatform.CustomJob(display_name=job["displayName"],
                                  worker_pool_specs=[_snake(p) for p in job["jobSpec"]["workerPoolSpecs"]])
    custom.submit()
    return f"submitted Vertex AI CustomJob {custom.resource_name}"


def _snake(tree):
    """REST camelCase keys as the SDK's snake_case field names."""
    if isinstance(tree, dict):
        return {re.sub(r"(?<!^)([A-Z])", r"_\1", k).lower(): _snake(v) for k, v in tree.items()}
    return [_snake(v) for v in tree] if isinstance(tree, list) else tree
