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

Schedules are objects chosen when the run is built (`SCHEDULES`); each runs one step's
micro-batches on this stage and says how long it waited for its neighbours (the bubble, as
measured: time blocked in receives over the step's time). With M micro-batches and P stages
both leave (P-1)/(M+P-1) of the step idle; 1F1B holds at most P - s micro-batches of
activations on stage s (GPipe holds all M).

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
from shardlm.parallel.weight_grads import WeightGrads

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
    """This rank's pipeline stage: one chunk of consecutive blocks, or with virtual stages
    (interleaved schedule) V chunks, chunk v being global stage v·P + rank."""

    comm: Comm
    """The pipeline group (rank r holds global stages r, P + r, ...)."""
    chunks: list[range]
    """The blocks of each of this rank's chunks."""
    tied: bool
    """The head is the embedding's weight: both ends hold it (tok_emb.weight)."""
    n_layers: int
    ends: object | None = None
    """The process group of the first and last stage at this rank's position (tied weights)."""
    wait_s: float = 0.0
    """Seconds this step spent blocked on a neighbour."""
    pending: list = field(default_factory=list)
    hidden: tuple | None = None
    """(shape, dtype) of the hidden states between stages: the first stage's first output says
    (a header sent once ahead of it), as autocast decides the residual stream's dtype."""
    announced: bool = False
    weight_grads: WeightGrads = field(default_factory=lambda: WeightGrads())
    """Weight gradients a split backward set aside (the zero-bubble schedule)."""

    @property
    def index(self) -> int:
        return self.comm.rank

    @property
    def count(self) -> int:
        return self.comm.size

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    def starts(self, chunk: int) -> bool:
        """Whether this chunk is the model's first global stage (the embedding)."""
        return self.chunks[chunk].start == 0

    def ends_model(self, chunk: int) -> bool:
        """Whether this chunk is the model's last global stage (the head and the loss)."""
        return self.chunks[chunk].stop == self.n_layers

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

    def recv(self, like: tuple, frm: int, tag: int) -> torch.Tensor:
        shape, dtype, device = like
        buffer = torch.empty(shape, dtype=dtype, device=device)
        start = time.perf_counter()
        self.comm.recv(buffer, frm, tag).wait()
        self.wait_s += time.perf_counter() - start
        return buffer

    def send_hidden(self, t: torch.Tensor, header: bool = False) -> tuple:
        """The hidden states to the next stage; a (dtype, shape) header ahead of the first
        (or of every one, `header`: shapes that change, as in generation)."""
        to = (self.index + 1) % self.count
        if header or not self.announced:
            code = DTYPES.index(t.dtype)
            self.send(torch.tensor([code, *t.shape], dtype=torch.int64, device=t.device), to, ACTIVATIONS)
            self.announced = True
        return self.send(t, to, ACTIVATIONS)

    def recv_hidden(self, device: torch.device, header: bool = False) -> torch.Tensor:
        frm = (self.index - 1) % self.count
        if header or self.hidden is None:
            header = self.recv(((4,), torch.int64, device), frm, ACTIVATIONS).tolist()
            self.hidden = (tuple(header[1:]), DTYPES[header[0]])
        return self.recv((*self.hidden, device), frm, ACTIVATIONS)

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


def apply_pp(model: nn.Module, comm: Comm, layers: list[int], ends, virtual: int = 1) -> Stage | None:
    """Cut a meta-device Decoder to this rank's stage, in place. `layers`: blocks per global
    stage (pp × virtual of them, summing to the model's); rank r keeps global stages r, P + r,
    ...; `ends`: the first-and-last-stage group (tied weights)."""
    from shardlm.models.decoder import Decoder

    if comm.size == 1:
        return None
    if not isinstance(model, Decoder):
        raise ConfigError(f"parallel.pp > 1 needs shardlm's Decoder (got {type(model).__name__}): "
                          f"pipeline stages of transformers models are not supported yet; use pp = 1")
    bounds = [sum(layers[:g]) for g in range(len(layers) + 1)]
    mine = [range(bounds[g], bounds[g + 1]) for g in range(comm.rank, len(layers), comm.size)]
    stage = Stage(comm, mine, model.cfg.tie_embeddings, model.cfg.n_layers, ends)
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
    log.info("pipeline parallel: rank %d of %d, blocks %s (split %s)%s", stage.index, stage.count,
             ", ".join(f"{c.start}-{c.stop - 1}" for c in mine), "/".join(map(str, layers)),
             "; tied head: the embedding also on the last stage" if stage.tied and stage.last else "")
    return stage


# ---------------------------------------------------------------------------------------------
# Schedules


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
    """One step's forwards and backwards on this rank, in an order (`order`) of ("F" | "B" |
    "W", chunk, micro-batch) that a global timeline of the whole pipeline respects, so receives
    never wait on a send that waits on them. "W" (schedules that split the backward): the
    weight gradients of a micro-batch whose "B" computed only the gradients to send back."""

    name = ""
    splits_backward = False

    def __init__(self, stage: Stage):
        self.stage = stage

    @property
    def virtual(self) -> int:
        return len(self.stage.chunks)

    def order(self, micro: int) -> list[tuple[str, int, int]]:
        raise NotImplementedError

    def bubble_formula(self, micro: int) -> float:
        """The idle fraction of a step the schedule leaves, for equal stage times: P - 1 stage
        times of fill and drain in M·V + P - 1 (V chunks of 1/V each)."""
        p, v = self.stage.count, self.virtual
        return (p - 1) / (v * micro + p - 1)

    def _forward_steps(self, micro: int) -> list[tuple[int, int]]:
        """(chunk, micro-batch) of forward step k (Megatron-LM's order): P micro-batches through
        chunk 0, the same P through chunk 1, ..., then the next P micro-batches."""
        p, v = self.stage.count, self.virtual
        return [((k % (p * v)) // p, (k // (p * v)) * p + k % p) for k in range(micro * v)]

    def run(self, io: StepIO, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Every micro-batch's forward and backward on this rank; the summed loss (on the rank
        holding the head; 0 elsewhere)."""
        stage = self.stage
        stage.wait_s = 0.0
        total = torch.zeros((), device=io.device)
        inputs: dict[tuple[int, int], torch.Tensor | None] = {}
        outputs: dict[tuple[int, int], torch.Tensor] = {}
        sent: dict[tuple[int, int], tuple] = {}  # activation sends, freed when their gradient returns
        prev, nxt = (stage.index - 1) % stage.count, (stage.index + 1) % stage.count
        for kind, chunk, i in self.order(len(batches)):
            x, y = batches[i]
            key = (chunk, i)
            if kind == "F":
                hidden = None if stage.starts(chunk) else stage.recv_hidden(io.device).requires_grad_()
                io.model.layers = stage.chunks[chunk]
                with io.autocast():
                    out = io.forward(x, hidden)
                    if stage.ends_model(chunk):
                        out = io.loss(out, y)
                        total += out.detach()
                if not stage.ends_model(chunk):
                    sent[key] = stage.send_hidden(out.detach())
                inputs[key], outputs[key] = hidden, out
            elif kind == "W":  # the weight gradients a split backward left for later
                stage.weight_grads.apply(key)
            else:
                io.before_backward(i)
                out, hidden = outputs.pop(key), inputs.pop(key)
                with stage.weight_grads.deferred(key if self.splits_backward else None):
                    if stage.ends_model(chunk):
                        io.backward(out)
                    else:
                        grad = stage.recv((out.shape, out.dtype, out.device), nxt, GRADIENTS)
                        stage.release(sent.pop(key))
                        torch.autograd.backward(out, grad)
                if hidden is not None:
                    stage.send(hidden.grad, prev, GRADIENTS)
        stage.settle()
        stage.drain(io.device)
        return total

    @torch.no_grad()
    def forward_only(self, io: StepIO, batches, shape: tuple[int, ...] = (),
                     dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
        """io.loss of each of `batches` (evaluation: a tensor of `shape` and `dtype`, e.g. the
        token sums of parallel/evaluation.py), on every rank: the head's rank's, shared."""
        import torch.distributed as dist

        stage, losses = self.stage, []
        for x, y in batches:
            loss = torch.zeros(shape, dtype=dtype, device=io.device)
            for chunk in range(self.virtual):
                hidden = None if stage.starts(chunk) else stage.recv_hidden(io.device)
                io.model.layers = stage.chunks[chunk]
                with io.autocast():
                    out = io.forward(x, hidden)
                    if stage.ends_model(chunk):
                        loss = io.loss(out, y).to(dtype)
                if not stage.ends_model(chunk):
                    stage.send_hidden(out)
            losses.append(loss)
        stage.settle()
        summed = torch.stack(losses)
        dist.all_reduce(summed, group=stage.comm.group)  # only the head's rank's are non-zero
        return list(summed)

    @torch.no_grad()
    def generate(self, io: StepIO, idx: torch.Tensor, max_new_tokens: int, temperature: float = 0.8,
                 top_k: int | None = 50, generator: torch.Generator | None = None) -> torch.Tensor:
        """models.generate through the stages: each new token's forward passes every stage,
        the last samples it (models.decoder.next_token) and broadcasts it to the pipeline."""
        import torch.distributed as dist

        from shardlm.models.decoder import next_token

        stage, model = self.stage, io.model
        context = getattr(model, "context", None)
        with context.whole_sequences() if context is not None else contextlib.nullcontext():
            for _ in range(max_new_tokens):
                x = idx[:, -model.cfg.max_seq_len:]
                new = torch.zeros((idx.shape[0], 1), dtype=idx.dtype, device=idx.device)
                for chunk in range(self.virtual):
                    hidden = None if stage.starts(chunk) else stage.recv_hidden(io.device, header=True)
                    model.layers = stage.chunks[chunk]
                    with io.autocast():
                        out = io.forward(x, hidden)
                    if stage.ends_model(chunk):
                        new = next_token(model, out[:, -1, :], temperature, top_k, generator)
                    else:
                        stage.send_hidden(out, header=True)
                stage.settle()
                head = dist.get_global_rank(stage.comm.group, stage.count - 1)
                dist.broadcast(new, head, group=stage.comm.group)
                idx = torch.cat((idx, new), dim=1)
        return idx

    def by_stage(self, values: list[float], device: torch.device) -> list[list[float]]:
        """`values` of every stage, gathered over the pipeline: one list per value, by stage."""
        import torch.distributed as dist

        mine = torch.tensor(values, dtype=torch.float64, device=device)
        every = torch.empty(self.stage.count * len(values), dtype=torch.float64, device=device)
        dist.all_gather_into_tensor(every, mine, group=self.stage.comm.group)
        return every.view(self.stage.count, len(values)).t().tolist()


class GPipe(Schedule):
    """Every micro-batch's forward, then every backward: M micro-batches of activations held on
    every stage."""

    name = "gpipe"

    def order(self, micro: int) -> list[tuple[str, int, int]]:
        steps = self._forward_steps(micro)
        return [("F", c, i) for c, i in steps] + [("B", c, i) for c, i in reversed(steps)]


class OneFOneB(Schedule):
    """Warm up with a few forwards, then alternate one forward and one backward, then drain
    the backwards (PipeDream-Flush). One chunk per rank: P - r - 1 warm-up forwards, at most
    P - r micro-batches held on rank r, the bubble GPipe's. With V chunks per rank
    ('interleaved', Narayanan et al. 2021, Megatron-LM's order): 2·(P - r - 1) + (V - 1)·P
    warm-up forwards, and the bubble divided by about V."""

    name = "1f1b"

    def order(self, micro: int) -> list[tuple[str, int, int]]:
        p, v, r = self.stage.count, self.virtual, self.stage.index
        forwards = self._forward_steps(micro)
        backwards = [(v - 1 - c, i) for c, i in forwards]  # chunks in reverse
        total = len(forwards)
        warmup = min(total, p - r - 1 if v == 1 else 2 * (p - r - 1) + (v - 1) * p)
        out = [("F", *forwards[k]) for k in range(warmup)]
        for k in range(total - warmup):
            out += [("F", *forwards[warmup + k]), ("B", *backwards[k])]
        out += [("B", *backwards[k]) for k in range(total - warmup, total)]
        return out


class Interleaved(OneFOneB):
    name = "interleaved"


class ZeroBubble(Schedule):
    """The backward split in two (Qi et al. 2023): "B" computes only the gradient a stage
    sends back (the critical path), "W" its weight gradients, which wait to fill the time a
    stage would otherwise spend idle. The order is a list schedule of the whole pipeline in
    unit time steps (F, B and W one unit each): every rank runs, at each step, a ready B
    first, else a ready F if it holds fewer than P - r micro-batches (1F1B's memory bound) and
    fewer than P - r deferred W, else its oldest W. The bubble left is what that timeline
    leaves idle."""

    name = "zb"
    splits_backward = True

    def order(self, micro: int) -> list[tuple[str, int, int]]:
        return _list_schedule(self.stage.count, micro)[0][self.stage.index]

    def bubble_formula(self, micro: int) -> float:
        """The idle share of the unit-time timeline: 1 - 3M / its length."""
        return 1 - 3 * micro / _list_schedule(self.stage.count, micro)[1]


@functools.lru_cache(maxsize=None)
def _list_schedule(p: int, micro: int) -> tuple[list[list[tuple[str, int, int]]], int]:
    """Every rank's order and the timeline's length in steps (ZeroBubble's docstring)."""
    done: dict[tuple[str, int, int], int] = {}  # (kind, rank, micro-batch) -> finishing step
    orders: list[list[tuple[str, int, int]]] = [[] for _ in range(p)]
    nxt_f, nxt_b, pending_w = [0] * p, [0] * p, [[] for _ in range(p)]
    t = 0
    while any(len(o) < 3 * micro for o in orders):
        picks = []
        for r in range(p):
            f, b = nxt_f[r], nxt_b[r]
            b_ready = b < f and done.get(("F", r, b), t) < t and (r == p - 1 or done.get(("B", r + 1, b), t) < t)
            f_ready = f < micro and (r == 0 or done.get(("F", r - 1, f), t) < t) and f - b < p - r
            if b_ready:
                picks.append((r, "B", b))
            elif f_ready and len(pending_w[r]) < p - r:  # at most P - r sets of deferred gradients
                picks.append((r, "F", f))
            elif pending_w[r]:
                picks.append((r, "W", pending_w[r][0]))
            elif f_ready:
                picks.append((r, "F", f))
            elif pending_w[r]:
                picks.append((r, "W", pending_w[r][0]))
        for r, kind, m in picks:
            done[(kind, r, m)] = t
            orders[r].append((kind, 0, m))
            if kind == "F":
                nxt_f[r] += 1
            elif kind == "B":
                nxt_b[r] += 1
                pending_w[r].append(m)
            else:
                pending_w[r].pop(0)
        t += 1
    return orders, t


SCHEDULES = {cls.name: cls for cls in (GPipe, OneFOneB, Interleaved, ZeroBubble)}


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
