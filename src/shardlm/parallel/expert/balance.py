"""Hot experts spread by measured load: re-placing experts between the expert-parallel ranks
(parallel.ep_rebalance_every; docs/moe.md). A router that sends most tokens to a few experts
makes their ranks an expert-parallel step's critical path; moving experts so that each rank's
summed load is even takes that away without changing the arithmetic (an expert computes the
same rows wherever it runs).
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from shardlm.comm.collectives import Comm
from shardlm.errors import ConfigError
from shardlm.models.moe import MoE
from shardlm.parallel.expert.dispatch import EPState
from shardlm.models.placement import Split

log = logging.getLogger("shardlm")




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
        if every and not model.moe_stats.layers:  # (a pipeline stage may hold none of our blocks)
            raise ConfigError(f"parallel.ep_rebalance_every = {every} moves experts by the loads our MoE "
                              f"layers record; {type(model).__name__}'s layers record none: set it to 0")
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
