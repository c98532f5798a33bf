"""The training loop, read top to bottom: each step (step.py), its record (JSONL, trackers,
progress), evaluation and checkpoints when due, and the trained weights at the end.

`build_run` (build.py) assembles the run; `train` runs it. Its checkpoints (resume, save,
restore) are checkpointing.py.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from shardlm.checkpoint.weights import save_weights
from shardlm.config.fields import compile_on
from shardlm.launch.runtime import StopSignals, planned_fault
from shardlm.models.decoder import build_model
from shardlm.models.moe import bias_tensors
from shardlm.parallel.blocks.compile import compile_seconds
from shardlm.parallel.expert.dispatch import moe_record
from shardlm.parallel.pipeline.stages import gather_stages
from shardlm.parallel.tensor.pieces import whole_parameters
from shardlm.planner.search import run_prediction
from shardlm.train import fault_tolerance
from shardlm.train.checkpointing import save_checkpoint
from shardlm.train.resolve import local_hardware
from shardlm.train.run import Run, TrainResult
from shardlm.train.step import StepResult, evaluate, train_step
from shardlm.train.telemetry import (MetricsLog, ProgressDisplay, device_memory_record, peak_rss_bytes,
                                     prediction_summary, restate_cpu_peak)
from shardlm.train.tracking import StepProfiler, open_trackers

log = logging.getLogger("shardlm")


def step_record(run: Run, step: int, out: StepResult, seconds: float) -> dict:
    """A step's JSONL record: loss, throughput (MFU, HFU), memory, the ledger's bytes, the
    pipeline's and the features' figures (out.state), the time split."""
    tokens = run.train_loader.global_batch * run.cfg.train.seq_len
    tokens_per_s = tokens / seconds
    peak = run.peak_flops_per_device * run.runtime.world_size
    mfu = tokens_per_s * run.flops_per_token / peak  # model FLOPs only (PaLM appendix B)
    hardware = run.flops_per_token if run.hardware_flops_per_token is None else run.hardware_flops_per_token
    hfu = tokens_per_s * hardware / peak  # + recomputation: what the hardware executed
    comm = run.strategy.ledger.snapshot()  # this step's collectives (reset before it began)
    pipeline, state = {}, out.state
    if run.schedule is not None:  # per stage: idle fraction (blocked on a neighbour), peak RSS
        idle, rss = run.schedule.by_stage([run.schedule.stage.wait_s / seconds, peak_rss_bytes()],
                                          run.runtime.device)
        pipeline = {"pp_bubble": sum(idle) / len(idle), "pp_bubble_by_stage": idle,
                    "pp_bubble_formula": run.schedule.bubble_formula(run.cfg.train.grad_accum),
                    "pp_peak_rss_bytes_by_stage": [int(b) for b in rss]}
    if state.moe_sums is not None:  # mixture of experts: balance, drops, traffic
        pipeline.update(moe_record(run.moe, state.moe_sums, comm), **state.moe_placement)
    return {"step": step + 1, "world_size": run.runtime.world_size, "loss": out.loss,
            "lr": run.strategy.optimizer.param_groups[0]["lr"],
            "grad_norm": out.grad_norm, "tokens_per_s": tokens_per_s, "mfu": mfu,
            "hfu": hfu, "step_time_s": seconds, "peak_rss_bytes": peak_rss_bytes(),
            **device_memory_record(run.runtime.device), "loss_scale": run.precision.scaler.scale,
            "model_state_bytes": sum(run.strategy.model_state_bytes().values()),
            "comm_bytes": sum(comm.values()), "comm_bytes_by_op": comm,
            **run.strategy.offload_report(), **pipeline,
            **({} if state.loss_token_fraction is None else {"loss_token_fraction": state.loss_token_fraction}),
            **state.fp8_record, **run.times.record(seconds)}


def train(run: Run, on_step: Callable[[Run, dict], None] | None = None) -> TrainResult:
    """Train `run` to train.steps. `on_step(run, record)`, on every rank after each step is logged
    (and checkpointed: record['checkpoint_step']), before a planned fault strikes: a launcher's
    hook (integrations/ray.py reports to Ray Train)."""
    cfg, main = run.cfg, run.runtime.is_main
    fault_tolerance.rejoin(run)  # a restarted replica (parallel.fault_tolerant): the others' state
    tracker = open_trackers(cfg.run.tracker, run.run_dir, enabled=main)  # first: closed in finally
    profiler = StepProfiler(cfg.run.profile_steps, run.run_dir, run.runtime.rank, run.runtime.device)
    completed = False
    predicted = run_prediction(cfg, lambda: local_hardware(run.runtime.device, run.mesh.dims.world_size,
                                                                   cfg.run.malloc_mmap_threshold)) if main else {}
    # Said once, in the first record: the planner's prediction for this run, the chat template.
    first = {"predicted": predicted}
    if "chat_template" in (run.dataset.meta or {}):
        first["chat_template"] = run.dataset.meta["chat_template"]
    metrics = MetricsLog(run.run_dir / "metrics.jsonl" if main else None, first)
    steps = cfg.train.steps
    progress = ProgressDisplay(steps - run.start_step, cfg.run.progress, enabled=main)
    result = TrainResult(run.run_dir)
    fault = planned_fault()  # $SHARDLM_FAULT: the fault tests' injected crash, leave or pause
    speeds: dict[str, list[float]] = {"tokens_per_s": [], "mfu": [], "hfu": [], "step_time_s": []}
    try:
        tracker.log_config(cfg.to_dict())  # resolved: every 'auto' decided
        with StopSignals() as signals:
            for step in range(run.start_step, steps):
                out, record = timed_step(run, step, profiler, signals.requested is not None)
                result.losses.append(out.loss)
                result.skipped_steps += not out.stepped
                if step > run.start_step or steps - run.start_step == 1:
                    for key, values in speeds.items():
                        values.append(record[key])
                evaluate_and_save(run, step, out, record, result, signals)
                if out.stop or step + 1 == steps or (step + 1) % cfg.train.log_every == 0:
                    metrics.write(record)
                    tracker.log_scalars(record["step"], record)
                progress.update(step - run.start_step, f"loss {out.loss:.3f}  "
                                f"{record['tokens_per_s']:,.0f} tok/s  MFU {record['mfu']:.1%} "
                                f"(HFU {record['hfu']:.1%})")
                if on_step is not None:
                    on_step(run, record)
                if fault is not None and fault.due(step + 1):
                    fault.strike()
                if out.stop:
                    result.stopped_by = signals.requested or "a signal to another rank"
                    break
            run.checkpoints.wait()  # an asynchronous save still writing
        completed = True
    finally:
        progress.close()
        profiler.close()  # a crash keeps what was traced and tracked
        tracker.close(failed=not completed)
        metrics.close()
    if speeds["tokens_per_s"]:
        result.tokens_per_s = sum(speeds["tokens_per_s"]) / len(speeds["tokens_per_s"])
        result.mfu = sum(speeds["mfu"]) / len(speeds["mfu"])
        result.hfu = sum(speeds["hfu"]) / len(speeds["hfu"])
        if main:
            print(prediction_summary(predicted, speeds["step_time_s"], run.runtime.device), flush=True)
    if result.stopped_by is None:
        save_trained_weights(run)
    return result


def timed_step(run: Run, step: int, profiler: StepProfiler, stop_requested: bool) -> tuple[StepResult, dict]:
    """One step, timed and profiled, and its record: the first step's compile time, whether it
    was skipped, the fault-tolerant replicas' quorum."""
    run.strategy.ledger.reset()  # evaluation's gathers are not a training step's
    compiling = compile_on(run.cfg.train) and step == run.start_step  # the blocks compile now
    compiled_before = compile_seconds() if compiling else 0.0
    profiler.begin(step + 1)
    start = time.perf_counter()
    out = train_step(run, step, stop_requested=stop_requested)
    record = step_record(run, step, out, time.perf_counter() - start)
    if record["mfu"] > 1 and run.runtime.device.type == "cpu":
        restate_cpu_peak(run, record)
    profiler.end(step + 1)
    if compiling:
        record["compile_s"] = compile_seconds() - compiled_before
        log.info("compile: %.1f s of the first step's %.1f s", record["compile_s"], record["step_time_s"])
    record["skipped"] = not out.stepped
    record.update(run.replicas.record() if run.replicas else {})  # fault tolerant: quorum
    return out, record


def evaluate_and_save(run: Run, step: int, out: StepResult, record: dict, result: TrainResult,
                      signals: StopSignals) -> None:
    """After step `step`: an evaluation (train.eval_every, and the last step) and a checkpoint
    (checkpoint.every, the last step, or a stop) when due, their figures into `record`."""
    t, every = run.cfg.train, run.cfg.checkpoint.every
    last = step + 1 == t.steps
    if last or (t.eval_every and (step + 1) % t.eval_every == 0):
        scores = evaluate(run)
        record.update(scores)
        result.val_loss = scores["val_loss"]
        result.val_perplexity = scores["val_perplexity"]
        result.val_token_accuracy = scores["val_token_accuracy"]
    due = out.stop or (every and (last or (step + 1) % every == 0))
    if due and fault_tolerance.writes_checkpoint(run):  # replicas: the lowest live one
        if out.stop:  # the last checkpoint before exiting: written in full
            run.checkpoints.asynchronous = False
        run.checkpoints.interrupted = signals.watch()  # a signal during it: a rank died
        report = save_checkpoint(run, step + 1)
        result.saves.append(report)
        record.update(checkpoint_step=step + 1, checkpoint_stall_s=report.stall_s,
                      checkpoint_bytes=report.bytes)


def save_trained_weights(run: Run) -> None:
    """The trained model's whole weights into the run directory (rank 0): pieces put together
    (tensor / expert parallelism), every pipeline stage's gathered."""
    cfg, main = run.cfg, run.runtime.is_main
    with run.strategy.full_parameters():
        cut = run.mesh.dims.tp > 1 or run.mesh.dims.ep > 1
        weights = whole_parameters(run.model) if cut else run.model
        if run.schedule is not None:  # every stage's parameters, gathered
            whole = weights if isinstance(weights, dict) else whole_parameters(weights)
            shapes = {n: tuple(p.shape) for n, p in build_model(cfg.model, "meta").named_parameters()}
            weights = gather_stages(whole, shapes, next(iter(whole.values())).dtype,
                                    run.schedule.stage, run.runtime.device)
        if main:
            if isinstance(weights, dict):  # put together from pieces: the MoE routing state too
                weights = {**weights, **bias_tensors(run.moe)}
            save_weights(run.run_dir, weights, cfg, run.dataset.tokenizer,
                         getattr(getattr(run.model, "model", None), "config", None))
