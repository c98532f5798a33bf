"""`shardlm train`: validate the config, check the machine and its disks before any process
starts (`preflight`), then train here (one process, or a rank under torchrun) or start
`--nproc N` local ranks; `--dry-run` prints the plan instead, `--resume` continues a run."""

from __future__ import annotations

import argparse
import sys

from shardlm.errors import ConfigError
from shardlm.launch.preflight import DISK_EXIT, DiskError, check_run_disks, nvme_bytes

def _model_axes(dims, par) -> str:
    """', tp 2 (sequence parallel), cp 2, pp 2 (1f1b), ep 2' for the axes beyond data parallelism."""
    axes = [f"tp {dims.tp}" + (" (sequence parallel)" if par.sequence_parallel else "")] if dims.tp > 1 else []
    axes += [f"cp {dims.cp}"] if dims.cp > 1 else []
    axes += [f"pp {dims.pp} ({par.pp_schedule}" + (f", {par.pp_virtual} chunks per rank" if par.pp_virtual > 1 else "")
             + ")"] if dims.pp > 1 else []
    axes += [f"ep {dims.ep}"] if dims.ep > 1 else []
    return "".join(", " + a for a in axes)


def cmd_train(args: argparse.Namespace, overrides: list[str]) -> int:
    from shardlm.config.load import describe, load_config, parse_overrides

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
    if args.quorum_endpoint != "127.0.0.1:0" and not (args.nproc and cfg.parallel.fault_tolerant):
        raise ConfigError(f"--quorum-endpoint {args.quorum_endpoint} is where the replicas of "
                          f"parallel.fault_tolerant = true meet, under --nproc N; this run has none")
    if args.max_restarts and not cfg.checkpoint.every and not cfg.parallel.fault_tolerant:
        raise ConfigError("--max-restarts restarts workers from the latest checkpoint, but "
                          "checkpoint.every = 0 saves none: add --checkpoint.every=N")
    from shardlm.launch.runtime import die_with_launcher

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
    its own; the inputs are usable (train.build.check_inputs). A ConfigError says what, where, the
    bytes needed and free. Under your own torchrun every rank checks (cheap)."""
    from pathlib import Path

    from shardlm.checkpoint.sharded import CHECKPOINTS
    from shardlm.config.dims import resolve_dims
    from shardlm.launch.runtime import launcher_sizes
    from shardlm.models.flops import count_params
    from shardlm.models.precision import carrier

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
    from shardlm.launch.runtime import pick_device
    from shardlm.train.build import check_inputs

    device = pick_device(cfg.run.device, 0, nproc or launcher_sizes()[1])
    check_inputs(cfg)  # a bad tokenizer, LoRA rank or data file: once, before any worker starts
    from shardlm.models.hf_build import route_line

    line = route_line(cfg.model)  # which way a model.hf_path trains, said once before any worker starts
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


def train_here(cfg, on_step=None) -> int:
    """Train in this process (one rank of it, under a launcher). `on_step(run, record)`: the
    launcher's hook after each step (train.loop.train; integrations/ray.py)."""
    from shardlm.launch.allocator import apply_malloc_policy

    malloc = apply_malloc_policy(cfg.run.malloc_mmap_threshold)  # before any large allocation
    from shardlm.models.flops import count_params
    from shardlm.models.flops import active_params
    from shardlm.launch.runtime import launcher_ranks, launcher_sizes, note_clean_stop, shutdown
    from shardlm.train.build import build_run
    from shardlm.train.loop import train
    from shardlm.train.step import sample_text
    from shardlm.train.checkpointing import state_report
    from shardlm.train.telemetry import reset_peak_rss

    (rank, local_rank), (world, local_world) = launcher_ranks(), launcher_sizes()
    if rank == 0:
        probe_this_cpu(cfg, world, local_rank, local_world)
        reset_peak_rss()  # the run's peak RSS starts here: the probe's buffers are not the run's

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
    result = train(run, on_step)
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


def probe_this_cpu(cfg, n_ranks: int, local_rank: int = 0, local_world: int | None = None) -> None:
    """Measure this CPU for `n_ranks` ranks (once per machine, then read from the cache) when the
    run trains on the CPU: before any rank builds anything, so that the probe's buffers (256 MiB
    copies, a 256 MiB AdamW state) never sit on top of a model in a rank's memory."""
    from shardlm.launch.runtime import pick_device

    if pick_device(cfg.run.device, local_rank, local_world or n_ranks).type == "cpu":
        from shardlm.hardware.probe import measure_cpu

        measure_cpu(n_ranks)


def launch_workers(args: argparse.Namespace, cfg, overrides: list[str]) -> int:
    """`--nproc N`: check the layout fits N ranks now (not after spawning), fix one run name
    for all workers, then hand over to torch's elastic launcher on this machine."""
    from shardlm.launch.local import launch_local
    from shardlm.launch.run_dir import unique_run_name
    from shardlm.config.dims import resolve_dims

    resolve_dims(cfg.parallel, args.nproc)
    # Here, not in rank 0: rank 0 reads the probe for the run's prediction (and strategy =
    # 'auto') while the other ranks wait in a collective, which a short
    # parallel.collective_timeout_s would otherwise end while the probe runs.
    probe_this_cpu(cfg, args.nproc)
    argv = ([args.config] if args.config else []) + list(overrides)
    if not cfg.run.name:  # also what lets restarted workers find the run's checkpoints
        argv.append(f"--run.name={unique_run_name()}")
    if cfg.parallel.fault_tolerant:  # a world per replica, restarted alone (parallel/data/fault_tolerant/launcher.py)
        from shardlm.config.layout_rules import STAGE0_REPLICA_RANKS
        from shardlm.parallel.data.fault_tolerant.launcher import launch_replicas

        replicas = cfg.parallel.dp_replicate
        if args.nproc % replicas:
            raise ConfigError(f"parallel.fault_tolerant: --nproc {args.nproc} must be a multiple "
                              f"of parallel.dp_replicate = {replicas} (replicas of equal ranks)")
        if resolve_dims(cfg.parallel, args.nproc).dp_shard > 1 and cfg.parallel.zero_stage == 0:
            raise ConfigError(f"parallel.fault_tolerant: {replicas} replicas of "
                              f"{args.nproc // replicas} ranks at parallel.zero_stage = 0: "
                              f"{STAGE0_REPLICA_RANKS}: use stage 1")
        name = cfg.run.name or argv[-1].split("=", 1)[1]
        return launch_replicas(replicas, ["-m", "shardlm", "train", *argv], cfg.run.dir, name,
                               args.max_restarts, cfg.parallel.collective_timeout_s or 600.0,
                               args.quorum_endpoint, args.nproc // replicas)
    return launch_local(args.nproc, ["-m", "shardlm", "train", *argv], args.max_restarts)


def dry_run(args: argparse.Namespace, cfg) -> int:
    """`train --dry-run`: everything a run decides before its first step, decided the same way
    (resolve.decide: the auto plan, the auto compute dtype, the checkpoint's dtype on resume) for
    --nproc ranks (or the launcher's WORLD_SIZE, or 1) on this machine, or on --gpus; then the
    planner's memory per rank for the result. Nothing is created, spawned or trained."""
    from shardlm.checkpoint.sharded import find_checkpoint
    from shardlm.config.dims import resolve_dims
    from shardlm.hardware.catalog import parse_cluster
    from shardlm.launch.runtime import launcher_sizes, pick_device
    from shardlm.planner.memory import estimate_memory
    from shardlm.planner.timing import estimate_time
    from shardlm.planner import report
    from shardlm.planner.search import config_strategy
    from shardlm.train.resolve import decide, local_hardware

    target = parse_cluster(args.gpus) if args.gpus else None
    world = target.world_size if target else (args.nproc or launcher_sizes()[0])
    if target and args.nproc and args.nproc != world:
        raise ConfigError(f"--nproc {args.nproc} but --gpus {args.gpus} has {world} devices")
    device = pick_device(cfg.run.device, 0)
    choice = cfg.checkpoint.resume
    checkpoint = find_checkpoint(choice) if choice not in ("auto", "never") else None
    resolved = decide(cfg, world, device, checkpoint, target)
    cluster = target or local_hardware(device, world, resolved.run.malloc_mmap_threshold)
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
          f"{resolved.train.grad_accum}, compile {str(resolved.train.compile).lower()}. Nothing was trained.")
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
