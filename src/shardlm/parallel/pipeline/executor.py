"""The one pipeline schedule executor: `Schedule.run` runs this rank's row of a schedule's table
on its Stage (stages.py) — every micro-batch's forward and backward of this rank's stages, in
the table's order, activations and gradients sent to the neighbours as the table's send plan
posts them — and says how long the step waited for its neighbours (the bubble, as measured:
time blocked in receives over the step's time). Also forward-only passes (evaluation) and
generation through the stages.

A schedule is data (shardlm/parallel/pipeline/tables.py): a table of operations per rank (F, B, or
the split backward's I and W, of a global stage and a micro-batch), built for the named ones
(gpipe, 1f1b, interleaved, zb, zbv, dualpipev) or read from a user's CSV, checked by
simulating it before the run.

Gradients are reduced over the data-parallel ranks after the last micro-batch's backward (the
engine's finish_backward), not overlapped with it: a stage's backward interleaves with its
neighbours', and a reduction inside it could wait on ranks still sending.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from shardlm.parallel.pipeline.schedules import bubble_formula, build_table, table_for
from shardlm.parallel.pipeline.stages import GRADIENTS, Stage
from shardlm.parallel.pipeline.tables import Table, send_plan


@dataclass
class StepIO:
    """What a schedule needs from the run, for one step."""

    model: nn.Module
    """The stage's Decoder: forward(idx, hidden=None) over `model.layers`."""
    forward: Callable
    """What runs it (the model, or its compiled wrapper)."""
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """(logits, targets) -> the micro-batch's loss, already divided as the step requires."""
    backward: Callable[[torch.Tensor], None]
    """loss -> its backward (the loss scaler's scaling applied)."""
    before_backward: Callable[[int], None]
    """Called with the micro-batch index before each backward (the engine's micro_step)."""
    autocast: Callable[[], contextlib.AbstractContextManager]
    device: torch.device


class Schedule:
    """Runs a schedule's table (pipeline_tables.Table) on this rank: `source` is
    parallel.pp_schedule (a name, or 'file:PATH'), `micro` the step's micro-batches (tables are
    built, checked and cached per count). Every named schedule is a subclass that only names
    itself; the table says everything else."""

    name = ""

    def __init__(self, stage: Stage, source: str | None = None, micro: int | None = None):
        self.stage = stage
        self.source = source or self.name
        self.micro = micro

    @property
    def virtual(self) -> int:
        return len(self.stage.chunks)

    def table(self, micro: int) -> Table:
        """The checked table for `micro` micro-batches (a file's: its own count, which must be)."""
        return _checked(self.source, self.stage.count, self.virtual, micro)

    @property
    def splits_backward(self) -> bool:
        """Some backward is split (I then W): the linear layers must defer weight gradients."""
        return self.table(self.micro).splits_backward

    def order(self, micro: int) -> list[tuple[str, int, int]]:
        """This rank's (kind, chunk, micro-batch) operations, in order (a named table unchecked)."""
        table = (self.table(micro) if self.source.startswith("file:")
                 else build_table(self.source, self.stage.count, self.virtual, micro))
        chunk = {g: c for c, g in enumerate(table.rank_stages(self.stage.index))}
        return [(op.kind, chunk[op.stage], op.micro) for op in table.rows[self.stage.index] if op is not None]

    def bubble_formula(self, micro: int) -> float:
        """The published idle fraction of a step (pipeline_schedules.bubble_formula)."""
        return bubble_formula(self.source, self.stage.count, self.virtual, micro)

    def run(self, io: StepIO, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """This rank's row of the table: every micro-batch's forward and backward on this
        rank's stages; the summed loss (on the rank holding the head; 0 elsewhere).
        Activations go to the rank of the next stage, gradients back to the previous stage's;
        between two stages on this rank (a V's turn) they are handed over in `local`. A message
        for another rank waits in `outbox` until send_plan posts it: in the order its receiver
        takes them, as NCCL, which matches a pair's messages by order alone, needs."""
        stage, last, table = self.stage, self.stage.n_stages - 1, self.table(len(batches))
        stage.wait_s, stage.posted = 0.0, []
        plan = _plan(self.source, stage.count, self.virtual, len(batches))[stage.index]
        outbox: dict[str, tuple] = {}  # made, not yet posted: Stage.post
        total = torch.zeros((), device=io.device)
        inputs: dict[tuple[int, int], torch.Tensor | None] = {}
        outputs: dict[tuple[int, int], torch.Tensor] = {}
        sent: dict[tuple[int, int], tuple] = {}  # activation sends, freed when their gradient returns
        local: dict[tuple[str, int, int], torch.Tensor] = {}  # ("act" | "grad", from stage, micro-batch)
        for slot, op in enumerate(table.rows[stage.index]):
            if op is None:  # an idle slot
                continue
            g, i = op.stage, op.micro
            key = (g, i)
            if op.kind == "F":
                x, y = batches[i]
                hidden = None
                if g > 0 and stage.holds(g - 1):
                    hidden = local.pop(("act", g - 1, i)).requires_grad_()
                elif g > 0:
                    stage.posted.append(("recv", stage.rank_of(g - 1), f"{g - 1}F{i}"))
                    hidden = stage.recv_hidden(io.device, stage.rank_of(g - 1)).requires_grad_()
                io.model.layers = stage.chunks[stage.stages.index(g)]
                with io.autocast():
                    out = io.forward(x, hidden)
                    if g == last:
                        out = io.loss(out, y)
                        total += out.detach()
                if g < last and stage.holds(g + 1):
                    local[("act", g, i)] = out.detach()
                elif g < last:
                    outbox[f"{g}F{i}"] = (out.detach(), key)
                inputs[key], outputs[key] = hidden, out
            elif op.kind == "W":  # the weight gradients its I set aside
                stage.weight_grads.apply(key)
            else:  # B, or I: the gradient to send back now, the weights' at its W
                io.before_backward(i)
                out, hidden = outputs.pop(key), inputs.pop(key)
                with stage.weight_grads.deferred(key if op.kind == "I" else None):
                    if g == last:
                        io.backward(out)
                    else:
                        if stage.holds(g + 1):
                            grad = local.pop(("grad", g + 1, i))
                        else:
                            stage.posted.append(("recv", stage.rank_of(g + 1), f"{g + 1}B{i}"))
                            grad = stage.recv((out.shape, out.dtype, out.device), stage.rank_of(g + 1), GRADIENTS)
                            stage.release(sent.pop(key))
                        torch.autograd.backward(out, grad)
                if hidden is not None and stage.holds(g - 1):
                    local[("grad", g, i)] = hidden.grad
                elif hidden is not None:
                    outbox[f"{g}B{i}"] = (hidden.grad, None)
            stage.post(plan[slot], outbox, sent)
        assert not local and not outputs and not outbox, "a checked table leaves nothing behind"
        stage.settle()
        stage.drain(io.device)
        return total

    def _forward_stages(self, io: StepIO, x: torch.Tensor, on_head: Callable, header: bool = False) -> None:
        """One forward of `x` through this rank's stages in order (evaluation, generation):
        `on_head(output)` on the model's last stage."""
        stage, local = self.stage, {}
        for chunk, g in enumerate(stage.stages):
            if g == 0:
                hidden = None
            elif stage.holds(g - 1):
                hidden = local.pop(g - 1)
            else:
                hidden = stage.recv_hidden(io.device, stage.rank_of(g - 1), header=header)
            io.model.layers = stage.chunks[chunk]
            with io.autocast():
                out = io.forward(x, hidden)
                if g == stage.n_stages - 1:
                    on_head(out)
            if g == stage.n_stages - 1:
                continue
            if stage.holds(g + 1):
                local[g] = out
            else:
                stage.send_hidden(out, stage.rank_of(g + 1), header=header)

    @torch.no_grad()
    def forward_only(self, io: StepIO, batches, shape: tuple[int, ...] = (),
                     dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
        """io.loss of each of `batches` (evaluation: a tensor of `shape` and `dtype`, e.g. the
        token sums of parallel/data/evaluation.py), on every rank: the head's rank's, shared."""
        import torch.distributed as dist

        losses = []
        for x, y in batches:
            losses.append(torch.zeros(shape, dtype=dtype, device=io.device))
            self._forward_stages(io, x, lambda out: losses.__setitem__(-1, io.loss(out, y).to(dtype)))
        self.stage.settle()
        summed = torch.stack(losses)
        dist.all_reduce(summed, group=self.stage.comm.group)  # only the head's rank's are non-zero
        return list(summed)

    @torch.no_grad()
    def generate(self, io: StepIO, idx: torch.Tensor, max_new_tokens: int, temperature: float = 0.8,
                 top_k: int | None = 50, generator: torch.Generator | None = None) -> torch.Tensor:
        """models.generate through the stages: each new token's forward passes every stage,
        the head's rank samples it (models.decoder.next_token) and broadcasts it to the pipeline."""
        import torch.distributed as dist

        from shardlm.models.decoder import next_token

        stage, model = self.stage, io.model
        head = dist.get_global_rank(stage.comm.group, stage.rank_of(stage.n_stages - 1))
        context = getattr(model, "context", None)
        with context.whole_sequences() if context is not None else contextlib.nullcontext():
            for _ in range(max_new_tokens):
                x = idx[:, -model.cfg.max_seq_len:]
                new = [torch.zeros((idx.shape[0], 1), dtype=idx.dtype, device=idx.device)]

                def sample(out: torch.Tensor) -> None:
                    new[0] = next_token(model, out[:, -1, :], temperature, top_k, generator)

                self._forward_stages(io, x, sample, header=True)
                stage.settle()
                dist.broadcast(new[0], head, group=stage.comm.group)
                idx = torch.cat((idx, new[0]), dim=1)
        return idx

    def by_stage(self, values: list[float], device: torch.device) -> list[list[float]]:
        """`values` of every stage, gathered over the pipeline: one list per value, by stage."""
        import torch.distributed as dist  # metrics, not training traffic: outside the ledger
        mine = torch.tensor(values, dtype=torch.float64, device=device)
        every = torch.empty(self.stage.count * len(values), dtype=torch.float64, device=device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # 2.13's name
        gather(every, mine, group=self.stage.comm.group)
        return every.view(self.stage.count, len(values)).t().tolist()


@functools.lru_cache(maxsize=32)
def _checked(source: str, ranks: int, virtual: int, micro: int) -> Table:
    return table_for(source, ranks, virtual, micro)


@functools.lru_cache(maxsize=32)
def _plan(source: str, ranks: int, virtual: int, micro: int) -> list:
    return send_plan(_checked(source, ranks, virtual, micro))


class GPipe(Schedule):
    """Every micro-batch's forward, then every backward: M micro-batches held on every stage."""
    name = "gpipe"


class OneFOneB(Schedule):
    """PipeDream-Flush: warm-up forwards, then one forward and one backward, then the drain."""
    name = "1f1b"


class Interleaved(Schedule):
    """1F1B over V chunks per rank in a loop (Narayanan et al. 2021)."""
    name = "interleaved"


class ZeroBubble(Schedule):
    """1F1B's memory with the backward split (I, then W where a rank would idle)."""
    name = "zb"


class ZeroBubbleV(Schedule):
    """ZB-V: two chunks per rank in a V, F, I and W (Qi et al. 2024)."""
    name = "zbv"


class DualPipeV(Schedule):
    """DeepSeek-V3's DualPipe cut in half: a V, forwards and backwards of two streams paired."""
    name = "dualpipev"


SCHEDULES = {cls.name: cls for cls in (GPipe, OneFOneB, Interleaved, ZeroBubble, ZeroBubbleV, DualPipeV)}


def schedule_for(source: str, stage: Stage, micro: int) -> Schedule:
    """parallel.pp_schedule's executor for this rank: a named schedule, or a user's table."""
    return SCHEDULES.get(source, Schedule)(stage, source, micro)
