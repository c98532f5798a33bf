"""What a run computes on its model: one training step (forwards, backwards, the optimizer, the
loss summed over the ranks), an evaluation, a sample.

`train_step` reads top to bottom; each feature takes its part through the hooks parallelize
registered (parallel/build.py StepHooks: before the forwards, after the backwards, after the
optimizer step, on the loss's all-reduce), so the step names none of them. What a step leaves
behind is its StepResult; the run keeps only what was built.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, NamedTuple

import torch

from shardlm.comm.watchdog import watched
from shardlm.data.seq2seq import Seq2SeqInputs
from shardlm.models.decoder import generate
from shardlm.models.hf import CausalLMAdapter
from shardlm.models.hf_build import generate_causal
from shardlm.models.precision import is_finite
from shardlm.models.seq2seq import generate_seq2seq
from shardlm.parallel.build import StepState
from shardlm.parallel.data.evaluation import metrics_of
from shardlm.parallel.pipeline.executor import StepIO
from shardlm.train.run import Run
from shardlm.parallel.data.zero.optim import lr_at, set_lr


class StepResult(NamedTuple):
    loss: float
    """Averaged over all data-parallel ranks."""
    grad_norm: float
    stepped: bool
    """False when the step was skipped (fp16 overflow, or a non-finite step under 'skip')."""
    stop: bool
    """Some rank was asked to stop (SIGTERM/SIGINT): every rank sees the same answer."""
    state: StepState
    """The step's own figures (the loss-token fraction, MoE sums and placement, FP8 counts)."""


def pipeline_io(run: Run, divisor: int = 1, denominator: float | None = None) -> StepIO:
    """What a pipeline schedule needs from the run: each micro-batch's loss (over `denominator`
    counted targets when given: train_step's global count) divided by `divisor`; gradients
    reduced after the step's last backward (finish_backward)."""
    device = run.runtime.device
    forward = run.times.timed("forward", lambda x, hidden: run.forward(x.to(device, non_blocking=True), hidden))
    return StepIO(model=run.model, forward=forward,
                  loss=run.times.timed("forward", lambda logits, y: run.loss(
                      logits, y.to(device, non_blocking=True), denominator) / divisor),
                  backward=lambda loss: run.precision.scaler.scale_loss(loss).backward(),
                  before_backward=lambda i: run.strategy.micro_step(sync=False),
                  autocast=run.precision.autocast, device=device)


def loss_of(run: Run, x: torch.Tensor, y: torch.Tensor,
            score: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
            denominator: float | None = None) -> torch.Tensor:
    """run.loss (over `denominator` counted targets when given), or `score` (run.token_sums),
    of the forward of one micro-batch."""
    device = run.runtime.device
    y = y.to(device, non_blocking=True)
    with run.precision.autocast():
        if isinstance(x, Seq2SeqInputs):  # an encoder-decoder's (source, source_mask, labels)
            logits = run.forward(*(part.to(device, non_blocking=True) for part in x))  # (B, T, vocab)
        else:  # (B, T, vocab), or this rank's vocabulary under tensor parallelism
            logits = run.forward(x.to(device, non_blocking=True))
    return score(logits, y) if score is not None else run.loss(logits, y, denominator)


def train_step(run: Run, step: int, stop_requested: bool = False) -> StepResult:
    """One optimizer step over grad_accum micro-batches."""
    with run.precision.kernels():  # precision.cpu_bf16_gemm = 'fp32': recomputation included
        return _train_step(run, step, stop_requested)


def _train_step(run: Run, step: int, stop_requested: bool) -> StepResult:
    hooks, dims = run.hooks, run.mesh.dims
    run.times.start()
    set_lr(run.strategy.optimizer, lr_at(step, run.cfg.train))
    micro_batches = run.train_loader.micro_batches(step)
    # Every micro-batch's loss is divided by the global number of micro-batches and gradients
    # are summed across ranks: each rank's backward then computes exactly what one process
    # would for that micro-batch. Context parallelism: each rank's loss is the mean over its
    # 1/cp of the tokens. Local SGD (parallel/data/zero/local_sgd.py): a replica's gradient is its own data's
    # mean, not a share (run.replicas_apart).
    state = StepState(step, [y for _, y in micro_batches],
                      len(micro_batches) * dims.dp_size * dims.cp // run.replicas_apart,
                      run.precision.scaler.scale, stop_requested)
    for hook in hooks.before_forward:  # the loss-token count, MoE's loss scale, FP8's histories
        hook(state)
    state.total = forward_backward(run, micro_batches, state)
    for hook in hooks.after_backward:  # fault tolerant: the mean over the live replicas
        if not hook(state):  # a replica died during it: no optimizer step; the step again, without it
            return train_step(run, step, state.stop)
    with run.times.phase("optimizer"):
        norm = clip_and_step(run, state)
        run.strategy.zero_grad()
        for hook in hooks.after_optimizer:  # local SGD: the outer step when a round ends
            hook(state)
    for hook in hooks.after_update:  # MoE: the routing summed over the ranks, the biases moved
        hook(state)
    summed = reduce_loss(run, state, norm)
    for hook in hooks.after_reduce:  # fault tolerant: a joining replica takes this state
        hook(state)
    run.times.stop()
    return StepResult(float(summed[0]), state.grad_norm, state.stepped, bool(summed[1] > 0), state)


def forward_backward(run: Run, micro_batches: list, state: StepState) -> torch.Tensor:
    """Every micro-batch's forward and backward (a pipeline: in its schedule's order); returns
    this rank's summed loss."""
    total = torch.zeros((), device=run.runtime.device)
    if run.schedule is not None:  # the pipeline's order of forwards and backwards
        with run.times.phase("backward"):  # less its forwards (timed in pipeline_io) and waits
            total = run.schedule.run(pipeline_io(run, state.global_micro_batches, state.denominator),
                                     micro_batches)
        run.schedule.stage.sync_tied(run.model)
        micro_batches = []
    for i, (x, y) in enumerate(micro_batches):
        # Gradients are synchronised on the last micro-batch only (nanoGPT's no_sync reasoning:
        # reducing inner micro-steps would be pure waste).
        run.strategy.micro_step(sync=i == len(micro_batches) - 1)
        with run.times.phase("forward"):
            loss = loss_of(run, x, y, denominator=state.denominator) / state.global_micro_batches
        with run.times.phase("backward"):
            run.precision.scaler.scale_loss(loss).backward()
        total += loss.detach()
    with run.times.phase("backward"):
        run.strategy.finish_backward()
    return total


def clip_and_step(run: Run, state: StepState) -> torch.Tensor | None:
    """Unscale, clip and step (or skip). The norm is computed every step (telemetry) and doubles
    as the overflow check; it is global, so every rank takes the same skip decision. A step
    decided on the device (run.step_on_device) returns the norm as a device scalar, read with
    the loss (reduce_loss); otherwise state.grad_norm and state.stepped are set here."""
    strategy, scaler = run.strategy, run.precision.scaler
    scaler.unscale_(strategy.grads())
    if run.step_on_device:
        return strategy.clip_and_step_on_device(run.cfg.train.grad_clip or float("inf"))
    state.grad_norm = strategy.clip_grad_norm(run.cfg.train.grad_clip or float("inf"))
    state.stepped = scaler.update(is_finite(state.grad_norm))
    if state.stepped:
        strategy.step()
    return None


def reduce_loss(run: Run, state: StepState, norm: torch.Tensor | None) -> torch.Tensor:
    """The loss and the stop flag in one tensor: the logging scalar every step sums anyway
    carries the agreement to stop (a signal may reach only some ranks, or at different steps),
    and the features' figures (hooks.summed) ride on it. Every rank of a tensor-parallel group
    holds the same loss: counted once. Returns the sum ([loss, stop, norm?, figures...])."""
    total = state.total
    summed = torch.stack([total / run.mesh.dims.tp / run.replicas_apart,
                          torch.tensor(float(state.stop), device=total.device),
                          *([] if norm is None else [norm.to(total.dtype)])])
    riding = [(values(total.device), read) for values, read in run.hooks.summed]
    if riding:
        summed = torch.cat([summed, *(values for values, _ in riding)])
    if run.runtime.world_size > 1:  # not model communication: not in the ledger
        with watched(run.watchdog, "all_reduce(loss)", "dp", 4 * len(summed)):
            torch.distributed.all_reduce(summed)
    if norm is not None:  # (one process: nothing was summed over ranks)
        state.grad_norm = float(summed[2])
        state.stepped = run.precision.scaler.update(is_finite(state.grad_norm))
    offset = len(summed) - sum(len(values) for values, _ in riding)
    for values, read in riding:
        read(state, summed[offset:offset + len(values)])
        offset += len(values)
    return summed


@torch.no_grad()
def evaluate(run: Run) -> dict[str, float]:
    """val_loss, val_perplexity, val_token_accuracy over the first train.eval_batches
    micro-batches of validation windows, dealt to the data-parallel ranks (Loader.eval_batches).
    Each rank sums [cross-entropy, correct, targets] over its targets that carry loss, and the
    sums (not the ranks' means) are added over all ranks: every target weighs the same whatever
    rank or batch it fell in (parallel/data/evaluation.py)."""
    run.model.eval()
    batches = run.val_loader.eval_batches(run.cfg.train.eval_batches)
    device = run.runtime.device
    if run.schedule is not None:  # the head's stage's sums, shared with the whole pipeline
        io = replace(pipeline_io(run), loss=lambda logits, y: run.token_sums(
            logits, y.to(device, non_blocking=True)))
        sums = torch.stack(run.schedule.forward_only(io, list(batches), (3,), torch.float64)).sum(0)
    else:
        sums = sum((loss_of(run, x, y, run.token_sums) for x, y in batches),
                   torch.zeros(3, dtype=torch.float64, device=device))
    run.model.train()
    if run.runtime.world_size > 1:
        # dp ranks hold different windows and cp ranks different tokens of them: both add up.
        # tp ranks hold the same sums, and so do pp ranks after forward_only: counted once.
        with watched(run.watchdog, "all_reduce(eval)", "world", 8 * len(sums)):
            torch.distributed.all_reduce(sums)
        sums /= run.mesh.dims.tp * run.mesh.dims.pp
    return metrics_of(sums.tolist())


def sample_text(run: Run, prompt: str, max_new_tokens: int) -> str:
    """The prompt continued (an encoder-decoder: the prompt is the source, the target printed)."""
    tokenizer = run.dataset.tokenizer
    idx = torch.tensor([tokenizer.encode(prompt).ids], device=run.runtime.device)
    generator = torch.Generator(device=run.runtime.device).manual_seed(run.cfg.train.seed)
    run.model.eval()
    with run.precision.autocast(), run.strategy.full_parameters():
        if run.dataset.source_len:  # the library's generate (its KV cache), sampling as below
            out = generate_seq2seq(run.model, idx, torch.ones_like(idx), max_new_tokens,
                                   run.dataset.eot_id, temperature=0.8, generator=generator)
        elif run.schedule is not None:  # through the pipeline's stages
            out = run.schedule.generate(pipeline_io(run), idx, max_new_tokens, generator=generator)
        elif isinstance(run.model, CausalLMAdapter):  # the library's generate, as for seq2seq
            out = generate_causal(run.model, idx, max_new_tokens, run.dataset.eot_id, 0.8,
                                  generator=generator)
        else:
            out = generate(run.model, idx, max_new_tokens, generator=generator)
    return tokenizer.decode(out[0].tolist())
