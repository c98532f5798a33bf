"""A run's checkpoints as the loop saves and resumes them: which checkpoint a run resumes from
(the newest one that every rank can read, agreed on all ranks), saving the model, optimizer,
data position and RNG state at a step, and restoring them — at the layout they were saved in or
any other (checkpoint/ reads and writes the pieces; this module knows the run)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from shardlm.checkpoint.sharded import (CHECKPOINTS, MANIFEST, CheckpointError, CheckpointWriter, SaveReport,
                                        find_checkpoint, newest_usable, read_manifest)

from shardlm.checkpoint.reader import load_slices, raise_on_every_rank
from shardlm.config.schema import Config, ParallelConfig
from shardlm.parallel.data.fault_tolerant.launcher import replica_identity
from shardlm.launch.runtime import Runtime, agree_on_name, broadcast_text, is_restart
from shardlm.train.run import Run
from shardlm.parallel.data.zero.optim import adam_steps, set_adam_steps

log = logging.getLogger("shardlm")


def resume_source(cfg: Config, run_dir: Path, runtime: Runtime | None = None,
                  rejected: dict[Path, str] | None = None) -> Path | None:
    """Which checkpoint the run continues from. A restarted worker (torchrun --max-restarts)
    always takes its run's newest usable one; otherwise an explicit checkpoint.resume path
    comes first (a run directory: its newest usable one), and 'auto' takes the run directory's
    newest usable one if there is one. An unusable newer checkpoint is logged with its reason
    and skipped; so are the `rejected` ones (they failed to load: load_with_fallback). A run
    directory holding checkpoints of which none is usable is a CheckpointError, never a silent
    start from step 0 over them (checkpoint.resume = 'never' is how to ask for that).
    Rank 0 chooses and every rank receives its choice, or its error: all ranks load the same
    checkpoint, and one log says what was skipped."""
    if runtime is None or runtime.world_size == 1:
        return _choose_source(cfg, run_dir, rejected)
    outcome, failure = None, None
    if runtime.is_main:
        try:
            source = _choose_source(cfg, run_dir, rejected)
            outcome = "none:" if source is None else f"path:{source}"
        except Exception as e:  # whatever it is, the other ranks must hear of it
            outcome, failure = f"error:{e}", e
    kind, _, text = broadcast_text(outcome, runtime).partition(":")
    if failure is not None:
        raise failure
    if kind == "error":
        raise CheckpointError(f"rank 0 could not choose a checkpoint to resume from: {text}")
    return Path(text) if kind == "path" else None


def checkpoints_root(parallel: ParallelConfig, run_dir: Path) -> Path:
    """The run's checkpoints/: in its run directory; with parallel.fault_tolerant, in the
    replicas' common one, <run.dir>/<run.name> (each replica's run directory is its replica-<r>:
    parallel/data/fault_tolerant/launcher.py), where whichever replica writes a checkpoint puts it."""
    return (run_dir.parent if parallel.fault_tolerant else run_dir) / CHECKPOINTS


def checkpoint_writer(cfg: Config, run_dir: Path, runtime: Runtime) -> CheckpointWriter:
    """This rank's writer. A fault-tolerant replica is rank 0 of a world of its own, one of
    several writers of one directory: its sessions are named after it, and it sweeps only its
    own earlier sessions' leftovers (another replica's save may be in flight)."""
    identity = replica_identity() if cfg.parallel.fault_tolerant else None
    owner = f"replica-{identity.replica}-" if identity is not None else ""
    session = owner + agree_on_name(f"{os.getpid()}-{time.time_ns()}", runtime)
    return CheckpointWriter(checkpoints_root(cfg.parallel, run_dir), runtime.rank, runtime.world_size,
                            cfg.checkpoint.keep, cfg.checkpoint.async_, session=session,
                            timeout_s=cfg.parallel.collective_timeout_s or 3600.0, owner=owner)


def _choose_source(cfg: Config, run_dir: Path, rejected: dict[Path, str] | None) -> Path | None:
    choice = cfg.checkpoint.resume
    if choice == "never" or (cfg.parallel.fault_tolerant and is_restart()):
        return None  # (a restarted replica takes the live replicas' state: fault_tolerance.rejoin)
    if is_restart() or choice == "auto":
        own = newest_usable(checkpoints_root(cfg.parallel, run_dir), rejected)
        if own is not None or choice == "auto":
            return own
    return find_checkpoint(choice, rejected)


def _layout(run: Run) -> dict:
    dims = run.mesh.dims
    return {"world_size": dims.world_size, "zero_stage": run.cfg.parallel.zero_stage,
            "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "cp": dims.cp, "tp": dims.tp, "pp": dims.pp}


def save_checkpoint(run: Run, step: int) -> SaveReport:
    """Checkpoint `step` (the number of steps done): this rank's slices of the model and
    optimizer, and everything else a resume needs — the loss scaler, the optimizer's step count,
    the data position (the step: the sampler is a pure function of it), this rank's RNG. The LR
    is a pure function of the step."""
    rng = {"cpu": torch.get_rng_state().numpy().tobytes().hex(),
           "cuda": (torch.cuda.get_rng_state(run.runtime.device).numpy().tobytes().hex()
                    if run.runtime.device.type == "cuda" else None)}
    t = run.cfg.train
    state = {"step": step, "optimizer_steps": adam_steps(run.strategy.optimizer),
             "scaler": run.precision.scaler.state_dict(),
             "data": {"seed": t.seed, "global_batch": run.train_loader.global_batch, "seq_len": t.seq_len,
                      "samples": run.train_loader.samples_done(step)}}
    if run.moe is not None and run.moe.biases:  # balance = 'bias': the routers' biases (the same everywhere)
        state["moe_biases"] = {str(k): v.tolist() for k, v in run.moe.biases.items()}
    meta = {"config": run.cfg.to_dict(), "layout": _layout(run)}
    # A fault-tolerant replica that writes (fault_tolerance.writes_checkpoint) writes all of its
    # state, whatever its place among the replicas: it is a world of its own.
    writes = run.strategy.writes_checkpoint or run.replicas is not None
    return run.checkpoints.save(step, run.strategy.state_slices(saving=True), writes,
                                state, {"rng": rng}, meta)


def load_checkpoint(run: Run, path: Path) -> int:
    """Load a checkpoint saved at any layout into this run; returns the step to continue from.
    A CheckpointError is raised on every rank or on none (so load_with_fallback can try another
    checkpoint on all ranks at once)."""
    outer = run.strategy.local_sgd  # train.local_sgd (parallel/data/zero/local_sgd.py)
    fresh = outer is not None and _local_sgd_fresh_start(run, path)
    if fresh:  # a synchronous run's checkpoint: every replica loads its one model and moments
        outer.loading_synchronous = True
    try:
        manifest = load_slices(path, run.strategy.state_slices(), run.runtime, run.cfg.checkpoint.readers)
    finally:
        if outer is not None:
            outer.loading_synchronous = False
    run.strategy.after_load()
    if fresh:
        outer.restart_from_masters()
    step, error = 0, None
    try:
        step = _restore_state(run, manifest)
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:  # verified, yet malformed
        error = CheckpointError(f"{Path(path) / MANIFEST}: its run state cannot be restored "
                                f"({type(e).__name__}: {e})")
    raise_on_every_rank(error, run.runtime)
    if run.runtime.is_main:
        saved = manifest["layout"]
        log.info("resumed from %s (step %d, saved on %s rank(s) at ZeRO stage %s)", path, step,
                 saved.get("world_size"), saved.get("zero_stage"))
    return step


def _local_sgd_fresh_start(run: Run, path: Path) -> bool:
    """train.local_sgd resumes a local-SGD checkpoint of as many replicas exactly (each
    replica's own state and the outer model are in it: False), or starts from a synchronous
    run's checkpoint — DiLoCo's recipe: every replica and the outer model from its model, the
    outer momentum zero (True); a local-SGD checkpoint of another replica count is a
    CheckpointError. Rank 0 reads the manifest (checkpoint.readers = 'one': the others touch no
    file) and every rank receives its answer."""
    answer = None
    if run.runtime.is_main:
        try:
            saved = read_manifest(path)
            replicas = saved.get("layout", {}).get("dp_replicate")
            local = saved.get("config", {}).get("train", {}).get("local_sgd", {}).get("every", 0)
            answer = ("fresh:" if not local else "exact:" if replicas == run.mesh.dims.dp_replicate else
                      f"error:{path}: a local-SGD checkpoint of parallel.dp_replicate = {replicas} "
                      f"replicas; this run has parallel.dp_replicate = {run.mesh.dims.dp_replicate}. It "
                      f"holds each replica's own state: resume it with dp_replicate = {replicas}, or "
                      f"without train.local_sgd (replica 0's state)")
        except (CheckpointError, OSError):
            answer = "exact:"  # unreadable: load_slices says why, on every rank
    kind, _, message = broadcast_text(answer, run.runtime).partition(":")
    if kind == "error":
        raise CheckpointError(message)
    return kind == "fresh"


def _restore_state(run: Run, manifest: dict) -> int:
    """Everything but the tensors: optimizer step count, scaler, RNG, data position."""
    state = manifest["state"]
    set_adam_steps(run.strategy.optimizer, state["optimizer_steps"])
    moe = run.moe
    for layer, values in state.get("moe_biases", {}).items():
        if moe is not None and int(layer) in moe.biases:
            moe.biases[int(layer)].copy_(torch.tensor(values))
    run.precision.scaler.load_state_dict(state["scaler"])
    ranks = manifest["ranks"]
    if len(ranks) == run.runtime.world_size:
        rng = ranks[run.runtime.rank]["rng"]
        torch.set_rng_state(torch.frombuffer(bytearray.fromhex(rng["cpu"]), dtype=torch.uint8))
        if rng["cuda"] and run.runtime.device.type == "cuda":
            torch.cuda.set_rng_state(torch.frombuffer(bytearray.fromhex(rng["cuda"]), dtype=torch.uint8),
                                     run.runtime.device)
    else:  # another world size: no rank's stream carries over; a fresh one per (seed, step)
        torch.manual_seed(run.cfg.train.seed + state["step"])
    data = state["data"]
    # The data position is the sequences consumed, not the step: it carries across a change of
    # global batch (older checkpoints: step x their global batch).
    samples = int(data.get("samples", state["step"] * data["global_batch"]))
    run.train_loader.resume_at(int(state["step"]), samples)
    if data["global_batch"] != run.train_loader.global_batch or data["seq_len"] != run.cfg.train.seq_len:
        log.warning("resuming with %d x %d tokens per step where the checkpoint had %d x %d: the data "
                    "continues after the %d sequences consumed, but the steps left differ from the "
                    "uninterrupted run's (train.global_batch keeps a global batch across world sizes)",
                    run.train_loader.global_batch, run.cfg.train.seq_len, data["global_batch"],
                    data["seq_len"], samples)
    return int(state["step"])


def state_report(run: Run) -> str:
    """This rank's model-state bytes by category, next to the ZeRO formula's prediction."""
    held = run.strategy.model_state_bytes()
    predicted = run.strategy.predicted_state_bytes()
    parts = []
    for key, value in held.items():
        formula = f" (formula {predicted[key] / 2**20:.2f})" if key in predicted else ""
        parts.append(f"{key} {value / 2**20:.2f}{formula}")
    return f"rank {run.runtime.rank}: model states MiB: " + ", ".join(parts)
