"""Per-rank memory by category for one strategy: ZeRO model states, activations (Korthikanti
et al. 2022: activations.py, whose names are importable from here too), the engine's transient
buffers by phase of backward, fragmentation, and host memory for offloaded states.

Pure functions; no torch, no process group, no allocation. Formulas and sources:
docs/planner.md; notation: workload.py.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from shardlm.config.model import ModelConfig
from shardlm.config.dims import ParallelDims
from shardlm.models import flops
from shardlm.hardware.catalog import Cluster
from shardlm.planner.activations import (activation_dtypes, activation_peak,
                                         block_activation)
from shardlm.planner.cp_modes import a2a_degree
from shardlm.planner.muon import local_saving as muon_local_saving, momentum_item as muon_momentum_item
from shardlm.planner.traffic import fp8_gathered_elements
from shardlm.planner.pipeline import pp_hidden_bytes, pp_in_flight, pp_sends
from shardlm.planner.workload import (DTYPE_BYTES, PHASES, Item, StageParams, Strategy, Workload,
                                      effective_tier, offloaded_blocks, pipeline_layers, stage_params,
                                      validate, zero_ranks)
from shardlm.parallel.data.zero.partition import model_state_bytes

FRAGMENTATION = 0.10
"""Allocator slack on memory allocated and freed every step (activations, transient buffers):
the caching allocator's block rounding and splitting; an assumption to calibrate."""
HOST_PROCESS_BYTES = 3e9
"""Host RSS of one GPU worker (torch, CUDA libraries, data loader): an assumption."""


# ---------------------------------------------------------------------------------------------
# Memory


@dataclass
class Memory:
    stage: str
    params_on_rank: float
    """Ψ_r: parameters this rank holds before ZeRO sharding (its tp/pp share)."""
    items: list[Item]
    """parameters, gradients, optimizer states, activations, buffers, fragmentation."""
    train_peak: float
    step_peak: float
    """During the optimizer step (activations are gone; the fp32 gradient copy exists)."""
    setup_peak: float
    """While building: the shards built so far and one unit materialised in full."""
    capacity: float
    host: list[Item]
    host_per_node: float
    host_capacity: float
    notes: list[str]

    @property
    def peak(self) -> float:
        return max(self.train_peak, self.step_peak, self.setup_peak)

    @property
    def limit(self) -> str:
        """Which phase sets the peak, in words (for explanations)."""
        if self.setup_peak >= max(self.train_peak, self.step_peak):
            return "setup: the shards plus one unit materialised in full (the sharded build)"
        if self.step_peak > self.train_peak:
            return "the optimizer step (fp32 copy of the gradient shard)"
        big = max(self.items, key=lambda i: i.bytes)
        return f"the training step, mostly {big.name}"

    @property
    def fits(self) -> bool:
        return self.peak <= self.capacity and self.host_per_node <= self.host_capacity

    @property
    def activations(self) -> float:
        return next(i.bytes for i in self.items if i.name == "activations")

    def category(self, name: str) -> float:
        return next(i.bytes for i in self.items if i.name == name)


def _g(x: float) -> str:
    return f"{x / 1e9:.3g} GB"


def _n(x: float) -> str:
    return f"{x / 1e9:.3g}B" if x >= 1e9 else f"{x / 1e6:.3g}M"


def _state_items(sp: StageParams, lay: ParallelDims, s: Strategy, cluster: Cluster) -> tuple[list[Item], dict]:
    """Parameters, gradients, optimizer states: parallel.data.zero.partition.model_state_bytes (the ZeRO
    paper's table, section 5.1) for dense and expert parameters, minus what is offloaded.
    N = dp_shard x cp: context-parallel ranks are data-parallel ranks for ZeRO."""
    d, local = s.dtypes, s.local
    p, g, k = (4, 4, 8) if local else (d.param_bytes, d.grad_bytes, d.optimizer_bytes)
    n_dense = zero_ranks(lay) if s.zero_stage else 1  # dp_shard x cp
    n_expert = max(1, zero_ranks(lay) // lay.ep) if s.zero_stage else 1
    dense = model_state_bytes(sp.dense, n_dense, s.zero_stage, p, g, k)
    expert = model_state_bytes(sp.experts, n_expert, s.zero_stage, p, g, k)
    total = {key: dense[key] + expert[key] for key in dense}
    if s.optimizer == "muon" and local:  # MuonWithAdamW: one word for a matrix, not two moments
        total["optimizer"] -= muon_local_saving(sp)
    opt_tier = effective_tier(s.offload_optimizer, cluster)
    param_tier = effective_tier(s.offload_params, cluster)
    shard = lambda on: f" / N={n_dense}" if on else ""  # noqa: E731
    why_local = " (one process: fp32 parameters and gradients, fp32 master is the parameter)" if local else ""
    master = "" if local else f" (Adam m, v in {d.master}" + (
        f" + {d.master} master" if k > 2 * DTYPE_BYTES[d.master] else "") + ")"
    reduce = d.compute if d.reduce == "auto" else d.reduce
    shards_transient = s.zero_stage >= 2 and not local  # zero_grad drops them after the step
    grads_life = ("fp32 param.grad, backward to step: counted against activations, the larger wins" if local
                  else f"{reduce}, each unit's from its reduction to the step" if shards_transient
                  else f"persistent, {reduce}")
    items = [
        Item("parameters", 0.0 if param_tier != "none" else total["params"],
             f"{p} B x Ψ_r{shard(s.zero_stage >= 3)}" + (f", held on {param_tier}" if param_tier != "none"
                                                         else "") + why_local),
        Item("gradients", total["grads"], f"{g} B x Ψ_r{shard(s.zero_stage >= 2)} ({grads_life})",
             phases=_shard_phases(total["grads"], g * sp.root_unit / n_dense, lay.pp) if shards_transient else {}),
        Item("optimizer states", 0.0 if opt_tier != "none" else total["optimizer"],
             f"K={k} B x Ψ_r{shard(s.zero_stage >= 1)}{master}"
             + (f", held on {opt_tier}" if opt_tier != "none" else "")),
    ]
    if s.optimizer == "muon" and not local:
        items.append(muon_momentum_item(sp, s))
    if s.local_sgd_every:  # parallel/data/zero/local_sgd.py: θ_outer (and the momentum) of the rank's master shard
        words = 2 if s.local_sgd_outer == "diloco" else 1  # (the experts' shard: over N / ep ranks)
        items.append(Item("local SGD outer model", 4.0 * words * (sp.dense / n_dense + sp.experts / n_expert),
                          f"{4 * words} B x Ψ_r{shard(s.zero_stage >= 1)} (fp32 θ_outer"
                          + (" + outer momentum" if words == 2 else "") + ", train.local_sgd)"))
    return items, {**total, "p": p, "g": g, "k": k, "n": n_dense, "opt_tier": opt_tier,
                   "param_tier": param_tier}


def _shard_phases(grads: float, root: float, pp: int) -> dict[str, float]:
    """Stages 2-3's gradient shards by phase of backward (parallel/data/zero/engine.py): a unit's shard is
    allocated by its reduction and dropped after the optimizer step (zero_grad), so at the loss's
    backward none exists; the blocks' appear one by one as the backward frees at least as many
    bytes of their saved activations (a block's shard is Ψ_block/N, its saved activations b·s x
    tens of h), so a block's backward peaks at the first, with none; the embedding's backward
    holds every block's, the root's reduction all. A pipeline stage reduces after its last
    backward: all at once, at the end."""
    if pp > 1:
        return {"root": grads}
    return {"embedding": grads - root, "root": grads}


def _buffer_items(w: Workload, sp: StageParams, s: Strategy, cluster: Cluster,
                  states: dict) -> list[Item]:
    """Transient buffers of the engine (parallel/data/zero/engine.py, parallel/data/zero/params.py), one line each, with
    the phases of backward they live in. Measured on CPU (tests, docs/planner.md)."""
    d, m, items = s.dtypes, w.model, []
    e, g = (4, 4) if s.local else (d.param_bytes, d.grad_bytes)
    root, block, psi = sp.root_unit, sp.block_unit, sp.dense + sp.experts
    units = f"root unit {_n(root)} + block {_n(block)}"
    if s.local and d.compute != "fp32":
        matmul = flops.matmul_params(m) / m.n_layers * sp.layers
        items.append(Item("autocast weight copies", d.param_bytes * matmul,
                          f"{d.param_bytes} B x {_n(matmul)} matmul weights cast for forward, kept "
                          f"for backward", phases={"loss": d.param_bytes * matmul,
                                                   "blocks": d.param_bytes * matmul}))
    if m.tie_embeddings and s.layout.pp == 1:
        # autograd adds the embedding's dense gradient to the head's out of place: 3 copies.
        tied = 2 * e * m.vocab_size * m.d_model / s.layout.tp
        items.append(Item("tied embedding gradient", tied, f"2 x {e} B x V·h: the embedding's "
                          f"gradient and its sum with the head's", phases={"embedding": tied}))
    if s.local:
        return items
    if s.zero_stage <= 1 and d.reduce in ("auto", d.compute):
        pass  # param.grad views the flat gradient buffer (Unit.attach_grads): counted in states
    elif s.grad_accum > 1 or s.layout.pp > 1:
        items.append(Item("accumulated gradients", e * psi, f"{e} B x Ψ_r: param.grad of every "
                          f"parameter across {s.grad_accum} micro-steps (the engine reduces "
                          + ("after the pipeline's last backward" if s.layout.pp > 1 else "on the last only")
                          + "), unsharded"))
    else:
        items.append(Item("unit gradients", e * (root + block), f"{e} B x ({units}): param.grad "
                          f"until a unit's last gradient (the root's lives through all of backward)",
                          phases={"blocks": e * (root + block), "embedding": e * root, "root": e * root}))
    if s.zero_stage >= 2:
        # The engine completes a unit's reduction before it flattens the next unit's gradient,
        # and on gloo reduces the flat gradient in place (comm/collectives.py): one alive.
        items.append(Item("gradient reduction buffer", g * max(root, block), f"{g} B x one unit's "
                          f"flat gradient: the previous reduction completes before the next unit "
                          f"is flattened", phases={"blocks": g * block, "embedding": g * block,
                                                   "root": g * root}))
    if s.zero_stage == 3 and s.layout.pp > 1:
        # A pipeline stage holds its units gathered from their first forward of the step to its
        # last backward (parallel/data/zero/params.py hold_for_step), every micro-batch in between.
        gloo = e * max(root, block) if cluster.device.kind == "cpu" else 0.0
        held = e * psi
        items.append(Item("gathered parameters", held + gloo, f"{e} B x Ψ_r {_n(psi)}: the stage's "
                          f"units, gathered at their first forward and held to the step's last backward"
                          + (" (+ gloo's copy of the one gathering)" if gloo else ""),
                          phases={"loss": held, "blocks": held + gloo, "embedding": held, "root": held}))
    elif s.zero_stage == 3:
        # a block's gathered bytes: its FP8 linears' weights at 1 byte with fp8_all_gather (their
        # own unit, parallel/data/zero/fp8_gather.py), the rest at e
        fp8 = fp8_gathered_elements(m) / m.n_layers if d.fp8_all_gather else 0.0
        block_bytes = e * block - (e - 1) * fp8
        gathered = e * root + (2 if s.prefetch else 1) * block_bytes
        gloo = cluster.device.kind == "cpu"  # gloo's all-gather allocates its output again
        # At the loss's backward the root is gathered (since the forward began) and the last
        # block is not (freed after its forward); backward reaching the head starts the last
        # block's gather when prefetching (parallel/data/zero/params.py _next_in_backward), its gloo copy
        # alive until it is waited for.
        in_flight = (2 if gloo else 1) * block_bytes if s.prefetch else 0.0
        phases = {"loss": e * root + in_flight,
                  "blocks": gathered + (block_bytes if gloo else 0), "embedding": e * root}
        items.append(Item("gathered parameters", max(phases.values()), f"{e} B x ({units}"
                          + (" x 2): the " if s.prefetch else "): the ")
                          + "root stays gathered until its backward; the current block"
                          + (" and the prefetched next" if s.prefetch else " (no prefetch)")
                          + (f"; the blocks' FP8 linear weights at 1 B ({fp8:,.0f} per block)" if fp8 else "")
                          + (" (+ gloo's copy of the one gathering)" if gloo else ""),
                          phases=phases))
    if states["param_tier"] != "none":
        shard = states["p"] * max(root, block) / states["n"]
        items.append(Item("fetched parameter shard", shard, f"{states['p']} B x {_n(max(root, block))}"
                          f" / N: a unit's shard, brought from {states['param_tier']} for its gather"))
    return items


def estimate_memory(w: Workload, s: Strategy, cluster: Cluster) -> Memory:
    """The worst pipeline stage's per-rank memory, by category, for the run as the runtime
    builds it (or would, for ep, which it does not have yet)."""
    validate(w, s, cluster)
    stages = peak_candidates(stage_params(w, s.layout, pipeline_layers(w, s)))
    return max((_stage_memory(w, s, cluster, sp) for sp in stages), key=lambda m: m.peak)


def stage_memories(w: Workload, s: Strategy, cluster: Cluster) -> list[Memory]:
    """Every pipeline rank's memory, first stage first (one entry when pp = 1)."""
    validate(w, s, cluster)
    return [_stage_memory(w, s, cluster, sp) for sp in stage_params(w, s.layout, pipeline_layers(w, s))]


def peak_candidates(stages: list[StageParams]) -> list[StageParams]:
    """The stages that can hold the most: the two ends (embedding, head and loss) and, of the
    stages between, the earliest with each number of blocks — every schedule holds at least as
    many micro-batches on an earlier stage (pp_in_flight), and a middle stage's memory grows
    with its blocks and its micro-batches only. Also every distinct stage after the pipeline
    drains (timing: middle stages with the same blocks reduce and step the same parameters)."""
    middle: dict[int, StageParams] = {}
    for sp in stages[1:-1]:
        middle.setdefault(sp.layers, sp)
    return stages[:1] + list(middle.values()) + stages[1:][-1:]


def _stage_memory(w: Workload, s: Strategy, cluster: Cluster, sp: StageParams) -> Memory:
    lay, calib = s.layout, cluster.calibration
    items, states = _state_items(sp, lay, s, cluster)
    # The loss is on the last chunk, whose every forward is followed by its backward but in
    # GPipe (all forwards first).
    loss_in_flight = s.grad_accum if lay.pp > 1 and s.pp_schedule == "gpipe" else 1
    in_flight = pp_in_flight(s, sp.index, pipeline_layers(w, s))
    offloaded, per_micro = offloaded_activations(w, s, cluster, sp)
    items.append(activation_peak(w.model, w.seq_len, s.micro_batch, sp.layers, in_flight,
                                 activation_dtypes(s, cluster), s.recompute, lay.tp,
                                 s.sequence_parallel and lay.tp > 1, sp.index == lay.pp - 1,
                                 (w.experts, w.top_k, w.capacity_factor), lay.cp, loss_in_flight,
                                 offloaded, a2a_degree(w.model, lay.cp, lay.tp, s.cp_mode, s.cp_ulysses)))
    if s.pp_schedule == "zb" and lay.pp > 1 and lay.tp == 1:
        items.append(deferred_weight_grads(w.model, s.micro_batch * w.seq_len // lay.cp, sp.layers,
                                           sp.index == lay.pp - 1, s.dtypes.param_bytes, s.recompute))
    buffers = _buffer_items(w, sp, s, cluster, states) + _pipeline_buffers(w, sp, s)
    host = _host_memory(s, states, cluster, sp)
    if offloaded:  # never on a CPU device (offloaded_blocks: the host is the device)
        host.append(Item("offloaded activations", in_flight * per_micro,
                         f"{offloaded} block(s) x {in_flight:g} micro-batch(es) x their saved "
                         f"activations (pinned host memory; activation.offload)"))
    if cluster.device.kind == "cpu":  # the host is the device: offload buffers count here
        buffers, host = buffers + host, []
    buffers.append(Item("runtime reserve", calib.runtime_reserve,
                        "measured RSS of a worker after imports and gloo, + 100 MB for its data"
                        if cluster.device.kind == "cpu"
                        else "CUDA/HIP context, cuBLAS workspace, NCCL buffers (assumed)"))
    items.append(Item("buffers", sum(b.bytes for b in buffers), "below", buffers))
    # Transients of different phases do not coexist: the peak is what is held throughout plus
    # the worst phase. One process: param.grad appears as backward frees the activations.
    parts = [i for i in items if i.name != "buffers"] + buffers
    if s.local:  # param.grad of everything by the end, fp32
        items[1].phases = {"blocks": 4 * sp.root_unit, "embedding": states["grads"],
                           "root": states["grads"]}
    held, phase, worst = _phases(parts)
    frag = FRAGMENTATION * phase[worst]
    items.append(Item("fragmentation allowance", frag, f"{FRAGMENTATION:.0%} x the worst phase's "
                      f"transients ({PHASES[worst]})"))
    train_peak = held + phase[worst] + frag
    grad_copy = _step_grad_copy(s, states, cluster, sp)
    step_peak = sum(i.bytes for i in items[:3]) + grad_copy + calib.runtime_reserve
    setup_peak = 0.0 if s.local else (sum(i.bytes for i in items[:3]) + calib.runtime_reserve
                                      + _setup_transient(s, states, sp))
    if host:
        host.append(Item("worker process", HOST_PROCESS_BYTES, "torch + CUDA libraries (assumed)"))
    notes = [f"held throughout {_g(held)} + the worst phase, {PHASES[worst]}, {_g(phase[worst])}"
             f" (+{FRAGMENTATION:.0%}); transients of other phases are not added"]
    if step_peak > train_peak:
        notes.append(f"the optimizer step peaks higher ({_g(step_peak)}): +{_g(grad_copy)} for the "
                     f"gradient shard cast to {s.dtypes.master}"
                     + (" and the parameter shards read back from nvme"
                        if states["param_tier"] == "nvme" else ""))
    if setup_peak > max(train_peak, step_peak):
        notes.append(f"setup peaks highest ({_g(setup_peak)}): the shards plus one unit "
                     f"materialised in full (parallel/data/zero/engine.py, the sharded build)")
    return Memory(sp.name, sp.dense + sp.experts, items, train_peak, step_peak, setup_peak,
                  cluster.device.memory, host, sum(i.bytes for i in host) * cluster.per_node,
                  0.9 * cluster.node.host_memory, notes)


def _phases(parts: list[Item]) -> tuple[float, dict[str, float], str]:
    """(what is held throughout, each phase's transients summed over `parts` in order, the worst
    phase): transients of different phases do not coexist."""
    held = sum(i.bytes for i in parts if not i.phases)
    phase = dict.fromkeys(PHASES, 0.0)
    for i in parts:
        for p, value in i.phases.items():
            if p in phase:
                phase[p] += value
    return held, phase, max(phase, key=phase.get)


def _step_grad_copy(s: Strategy, states: dict, cluster: Cluster, sp: StageParams) -> float:
    """What the optimizer step holds beyond the training peak's states: the gradient shard cast
    to the master dtype, nvme parameter shards read back (materialize_all), gloo all-gather's
    copy of a unit at stages 1-2 on a CPU."""
    grad_copy = 0.0
    if not s.local and states["opt_tier"] == "none" and states["g"] != DTYPE_BYTES[s.dtypes.master]:
        shard = (sp.dense + sp.experts) / (states["n"] if s.zero_stage else 1)
        grad_copy = DTYPE_BYTES[s.dtypes.master] * shard
    if states["param_tier"] == "nvme":  # the step reads every shard back (materialize_all)
        grad_copy += states["params"]
    if cluster.device.kind == "cpu" and s.zero_stage in (1, 2):  # gloo all-gather's copy
        grad_copy += states["p"] * max(sp.root_unit, sp.block_unit)
    return grad_copy


def _setup_transient(s: Strategy, states: dict, sp: StageParams) -> float:
    """The sharded build's transient above the states (parallel/data/zero/engine.py
    ZeroEngine._build_units), in its order: unit by unit its parameters, gradient buffer and
    master join what is held, while the unit's transients live — one parameter's freshly drawn
    fp32 values (<= the unit), the fp32 initial values unless they are the compute-dtype flat
    parameter itself (fp32 compute), and at stage 3 the unit in full beside its shard; Adam's
    moments are allocated after the last unit."""
    unit = max(sp.root_unit, sp.block_unit)
    p = states["p"]
    transient = (4 + (4 if p != 4 else 0) + (p if s.zero_stage == 3 else 0)) * unit
    moments = 0.0 if states["opt_tier"] != "none" else (
        2 * DTYPE_BYTES[s.dtypes.master] * (sp.dense + sp.experts) / (states["n"] if s.zero_stage else 1))
    return max(0.0, transient - moments)


def offloaded_activations(w: Workload, s: Strategy, cluster: Cluster, sp: StageParams) -> tuple[int, float]:
    """(blocks, bytes): how many of the stage's blocks offload their saved activations
    (workload.offloaded_blocks: 0 on a CPU device) and what those blocks save per micro-batch
    (block_activation x this rank's b·s/cp tokens): what goes to host memory in forward and
    comes back in backward, per micro-batch."""
    lay = s.layout
    blocks = offloaded_blocks(s, sp.layers, cluster)
    if not blocks:
        return 0, 0.0
    per_layer, _ = block_activation(w.model, activation_dtypes(s, cluster), s.recompute, lay.tp,
                                    s.sequence_parallel and lay.tp > 1,
                                    (w.experts, w.top_k, w.capacity_factor), w.seq_len)
    return blocks, blocks * s.micro_batch * w.seq_len / lay.cp * per_layer


def deferred_weight_grads(m: ModelConfig, tokens: int, layers: int, head: bool, e: int,
                          mode: str) -> Item:
    """The zero-bubble schedule's stash (parallel/pipeline/stages.py WeightGrads): a split backward
    ("B") leaves every linear layer's input x and output gradient g for its weight gradients
    ("W"), one micro-batch's until its W runs (the runtime's order never holds two). Per token
    and block, in e bytes: x of qkv, the attention projection, the MLP's two linears (3h + f)
    and g of their outputs (h + 2kv + h + f or 2f + h); the head on the last stage adds x (h)
    and g (V). Without recomputation the inputs are tensors the blocks saved anyway (counted
    there): only the gradients are extra. It grows through B and is consumed by W: counted in
    a block's backward and the embedding's, on top of the saved activations (an upper bound:
    B frees its micro-batch's activations as the stash grows)."""
    h, a, f = m.d_model, m.n_heads, flops.resolved_d_ff(m)
    q, kv = flops.attention_width(m), (m.n_kv_heads or a) * flops.head_dim(m)
    up = 2 * f if m.mlp == "swiglu" else f
    inputs = 2 * h + q + f  # q: the attention projection's input (d_model unless model.head_dim)
    grads = (q + 2 * kv) + h + up + h
    per_token = layers * (grads + (inputs if mode != "none" else 0)) + (h + m.vocab_size if head else 0)
    stash = tokens * e * per_token
    return Item("deferred weight gradients", stash,
                f"zb: one micro-batch's b·s={tokens:,} x {e} B x (L={layers} x ("
                f"{'' if mode == 'none' else '3h+f inputs + '}h+2kv+2h+{'2f' if up > f else 'f'} output "
                f"gradients){' + h+V (head)' if head else ''}), until its W",
                phases={"blocks": stash, "embedding": stash})


def _pipeline_buffers(w: Workload, sp: StageParams, s: Strategy) -> list[Item]:
    """The input gradients a pipeline stage sends back stay alive until the step's end
    (parallel/pipeline/stages.py: gloo completes a send only when waited on, and nothing tells a stage
    its gradient was consumed before Stage.settle()). Activations sent forward are freed as
    their gradient returns (Stage.release) and share storage with the outputs the backward
    keeps anyway: nothing extra."""
    lay = s.layout
    if lay.pp == 1:
        return []
    e = 4 if s.local else s.dtypes.param_bytes
    hidden = pp_hidden_bytes(w.model, s.micro_batch * w.seq_len, lay.tp, lay.cp,
                             s.sequence_parallel, e)
    _, gradients = pp_sends(sp.index, lay.pp, s.grad_accum, s.pp_virtual)
    held = gradients * hidden
    if not held:
        return []
    return [Item("pipeline send buffers", held, f"{gradients} gradients sent back x {e} B x "
                 f"b·s{'/cp' if lay.cp > 1 else ''}{'/t' if s.sequence_parallel and lay.tp > 1 else ''}·h: "
                 f"held until the step's end (Stage.settle)",
                 phases={"loss": held, "blocks": held, "embedding": held})]


@functools.lru_cache(maxsize=4096)  # a search asks for the same stage and tier thousands of times
def nvme_stream_resident(sp: StageParams, n: int, chunk_bytes: int, buffers: int,
                         itemsize: int) -> tuple[float, int]:
    """Host bytes the nvme tier's stream buffers really hold (parallel/data/zero/tiers/nvme.py NvmeTier), and
    the number of chunks. Its slots (max(3, buffers) of them, 3 page-aligned state buffers +
    1 gradient buffer of one chunk each) are anonymous mappings touched lazily: a slot holds
    only as much as the largest chunk it has carried. Chunks never cross a segment, one per
    (unit, decay group) of this rank's shard, root unit first; chunk k goes to slot k mod
    slots, and setup writes every initial master through slot 0's master buffer. Rank 0's
    shard, the first ceil(unit / N) elements of a unit (decay parameters first), is all decay
    when N > 1; with N = 1 each unit adds a small no-decay segment (biases, norms) that takes
    a slot turn but next to no memory."""
    chunk = max(4096, chunk_bytes // 4096 * 4096) // itemsize
    slots = max(3, buffers)
    sizes = []
    for unit in [sp.root_unit] + [sp.block_unit] * sp.layers:
        if unit <= 0:
            continue
        numel = -(-int(unit) // n)
        sizes += [min(chunk, numel - a) for a in range(0, numel, chunk)]
        if n == 1:
            sizes.append(0)
    page = lambda x: -(-x * itemsize // 4096) * 4096  # noqa: E731
    largest = [0] * slots
    for k, size in enumerate(sizes):
        largest[k % slots] = max(largest[k % slots], size)
    resident = sum(4 * page(x) for x in largest)
    resident += page(max(sizes, default=0)) - page(largest[0])  # slot 0's master at setup
    return float(resident), len(sizes)


def nvme_first_chunk(sp: StageParams, n: int, chunk_bytes: int, itemsize: int) -> float:
    """Parameters in the nvme tier's first chunk on one of `n` ranks (parallel/data/zero/tiers/nvme.py: the
    root unit's shard first, chunks of `chunk_bytes` never crossing a segment; as
    nvme_stream_resident orders them), 0 where the stage holds no unit."""
    chunk = max(4096, chunk_bytes // 4096 * 4096) // itemsize
    unit = next((u for u in (sp.root_unit, sp.block_unit if sp.layers else 0) if u > 0), 0)
    return float(min(chunk, -(-int(unit) // n))) if unit else 0.0


def _host_memory(s: Strategy, states: dict, cluster: Cluster, sp: StageParams) -> list[Item]:
    """Host RAM per rank for offloaded states (parallel/data/zero/tiers/; ZeRO-Offload, Ren et al. 2021;
    ZeRO-Infinity, Rajbhandari et al. 2021). The cpu tier holds fp32 masters and moments (a
    master cannot alias a parameter on another device) and receives the gradient shard in
    fp32 for the step; the nvme tier keeps 3 state files on disk and streams them through
    nvme_buffers x (3 state chunks + 1 gradient chunk) of host memory."""
    from shardlm.config.schema import ZeroConfig

    d, n, items = s.dtypes, states["n"], []
    psi_n = states["optimizer"] / states["k"]  # Ψ_r / N
    master = DTYPE_BYTES[d.master]
    if states["opt_tier"] == "cpu":
        items.append(Item("optimizer states (cpu tier)", (3 * master + 4) * psi_n,
                          f"(3 x {master} B master, m, v + 4 B fp32 gradient) x Ψ_r / N"))
    if "nvme" in (states["opt_tier"], states["param_tier"]):
        z = ZeroConfig()
        resident, chunks = nvme_stream_resident(sp, n, z.nvme_chunk_mb * 2**20, z.nvme_buffers, master)
        items.append(Item("nvme stream buffers", resident,
                          f"at most zero.nvme_buffers {z.nvme_buffers} x 4 x zero.nvme_chunk_mb "
                          f"{z.nvme_chunk_mb} MiB (defaults), touched lazily: each slot holds its "
                          f"largest chunk of the {chunks} (one segment per unit and decay group of "
                          f"the shard); the states are on disk"))
    if states["param_tier"] == "cpu":
        items.append(Item("parameter shards (cpu tier)", states["p"] * states["params"] / states["p"],
                          f"{states['p']} B x Ψ_r / N"))
    return items
