"""Pipeline parallelism: the model's blocks in contiguous stages, one stage per rank of the
pipeline group, micro-batches flowing through them (GPipe: Huang et al. 2019; 1F1B: Narayanan
et al. 2019, PipeDream-Flush / Megatron-LM's non-interleaved schedule).

A stage is the Decoder itself, built on the meta device and cut before anything is allocated:
the blocks outside this stage's range become placeholders without parameters, the embedding
stays on the first stage, the final norm and the head on the last (a tied head keeps its copy
of the embedding on the last stage, as Megatron-LM does: its gradient is summed with the first
stage's after backward, and the first stage alone saves and counts it). Parameter names are the
whole model's, so checkpoints load at any other pipeline layout. Every stage reads the same
micro-batches (token ids give positions and context-parallel cuts everywhere; the last stage
needs the targets); a stage after the first receives the previous stage's hidden states, and
every stage but the first sends back the gradient of what it received.

The split (models.flops.pipeline_split) balances forward FLOPs per token — the head's 2·d·V
counted on the last stage — or follows parallel.pp_layers.

A schedule is data (shardlm/parallel/pipeline/tables.py): a table of operations per rank (F, B, or
the split backward's I and W, of a global stage and a micro-batch), built for the named ones
(gpipe, 1f1b, interleaved, zb, zbv, dualpipev) or read from a user's CSV, checked by
simulating it before the run, and run by the one executor here (`Schedule.run`), which says how
long the step waited for its neighbours (the bubble, as measured: time blocked in receives over
the step's time). Stages sit on ranks in a loop (stage g on rank g mod P) or in a V (rank r holds
stages r and 2P-1-r: the embedding and the head both on rank 0, and the turn at rank P-1 passes
its activations and gradients without communication).

Gradients are reduced over the data-parallel ranks after the last micro-batch's backward (the
engine's finish_backward), not overlapped with it: a stage's backward interleaves with its
neighbours', and a reduction inside it could wait on ranks still sending.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from shardlm.comm.collectives import Comm
from shardlm.errors import ConfigError
from shardlm.parallel.pipeline.tables import Table, send_plan, stage_rank
from shardlm.parallel.pipeline.schedules import bubble_formula
from shardlm.parallel.pipeline.schedules import build_table, table_for
from shardlm.parallel.pipeline.weight_grads import WeightGrads

log = logging.getLogger("shardlm")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Elsewhere(nn.Module):
    """A block another pipeline stage holds: no parameters, never called."""

    def forward(self, *args, **kwargs):  # pragma: no cover - a bug if reached
        raise RuntimeError("this block lives on another pipeline stage")


ACTIVATIONS, GRADIENTS = 0, 1
"""Message tags: the two streams between neighbours (with virtual stages both run each way)."""


@dataclass
class Stage:
    """This rank's pipeline stage: one chunk of consecutive blocks, or several (interleaved: V
    chunks, chunk v being global stage v·P + rank; V-shaped: stages rank and 2P-1-rank)."""

    comm: Comm
    """The pipeline group."""
    chunks: list[range]
    """The blocks of each of this rank's chunks."""
    tied: bool
    """The head is the embedding's weight: both ends hold it (tok_emb.weight)."""
    n_layers: int
    ends: object | None = None
    """The process group of the first and last stage at this rank's position (tied weights held
    on two ranks; None when one rank holds both ends, as in a V)."""
    stages: list[int] = field(default_factory=lambda: [0])
    """The global stage of each chunk."""
    placement: str = "loop"
    """'loop' or 'v' (pipeline_tables.stage_rank)."""
    n_stages: int = 1
    """Global stages in all."""
    wait_s: float = 0.0
    """Seconds this step spent blocked on a neighbour."""
    pending: list = field(default_factory=list)
    hidden: dict = field(default_factory=dict)
    """Per sending rank: (shape, dtype) of the hidden states it sends: its first message says
    (a header sent once ahead of it), as autocast decides the residual stream's dtype."""
    announced: set = field(default_factory=set)
    """The ranks this one has sent its header to."""
    weight_grads: WeightGrads = field(default_factory=lambda: WeightGrads())
    """Weight gradients a split backward set aside (I now, W later)."""
    posted: list = field(default_factory=list)
    """This step's messages to and from other ranks, in the order posted: ('send' | 'recv', peer, label)."""

    @property
    def index(self) -> int:
        return self.comm.rank

    @property
    def count(self) -> int:
        return self.comm.size

    def rank_of(self, stage: int) -> int:
        """The pipeline rank holding global stage `stage`."""
        return stage_rank(self.placement, self.count, stage)

    def holds(self, stage: int) -> bool:
        return stage in self.stages

    @property
    def first(self) -> bool:
        """Holds the model's first stage (the embedding)."""
        return self.holds(0)

    @property
    def last(self) -> bool:
        """Holds the model's last stage (the head and the loss)."""
        return self.holds(self.n_stages - 1)

    @property
    def copies(self) -> frozenset[str]:
        """Parameters held here that another stage saves and counts (the tied head's copy)."""
        return frozenset({"tok_emb.weight"}) if self.tied and self.last and not self.first else frozenset()

    # -- point to point ----------------------------------------------------------------------

    def send(self, tensor: torch.Tensor, to: int, tag: int) -> tuple:
        """Start sending; the tensor stays alive with its handle until `release` or settle()."""
        tensor = tensor.contiguous()
        self.pending.append((self.comm.send(tensor, to, tag), tensor))
        return self.pending[-1]

    def release(self, sent: tuple) -> None:
        """Free a send the receiver has provably consumed (an activation whose gradient came
        back): its wait returns at once. (gloo reports a send complete only when waited on, and
        waiting on one not yet consumed could wait on a neighbour that first needs something
        this rank sends later.)"""
        sent[0].wait()
        self.pending = [entry for entry in self.pending if entry is not sent]

    def post(self, messages: list[tuple[int, str]], outbox: dict, sent: dict) -> None:
        """Send `messages` (a slot of send_plan) out of `outbox` (label -> (tensor, (stage,
        micro-batch) if activations)); activations' handles into `sent` (freed by `release`)."""
        for to, label in messages:
            tensor, activation = outbox.pop(label)
            self.posted.append(("send", to, label))
            if activation is not None:
                sent[activation] = self.send_hidden(tensor, to)
            else:
                self.send(tensor, to, GRADIENTS)

    def recv(self, like: tuple, frm: int, tag: int) -> torch.Tensor:
        shape, dtype, device = like
        buffer = torch.empty(shape, dtype=dtype, device=device)
        start = time.perf_counter()
        self.comm.recv(buffer, frm, tag).wait()
        self.wait_s += time.perf_counter() - start
        return buffer

    def send_hidden(self, t: torch.Tensor, to: int, header: bool = False) -> tuple:
        """Hidden states to rank `to`; a (dtype, shape) header ahead of the first sent there (or
        of every one, `header`: shapes that change, as in generation)."""
        if header or to not in self.announced:
            code = DTYPES.index(t.dtype)
            self.send(torch.tensor([code, *t.shape], dtype=torch.int64, device=t.device), to, ACTIVATIONS)
            self.announced.add(to)
        return self.send(t, to, ACTIVATIONS)

    def recv_hidden(self, device: torch.device, frm: int, header: bool = False) -> torch.Tensor:
        if header or frm not in self.hidden:
            header = self.recv(((4,), torch.int64, device), frm, ACTIVATIONS).tolist()
            self.hidden[frm] = (tuple(header[1:]), DTYPES[header[0]])
        return self.recv((*self.hidden[frm], device), frm, ACTIVATIONS)

    def settle(self) -> None:
        """Wait for this step's sends (their buffers may then be freed)."""
        start = time.perf_counter()
        for handle, _ in self.pending:
            handle.wait()
        self.wait_s += time.perf_counter() - start
        self.pending.clear()

    def drain(self, device: torch.device) -> None:
        """Wait for every stage to finish its step: a stage that ends early idles until the
        pipeline drains (the last stage, whose last backward is the step's first to finish).
        Waited here, timed as bubble, instead of unseen in the gradient norm's all-reduce that
        follows. A 4-byte all-reduce: telemetry, not model communication (not in the ledger's
        bytes; its time is blocked on other ranks: in the ledger's wait_s)."""
        import torch.distributed as dist

        start = time.perf_counter()
        dist.all_reduce(torch.zeros(1, device=device), group=self.comm.group)
        waited = time.perf_counter() - start
        self.wait_s += waited
        self.comm.ledger.wait_s += waited

    def sync_tied(self, model: nn.Module) -> None:
        """Sum the tied embedding's gradient over the first and last stage (each computed its
        share: the lookup and the head)."""
        if not self.tied or self.ends is None:
            return
        import torch.distributed as dist

        param = model.tok_emb.weight
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        self.comm.ledger.add("all_reduce", "pp_ends", 2 * grad.numel() * grad.element_size())
        dist.all_reduce(grad, group=self.ends)
        param.grad = grad


def apply_pp(model: nn.Module, comm: Comm, layers: list[int], ends, virtual: int = 1,
             placement: str = "loop") -> Stage | None:
    """Cut a meta-device Decoder to this rank's stage, in place. `layers`: blocks per global
    stage (pp × virtual of them, summing to the model's); `placement`: 'loop' (rank r keeps
    global stages r, P + r, ...) or 'v' (stages r and 2P-1-r); `ends`: the first-and-last-stage
    group (tied weights; unused in a V, whose rank 0 holds both)."""
    from shardlm.models.decoder import Decoder

    if comm.size == 1:
        return None
    if not isinstance(model, Decoder):
        raise ConfigError(f"parallel.pp > 1 needs shardlm's Decoder (got {type(model).__name__}): "
                          f"pipeline stages of transformers models are not supported yet; use pp = 1")
    bounds = [sum(layers[:g]) for g in range(len(layers) + 1)]
    stages = [g for g in range(len(layers)) if stage_rank(placement, comm.size, g) == comm.rank]
    mine = [range(bounds[g], bounds[g + 1]) for g in stages]
    stage = Stage(comm, mine, model.cfg.tie_embeddings, model.cfg.n_layers,
                  ends if placement == "loop" else None, stages, placement, len(layers))
    kept = {i for chunk in mine for i in chunk}
    for i in range(len(model.blocks)):
        if i not in kept:
            model.blocks[i] = Elsewhere()
    model.layers = mine[0]
    if not stage.first:
        if model.cfg.position == "learned":
            model.pos_emb = None
        if not (stage.tied and stage.last):  # the last stage's head keeps the tied weight
            model.tok_emb = None
    if not stage.last:
        model.norm_f = None
        model.head = None
    model.pipeline = stage
    log.info("pipeline parallel: rank %d of %d, stages %s, blocks %s (split %s, %s placement)%s", stage.index,
             stage.count, stages, ", ".join(f"{c.start}-{c.stop - 1}" for c in mine), "/".join(map(str, layers)),
             placement, "; tied head: the embedding also on the last stage" if stage.copies else "")
    return stage


# ---------------------------------------------------------------------------------------------
# The executor


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


def gather_stages(tensors: dict[str, torch.Tensor], shapes: dict[str, tuple], dtype: torch.dtype,
                  stage: Stage, device: torch.device) -> dict[str, torch.Tensor]:
    """Every parameter of the whole model (names and shapes: `shapes`, in model order), on
    every stage (CPU): each sent by the stage that holds it (the first stage for a tied copy)."""
    import torch.distributed as dist

    owners = torch.tensor([stage.index if n in tensors and n not in stage.copies else -1 for n in shapes],
                          device=device)
    dist.all_reduce(owners, op=dist.ReduceOp.MAX, group=stage.comm.group)
    out = {}
    for (name, shape), owner in zip(shapes.items(), owners.tolist()):
        value = (tensors[name].to(device) if owner == stage.index
                 else torch.empty(shape, dtype=dtype, device=device)).contiguous()
        dist.broadcast(value, dist.get_global_rank(stage.comm.group, owner), group=stage.comm.group)
        out[name] = value.cpu()
    return out
