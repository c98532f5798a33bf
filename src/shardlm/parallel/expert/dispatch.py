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

Three groups can hold the experts:
    parallel.ep = E   E ranks of one shard group (ep divides dp_shard × cp): the dense
                      part stays data-parallel; the experts' gradients are reduced over the
                      dp_shard / ep ranks (× replicas) that hold the same experts, and ZeRO
                      shards them over those (the engine's expert units, parallel/data/zero/engine.py)
    parallel.tp = T   the tensor-parallel ranks (their tokens are the same, so each takes 1/T of
                      them first: `TokenShare`; with sequence parallelism they already differ),
                      so a MoE block under tp splits its experts, not each expert's width: no
                      expert matmul gets narrower, and the exchange replaces tp's all-reduce.
                      The shared experts are cut like a dense MLP (parallel/tensor/decoder.py).
    both              ep × tp ranks (mesh.expert_group): each tp rank takes its share of the
                      tokens as under tp alone, and the exchange runs over the ep ranks' tp
                      groups together (Megatron-Core's expert grid, with our experts spread
                      over tp rather than cut by it); the ranks at the same (ep, tp) position
                      of other ep groups hold the same experts and reduce them.
Context-parallel ranks can be expert-parallel ranks too (ep divides dp_shard × cp): their tokens
differ already, and the balancing statistics are summed over the cp group (TokenShare.cp).
Either way an expert weight is this rank's slice of the stacked (E, ...) tensor along dim 0,
described by a placement.Split: checkpoints and exports see whole tensors at any layout.

A transformers mixture of experts (through models.hf.CausalLMAdapter) gets the same exchange
where its experts module allows it: transformers >= 5 keeps a block's experts as one module with
stacked `gate_up_proj` (E, 2f, d) / `down_proj` (E, d, f) whose forward takes the routing decision,
`forward(hidden_states, top_k_index, top_k_weights)` (MixtralExperts, Qwen2MoeExperts,
OlmoeExperts). That module is replaced by `StackedExperts`: this rank's E / ep rows of the same
two parameters (same names), the (token, choice) pairs grouped by models.moe.route, sent through
AllToAllDispatcher, run with transformers' expert math, and combined with the gates as
transformers does. The router, the shared experts and the balancing loss stay the model's own.
Other layouts (biases, transposed or interleaved weights, custom gating, a post-expert norm,
per-expert ModuleLists as in transformers 4) are refused with the reason (`hf_experts_problem`).
"""

from __future__ import annotations

import inspect
import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardlm.comm.collectives import Comm
from shardlm.errors import ConfigError
from shardlm.models.moe import Experts, MoE, MoEStats, Routing, route, update_biases
from shardlm.models.quant import quantize_experts
from shardlm.parallel.tensor.decoder import cut_mlp
from shardlm.parallel.tensor.regions import TPState, copy_to_group, frozen_kept, reduce_from_group, summed
from shardlm.models.placement import Split, even_range

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
    blocks [j·E/G, (j+1)·E/G) until a re-placement by load moves them: expert_balance.place_experts)."""

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
        outs = experts(y[order], arriving.view(g, e_l).sum(0))
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


class TokenShare:
    """A MoE block's tokens and the groups its balancing statistics are summed over.

    Tensor parallelism (`tp`): the tokens are replicated across the group (each rank routes 1/T
    of them, the outputs gathered back), or, under sequence parallelism, already this rank's
    own (nothing to split or gather). Context parallelism (`cp`): each rank holds its own chunks
    of the sequences (nothing to split), but Switch's f and P are over the whole micro-batch, so
    the counts and probabilities are summed over the cp group too — while this forward runs on
    chunks (`cp.sharded`; generation does not split)."""

    def __init__(self, tp=None, cp=None):
        self.tp, self.cp = tp, cp

    def split(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is None or self.tp.sharded:
            return x
        if x.shape[0] % self.tp.size:
            raise ValueError(f"a MoE block under tensor parallelism splits its {x.shape[0]} tokens "
                             f"over {self.tp.size} ranks: micro_batch × seq_len must divide by tp")
        return _SplitRows.apply(x, self.tp.comm)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.tp is None or self.tp.sharded else _GatherRows.apply(x, self.tp.comm)

    def _comms(self) -> list[Comm]:
        """The groups whose ranks hold the other parts of this micro-batch's tokens."""
        return [s.comm for s in (self.tp, self.cp) if s is not None and (s is self.tp or s.sharded)]

    def total(self, n: int) -> int:
        for comm in self._comms():
            n *= comm.size
        return n

    def grad_factor(self) -> int:
        """What the balancing terms' gradient scale is multiplied by. The trainer's scale
        divides by every micro-batch of the global batch, cp's shares counted as micro-batches
        (each cp rank's language-model loss is its share of the whole); the terms here are the
        whole micro-batch's on every cp rank, their gradients summed over the group: × cp."""
        return self.cp.size if self.cp is not None and self.cp.sharded else 1

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """A count summed over the groups (no gradient)."""
        for comm in self._comms():
            x = summed(x, comm)
        return x

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Summed over the groups forward, each rank's gradient to its own share (the ranks'
        gradients are then summed: the router's by sync_weight over tp, by the data-parallel
        reduction over cp)."""
        for comm in self._comms():
            x = reduce_from_group(x, comm)
        return x


def share_over_cp(model: nn.Module, cp) -> None:
    """Context parallelism (after apply_cp): each MoE block's balancing statistics summed over
    the cp group, so Switch's loss is the whole micro-batch's, as in one process."""
    for moe in model.modules():
        if isinstance(moe, MoE):
            if moe.tokens is None:
                moe.tokens = TokenShare(cp=cp)
            else:
                moe.tokens.cp = cp


# ---------------------------------------------------------------------------------------------
# Applying it (parallelize: tensor → context → expert → pipeline → ...)


def spread_experts(moe: MoE, name: str, cfg, comm: Comm, stats: MoEStats) -> dict[str, Split]:
    """Replace block `name`'s experts (meta device) by this rank's E / G of them over `comm`'s
    group with an all-to-all dispatcher; the Splits of the new weights (dim 0 of the whole)."""
    lo, hi = even_range(moe.n_experts, comm.size, comm.rank)
    splits = {f"{name}.experts.{attr}": Split(tuple(p.shape), 0, ((lo, hi),))
              for attr, p in moe.experts.named_parameters()}
    quant = moe.experts.quant  # a quantised base (lora.quantize): the new experts' bytes too
    fp8 = moe.experts.fp8  # fp8: every global expert's quantisers; this rank uses its own
    moe.experts = Experts(cfg, hi - lo, lo)
    moe.experts.fp8 = fp8
    if quant:
        quantize_experts(moe.experts, next(iter(quant.values())).kind)
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


# --- transformers' experts modules ---------------------------------------------------------

_HF_EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def hf_experts_problem(module: nn.Module) -> str | None:
    """Why a transformers experts module (one holding a stacked `gate_up_proj` or `down_proj`)
    cannot be spread by StackedExperts, or None when it can."""
    kind = type(module).__name__
    params = dict(module.named_parameters())
    if set(params) != set(_HF_EXPERT_WEIGHTS):
        return f"{kind} holds {sorted(params)}, StackedExperts exactly gate_up_proj and down_proj (no biases)"
    if list(module.buffers()):
        return f"{kind} has buffers"
    flags = {"has_gate": True, "has_bias": False, "has_post_expert_norm": False, "is_transposed": False,
             "is_concatenated": True}
    odd = [f"{k} = {getattr(module, k)}" for k, want in flags.items() if getattr(module, k, want) != want]
    if odd:
        return f"{kind} has {', '.join(odd)} (StackedExperts: concatenated [gate; up] rows, (E, out, in), no bias, no norm)"
    gate = getattr(type(module), "_apply_gate", None)
    if gate is not None and getattr(gate, "__name__", "") != "_default_apply_gate":
        return f"{kind} has its own gating ({gate.__qualname__}), StackedExperts the default act(gate) * up"
    if not callable(getattr(module, "act_fn", None)) or not isinstance(getattr(module, "num_experts", None), int):
        return f"{kind} has no act_fn or num_experts"
    args = list(inspect.signature(type(module).forward).parameters)[1:]
    if args != ["hidden_states", "top_k_index", "top_k_weights"]:
        return f"{kind}.forward takes {args}, not the routing decision (hidden_states, top_k_index, top_k_weights)"
    e, gu, down = module.num_experts, params["gate_up_proj"], params["down_proj"]
    if gu.dim() != 3 or down.dim() != 3 or gu.shape[0] != e or down.shape[0] != e or \
            gu.shape[1] != 2 * down.shape[2] or gu.shape[2] != down.shape[1]:
        return (f"{kind} weights gate_up_proj {tuple(gu.shape)}, down_proj {tuple(down.shape)} are not "
                f"(E={e}, 2f, d) and (E, d, f)")
    return None


class StackedExperts(nn.Module):
    """This rank's experts of a transformers experts module (hf_experts_problem says which ones
    qualify), its tokens exchanged by all-to-all: the same parameter names, each its E / ep rows
    [first, first + count) of the stacked whole; forward(hidden_states, top_k_index,
    top_k_weights) like the module it replaces. Each local expert computes transformers' eager
    math, down(act(gate) * up); each output is weighted by its gate in the output's dtype
    promoted with the gate's, then added into its token in the hidden dtype, as transformers does."""

    def __init__(self, source: nn.Module, first: int, count: int, dispatcher: AllToAllDispatcher):
        super().__init__()
        self.num_experts, self.first, self.count = source.num_experts, first, count
        self.act_fn, self.dispatcher = source.act_fn, dispatcher
        for attr in _HF_EXPERT_WEIGHTS:
            whole = getattr(source, attr)
            piece = whole.detach().narrow(0, first, count)
            # On the meta device it stays there (the ZeRO engine materialises it from the
            # sliced initializer); a model built on the CPU keeps its values.
            setattr(self, attr, nn.Parameter(piece if whole.is_meta else piece.clone(),
                                             requires_grad=whole.requires_grad))

    def _local(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        outs = []
        for e, xe in enumerate(x.split(counts.tolist())):
            gate, up = F.linear(xe, self.gate_up_proj[e]).chunk(2, dim=-1)
            outs.append(F.linear(self.act_fn(gate) * up, self.down_proj[e]))
        return torch.cat(outs) if outs else x[:0]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        routing = route(top_k_index, top_k_weights, self.num_experts, 0)  # dropless
        out = self.dispatcher(hidden_states[routing.token], routing, self._local)
        weighted = (out * routing.gate.unsqueeze(-1)).to(hidden_states.dtype)
        return torch.zeros_like(hidden_states).index_add(0, routing.token, weighted)


def spread_hf_experts(model: nn.Module, comm: Comm, stats: MoEStats) -> dict[str, Split]:
    """Every transformers experts module of `model` replaced by this rank's StackedExperts; the
    Splits of their weights by parameter name. A ConfigError naming the module and the reason
    when there is none, or one cannot be spread."""
    found = [(n, m) for n, m in model.named_modules()
             if any(a in dict(m.named_parameters(recurse=False)) for a in _HF_EXPERT_WEIGHTS)]
    if not found:
        raise ConfigError(f"parallel.ep = {comm.size}: {type(model).__name__} has no experts module with "
                          f"stacked gate_up_proj / down_proj weights (transformers >= 5's layout) to spread")
    problems = [f"{n}: {why}" for n, m in found if (why := hf_experts_problem(m))]
    problems += [f"{n}: {m.num_experts} experts do not divide over parallel.ep = {comm.size} ranks"
                 for n, m in found if not problems and m.num_experts % comm.size]
    if problems:
        raise ConfigError(f"parallel.ep = {comm.size} cannot spread the experts of {type(model).__name__}: "
                          + "; ".join(problems))
    splits: dict[str, Split] = {}
    for name, module in found:
        lo, hi = even_range(module.num_experts, comm.size, comm.rank)
        for attr in _HF_EXPERT_WEIGHTS:
            splits[f"{name}.{attr}"] = Split(tuple(getattr(module, attr).shape), 0, ((lo, hi),))
        parent, _, child = name.rpartition(".")
        new = StackedExperts(module, lo, hi - lo, AllToAllDispatcher(comm, module.num_experts, stats))
        setattr(model.get_submodule(parent) if parent else model, child, new)
    return splits


def spread_over_tp(model: nn.Module, tp: TPState, experts: bool = True) -> None:
    """Our Decoder under tensor parallelism (after apply_tp, still on the meta device): each MoE
    block's experts spread over the tp group (their Splits into tp.splits), each rank routing
    its share of the tokens (TokenShare); the router's gradient summed over the group (each
    rank routed different tokens); the shared experts cut as a dense MLP. `experts` False
    (parallel.ep > 1): apply_ep spreads the experts over the ep × tp ranks instead."""
    with torch.device("meta"), frozen_kept(model):  # frozen experts (LoRA) stay frozen
        for name, moe in model.named_modules():
            if isinstance(moe, MoE):
                if experts:
                    tp.splits.update(spread_experts(moe, name, model.cfg, tp.comm, model.moe_stats))
                moe.tokens = TokenShare(tp=tp)
                moe.router.sync_weight = lambda w, comm=tp.comm: copy_to_group(w, comm)
                if moe.shared is not None:
                    cut_mlp(moe.shared, f"{name}.shared", model.cfg.d_model, tp)


def apply_ep(model: nn.Module, comm: Comm) -> dict[str, Split]:
    """parallel.ep > 1: the experts spread over the expert group (mesh.expert_group: the ep
    data- / context-parallel ranks, times the tp ranks under tensor parallelism, whose tokens
    TokenShare already split); model.ep records it (whole_parameters puts the experts back
    together from it). Our Decoder's MoE blocks, or a transformers model's experts modules
    (StackedExperts)."""
    stats: MoEStats | None = getattr(model, "moe_stats", None)
    if stats is None:
        raise ValueError("parallel.ep > 1 needs a mixture-of-experts model (model.experts > 0)")
    splits: dict[str, Split] = {}
    if not any(isinstance(m, MoE) for m in model.modules()):  # a transformers model
        splits = spread_hf_experts(model, comm, stats)
    with torch.device("meta"), frozen_kept(model):  # frozen experts (LoRA) stay frozen
        for name, module in model.named_modules():
            if isinstance(module, MoE):
                splits.update(spread_experts(module, name, model.cfg, comm, stats))
    log.info("expert parallel: %d ranks, %d of %d experts per MoE block on each", comm.size,
             stats.experts // comm.size, stats.experts)  # comm.size = ep × tp
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
