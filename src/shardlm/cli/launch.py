"""`shardlm launch`: its options, and the command that checks the config as `shardlm train`
would for N x G ranks, then writes (and submits) the target's job (launch/targets.py;
docs/launch.md)."""

from __future__ import annotations

import argparse
import sys

from shardlm.cli.train import dry_run
from shardlm.errors import ConfigError


def launch_args(sub) -> None:
    """`shardlm launch`: the options of the cluster-launch subcommand (docs/launch.md)."""
    from shardlm.launch.targets import RDZV_PLACEHOLDER, RUNS_MOUNT, TARGETS
    from shardlm.launch.trainjob import DEFAULT_CLAIM

    p = sub.add_parser(
        "launch", help="write (and --submit) a multi-node job for torchrun, SLURM, Kubernetes "
                       "(PyTorchJob, TrainJob), Vertex AI, SkyPilot or Ray Train from a train config",
        description="The same CONFIG and --section.key=value overrides as `shardlm train`, checked "
                    "the same way for NODES x GPUS_PER_NODE ranks, written as TARGET's job: "
                    "torchrun lines per node, an sbatch script, a Kubeflow PyTorchJob, a Kubeflow "
                    "Trainer TrainJob, a Vertex AI CustomJob, a SkyPilot task or a Ray Train script "
                    "(N x G workers). The config path is "
                    "passed as given: it must exist on the workers too (in the image, or a shared "
                    "file system), or use --inline. See docs/launch.md.")
    p.add_argument("config", nargs="?", help="TOML config file (optional)")
    p.add_argument("--target", required=True, choices=TARGETS)
    p.add_argument("--nodes", type=int, required=True, metavar="N", help="machines (one torchrun agent each)")
    p.add_argument("--gpus-per-node", type=int, required=True, metavar="G",
                   help="worker processes per machine; world size = N x G")
    p.add_argument("--image", default="",
                   help="container image with shardlm (k8s, trainjob, vertex: required; skypilot: "
                        "optional, the nodes' docker image)")
    p.add_argument("--out", metavar="FILE", help="also write the spec to FILE (stdout gets it either way)")
    p.add_argument("--submit", action="store_true",
                   help="submit it: sbatch (slurm), kubectl create (k8s, trainjob), the Vertex AI SDK "
                        "(vertex, pip install 'shardlm[vertex]'), sky jobs launch (skypilot), python (ray: "
                        "runs the script here, pip install 'shardlm[ray]')")
    p.add_argument("--job-name", default="", metavar="NAME",
                   help="job name, also run.name unless the config sets one (default shardlm-<time>)")
    p.add_argument("--rdzv-endpoint", default="", metavar="HOST:PORT",
                   help=f"torchrun target: the c10d rendezvous, on node 0 (default {RDZV_PLACEHOLDER}, "
                        f"a placeholder to replace)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="K",
                   help="torchrun's --max-restarts for every agent (workers resume from the latest "
                        "checkpoint); trainjob --runtime: also the JobSet's restarts of every pod; ray: "
                        "Ray Train's FailureConfig(max_failures)")
    p.add_argument("--min-nodes", type=int, default=0, metavar="M",
                   help="torchrun target: an elastic job of M to N nodes (--nnodes=M:N); the gang "
                        "restarts at each change of members, resharded from the latest checkpoint")
    p.add_argument("--inline", action="store_true",
                   help="pass the config file's settings as overrides, so the workers need no copy of it")
    p.add_argument("--gpu-type", metavar="DEVICE",
                   help="also run `train --dry-run --gpus NxGxDEVICE` (e.g. A100-80GB) before writing: "
                        "the auto plan and memory per rank for that cluster (report on stderr)")
    p.add_argument("--json", action="store_true", help="k8s, trainjob, skypilot: JSON instead of YAML")
    p.add_argument("--accelerator", default=None,
                   help="vertex: the accelerator type (default NVIDIA_TESLA_A100); skypilot: the "
                        "accelerator name, G per node (default A100)")
    trainjob = p.add_argument_group("trainjob (Kubeflow Trainer v2)")
    trainjob.add_argument("--runtime", action="store_true",
                          help="also write the ClusterTrainingRuntime the TrainJob references (named "
                               "after the job); without it, the Trainer's stock torch-distributed")
    p.add_argument("--volume", default=None, metavar="NAME",
                   help=f"the volume holding the run directory, mounted at {RUNS_MOUNT}: trainjob, a "
                        f"PersistentVolumeClaim (default {DEFAULT_CLAIM}; ReadWriteMany for N > 1); "
                        f"skypilot, a SkyPilot volume instead of --bucket")
    sky = p.add_argument_group("skypilot")
    sky.add_argument("--bucket", default=None, metavar="NAME",
                     help=f"the bucket holding the run directory, mounted at {RUNS_MOUNT} on every "
                          f"node (default JOB-runs unless --volume; created if missing, kept after)")
    sky.add_argument("--install", default=None, metavar="SPEC",
                     help="what the task's setup pip-installs on every node (default '.': the synced "
                          "workdir, a shardlm checkout; none with --image)")
    vertex = p.add_argument_group("vertex")
    vertex.add_argument("--machine-type", default="",
                        help="default a2-highgpu-{G}g (a2-megagpu-16g for 16) with the default accelerator")
    vertex.add_argument("--project", help="with --submit: Google Cloud project (default: the SDK's)")
    vertex.add_argument("--region", default="us-central1", help="with --submit (default us-central1)")


def cmd_launch(args: argparse.Namespace, overrides: list[str]) -> int:
    """`shardlm launch`: validate the config as `train` does for N x G ranks, then render, check,
    print, write (--out) and submit (--submit) the target's job. Nothing is written or submitted
    unless every check passed."""
    import contextlib
    import tempfile
    from pathlib import Path

    import shardlm.launch.targets as lt
    from shardlm.config.load import load_config, parse_overrides
    from shardlm.config.dims import grad_accum_for
    from shardlm.launch.run_dir import unique_run_name

    if args.nodes < 1 or args.gpus_per_node < 1:
        raise ConfigError(f"--nodes {args.nodes} and --gpus-per-node {args.gpus_per_node} must be >= 1")
    cfg = load_config(args.config, parse_overrides(overrides)).validate()
    # The layout (and train.global_batch) fits N x G ranks, as `train --nproc` checks; an
    # elastic job, every size it may run at.
    for nodes in range(max(1, args.min_nodes or args.nodes), args.nodes + 1):
        grad_accum_for(cfg.train, cfg.parallel, nodes * args.gpus_per_node)
    if args.gpu_type:  # the dry run's report is not part of the spec: it goes to stderr
        with contextlib.redirect_stdout(sys.stderr):
            dry_run(argparse.Namespace(gpus=f"{args.nodes}x{args.gpus_per_node}x{args.gpu_type}",
                                       nproc=0), cfg)
    name = args.job_name or f"shardlm-{unique_run_name()}"
    train_args = (lt.inline_args(args.config, overrides) if args.inline
                  else ([args.config] if args.config else []) + list(overrides))
    if not cfg.run.name:  # every node's rank 0 and every restart find the same run directory
        train_args.append(f"--run.name={name}")
    mount, run_dir_args = lt.run_dir_args(args.target, cfg.run.dir)  # a volume's targets: on it
    train_args += run_dir_args
    spec = lt.LaunchSpec(args.target, args.nodes, args.gpus_per_node, train_args, name, args.image,
                         args.rdzv_endpoint, args.max_restarts, args.machine_type,
                         min_nodes=args.min_nodes, run_mount=mount or lt.RUNS_MOUNT,
                         runtime=args.runtime, **_target_options(args, name))
    lt.check_spec(spec)
    if args.submit:
        lt.check_submit(args.target)
    text = lt.render(spec, args.json)
    lt.validate_text(spec, text)
    sys.stdout.write(text)
    path = Path(args.out) if args.out else None
    if path is not None:
        try:
            path.write_text(text)
        except OSError as e:
            raise ConfigError(f"cannot write --out {str(path)!r}: {e.strerror or e}") from None
        print(f"shardlm: wrote {path}", file=sys.stderr)
    if args.submit:
        if path is None:
            structured = ".json" if text.startswith("{") else ".yaml"
            suffix = {"slurm": ".sbatch", "vertex": ".json", "ray": ".py"}.get(args.target, structured)
            with tempfile.NamedTemporaryFile("w", suffix=suffix, prefix=f"{name}-", delete=False) as f:
                f.write(text)
            path = Path(f.name)
        print(f"shardlm: {lt.submit(spec, path, args.project, args.region)}", file=sys.stderr)
    return 0


def _target_options(args: argparse.Namespace, name: str) -> dict:
    """The options that belong to one target, refused on another; their defaults by target."""
    from shardlm.launch.skypilot import default_bucket
    from shardlm.launch.targets import ACCELERATORS
    from shardlm.launch.trainjob import DEFAULT_CLAIM

    owners = {"--accelerator": (args.accelerator, tuple(ACCELERATORS)),
              "--runtime": (args.runtime or None, ("trainjob",)),
              "--volume": (args.volume, ("trainjob", "skypilot")),
              "--bucket": (args.bucket, ("skypilot",)), "--install": (args.install, ("skypilot",))}
    for option, (value, targets) in owners.items():
        if value is not None and args.target not in targets:
            raise ConfigError(f"{option} is for --target {' or '.join(targets)}, not {args.target}")
    if args.volume is not None and args.bucket is not None:
        raise ConfigError("--volume and --bucket: the run directory is on one of them, give one")
    volume = args.volume or (DEFAULT_CLAIM if args.target == "trainjob" else "")
    sky = args.target == "skypilot"
    bucket = (args.bucket or default_bucket(name)) if sky and not volume else ""
    install = args.install if args.install is not None else ("" if args.image else ".")
    return {"accelerator": args.accelerator or ACCELERATORS.get(args.target, ""), "volume": volume,
            "bucket": bucket, "install": install if sky else ""}
