"""`shardlm launch --target trainjob`: a Kubeflow Trainer v2 TrainJob (trainer.kubeflow.org/
v1alpha1, as in kubeflow/trainer v2.3.0) and, with --runtime, the ClusterTrainingRuntime it
references. The runtime is a JobSet template: one replicated job `node` of N pods (mlPolicy
numNodes), each one torchrun agent over G GPUs. The Trainer's torch plugin sets PET_MASTER_ADDR
(the first pod, `JOB-node-0-0.JOB`) and PET_MASTER_PORT (29500) in the `node` container, and
Kubernetes expands $(VAR) in its command: the same c10d rendezvous as every target.

Since Trainer v2.2 the runtime's torch policy has no numProcPerNode or elasticPolicy: processes
per node are the TrainJob's trainer.numProcPerNode. The run directory is a PersistentVolumeClaim
mounted into every `node` pod by the TrainJob's runtimePatches, so it works with the stock
`torch-distributed` runtime too. Checked offline against the CRDs' schemas (schema_check)."""

from __future__ import annotations

from shardlm.launch.spec import LaunchSpec
from shardlm.launch.torchrun import torchrun_argv

TRAINER_API = "trainer.kubeflow.org/v1alpha1"
TRAINER_GROUP = "trainer.kubeflow.org"
STOCK_RUNTIME = "torch-distributed"
"""The ClusterTrainingRuntime a TrainJob references without --runtime: the torch runtime that
Kubeflow Trainer installs (manifests/base/runtimes/torch_distributed.yaml)."""
NODE = "node"
"""The Trainer's name for the trainer's replicated job and its container (constants.Node)."""
ENDPOINT = "$(PET_MASTER_ADDR):$(PET_MASTER_PORT)"
RUNS_VOLUME = "runs"
DEFAULT_CLAIM = "shardlm-runs"
PATCH_MANAGER = "shardlm"
_LABELS = {"app.kubernetes.io/created-by": "shardlm"}


def command(spec: LaunchSpec) -> list[str]:
    return torchrun_argv(spec.nodes, spec.gpus_per_node, ENDPOINT, spec.train_args, spec.job_name,
                         spec.max_restarts)


def trainjob_docs(spec: LaunchSpec) -> list[dict]:
    """[ClusterTrainingRuntime (with --runtime),] TrainJob: the documents to apply, in order."""
    gpus = {"nvidia.com/gpu": spec.gpus_per_node}
    runtime_name = spec.job_name if spec.runtime else STOCK_RUNTIME
    volume = {"name": RUNS_VOLUME, "persistentVolumeClaim": {"claimName": spec.volume}}
    mount = {"name": RUNS_VOLUME, "mountPath": spec.run_mount}
    pod_patch = {"volumes": [volume], "containers": [{"name": NODE, "volumeMounts": [mount]}]}
    job = {
        "apiVersion": TRAINER_API, "kind": "TrainJob",
        "metadata": {"name": spec.job_name, "labels": dict(_LABELS)},
        "spec": {
            "runtimeRef": {"name": runtime_name, "apiGroup": TRAINER_GROUP, "kind": "ClusterTrainingRuntime"},
            "trainer": {"image": spec.image, "command": command(spec), "numNodes": spec.nodes,
                        "numProcPerNode": spec.gpus_per_node, "resourcesPerNode": {"limits": gpus}},
            "runtimePatches": [{"manager": PATCH_MANAGER, "trainingRuntimeSpec": {"template": {"spec": {
                "replicatedJobs": [{"name": NODE, "template": {"spec": {"template": {"spec": pod_patch}}}}],
            }}}}],
        },
    }
    return ([runtime_doc(spec)] if spec.runtime else []) + [job]


def runtime_doc(spec: LaunchSpec) -> dict:
    """A ClusterTrainingRuntime named after the job: the stock torch runtime's shape (the
    `trainjob-ancestor-step: trainer` label is how the Trainer finds the trainer's pods) plus a
    restart policy: a failed pod fails its Job (backoffLimit 0, restartPolicy Never) and the
    JobSet recreates every pod, up to --max-restarts times; the new gang resumes from the latest
    checkpoint on the volume."""
    pod = {"restartPolicy": "Never", "containers": [{"name": NODE, "image": spec.image}]}
    return {
        "apiVersion": TRAINER_API, "kind": "ClusterTrainingRuntime",
        "metadata": {"name": spec.job_name, "labels": {"trainer.kubeflow.org/framework": "torch", **_LABELS}},
        "spec": {
            "mlPolicy": {"numNodes": spec.nodes, "torch": {}},
            "template": {"spec": {
                "failurePolicy": {"maxRestarts": spec.max_restarts},
                "replicatedJobs": [{"name": NODE, "template": {
                    "metadata": {"labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}},
                    "spec": {"backoffLimit": 0, "template": {"spec": pod}},
                }}],
            }},
        },
    }


def as_list(docs: list[dict]) -> dict:
    """Several documents as one JSON object kubectl takes (a v1 List)."""
    return {"apiVersion": "v1", "kind": "List", "items": docs}


def problems(spec: LaunchSpec, docs: list[dict]) -> list[str]:
    """What is wrong with the parsed documents: each against its CRD's schema, then what the
    schema cannot say (counts, the command, the volume, the runtime reference)."""
    from shardlm.launch.schema_check import trainer_errors

    kinds = [d.get("kind") if isinstance(d, dict) else None for d in docs]
    expected = (["ClusterTrainingRuntime"] if spec.runtime else []) + ["TrainJob"]
    if kinds != expected:
        return [f"documents {kinds}, expected {expected}"]
    out = [e for d in docs for e in trainer_errors(d)]
    if out:
        return out
    job = docs[-1]["spec"]
    trainer = job["trainer"]
    if (trainer.get("numNodes"), trainer.get("numProcPerNode")) != (spec.nodes, spec.gpus_per_node):
        out.append("trainer.numNodes / numProcPerNode")
    if trainer.get("resourcesPerNode", {}).get("limits", {}).get("nvidia.com/gpu") != spec.gpus_per_node:
        out.append("trainer.resourcesPerNode nvidia.com/gpu limit")
    if not trainer.get("image"):
        out.append("trainer.image")
    argv = trainer.get("command", [])
    want = [f"--nnodes={spec.nodes}", f"--nproc-per-node={spec.gpus_per_node}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={ENDPOINT}"]
    out += [f"trainer.command: missing {w}" for w in want if w not in argv]
    if argv[-len(spec.train_args) - 3:] != ["-m", "shardlm", "train", *spec.train_args]:
        out.append("trainer.command: the train command is not the last")
    out += _volume_problems(spec, job.get("runtimePatches", []))
    if spec.runtime:
        out += _runtime_problems(spec, docs[0], job["runtimeRef"]["name"])
    elif job["runtimeRef"]["name"] != STOCK_RUNTIME:
        out.append(f"runtimeRef {job['runtimeRef']['name']!r}, expected {STOCK_RUNTIME!r}")
    return out


def _volume_problems(spec: LaunchSpec, patches: list) -> list[str]:
    """The run directory's claim, mounted at spec.run_mount in the `node` container."""
    try:
        [patch] = patches
        [node] = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
        pod = node["template"]["spec"]["template"]["spec"]
        claims = [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if v["name"] == RUNS_VOLUME]
        mounts = [m["mountPath"] for c in pod["containers"] if c["name"] == NODE
                  for m in c["volumeMounts"] if m["name"] == RUNS_VOLUME]
    except (KeyError, ValueError, TypeError) as e:
        return [f"runtimePatches: no run volume for {NODE!r} ({type(e).__name__}: {e})"]
    if node["name"] != NODE or claims != [spec.volume] or mounts != [spec.run_mount]:
        return [f"the run volume: claim {claims}, mounted at {mounts} in {node['name']!r}"]
    return []


def _runtime_problems(spec: LaunchSpec, runtime: dict, ref: str) -> list[str]:
    out = [] if runtime["metadata"]["name"] == ref else [f"runtimeRef {ref!r} is not the runtime written"]
    policy = runtime["spec"].get("mlPolicy", {})
    if policy.get("numNodes") != spec.nodes or "torch" not in policy:
        out.append("runtime mlPolicy: numNodes and torch")
    label = "trainer.kubeflow.org/trainjob-ancestor-step"
    try:
        [node] = [j for j in runtime["spec"]["template"]["spec"]["replicatedJobs"] if j["name"] == NODE]
        labelled = node["template"]["metadata"]["labels"][label] == "trainer"
        containers = [c["name"] for c in node["template"]["spec"]["template"]["spec"]["containers"]]
    except (KeyError, ValueError) as e:
        return out + [f"runtime: no replicated job {NODE!r} labelled {label} ({type(e).__name__}: {e})"]
    if not labelled or containers != [NODE]:
        out.append(f"runtime: the replicated job {NODE!r} labelled {label}: trainer, one container {NODE!r}")
    return out
