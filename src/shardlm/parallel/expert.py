"""Expert parallelism: each rank of a group holds experts / G of every MoE block's experts, and
tokens travel to their experts' ranks and back by all-to-all with uneven splits (GShard,
Lepikhin et al. 2020; DeepSpeed-MoE; Megatron-LM's token dispatcher).

Per MoE block and micro-batch, on each rank of the group (models/moe.py routes first):

    1. the chosen (token, expert) pairs, grouped by expert (models.moe.route), are counted per
       expert; one small all-to-all tells every rank how many rows it will receive for each of
       its experts from each rank ("all_to_all_splits" in the ledger: E int64 per rank)
    2. the rows go to the ranks owning their experts (an all-to-all, "all_to_all");
       received grouped by source rank, they are regrouped by local expert, each expert runs on
       its rows, and the outputs are put back in arrival order
    3. the outputs return by the reverse all-to-all; the source rank weights them by their
       gates and adds them into its tokens (so the router's gradient stays local)
Backward runs the same exchanges in reverse (an all-to-all's gradient is the all-to-all back).

Two groups can hold the experts:
    parallel.ep = E   E data-parallel ranks of one shard group (ep divides dp_shard): the dense
                      part stays data-parallel; the experts' gradients are reduced over the
                      dp_shard / ep ranks (× replicas) that hold the same experts, and ZeRO
                      shards them over those (the engine's expert units, zero/engine.py)
    parallel.tp = T   the tensor-parallel ranks (their tokens are the same, so each takes 1/T of
                      them first: `TokenShare`; with sequence parallelism they already differ),
                      so a MoE block under tp splits its experts, not each expert's width: no
                      expert matmul gets narrower, and the exchange replaces tp's all-reduce.
                      The shared experts are cut like a dense MLP (parallel/tensor.py).
Either way an expert weight is this rank's slice of the stacked (E, ...) tensor along dim 0,
described by a placement.Split: checkpoints and exports see whole tensors at any layout.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from shardlm.comm.collectives import Comm
from shardlm.models.moe import Experts, MoE, MoEStats, Routing, update_biases
from shardlm.placement import Split, even_range

log = logging.getLogger("shardlm")


class _AllToAll(torch.autograd.Function):
    """Rows to ranks by `send` splits, received by `recv` splits; backward the reverse."""

    @staticmethod
    def forward(ctx, x, recv, send, comm, stats):
        ctx.recv, ctx.send, ctx.comm, ctx.stats = recv, send, comm, stats
        return _exchange(x, recv, send, comm, stats)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.send, ctx.recv, ctx.comm, ctx.stats), None, None, None, None


def _exchange(x: torch.Tensor, recv: list[int], send: list[int], comm: Comm, stats: MoEStats) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    handle = comm.all_to_all(out, x.contiguous(), recv, send)
    start = time.perf_counter()
    handle.wait()
    stats.a2a_wait_s += time.perf_counter() - start
    return out


def _expert_major(counts: torch.Tensor) -> torch.Tensor:
    """counts (G, E_l): rows from each source rank for each local expert, arrived source-major
    (rank 0's rows for experts 0..E_l-1, then rank 1's, ...). The arrival indices of the rows in
    expert-major order (expert 0's rows from every rank, then expert 1's, ...)."""
    flat = counts.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).view_as(counts)  # where segment (s, e) arrived
    lengths = counts.t().reshape(-1)  # segments in expert-major order
    offsets = torch.cumsum(lengths, 0) - lengths
    first = starts.t().reshape(-1)
    return torch.repeat_interleave(first - offsets, lengths) + torch.arange(int(lengths.sum()), device=counts.device)


class AllToAllDispatcher:
    """Sends each expert's rows to the rank holding it and brings their outputs back (steps 1-3
    of the module docstring). `placement[j]`: the experts rank j holds, ascending (contiguous
    blocks [j·E/G, (j+1)·E/G) until a re-placement by load moves them: place_experts)."""

    def __init__(self, comm: Comm, n_experts: int, stats: MoEStats):
        self.comm, self.n_experts, self.stats = comm, n_experts, stats
        self.local = n_experts // comm.size
        self.placement = [list(range(j * self.local, (j + 1) * self.local)) for j in range(comm.size)]
        self._order: torch.Tensor | None = None  # the experts in rank-major order, when moved

    def set_placement(self, placement: list[list[int]]) -> None:
        self.placement = [sorted(p) for p in placement]
        order = [e for p in self.placement for e in p]
        self._order = None if order == list(range(self.n_experts)) else torch.tensor(order)

    def __call__(self, x: torch.Tensor, routing: Routing, experts: Experts) -> torch.Tensor:
        g, e_l = self.comm.size, self.local
        counts = routing.counts.to(torch.int64)
        rows = None
        if self._order is not None:  # rows grouped by expert id -> by (owning rank, expert id)
            starts = torch.cumsum(counts, 0) - counts
            order = self._order.to(counts.device)
            rows = torch.cat([torch.arange(int(starts[e]), int(starts[e] + counts[e]), device=x.device)
                              for e in order.tolist()])
            x, counts = x[rows], counts[order]
        arriving = torch.empty_like(counts)  # (G·E_l): from rank s, for my expert e: [s·E_l + e]
        self.comm.all_to_all(arriving, counts, [e_l] * g, [e_l] * g, op="all_to_all_splits").wait()
        send = counts.view(g, e_l).sum(1).tolist()
        recv = arriving.view(g, e_l).sum(1).tolist()  # rows from each rank
        y = _AllToAll.apply(x, recv, send, self.comm, self.stats)  # by source, then local expert
        # Regroup by local expert (expert-major), run the experts, restore arrival order.
        order = _expert_major(arriving.view(g, e_l).to(x.device))
        outs = experts(y[order], arriving.view(g, e_l).sum(0).tolist())
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=x.device)
        out = _AllToAll.apply(outs[back], send, recv, self.comm, self.stats)
        if rows is not None:  # back to grouped by expert id
            undo = torch.empty_like(rows)
            undo[rows] = torch.arange(rows.numel(), device=rows.device)
            out = out[undo]
        return out


# ---------------------------------------------------------------------------------------------
# Tensor-parallel ranks as the expert group: each takes its share of the (same) tokens


def _all_gather_rows(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    out = x.new_empty((comm.size * x.shape[0], *x.shape[1:]))
    comm.all_gather(out.view(-1), x.contiguous().view(-1)).wait()
    return out


class _SplitRows(torch.autograd.Function):
    """This rank's 1/G of the rows forward; backward all-gathers the shares' gradients (every
    rank's upstream holds all the rows: Megatron's scatter-to-model-parallel-region)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        n = x.shape[0] // comm.size
        return x[comm.rank * n:(comm.rank + 1) * n]

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_rows(grad, ctx.comm), None


class _GatherRows(torch.autograd.Function):
    """All-gather the shares forward; backward keeps this rank's share of the gradient (every
    rank's downstream gradient is the same whole one)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _all_gather_rows(x, comm)

    @staticmethod
    def backward(ctx, grad):
        n = grad.shape[0] // ctx.comm.size
        return grad[ctx.comm.rank * n:(ctx.comm.rank + 1) * n], None


class _SumForward(torch.autograd.Function):
    """All-reduce forward, identity backward: a sum over the group's shares whose gradient
    each rank takes for its own share."""

    @staticmethod
    def forward(ctx, x, comm):
        out = x.contiguous().clone()
        comm.all_reduce(out).wait()
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class TokenShare:
    """A MoE block's tokens under tensor parallelism: replicated across the group (each rank
    routes 1/T of them, the outputs gathered back), or, under sequence parallelism, already
    this rank's own (nothing to split or gather)."""

    def __init__(self, tp):
        self.tp = tp

    def split(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.sharded:
            return x
        if x.shape[0] % self.tp.size:
            raise ValueError(f"a MoE block under tensor parallelism splits its {x.shape[0]} tokens "
                             f"over {self.tp.size} ranks: micro_batch × seq_len must divide by tp")
        return _SplitRows.apply(x, self.tp.comm)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.tp.sharded else _GatherRows.apply(x, self.tp.comm)

    def total(self, n: int) -> int:
        return n * self.tp.size

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """A count summed over the group (no gradient)."""
        out = x.detach().clone()
        self.tp.comm.all_reduce(out).wait()
        return out

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        return _SumForward.apply(x, self.tp.comm)


# ---------------------------------------------------------------------------------------------
# Applying it (parallelize: tensor → context → expert → pipeline → ...)


def spread_experts(moe: MoE, name: str, cfg, comm: Comm, stats: MoEStats) -> dict[str, Split]:
    """Replace block `name`'s experts (meta device) by this rank's E / G of them over `comm`'s
    group with an all-to-all dispatcher; the Splits of the new weights (dim 0 of the whole)."""
    lo, hi = even_range(moe.n_experts, comm.size, comm.rank)
    splits = {f"{name}.experts.{attr}": Split(tuple(p.shape), 0, ((lo, hi),))
              for attr, p in moe.experts.named_parameters()}
    moe.experts = Experts(cfg, hi - lo, lo)
    moe.dispatcher = AllToAllDispatcher(comm, moe.n_experts, stats)
    return splits


@dataclass
class EPState:
    """The expert-parallel group of a model (model.ep) and the expert weights it cut."""

    comm: Comm
    splits: dict[str, Split]

    @property
    def rank(self) -> int:
        return self.comm.rank


def apply_ep(model: nn.Module, comm: Comm) -> dict[str, Split]:
    """parallel.ep > 1: the experts spread over the expert-parallel group (data-parallel ranks);
    model.ep records it (whole_parameters puts the experts back together from it)."""
    stats: MoEStats | None = getattr(model, "moe_stats", None)
    if stats is None:
        raise ValueError("parallel.ep > 1 needs a mixture-of-experts model (model.experts > 0)")
    splits: dict[str, Split] = {}
    with torch.device("meta"):
        for name, module in model.named_modules():
            if isinstance(module, MoE):
                splits.update(spread_experts(module, name, model.cfg, comm, stats))
    log.info("expert parallel: %d ranks, %d of %d experts per MoE block on each", comm.size,
             stats.experts // comm.size, stats.experts)
    model.ep = EPState(comm, splits)
    return splits


def finish_moe_step(stats: MoEStats, balance: str, rate: float) -> torch.Tensor | None:
    """After a step: this step's figures summed over every rank (telemetry, not in the ledger:
    every pipeline stage's layers, every rank's tokens), and the balancing biases moved by them.
    Returns the (layers, E + 4) sums (models.moe.MoEStats.sums), or None before any forward."""
    sums = stats.sums
    if sums is None:
        return None
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sums)
    if balance == "bias":
        update_biases(stats, sums[:, :stats.experts], rate)
    return sums


def moe_record(stats: MoEStats, sums: torch.Tensor, comm_bytes: dict[str, int]) -> dict:
    """The JSONL figures of a step (telemetry, docs/moe.md)."""
    e = stats.experts
    routed = sums[:, :e]
    dropped, aux_w, lse2, tokens = (sums[:, e + i] for i in range(4))
    mean = routed.mean(1).clamp(min=1e-12)
    imbalance = (routed.max(1).values / mean).tolist()
    a2a = sum(v for k, v in comm_bytes.items() if k.startswith("all_to_all"))
    return {"moe_aux_loss": float(aux_w.sum() / tokens.sum()),
            "moe_z_loss": float(lse2.sum() / tokens.sum()),
            "moe_tokens_per_expert": [[int(v) for v in row] for row in routed.tolist()],
            "moe_imbalance": max(imbalance), "moe_imbalance_by_layer": imbalance,
            "moe_dropped_fraction": float(dropped.sum() / routed.sum().clamp(min=1)),
            "moe_a2a_bytes": int(a2a), "moe_a2a_wait_s": stats.a2a_wait_s}


# ---------------------------------------------------------------------------------------------
# Re-placing experts by measured load (parallel.ep_rebalance_every)


def balanced_placement(loads: list[float], ranks: int) -> list[list[int]]:
    """Experts to ranks, E / ranks each, the heaviest first onto the rank with the least load
    so far (longest-processing-time first; ties to the lower rank, then the lower expert id):
    the busiest rank's load, which sets an expert-parallel step's time, as low as LPT makes it."""
    per = len(loads) // ranks
    placement: list[list[int]] = [[] for _ in range(ranks)]
    totals = [0.0] * ranks
    for e in sorted(range(len(loads)), key=lambda i: (-loads[i], i)):
        j = min((r for r in range(ranks) if len(placement[r]) < per), key=lambda r: (totals[r], r))
        placement[j].append(e)
        totals[j] += loads[e]
    return [sorted(p) for p in placement]


def rank_loads(loads: list[float], placement: list[list[int]]) -> list[float]:
    return [sum(loads[e] for e in p) for p in placement]


def _runs(ids: list[int]) -> tuple[tuple[int, int], ...]:
    """Sorted expert ids as [lo, hi) ranges of consecutive ones."""
    out: list[list[int]] = []
    for e in ids:
        if out and out[-1][1] == e:
            out[-1][1] = e + 1
        else:
            out.append([e, e + 1])
    return tuple((lo, hi) for lo, hi in out)


@torch.no_grad()
def place_experts(model: nn.Module, strategy, shard_group, placements: dict[str, list[list[int]]]) -> int:
    """Move experts between the expert-parallel ranks: block name -> its new placement (every
    rank calls with the same). Every expert state (parameters, masters, Adam moments) is put
    together whole on each rank of the shard group by a summed all-reduce of what each rank
    holds (the checkpoint slices: their coordinates are the whole tensors'), the expert
    weights' Splits are changed, and every rank copies its new slices out of the whole; the
    dispatchers learn the new owners. Transient memory: the whole expert states of the moved
    blocks (a production version would send only the moved experts). Returns the bytes
    all-reduced (in the ledger as all_reduce/ep_rebalance)."""
    ep: EPState = model.ep
    names = {f"{block}.experts.{attr}" for block in placements
             for attr, _ in model.get_submodule(f"{block}.experts").named_parameters()}
    keyed = lambda slices: [sl for sl in slices if sl.name.rsplit("/", 1)[-1] in names]  # noqa: E731
    whole: dict[str, torch.Tensor] = {}
    for sl in keyed(strategy.state_slices(saving=True)):
        buf = whole.setdefault(sl.name, torch.zeros(math.prod(sl.shape), dtype=torch.float32, device=sl.tensor.device))
        buf[sl.start:sl.end] = sl.tensor.float()
    comm = Comm(shard_group, "ep_rebalance", strategy.ledger)
    # Every rank must hold every tensor's buffer (a rank may hold no slice of one): by name.
    for name in sorted(names):
        for kind in ("model", "optim/exp_avg", "optim/exp_avg_sq"):
            key = f"{kind}/{name}"
            if key not in whole:
                whole[key] = torch.zeros(math.prod(ep.splits[name].shape), dtype=torch.float32,
                                         device=next(model.parameters()).device)
    moved = 0
    for key in sorted(whole):
        comm.all_reduce(whole[key]).wait()
        moved += 2 * whole[key].numel() * whole[key].element_size()
    for block, placement in placements.items():
        moe = model.get_submodule(block)
        for attr, _ in moe.experts.named_parameters():
            name = f"{block}.experts.{attr}"
            split = ep.splits[name]
            ep.splits[name] = Split(split.shape, 0, _runs(placement[ep.rank]))
        moe.dispatcher.set_placement(placement)
    for sl in keyed(strategy.state_slices()):
        sl.tensor.copy_(whole[sl.name][sl.start:sl.end].to(sl.tensor.dtype))
    strategy.after_load()
    return moved


class ExpertBalancer:
    """The expert-parallel ranks' loads (rank_imbalance, logged every step) and, with
    parallel.ep_rebalance_every = N: every N steps, each MoE block whose busiest
    expert-parallel rank (by the loads routed over those N steps) would carry less under
    balanced_placement gets its experts moved (place_experts). The loads are the steps'
    choices per expert summed over every rank (finish_moe_step), so every rank decides alike."""

    def __init__(self, model: nn.Module, every: int):
        self.model, self.every = model, every
        self.blocks = [n for n, m in model.named_modules() if isinstance(m, MoE)]
        self.rows = {n: model.moe_stats.layers.index(model.get_submodule(n).index) for n in self.blocks}
        self.loads: torch.Tensor | None = None

    def rank_imbalance(self, sums: torch.Tensor) -> list[float]:
        """Per MoE block here: the busiest ep rank's load over the mean rank's, this step."""
        out = []
        for block in self.blocks:
            loads = sums[self.rows[block], :self.model.moe_stats.experts].tolist()
            per_rank = rank_loads(loads, self.model.get_submodule(block).dispatcher.placement)
            out.append(max(per_rank) / max(sum(per_rank) / len(per_rank), 1e-12))
        return out

    def step(self, step: int, sums: torch.Tensor, strategy, shard_group) -> int:
        """After step `step` (0-based) with its summed figures: maybe move experts; returns
        how many blocks were re-placed."""
        e = self.model.moe_stats.experts
        if not self.every:
            return 0
        self.loads = sums[:, :e].clone() if self.loads is None else self.loads + sums[:, :e]
        if (step + 1) % self.every:
            return 0
        moves = {}
        for block in self.blocks:
            loads = self.loads[self.rows[block]].tolist()
            now = self.model.get_submodule(block).dispatcher.placement
            new = balanced_placement(loads, len(now))
            if max(rank_loads(loads, new)) < max(rank_loads(loads, now)):
                moves[block] = new
        self.loads = None
        if moves:
            place_experts(self.model, strategy, shard_group, moves)
            log.info("experts re-placed by load in %d MoE block(s) after step %d", len(moves), step + 1)
        return len(moves)
