"""What `shardlm launch` knows about one job (`LaunchSpec`) and the shell words every target
writes from it: the torchrun line with a rendezvous endpoint that a shell expands. The targets
themselves are in targets.py (torchrun, slurm, k8s, vertex), trainjob.py (Kubeflow Trainer v2)
and skypilot.py. Text only: no torch import."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from shardlm.errors import ConfigError
from shardlm.launch.torchrun import nnodes_arg, torchrun_argv

RDZV_PORT = 29500
RDZV_PLACEHOLDER = f"HEAD_NODE:{RDZV_PORT}"
"""The torchrun target's rendezvous endpoint when --rdzv-endpoint is not given: replace HEAD_NODE
with the first node's address (the same placeholder `shardlm plan` prints)."""
VERTEX_ACCELERATOR = "NVIDIA_TESLA_A100"
RUNS_MOUNT = "/runs"
"""Where the targets that mount a volume for the run directory (trainjob: a PersistentVolumeClaim,
skypilot: a bucket) mount it, unless the config's run.dir is an absolute path."""
VOLUME_TARGETS = ("trainjob", "skypilot")
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


@dataclass
class LaunchSpec:
    """One job: `nodes` x `gpus_per_node` ranks training `train_args` (the arguments after
    `shardlm train`: the config path as given, then the overrides)."""

    target: str
    nodes: int
    gpus_per_node: int
    train_args: list[str]
    job_name: str
    image: str = ""
    rdzv_endpoint: str = ""
    max_restarts: int = 0
    machine_type: str = ""
    accelerator: str = VERTEX_ACCELERATOR
    min_nodes: int = 0
    """torchrun only: an elastic job of min_nodes to `nodes` machines (--nnodes=MIN:MAX); 0 = fixed."""
    run_mount: str = RUNS_MOUNT
    """trainjob, skypilot: where the run directory's volume is mounted (`run_dir_args`)."""
    volume: str = ""
    """The volume holding the run directory. trainjob: a PersistentVolumeClaim; skypilot: a
    SkyPilot volume (`sky volumes apply`), or '' for `bucket`."""
    bucket: str = ""
    """skypilot: the bucket holding the run directory when there is no `volume`."""
    runtime: bool = False
    """trainjob: also write the ClusterTrainingRuntime the TrainJob references."""
    install: str = ""
    """skypilot: what the task's setup pip-installs on every node ('' = nothing: the image has it)."""

    @property
    def nnodes(self) -> str:
        return nnodes_arg(self.nodes, self.min_nodes)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


def shell(argv: list[str], raw: tuple[str, ...] = ()) -> str:
    """argv as one shell line; arguments in `raw` are written as they are (they expand shell
    variables, e.g. --rdzv-endpoint="$head_node:29500")."""
    return " ".join(a if a in raw else shlex.quote(a) for a in argv)


def shell_line(spec: LaunchSpec, endpoint_arg: str, id_arg: str = "", after_endpoint: str = "") -> str:
    """`torchrun_argv` as a shell line whose --rdzv-endpoint (and --rdzv-id) are the given
    shell words, written unquoted so that the shell expands their variables; `after_endpoint`,
    another such word, follows the endpoint."""
    argv = torchrun_argv(spec.nodes, spec.gpus_per_node, "@", spec.train_args, spec.job_name,
                         spec.max_restarts)
    argv = [endpoint_arg if a.startswith("--rdzv-endpoint=") else
            id_arg if id_arg and a.startswith("--rdzv-id=") else a for a in argv]
    if after_endpoint:
        argv.insert(argv.index(endpoint_arg) + 1, after_endpoint)
    return shell(argv, raw=tuple(a for a in (endpoint_arg, id_arg, after_endpoint) if a))


def run_dir_args(target: str, run_dir: str) -> tuple[str, list[str]]:
    """(where the run directory's volume is mounted, train arguments to add) for a target that
    mounts one: every node's ranks and every restart must find the checkpoints, so the run
    directory is on the volume. The default run.dir ('runs', relative) becomes RUNS_MOUNT; an
    absolute run.dir is mounted where it is; any other relative one is refused (relative to a
    working directory the spec does not know)."""
    if target not in VOLUME_TARGETS:
        return "", []
    if run_dir.startswith("/"):
        return run_dir.rstrip("/") or "/", []
    if run_dir == "runs":
        return RUNS_MOUNT, [f"--run.dir={RUNS_MOUNT}"]
    raise ConfigError(f"run.dir = {run_dir!r} is relative: --target {target} mounts a volume for the "
                      f"run directory; give an absolute run.dir (the volume is mounted there) or leave "
                      f"run.dir unset (mounted at {RUNS_MOUNT})")
