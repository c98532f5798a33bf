"""Per-rank memory by category for one strategy: ZeRO model states, activations (Korthikanti
et al. 2022), the engine's transient buffers by phase of backward, fragmentation, and host
memory for offloaded states.

Pure functions; no torch, no process group, no allocation. Formulas and sources:
docs/planner.md; notation: workload.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardlm.config import ModelConfig
from shardlm.dims import ParallelDims
from shardlm.models import flops
from shardlm.hardware.catalog import Cluster
from shardlm.planner.workload import (DTYPE_BYTES, StageParams, Strategy, Workload,
                                      effective_tier, offloaded_blocks, pipeline_layers, pp_hidden_bytes,
                                      pp_in_flight, pp_sends, stage_params, validate, zero_ranks)
from shardlm.zero.partition import model_state_bytes

FRAGMENTATION = 0.10
"""Allocator slack on memory allocated and freed every step (activations, transient buffers):
the caching allocator's block rounding and splitting; an assumption to calibrate."""
HOST_PROCESS_BYTES = 3e9
"""Host RSS of one GPU worker (torch, CUDA libraries, data loader): an assumption."""


@dataclass
class Item:
    name: str
    bytes: float
    formula: str
    parts: list["Item"] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)
    """Transient memory: its bytes in each phase of backward it lives in (PHASES); empty =
    held throughout. `bytes` is the largest."""


PHASES = {"loss": "the loss's backward", "blocks": "a block's backward",
          "embedding": "the embedding's backward", "root": "the root unit's reduction"}


# ---------------------------------------------------------------------------------------------
# Activations (Korthikanti et al. 2022, section 4, adapted to our decoder and checked against
# what autograd saves: tests/test_planner.py measures it)


@dataclass(frozen=True)
class ActivationDtypes:
    compute: int
    """e: bytes of matmul inputs and outputs (autocast's dtype, or fp32)."""
    residual: int
    """r: bytes of the residual stream: the parameters' dtype (fp32 in the one-process run)."""
    norms_in_fp32: bool
    """CUDA autocast runs layer_norm in fp32, so it saves an fp32 copy of its input."""


def activation_dtypes(s: Strategy, cluster: Cluster) -> ActivationDtypes:
    compute = DTYPE_BYTES[s.dtypes.compute]
    return ActivationDtypes(compute, 4 if s.local else compute,
                            cluster.calibration.norms_in_fp32 and s.dtypes.compute != "fp32")


def _norm_saved(m: ModelConfig, dt: ActivationDtypes) -> tuple[float, str]:
    """Bytes per token one norm saves. LayerNorm: its input and mean/rstd (in the input dtype,
    or fp32 under CUDA autocast). torch's RMSNorm is decomposed and runs in fp32 under
    autocast: it saves an fp32 input, the fp32 normalised x (for the weight's gradient) and
    rstd."""
    h = m.d_model
    if m.norm == "rmsnorm":
        return 8 * h + 4, "(8h+4)"
    r = 4 if dt.norms_in_fp32 else dt.residual
    return r * h + 2 * r, f"({r}h+{2 * r})"


def visited_width(m: ModelConfig, experts: tuple[int, int, float]) -> float:
    """The MLP hidden width one token's activations span: the dense MLP's, or for a MoE block
    its top_k routed experts' (× the capacity factor: the busiest expert's rows) and the shared
    experts' (models.flops.expert_d_ff)."""
    if not experts[0]:
        return flops.resolved_d_ff(m)
    return flops.expert_d_ff(m) * (experts[1] * experts[2] + m.shared_experts)


def block_activation(m: ModelConfig, dt: ActivationDtypes, mode: str, tp: int = 1,
                     sp: bool = False, experts: tuple[int, int, float] = (0, 1, 1.0),
                     seq: int = 0) -> tuple[float, str]:
    """Bytes per token one block keeps for backward, and the formula.

    Korthikanti eq. (1): sbh(34 + 5as/h) in 16-bit for Megatron's GPT. Ours differs in two
    stated ways: no dropout (its 3 masks: 2sbh + as²b) and torch's scaled_dot_product_attention
    (flash / memory-efficient kernels keep Q, K, V, the output and a logsumexp, never the s x s
    scores: the 5as²b term becomes 4as bytes), so a 16-bit GPT-2 block keeps 32sbh + 4asb.
    tp divides what lives between the column- and row-parallel linears; sequence parallelism
    (sp) divides the rest (eq. 3-4). 'selective' is our runtime's policy (keep matmul and
    attention outputs, recompute element-wise ops), 'full' keeps the block input only.

    model.attention = 'math' (models/attention.py, the unfused reference) keeps the s x s
    probabilities instead of the logsumexp: e·a·s bytes per token in place of 4a (`seq` = s is
    then needed); with GQA its attention keeps e·a·s + 4·e·h (q, k and v expanded to every query
    head, the output's copy). Every other backend (sdpa, per_document, flex) stores no s² term.
    Measured: tests/test_attention.py.
    """
    h, a, e, r = m.d_model, m.n_heads, dt.compute, dt.residual
    hd = h // a
    kv = (m.n_kv_heads or a) * hd
    f, moe = visited_width(m, experts), 0.0
    if experts[0]:  # a MoE block also keeps each choice's input row and output row (gathered
        # for the expert, weighted by the gate) and the router's fp32 logits and probabilities
        moe = experts[1] * experts[2] * 2 * e * h + 8 * experts[0]
    rope = m.position == "rope"
    mlp_mult = 4 if m.mlp == "swiglu" else 2
    math = m.attention == "math"
    if math and seq <= 0:
        raise ValueError("model.attention = 'math' keeps s x s probabilities: block_activation needs seq")
    scores = e * a * seq if math else 4 * a  # probabilities, or the fused kernels' fp32 logsumexp
    scores_text = f"{e}as" if math else "4a"
    if mode == "full":
        value = r * h / (tp if sp else 1)
        return value, f"{r}h{'/t' if sp and tp > 1 else ''} (block input only)"
    if mode == "selective":
        sharded = e * (h + 2 * kv) + scores + e * h + e * f * (mlp_mult // 2) + moe
        replicated = r * h + 2 * e * h  # block input, attention and MLP output-projection outputs
        text = (f"{r}h + 2·{e}h + ({e}(h+2kv) + {scores_text} + {e}h + {e}·{mlp_mult // 2}f)/t "
                "(matmul and attention outputs)")
    else:
        norm, norm_text = _norm_saved(m, dt)
        replicated = 2 * norm + 2 * e * h  # two norms' saved tensors, their outputs (linear inputs)
        attention = (e * (h + 2 * kv) + scores + e * h
                     + (e * (h + kv) + e * h if rope else 0))  # rotated q, k; proj-input copy
        if math and kv != h:  # GQA: q, k and v as per-head copies for the matmuls, the output's
            # copy for the projection; the projection's own output is no longer kept (measured)
            attention = scores + 4 * e * h
        sharded = attention + mlp_mult * e * f + moe
        text = (f"2·{norm_text} + 2·{e}h + ({e}(h+2kv) + {scores_text} + {e}h + {mlp_mult}·{e}f"
                + (f" + {e}(2h+kv) rope" if rope else "") + ")/t")
    if tp > 1:
        replicated = replicated / tp if sp else replicated
    return replicated + sharded / tp, text


def cp_ring_buffers(m: ModelConfig, dt: ActivationDtypes, tp: int = 1) -> tuple[float, str]:
    """Bytes per local token of the context-parallel ring's transients inside one block's
    attention (parallel/context.py _RingAttention), the larger of its two passes; tp splits
    the heads. Forward: the key/value block held and the one arriving (2 x 2·kv·e), the fp32
    running output (4h) and log-sum-exp (4a), a block's partial output (e·h). Backward: the two
    key/value blocks (2 x 2·kv·e), the fp32 key/value gradient travelling with its block and
    the one arriving (2 x 2·kv·4), the fp32 query gradient (4h). With GQA each block is also
    expanded to the query heads (2·e·h)."""
    h, a, e = m.d_model, m.n_heads, dt.compute
    kv = (m.n_kv_heads or a) * (h // a)
    expand = 2 * e * h if kv != h else 0
    forward = 4 * e * kv + 4 * h + 4 * a + e * h + expand
    backward = 4 * e * kv + 16 * kv + 4 * h + expand
    text = (f"max(forward 4·{e}kv + 4h + 4a + {e}h, backward 4·{e}kv + 16kv + 4h)"
            + (f" + 2·{e}h (GQA expansion)" if expand else "") + ("/t" if tp > 1 else ""))
    return max(forward, backward) / tp, text


def activation_peak(m: ModelConfig, seq: int, micro: int, layers: int, in_flight: float,
                    dt: ActivationDtypes, mode: str, tp: int, sp: bool, with_loss: bool,
                    experts: tuple[int, int, float], cp: int = 1, loss_in_flight: float = 1,
                    offloaded: int = 0) -> Item:
    """Saved activations of `in_flight` micro-batches (workload.pp_in_flight: 1F1B's first
    stage holds p of them, GPipe's every stage all m) plus the worst transient of backward: the
    loss, or one block's recomputation.

    The loss (trainer.loss_of): logits in e, an fp32 copy, fp32 log-probabilities saved; its
    backward holds the saved log-probs, their gradient and the logits' gradient in fp32:
    12V bytes per token (vocabulary-parallel with tp). A block's backward recomputes what its
    mode dropped and holds gradients: e(h + 2f) bytes per token (measured).

    Context parallelism (cp > 1) gives each rank b·s/cp of the tokens for everything (the
    embedding, every block, the loss: parallel/context.py), so every per-token term above is
    per local token; the ring's buffers (cp_ring_buffers) join a block's backward.

    Activation offload (`offloaded` of the `layers` blocks, workload.offloaded_blocks): their
    saved activations live in host memory (counted there: _stage_memory), except ~2 blocks'
    worth of one micro-batch kept on the device — an assumption: the block whose copy to host
    is in flight at the end of forward, and in backward the block in use plus the one prefetched
    (parallel/activation.py: block b's backward fetches block b-1's).
    """
    tokens = micro * seq / cp
    per_layer, text = block_activation(m, dt, mode, tp, sp, experts, seq)
    full, _ = block_activation(m, dt, "none", tp, sp, experts, seq)
    saved = (layers - offloaded) * in_flight * tokens * per_layer + min(2, offloaded) * tokens * per_layer
    norm, _ = _norm_saved(m, dt)
    final = (norm + dt.compute * m.d_model) / (tp if sp else 1)
    # A block's backward holds the gradient of its output and, at the MLP, two f-wide
    # gradients at once (measured: silu/gelu backward), on top of what it recomputes; torch's
    # decomposed RMSNorm backward holds four fp32 h-vectors (worst at the final norm).
    working = dt.compute * (m.d_model + 2 * visited_width(m, experts) / tp)
    if m.attention == "math":  # its backward holds the s x s gradients of the probabilities and
        # of the scores at once, per head, after the MLP's have gone: the larger of the two (measured)
        working = max(working, dt.compute * (m.d_model + 2 * m.n_heads * seq / tp))
    if m.norm == "rmsnorm":
        working = max(working, 16 * m.d_model)
    recompute = tokens * (full - per_layer + working)
    if m.norm == "rmsnorm" and with_loss:  # the final norm's backward, its inputs still saved
        recompute = max(recompute, tokens * (final + 16 * m.d_model))
    loss = tokens * (final + 12 * m.vocab_size / tp) if with_loss else 0.0
    # The loss's micro-batches in flight (`loss_in_flight`: GPipe's last stage holds all m)
    # keep what it saved in forward: the final norm's tensors, the head's input and the fp32
    # log-probabilities (4V/t per token); the one being backwarded is in `loss`.
    waiting = (loss_in_flight - 1) * tokens * (final + 4 * m.vocab_size / tp) if with_loss else 0.0
    # int64 inputs and targets: whole sequences (every rank of a context-parallel group loads
    # them), plus this rank's cut of both
    ids = 16 * micro * seq * in_flight * (1 + 1 / cp if cp > 1 else 1)
    bs = "b·s/cp" if cp > 1 else "b·s"
    kept = f"(L={layers} - {offloaded} offloaded)" if offloaded else f"L={layers}"
    parts = [Item("saved by blocks", saved,
                  f"{kept} x {in_flight:g} micro-batch(es) x {bs}={tokens:,.0f} x {per_layer:,.0f} B"
                  f" = {text}" + (f"; + {min(2, offloaded)} offloaded block(s) of one micro-batch on the "
                                  f"device (the copy in flight / the prefetched block)" if offloaded else "")),
             Item("backward peak", max(loss, recompute),
                  f"max(loss: {bs} x (final norm + 12V/t) = {loss / 1e9:.3g} GB, "
                  f"one block's {'recompute + ' if mode != 'none' else ''}gradients "
                  f"e(h+2f) = {recompute / 1e9:.3g} GB)"),
             *([Item("saved for the loss", waiting, f"{loss_in_flight - 1:g} more micro-batch(es) in flight x "
                     f"{bs} x (final norm + 4V/t fp32 log-probabilities)")] if waiting else []),
             Item("token ids", ids, "16 B x b·s (int64 inputs, targets)"
                  + (" x (1 + 1/cp): whole sequences and this rank's cut" if cp > 1 else ""))]
    ring = 0.0
    if cp > 1:
        per_token, ring_text = cp_ring_buffers(m, dt, tp)
        ring = tokens * per_token
        parts.append(Item("cp ring buffers", ring, f"{bs} x {per_token:,.0f} B = {ring_text}: "
                          f"one block's attention at a time (a block's backward)"))
    fused = m.attention != "math"
    if not fused:  # math's boolean mask, built once per forward, shared by the blocks: b·s² bytes
        mask = micro * seq * seq * in_flight
        ids += mask
        parts.append(Item("attention mask", mask, "b·s² bytes (model.attention = 'math': one boolean "
                          "mask per forward)"))
    phases = {"loss": saved + waiting + loss + ids, "blocks": saved + waiting + recompute + ring + ids}
    return Item("activations", max(phases.values()), f"{mode} recompute; " + (
        "fused attention (no s² term)" if fused else "math attention (s² probabilities kept)"), parts, phases)


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
    """Parameters, gradients, optimizer states: zero.partition.model_state_bytes (the ZeRO
    paper's table, section 5.1) for dense and expert parameters, minus what is offloaded.
    N = dp_shard x cp: context-parallel ranks are data-parallel ranks for ZeRO."""
    d, local = s.dtypes, s.local
    p, g, k = (4, 4, 8) if local else (d.param_bytes, d.grad_bytes, d.optimizer_bytes)
    n_dense = zero_ranks(lay) if s.zero_stage else 1  # dp_shard x cp
    n_expert = max(1, zero_ranks(lay) // lay.ep) if s.zero_stage else 1
    dense = model_state_bytes(sp.dense, n_dense, s.zero_stage, p, g, k)
    expert = model_state_bytes(sp.experts, n_expert, s.zero_stage, p, g, k)
    total = {key: dense[key] + expert[key] for key in dense}
    opt_tier = effective_tier(s.offload_optimizer, cluster)
    param_tier = effective_tier(s.offload_params, cluster)
    shard = lambda on: f" / N={n_dense}" if on else ""  # noqa: E731
    why_local = " (one process: fp32 parameters and gradients, fp32 master is the parameter)" if local else ""
    master = "" if local else f" (Adam m, v in {d.master}" + (
        f" + {d.master} master" if k > 2 * DTYPE_BYTES[d.master] else "") + ")"
    items = [
        Item("parameters", 0.0 if param_tier != "none" else total["params"],
             f"{p} B x Ψ_r{shard(s.zero_stage >= 3)}" + (f", held on {param_tier}" if param_tier != "none"
                                                         else "") + why_local),
        Item("gradients", total["grads"], f"{g} B x Ψ_r{shard(s.zero_stage >= 2)} " + (
             "(fp32 param.grad, backward to step: counted against activations, the larger wins)"
             if local else f"(persistent, {d.compute if d.reduce == 'auto' else d.reduce})")),
        Item("optimizer states", 0.0 if opt_tier != "none" else total["optimizer"],
             f"K={k} B x Ψ_r{shard(s.zero_stage >= 1)}{master}"
             + (f", held on {opt_tier}" if opt_tier != "none" else "")),
    ]
    return items, {**total, "p": p, "g": g, "k": k, "n": n_dense, "opt_tier": opt_tier,
                   "param_tier": param_tier}


def _buffer_items(w: Workload, sp: StageParams, s: Strategy, cluster: Cluster,
                  states: dict) -> list[Item]:
    """Transient buffers of the engine (zero/engine.py, zero/params.py), one line each, with
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
        # last backward (zero/params.py hold_for_step), every micro-batch in between.
        gloo = e * max(root, block) if cluster.device.kind == "cpu" else 0.0
        held = e * psi
        items.append(Item("gathered parameters", held + gloo, f"{e} B x Ψ_r {_n(psi)}: the stage's "
                          f"units, gathered at their first forward and held to the step's last backward"
                          + (" (+ gloo's copy of the one gathering)" if gloo else ""),
                          phases={"loss": held, "blocks": held + gloo, "embedding": held, "root": held}))
    elif s.zero_stage == 3:
        gathered = e * (root + (2 if s.prefetch else 1) * block)
        gloo = cluster.device.kind == "cpu"  # gloo's all-gather allocates its output again
        phases = {"loss": gathered + (e * root if gloo else 0),
                  "blocks": gathered + (e * block if gloo else 0), "embedding": e * root}
        items.append(Item("gathered parameters", max(phases.values()), f"{e} B x ({units}"
                          + (" x 2): the " if s.prefetch else "): the ")
                          + "root stays gathered until its backward; the current block"
                          + (" and the prefetched next" if s.prefetch else " (no prefetch)")
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
                                 offloaded))
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
    held = sum(i.bytes for i in parts if not i.phases)
    phase = {p: sum(i.phases.get(p, 0.0) for i in parts) for p in PHASES}
    worst = max(phase, key=phase.get)
    frag = FRAGMENTATION * phase[worst]
    items.append(Item("fragmentation allowance", frag, f"{FRAGMENTATION:.0%} x the worst phase's "
                      f"transients ({PHASES[worst]})"))
    train_peak = held + phase[worst] + frag
    grad_copy = 0.0
    if not s.local and states["opt_tier"] == "none" and states["g"] != DTYPE_BYTES[s.dtypes.master]:
        shard = (sp.dense + sp.experts) / (states["n"] if s.zero_stage else 1)
        grad_copy = DTYPE_BYTES[s.dtypes.master] * shard
    if states["param_tier"] == "nvme":  # the step reads every shard back (materialize_all)
        grad_copy += states["params"]
    if cluster.device.kind == "cpu" and s.zero_stage in (1, 2):  # gloo all-gather's copy
        grad_copy += states["p"] * max(sp.root_unit, sp.block_unit)
    step_peak = sum(i.bytes for i in items[:3]) + grad_copy + calib.runtime_reserve
    # The sharded build (zero/engine.py ZeroEngine.__init__), in its order: unit by unit its
    # parameters, gradient buffer and master join what is held, while the unit's transients
    # live — one parameter's freshly drawn fp32 values (<= the unit), the fp32 initial values
    # unless they are the compute-dtype flat parameter itself (fp32 compute), and at stage 3
    # the unit in full beside its shard; Adam's moments are allocated after the last unit.
    unit = max(sp.root_unit, sp.block_unit)
    p = states["p"]
    transient = (4 + (4 if p != 4 else 0) + (p if s.zero_stage == 3 else 0)) * unit
    moments = 0.0 if states["opt_tier"] != "none" else (
        2 * DTYPE_BYTES[s.dtypes.master] * (sp.dense + sp.experts) / (states["n"] if s.zero_stage else 1))
    setup_peak = 0.0 if s.local else (sum(i.bytes for i in items[:3]) + calib.runtime_reserve
                                      + max(0.0, transient - moments))
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
                     f"materialised in full (zero/engine.py, the sharded build)")
    return Memory(sp.name, sp.dense + sp.experts, items, train_peak, step_peak, setup_peak,
                  cluster.device.memory, host, sum(i.bytes for i in host) * cluster.per_node,
                  0.9 * cluster.node.host_memory, notes)


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
    """The zero-bubble schedule's stash (parallel/pipeline.py WeightGrads): a split backward
    ("B") leaves every linear layer's input x and output gradient g for its weight gradients
    ("W"), one micro-batch's until its W runs (the runtime's order never holds two). Per token
    and block, in e bytes: x of qkv, the attention projection, the MLP's two linears (3h + f)
    and g of their outputs (h + 2kv + h + f or 2f + h); the head on the last stage adds x (h)
    and g (V). Without recomputation the inputs are tensors the blocks saved anyway (counted
    there): only the gradients are extra. It grows through B and is consumed by W: counted in
    a block's backward and the embedding's, on top of the saved activations (an upper bound:
    B frees its micro-batch's activations as the stash grows)."""
    h, a, f = m.d_model, m.n_heads, flops.resolved_d_ff(m)
    kv = (m.n_kv_heads or a) * (h // a)
    up = 2 * f if m.mlp == "swiglu" else f
    inputs = 3 * h + f
    grads = (h + 2 * kv) + h + up + h
    per_token = layers * (grads + (inputs if mode != "none" else 0)) + (h + m.vocab_size if head else 0)
    stash = tokens * e * per_token
    return Item("deferred weight gradients", stash,
                f"zb: one micro-batch's b·s={tokens:,} x {e} B x (L={layers} x ("
                f"{'' if mode == 'none' else '3h+f inputs + '}h+2kv+2h+{'2f' if up > f else 'f'} output "
                f"gradients){' + h+V (head)' if head else ''}), until its W",
                phases={"blocks": stash, "embedding": stash})


def _pipeline_buffers(w: Workload, sp: StageParams, s: Strategy) -> list[Item]:
    """The input gradients a pipeline stage sends back stay alive until the step's end
    (parallel/pipeline.py: gloo completes a send only when waited on, and nothing tells a stage
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


def nvme_stream_resident(sp: StageParams, n: int, chunk_bytes: int, buffers: int,
                         itemsize: int) -> tuple[float, int]:
    """Host bytes the nvme tier's stream buffers really hold (zero/tiers/nvme.py NvmeTier), and
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


def _host_memory(s: Strategy, states: dict, cluster: Cluster, sp: StageParams) -> list[Item]:
    """Host RAM per rank for offloaded states (zero/tiers/; ZeRO-Offload, Ren et al. 2021;
    ZeRO-Infinity, Rajbhandari et al. 2021). The cpu tier holds fp32 masters and moments (a
    master cannot alias a parameter on another device) and receives the gradient shard in
    fp32 for the step; the nvme tier keeps 3 state files on disk and streams them through
    nvme_buffers x (3 state chunks + 1 gradient chunk) of host memory."""
    from shardlm.config import ZeroConfig

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
