"""The `shardlm` command: train, launch, generate, export, presets, estimate, plan, study, compare."""

from __future__ import annotations

import argparse
import logging
import sys

from shardlm.cli_planner import calibrate_args, cmd_calibrate, cmd_estimate, cmd_plan, planner_args
from shardlm.compare import cmd_compare, compare_args
from shardlm.errors import ConfigError
from shardlm.studies import cmd_study, study_args
from shardlm.preflight import DISK_EXIT, DiskError, check_run_disks, nvme_bytes

EPILOG = """\
examples:
  shardlm train                                   train the default small GPT on the built-in corpus
  shardlm train configs/gpt2-124m.toml --train.steps=100
  shardlm train --model.preset=llama-tiny --precision.compute=bf16
  shardlm train --nproc 2 --checkpoint.every=100 --max-restarts 2
                                                  2 workers; a dead worker restarts the gang from
                                                  the latest checkpoint
  shardlm train --resume                          continue the newest run that has a checkpoint
  shardlm train --nproc 2 --parallel.zero_stage=3 --dry-run
                                                  resolve and check the config, print the layout
                                                  and the predicted memory per rank; no training
  shardlm train --help-config                     every config key, its default and meaning
  shardlm launch --target slurm --nodes 2 --gpus-per-node 8 configs/gpt2-124m.toml --train.steps=100
                                                  an sbatch script for 2 x 8 ranks (also torchrun,
                                                  k8s, vertex; --out FILE, --submit)
  shardlm generate --checkpoint runs/latest --prompt "def fib("
  shardlm eval --checkpoint runs/latest --data.val_source=test.parquet
                                                  val_loss, val_perplexity, val_token_accuracy
  shardlm export --checkpoint runs/latest --format hf --out hf-model/
  shardlm export --checkpoint runs/latest --format peft --out adapter/
                                                  a LoRA run's adapters for peft (--format hf
                                                  --merge: folded into the weights)
  shardlm compare runs/candidate runs/reference --rtol 1e-4
                                                  two runs' loss, grad norm, tokens/s, memory per
                                                  step; exit status 1 from the first step whose
                                                  loss differs beyond the tolerance
  shardlm presets                                 the named model shapes
  shardlm estimate --model gpt2-1.5b --gpus 8xV100-16GB --zero-stage 3 --micro-batch 4 --seq 1024
                                                  per-rank memory by category, with formulas, and
                                                  whether it fits (exit status 1 if it does not)
  shardlm estimate --params 7.5e9 --gpus 64xV100-32GB --zero-stage 1 --precision fp16
  shardlm plan --model llama-7b --gpus 2x8xA100-80GB
                                                  ranked strategies that fit, and why the best wins
  shardlm plan --model gpt-mini --gpus 2xcpu --runtime-only --json
  shardlm study max-batch --gpus 8xV100-16GB      a study measured here (each point a train run) and
                                                  predicted on the cluster: report.md, PNGs, JSONL
                                                  (also offload-rescue, zero-sweep, strategies,
                                                  scaling; --quick: seconds)
  shardlm plan --model llama-7b --gpus 8xA100-80GB --tokens 1e10 --cloud aws
                                                  with time to train, cost, energy and CO2 for
                                                  1e10 tokens (list price, --price-per-hour USD)
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardlm", description="Train language models efficiently on one device or many.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    train = sub.add_parser(
        "train", help="train a model (config file + --section.key=value overrides)",
        description="Train a model. Settings: defaults < model preset < CONFIG (TOML) < overrides "
                    "such as --train.steps=100. See --help-config for every key.")
    train.add_argument("config", nargs="?", help="TOML config file (optional)")
    train.add_argument("--help-config", action="store_true", help="list every config key and exit")
    train.add_argument("--nproc", type=int, default=0, metavar="N",
                       help="start N local worker processes (torch's elastic launcher); "
                            "under torchrun leave this out")
    train.add_argument("--max-restarts", type=int, default=0, metavar="K",
                       help="with --nproc: when a worker dies, restart all of them (up to K "
                            "times); they resume from the run's latest checkpoint")
    train.add_argument("--dry-run", action="store_true",
                       help="resolve and validate the whole config (the auto plan too), print the "
                            "resolved layout and the predicted memory per rank, and exit without "
                            "training (status 0 if it is valid, whether or not it fits)")
    train.add_argument("--gpus", metavar="CLUSTER",
                       help="with --dry-run: predict for this cluster (8xA100-80GB, "
                            "2x8xH100-80GB) instead of this machine; its size is the world size")
    train.add_argument("--resume", nargs="?", const="", default=None, metavar="PATH",
                       help="continue from a checkpoint: a run directory (its latest), a "
                            "checkpoint directory, or nothing for the newest run under run.dir "
                            "that has one. The run continues in that run's directory unless "
                            "run.name is given")
    _launch_args(sub)
    gen = sub.add_parser("generate", help="sample text from a trained run (a KV cache: the prompt "
                                          "runs once, then one token per step)")
    gen.add_argument("--checkpoint", default="runs/latest", help="run directory (default runs/latest)")
    gen.add_argument("--prompt", default="def ", help="text to continue; for an encoder-decoder "
                                                      "(seq2seq) run, the source to transform")
    gen.add_argument("--tokens", type=int, default=200, help="tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=50)
    gen.add_argument("--beams", type=int, default=1,
                     help="beam search with this many beams (encoder-decoder runs, --temperature 0)")
    gen.add_argument("--no-cache", action="store_true",
                     help="recompute the whole context for every token (decoder-only; for comparison)")
    gen.add_argument("--seed", type=int, default=0)
    ev = sub.add_parser("eval", help="a trained run's val_loss, val_perplexity and "
                                     "val_token_accuracy on its held-out split (or --data.* "
                                     "overrides: e.g. --data.val_source=test.parquet), one JSON line")
    ev.add_argument("--checkpoint", default="runs/latest", help="run directory (default runs/latest)")
    sub.add_parser("presets", help="list the named model shapes with parameter counts")
    exp = sub.add_parser("export", help="write a trained run in another library's format")
    exp.add_argument("--checkpoint", default="runs/latest", help="run directory (default runs/latest)")
    exp.add_argument("--format", choices=["hf", "peft"], default="hf",
                     help="hf: a transformers directory (the class of the run's model.family: GPT-2, "
                          "Llama, Qwen, Gemma, ... docs/finetuning.md; a LoRA run's base, or "
                          "merged with --merge); "
                          "peft: a LoRA run's adapters (adapter_config.json + "
                          "adapter_model.safetensors) for that base")
    exp.add_argument("--merge", action="store_true",
                     help="with --format hf, a LoRA run: fold the adapters into the weights, "
                          "W + (alpha/r) B A")
    exp.add_argument("--out", required=True, help="output directory")
    exp.add_argument("--force", action="store_true",
                     help="write into a non-empty output directory (files of the same names are "
                          "replaced)")
    est = sub.add_parser(
        "estimate", help="per-rank memory and step time of one configuration, before running it",
        description="Predict per-rank memory by category (with the formula behind each line), "
                    "whether it fits, and the step time. Pure arithmetic: no GPU, no processes. "
                    "Exit status 0 if it fits, 1 if it does not.")
    planner_args(est)
    est.add_argument("--zero-stage", type=int, default=0, choices=[0, 1, 2, 3])
    est.add_argument("--micro-batch", type=int, default=1, metavar="B", help="sequences per rank per pass")
    est.add_argument("--grad-accum", type=int, default=1, metavar="M", help="micro-batches per step")
    est.add_argument("--dp-replicate", type=int, default=1, metavar="R")
    est.add_argument("--dp-shard", type=int, default=-1, metavar="N", help="-1: every rank left")
    for name, what in (("tp", "tensor-parallel degree"), ("cp", "context-parallel degree"),
                       ("pp", "pipeline-parallel degree (1f1b schedule, balanced split)"),
                       ("ep", "expert-parallel degree (modelled; not in the runtime yet)")):
        est.add_argument(f"--{name}", type=int, default=1, metavar="D", help=what)
    est.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false",
                     help="with --tp > 1: model plain tensor parallelism (default: sequence parallel)")
    est.add_argument("--recompute", default="none", choices=["none", "selective", "full"],
                     help="activation checkpointing (the config's activation.checkpoint)")
    est.add_argument("--offload-optimizer", default="none", choices=["none", "cpu", "nvme"])
    est.add_argument("--offload-params", default="none", choices=["none", "cpu", "nvme"],
                     help="stage 3 only")
    plan = sub.add_parser(
        "plan", help="rank the strategies that fit by predicted throughput, and say why",
        description="Search data/tensor/pipeline/expert parallel degrees, ZeRO stage, offload, "
                    "activation checkpointing and the micro-batch split of a fixed global batch; "
                    "list what fits, fastest first, and explain the choice.")
    planner_args(plan)
    plan.add_argument("--global-batch", type=int, metavar="SEQS",
                      help="sequences per optimizer step (default: --batch-tokens / --seq)")
    plan.add_argument("--batch-tokens", type=int, default=2**20, metavar="TOKENS",
                      help="tokens per optimizer step when --global-batch is not given (1Mi)")
    plan.add_argument("--runtime-only", action="store_true",
                      help="only what `shardlm train` runs today (ep only with tp = cp = 1)")
    plan.add_argument("--top", type=int, default=8, help="plans to list")
    plan.add_argument("--rank-by", choices=["speed", "cost"], default="speed",
                      help="order plans by time to train (speed) or by cost for --tokens (on one "
                           "cluster the two agree: same devices, same price)")
    calibrate_args(sub.add_parser(
        "calibrate", help="time the model's own matmuls on this machine (best of N, cached) against "
                          "the peak and the planner's assumption"))
    study_args(sub)
    compare_args(sub)
    return parser


def _launch_args(sub) -> None:
    """`shardlm launch`: the options of the cluster-launch subcommand (docs/launch.md)."""
    from shardlm.launch_targets import RDZV_PLACEHOLDER, TARGETS, VERTEX_ACCELERATOR

    p = sub.add_parser(
        "launch", help="write (and --submit) a multi-node job for torchrun, SLURM, Kubernetes or "
                       "Vertex AI from a train config",
        description="The same CONFIG and --section.key=value overrides as `shardlm train`, checked "
                    "the same way for NODES x GPUS_PER_NODE ranks, written as TARGET's job: "
                    "torchrun lines per node, an sbatch script, a Kubeflow PyTorchJob or a Vertex AI "
                    "CustomJob. The config path is passed as given: it must exist on the workers "
                    "too (in the image, or a shared file system), or use --inline. See docs/launch.md.")
    p.add_argument("config", nargs="?", help="TOML config file (optional)")
    p.add_argument("--target", required=True, choices=TARGETS)
    p.add_argument("--nodes", type=int, required=True, metavar="N", help="machines (one torchrun agent each)")
    p.add_argument("--gpus-per-node", type=int, required=True, metavar="G",
                   help="worker processes per machine; world size = N x G")
    p.add_argument("--image", default="", help="container image with shardlm (k8s, vertex: required)")
    p.add_argument("--out", metavar="FILE", help="also write the spec to FILE (stdout gets it either way)")
    p.add_argument("--submit", action="store_true",
                   help="submit it: sbatch (slurm), kubectl create (k8s), the Vertex AI SDK (vertex, "
                        "pip install 'shardlm[vertex]')")
    p.add_argument("--job-name", default="", metavar="NAME",
                   help="job name, also run.name unless the config sets one (default shardlm-<time>)")
    p.add_argument("--rdzv-endpoint", default="", metavar="HOST:PORT",
                   help=f"torchrun target: the c10d rendezvous, on node 0 (default {RDZV_PLACEHOLDER}, "
                        f"a placeholder to replace)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="K",
                   help="torchrun's --max-restarts for every agent (workers resume from the latest checkpoint)")
    p.add_argument("--min-nodes", type=int, default=0, metavar="M",
                   help="torchrun target: an elastic job of M to N nodes (--nnodes=M:N); the gang "
                        "restarts at each change of members, resharded from the latest checkpoint")
    p.add_argument("--inline", action="store_true",
                   help="pass the config file's settings as overrides, so the workers need no copy of it")
    p.add_argument("--gpu-type", metavar="DEVICE",
                   help="also run `train --dry-run --gpus NxGxDEVICE` (e.g. A100-80GB) before writing: "
                        "the auto plan and memory per rank for that cluster (report on stderr)")
    p.add_argument("--json", action="store_true", help="k8s: JSON instead of YAML")
    vertex = p.add_argument_group("vertex")
    vertex.add_argument("--machine-type", default="",
                        help="default a2-highgpu-{G}g (a2-megagpu-16g for 16) with the default accelerator")
    vertex.add_argument("--accelerator", default=VERTEX_ACCELERATOR,
                        help=f"Vertex accelerator type (default {VERTEX_ACCELERATOR})")
    vertex.add_argument("--project", help="with --submit: Google Cloud project (default: the SDK's)")
    vertex.add_argument("--region", default="us-central1", help="with --submit (default us-central1)")


def _model_axes(dims, par) -> str:
    """', tp 2 (sequence parallel), cp 2, pp 2 (1f1b), ep 2' for the axes beyond data parallelism."""
    axes = [f"tp {dims.tp}" + (" (sequence parallel)" if par.sequence_parallel else "")] if dims.tp > 1 else []
    axes += [f"cp {dims.cp}"] if dims.cp > 1 else []
    axes += [f"pp {dims.pp} ({par.pp_schedule}" + (f", {par.pp_virtual} chunks per rank" if par.pp_virtual > 1 else "")
             + ")"] if dims.pp > 1 else []
    axes += [f"ep {dims.ep}"] if dims.ep > 1 else []
    return "".join(", " + a for a in axes)


def cmd_train(args: argparse.Namespace, overrides: list[str]) -> int:
    from shardlm.config import describe, load_config, parse_overrides

    if args.help_config:
        print(describe())
        return 0
    parsed = parse_overrides(overrides)
    cfg = load_config(args.config, parsed).validate()
    if args.resume is not None:
        overrides = overrides + resume_overrides(args.resume, cfg)
        cfg = load_config(args.config, parse_overrides(overrides)).validate()
    if args.nproc < 0 or args.max_restarts < 0:
        raise ConfigError(f"--nproc {args.nproc} and --max-restarts {args.max_restarts} must be >= 0 "
                          f"(--nproc 0: no local workers, e.g. under your own torchrun)")
    if args.gpus and not args.dry_run:
        raise ConfigError("--gpus goes with --dry-run (training runs on the devices it is given)")
    if args.dry_run:
        return dry_run(args, cfg)
    if args.max_restarts and not args.nproc:
        raise ConfigError("--max-restarts needs --nproc N (under your own torchrun, pass "
                          "--max-restarts to torchrun)")
    if args.max_restarts and not cfg.checkpoint.every:
        raise ConfigError("--max-restarts restarts workers from the latest checkpoint, but "
                          "checkpoint.every = 0 saves none: add --checkpoint.every=N")
    from shardlm.launch import die_with_launcher

    die_with_launcher()  # a worker of `--nproc N`: it must not outlive its launcher
    preflight(cfg, args.nproc)
    if args.nproc > 0:
        return launch_workers(args, cfg, overrides)
    try:
        return train_here(cfg)
    except DiskError as e:
        print(f"shardlm: stopped: {e}\n{resume_hint(cfg)}", file=sys.stderr)
        return DISK_EXIT


def preflight(cfg, nproc: int) -> None:
    """Before anything is spawned or trained: the run directory, its checkpoints/ and the
    NVMe offload path are writable, and the NVMe path has room for this machine's offload
    files (preflight.nvme_bytes for each local rank); on CUDA, that each local rank has a GPU of
    its own; the inputs are usable (trainer.check_inputs). A ConfigError says what, where, the
    bytes needed and free. Under your own torchrun every rank checks (cheap)."""
    from pathlib import Path

    from shardlm.checkpoint.sharded import CHECKPOINTS
    from shardlm.dims import resolve_dims
    from shardlm.launch import launcher_sizes
    from shardlm.models import count_params
    from shardlm.precision import carrier

    run_dir = Path(cfg.run.dir) / cfg.run.name if cfg.run.name else Path(cfg.run.dir)
    z = cfg.zero
    nvme_dir, needed = None, 0
    if "nvme" in (z.offload_optimizer, z.offload_params):
        nvme_dir = Path(z.nvme_path) if z.nvme_path else run_dir / "offload"
        world, local = (nproc, nproc) if nproc else launcher_sizes()
        try:
            dims = resolve_dims(cfg.parallel, world)
            per_rank = -(-count_params(cfg.model) // (dims.dp_shard * dims.cp * dims.tp))
        except (ConfigError, ValueError, TypeError, AttributeError):  # e.g. a model not ours
            per_rank = 0
        itemsize = {"fp32": 4, "bf16": 2, "fp16": 2}
        optimizer_bytes = (nvme_bytes(per_rank, itemsize[cfg.precision.master], 0, False)
                           if z.offload_optimizer == "nvme" else 0)
        optimizer_bytes *= 2 if cfg.checkpoint.async_ else 1  # an async save's on-disk snapshot
        param_bytes = (per_rank * itemsize.get(carrier(cfg.precision.compute), 4)
                       if z.offload_params == "nvme" else 0)
        needed = local * (optimizer_bytes + param_bytes)
    check_run_disks(run_dir, run_dir / CHECKPOINTS, nvme_dir, needed)
    # One GPU per rank (launch.pick_device): more local ranks than GPUs is refused before spawning.
    from shardlm.launch import pick_device
    from shardlm.trainer import check_inputs

    device = pick_device(cfg.run.device, 0, nproc or launcher_sizes()[1])
    check_inputs(cfg)  # a bad tokenizer, LoRA rank or data file: once, before any worker starts
    from shardlm.models.hf_build import route_line

    line = route_line(cfg)  # which way a model.hf_path trains, said once before any worker starts
    if line and (nproc or launcher_sizes()[0] == 1):
        print(f"shardlm: {line}", flush=True)
    if cfg.precision.compute == "fp8":  # FP8 hardware, or the emulation asked for: known here
        from shardlm.models.fp8 import check_fp8_device

        check_fp8_device(cfg.precision, device)


def resume_hint(cfg) -> str:
    """What was saved last and the command that continues from it (after a disk fault)."""
    from pathlib import Path

    from shardlm.checkpoint.sharded import CheckpointError, latest_in

    if not cfg.run.name:
        return "Resume from the run's last checkpoint with: shardlm train --resume <run directory>"
    run_dir = Path(cfg.run.dir) / cfg.run.name
    try:
        last = latest_in(run_dir)
    except (CheckpointError, OSError):
        last = None
    saved = f"Last checkpoint: {last}." if last else "No checkpoint was saved yet."
    return f"{saved} Resume with: shardlm train --resume {run_dir}"


def train_here(cfg) -> int:
    """Train in this process (one rank of it, under a launcher)."""
    from shardlm.allocator import apply_malloc_policy

    malloc = apply_malloc_policy(cfg.run.malloc_mmap_threshold)  # before any large allocation
    from shardlm.models import count_params
    from shardlm.models.flops import active_params
    from shardlm.launch import note_clean_stop, shutdown
    from shardlm.trainer import build_run, sample_text, state_report, train

    run = build_run(cfg)
    cfg = run.cfg  # parallel.strategy = 'auto' has filled in the plan
    main = run.runtime.is_main
    t = cfg.train
    if main:
        active = active_params(cfg.model)
        module = hasattr(getattr(run.model, "model", None), "config")  # a transformers module
        total = (count_params(cfg.model) if not module  # an encoder-decoder, a causal LM: its own
                 else sum(p.numel() for p in run.model.parameters()))
        size = f"{total / 1e6:.1f}M params" + (
            f", {active / 1e6:.1f}M active" if cfg.model.experts else "")
        print(f"shardlm: {cfg.model.preset} ({size}) on "
              f"{run.runtime.world_size} x {run.runtime.device}, {run.precision.name}, ZeRO stage "
              f"{cfg.parallel.zero_stage}{_model_axes(run.mesh.dims, cfg.parallel)}, "
              f"{run.train_loader.global_batch} x {t.seq_len} tokens/step, "
              f"{t.steps} steps -> {run.run_dir}", flush=True)
    print(f"rank {run.runtime.rank}: {malloc.report()}", flush=True)  # a per-process setting
    lora = getattr(run.model, "lora", None)
    if main and lora is not None:
        print(f"shardlm: {lora.summary()}", flush=True)
    print(state_report(run), flush=True)
    result = train(run)
    val = (f", val loss {result.val_loss:.3f} (perplexity {result.val_perplexity:.2f}, token "
           f"accuracy {result.val_token_accuracy:.1%})" if result.val_loss is not None else "")
    if main and not result.losses:
        print(f"nothing to do: the checkpoint is at step {run.start_step} of {t.steps}")
    elif main:
        print(f"{'stopped' if result.stopped_by else 'done'}: loss {result.losses[0]:.3f} -> "
              f"{result.losses[-1]:.3f}{val}; {result.tokens_per_s:,.0f} tokens/s, MFU "
              f"{result.mfu:.1%} (HFU {result.hfu:.1%}); log {run.run_dir / 'metrics.jsonl'}", flush=True)
    if result.stopped_by:
        if main:
            print(f"stopped by {result.stopped_by} after step {run.start_step + len(result.losses)}; "
                  f"checkpoint saved. Continue with: shardlm train --resume {run.run_dir}", flush=True)
        shutdown(run.runtime)
        note_clean_stop(run.runtime)
        return 0
    if t.sample_tokens > 0:
        text = sample_text(run, t.sample_prompt, t.sample_tokens)  # every rank: stage 3 gathers
        if main:
            print("sample:\n" + text)
    shutdown(run.runtime)
    return 0


def launch_workers(args: argparse.Namespace, cfg, overrides: list[str]) -> int:
    """`--nproc N`: check the layout fits N ranks now (not after spawning), fix one run name
    for all workers, then hand over to torch's elastic launcher on this machine."""
    from shardlm.launch import launch_local, pick_device, unique_run_name
    from shardlm.dims import resolve_dims

    resolve_dims(cfg.parallel, args.nproc)
    if pick_device(cfg.run.device, 0, args.nproc).type == "cpu":
        # This machine's probe (cached per machine), here: rank 0 reads it for the run's
        # prediction (and strategy = 'auto') while the other ranks wait in a collective, which a
        # short parallel.collective_timeout_s would otherwise end while the probe runs.
        from shardlm.hardware.probe import measure_cpu

        measure_cpu(args.nproc)
    argv = ([args.config] if args.config else []) + list(overrides)
    if not cfg.run.name:  # also what lets restarted workers find the run's checkpoints
        argv.append(f"--run.name={unique_run_name()}")
    return launch_local(args.nproc, ["-m", "shardlm", "train", *argv], args.max_restarts)


def dry_run(args: argparse.Namespace, cfg) -> int:
    """`train --dry-run`: everything a run decides before its first step, decided the same way
    (resolve.decide: the auto plan, the auto compute dtype, the checkpoint's dtype on resume) for
    --nproc ranks (or the launcher's WORLD_SIZE, or 1) on this machine, or on --gpus; then the
    planner's memory per rank for the result. Nothing is created, spawned or trained."""
    import os

    from shardlm.checkpoint.sharded import find_checkpoint
    from shardlm.dims import resolve_dims
    from shardlm.hardware.catalog import parse_cluster
    from shardlm.launch import pick_device
    from shardlm.planner import estimate_memory, estimate_time, report
    from shardlm.planner.search import config_strategy
    from shardlm.resolve import decide, local_hardware

    target = parse_cluster(args.gpus) if args.gpus else None
    world = target.world_size if target else (args.nproc or int(os.environ.get("WORLD_SIZE", "1")))
    if target and args.nproc and args.nproc != world:
        raise ConfigError(f"--nproc {args.nproc} but --gpus {args.gpus} has {world} devices")
    device = pick_device(cfg.run.device, 0)
    choice = cfg.checkpoint.resume
    checkpoint = find_checkpoint(choice) if choice not in ("auto", "never") else None
    resolved = decide(cfg, world, device, checkpoint, target)
    cluster = target or local_hardware(device, world)
    workload, strategy = config_strategy(resolved, cluster)
    memory = estimate_memory(workload, strategy, cluster)
    print(report.render_estimate(workload, strategy, cluster, memory,
                                 estimate_time(workload, strategy, cluster), []))
    where = "" if target else f" on {world} x {device.type}"
    print(f"\ndry run: the config is valid{where}; "
          + ("it fits" if memory.fits else "the planner predicts it does NOT fit (see above)")
          + f". Resolved: ZeRO stage {resolved.parallel.zero_stage}"
          f"{_model_axes(resolve_dims(resolved.parallel, world), resolved.parallel)}, precision "
          f"{resolved.precision.compute}, micro-batch {resolved.train.micro_batch} x grad-accum "
          f"{resolved.train.grad_accum}. Nothing was trained.")
    return 0


def resume_overrides(path: str, cfg) -> list[str]:
    """`--resume [PATH]` as config overrides, checked now (before any worker starts): where to
    resume from, and — unless run.name is given — that run's directory to continue in. A run
    directory (its checkpoints/, its `latest`, or no PATH: the newest run that has a checkpoint)
    stays that directory in checkpoint.resume, so the run takes its newest usable checkpoint when
    it loads and falls back past one that fails to load (a corrupted shard: its SHA-256 is only
    checked then), as auto-resume does; a checkpoint directory named explicitly is pinned
    (refused if it fails, no fallback)."""
    from pathlib import Path

    from shardlm.checkpoint.sharded import (CHECKPOINTS, MANIFEST, CheckpointError,
                                            find_checkpoint, latest_in)

    if path:
        ckpt = find_checkpoint(path)
        source = ckpt if (Path(path) / MANIFEST).exists() else Path(path).absolute()
    else:
        runs = Path(cfg.run.dir)
        candidates = ([runs / cfg.run.name] if cfg.run.name else
                      sorted((d for d in runs.iterdir() if d.is_dir() and not d.is_symlink()),
                             key=lambda d: d.stat().st_mtime) if runs.is_dir() else [])
        found = [(d, c) for d, c in ((d, latest_in(d)) for d in candidates) if c is not None]
        if not found:
            raise CheckpointError(f"--resume: no run under {str(runs)!r} has a checkpoint; pass "
                                  f"--resume PATH or train with --checkpoint.every=N")
        source, ckpt = found[-1][0].absolute(), found[-1][1]
    out = [f"--checkpoint.resume={source}"]
    if not cfg.run.name and ckpt.parent.name == CHECKPOINTS:
        run_dir = ckpt.parent.parent
        out += [f"--run.dir={run_dir.parent}", f"--run.name={run_dir.name}"]
    return out


def cmd_launch(args: argparse.Namespace, overrides: list[str]) -> int:
    """`shardlm launch`: validate the config as `train` does for N x G ranks, then render, check,
    print, write (--out) and submit (--submit) the target's job. Nothing is written or submitted
    unless every check passed."""
    import contextlib
    import tempfile
    from pathlib import Path

    import shardlm.launch_targets as lt
    from shardlm.config import load_config, parse_overrides
    from shardlm.dims import grad_accum_for
    from shardlm.launch import unique_run_name

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
    spec = lt.LaunchSpec(args.target, args.nodes, args.gpus_per_node, train_args, name, args.image,
                         args.rdzv_endpoint, args.max_restarts, args.machine_type, args.accelerator,
                         min_nodes=args.min_nodes)
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
            suffix = {"slurm": ".sbatch", "k8s": ".json" if text.startswith("{") else ".yaml"}.get(args.target, ".json")
            with tempfile.NamedTemporaryFile("w", suffix=suffix, prefix=f"{name}-", delete=False) as f:
                f.write(text)
            path = Path(f.name)
        print(f"shardlm: {lt.submit(spec, path, args.project, args.region)}", file=sys.stderr)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from shardlm.checkpoint import load_for_inference
    from shardlm.launch import pick_device
    from shardlm.data.tokenizer import eot_id
    from shardlm.models import generate
    from shardlm.models.hf import CausalLMAdapter, Seq2SeqAdapter
    from shardlm.models.hf_build import generate_causal
    from shardlm.models.seq2seq import generate_seq2seq

    device = pick_device("auto")
    model, tokenizer, cfg = load_for_inference(args.checkpoint, device)
    idx = torch.tensor([tokenizer.encode(args.prompt).ids], device=device)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    if isinstance(model, Seq2SeqAdapter):  # the prompt is the source; the target is printed
        if args.no_cache:
            raise ConfigError("--no-cache is for decoder-only runs; an encoder-decoder generates "
                              "with transformers' own cache")
        # The end token the targets were trained with (data/seq2seq.py): the checkpoint's eos,
        # or our BPE's <|endoftext|>.
        end = model.model.config.eos_token_id if cfg.model.hf_path else eot_id(tokenizer)
        out = generate_seq2seq(model, idx, torch.ones_like(idx), args.tokens, end,
                               temperature=args.temperature, top_k=args.top_k,
                               num_beams=args.beams, generator=generator)
    else:
        if args.beams != 1:
            raise ConfigError(f"--beams {args.beams}: beam search is for encoder-decoder runs; "
                              f"drop --beams (decoder-only runs sample or decode greedily)")
        if isinstance(model, CausalLMAdapter):  # the transformers path: the library's generate
            out = generate_causal(model, idx, args.tokens, temperature=args.temperature,
                                  top_k=args.top_k, generator=generator)
        else:
            out = generate(model, idx, args.tokens, temperature=args.temperature, top_k=args.top_k,
                           generator=generator, use_cache=not args.no_cache)
    print(tokenizer.decode(out[0].tolist()))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from shardlm.export import export_hf, export_peft

    if args.format == "peft":
        if args.merge:
            raise ConfigError("--merge goes with --format hf (a merged transformers model); "
                              "--format peft writes the adapters alone")
        out = export_peft(args.checkpoint, args.out, force=args.force)
        print(f"wrote {out} (load with peft.PeftModel.from_pretrained(base, {str(out)!r}), base: "
              f"`shardlm export --format hf` of the same run)")
        return 0
    out = export_hf(args.checkpoint, args.out, force=args.force, merge=args.merge)
    print(f"wrote {out} (load with transformers.AutoModelForCausalLM.from_pretrained({str(out)!r}))")
    return 0


def cmd_eval(args: argparse.Namespace, overrides: list[str]) -> int:
    import json

    from shardlm.config import parse_overrides
    from shardlm.eval_checkpoint import evaluate_checkpoint

    print(json.dumps(evaluate_checkpoint(args.checkpoint, parse_overrides(overrides))))
    return 0


def cmd_presets() -> int:
    from shardlm.config import ModelConfig
    from shardlm.models import count_params
    from shardlm.models.flops import active_params
    from shardlm.presets import ALIASES, PRESETS

    aliases = {v: k for k, v in ALIASES.items()}
    for name, shape in PRESETS.items():
        cfg = ModelConfig(preset=name, **shape)
        alias = f" (alias {aliases[name]})" if name in aliases else ""
        experts = (f" experts={cfg.experts} top-{cfg.top_k} ({active_params(cfg) / 1e6:.1f}M active)"
                   if cfg.experts else "")
        print(f"{name:21s} {count_params(cfg) / 1e6:10.1f}M  layers={cfg.n_layers:<3d} "
              f"d_model={cfg.d_model:<5d} heads={cfg.n_heads}/{cfg.n_kv_heads or cfg.n_heads} "
              f"vocab={cfg.vocab_size}{experts}{alias}")
    return 0


def joined_overrides(argv: list[str]) -> list[str]:
    """`--section.key value` as `--section.key=value`, so that argparse never takes the value for
    the optional CONFIG positional (`shardlm train --model.hf_path DIR` names no TOML file)."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if (arg.startswith("--") and "=" not in arg and "." in arg and i + 1 < len(argv)
                and not argv[i + 1].startswith("--")):
            out.append(f"{arg}={argv[i + 1]}")
            i += 2
            continue
        out.append(arg)
        i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = _parser()
    args, rest = parser.parse_known_args(joined_overrides(sys.argv[1:] if argv is None else argv))
    try:
        if args.command == "train":
            return cmd_train(args, rest)
        if args.command == "launch":
            return cmd_launch(args, rest)
        if args.command == "eval":
            return cmd_eval(args, rest)
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "export":
            return cmd_export(args)
        if args.command == "presets":
            return cmd_presets()
        if args.command == "estimate":
            return cmd_estimate(args)
        if args.command == "plan":
            return cmd_plan(args)
        if args.command == "calibrate":
            return cmd_calibrate(args)
        if args.command == "study":
            return cmd_study(args)
        if args.command == "compare":
            return cmd_compare(args)
        parser.print_help()
        return 0
    except ConfigError as e:
        print(f"shardlm: error: {e}", file=sys.stderr)
        return 2
    except FloatingPointError as e:  # the non-finite guard: a clear stop, not a traceback
        print(f"shardlm: stopped: {e}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
