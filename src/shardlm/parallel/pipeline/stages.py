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

Stages sit on ranks in a loop (stage g on rank g mod P) or in a V (rank r holds stages r and
2P-1-r: the embedding and the head both on rank 0, and the turn at rank P-1 passes its
activations and gradients without communication). A Stage sends and receives between them; the
schedule's executor that drives it is executor.py.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from shardlm.comm.collectives import Comm
from shardlm.errors import ConfigError
from shardlm.parallel.pipeline.tables import stage_rank
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
