"""The cost model: per-rank memory by category, and time per optimizer step, for one strategy.

Pure functions of (workload, strategy, cluster); no torch, no process group, no allocation.
Every formula, its source and the assumptions are in docs/planner.md; the comments here say
which term is which. Notation: Ψ parameters, N ranks a state is sharded over, L layers, h
width, a heads, V vocabulary, f MLP width, s sequence length, b micro-batch, t tensor-parallel
degree, p pipeline stages, m micro-batches per step; e / g / r bytes per element of the
compute dtype, the gradient (reduce) dtype and the residual stream.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType

from shardlm.config import ConfigError, ModelConfig
from shardlm.planner.hardware import Cluster
from shardlm.zero.partition import model_state_bytes

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
OFFLOAD_TIERS = ("none", "cpu", "nvme")
RECOMPUTE_MODES = ("none", "selective", "full")
FRAGMENTATION = 0.10
"""Allocator slack on memory allocated and freed every step (activations, transient buffers):
the caching allocator's block rounding and splitting; an assumption to calibrate."""
ADAM_BYTES_PER_PARAM = 36
"""Memory traffic of one fused AdamW update per parameter: read master, gradient, m, v (4 B
each, the gradient converted), write master, m, v, and the compute-dtype copy (~9 x 4 B)."""
HOST_PROCESS_BYTES = 3e9
"""Host RSS of one GPU worker (torch, CUDA libraries, data loader): an assumption."""


def models_module(name: str) -> ModuleType:
    """shardlm.models.<name> (flops or presets) without running shardlm/models/__init__.py,
    which imports the decoder and with it torch (~2 s): the planner must answer in well under
    a second. Both files need only shardlm.config. Loaded under a private name, so the real
    package, when something imports it, is untouched."""
    private = f"shardlm.planner._light_{name}"
    if private not in sys.modules:
        path = Path(__file__).resolve().parent.parent / "models" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(private, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[private] = module
        spec.loader.exec_module(module)
    return sys.modules[private]


# ---------------------------------------------------------------------------------------------
# What is being planned


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


@dataclass(frozen=True)
class Dtypes:
    """The mixed-precision policy (config [precision]): compute, gradient reduction, master."""

    compute: str = "bf16"
    reduce: str = "auto"
    """'auto' = the compute dtype (what DeepSpeed, FSDP and the ZeRO formulas assume)."""
    master: str = "fp32"

    @property
    def param_bytes(self) -> int:
        return DTYPE_BYTES[self.compute]

    @property
    def grad_bytes(self) -> int:
        return DTYPE_BYTES[self.compute if self.reduce == "auto" else self.reduce]

    @property
    def optimizer_bytes(self) -> int:
        """K: Adam's two moments in the master dtype, plus the master copy when it is not the
        parameters themselves (fp32 master + bf16 compute: 4 + 4 + 4 = 12, the paper's K)."""
        master = DTYPE_BYTES[self.master]
        return 2 * master + (master if self.master != self.compute else 0)


@dataclass(frozen=True)
class Layout:
    """dp_replicate x dp_shard x tp x pp ranks (ep experts' ranks come out of dp_shard)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp


@dataclass(frozen=True)
class Strategy:
    layout: Layout
    zero_stage: int = 0
    micro_batch: int = 1
    grad_accum: int = 1
    recompute: str = "none"
    """Activation checkpointing: 'none', 'selective' (keep matmul/attention outputs), 'full'."""
    offload_optimizer: str = "none"
    offload_params: str = "none"
    dtypes: Dtypes = Dtypes()
    sequence_parallel: bool = True
    """With tp > 1: shard norms and residuals along the sequence (Korthikanti et al. 2022)."""

    @property
    def local(self) -> bool:
        """One process at stage 0 trains without the engine (parallel/data.LocalStrategy):
        fp32 parameters, fp32 gradients, autocast casts weights on the fly."""
        return self.layout.world_size == 1 and self.zero_stage == 0


@dataclass(frozen=True)
class Workload:
    model: ModelConfig
    seq_len: int
    global_batch: int
    """Sequences per optimizer step (= micro_batch x grad_accum x dp)."""
    params: float | None = None
    """Ψ as the user gave it (--params): model states use it exactly, the shape only scales."""
    experts: int = 0
    """Mixture of experts: experts per MLP (0 = dense); modelled, not yet in the runtime."""
    top_k: int = 1
    capacity_factor: float = 1.25


def validate(w: Workload, s: Strategy, cluster: Cluster) -> None:
    """User mistakes, all at once, before any arithmetic."""
    lay, m, errors = s.layout, w.model, []
    if lay.world_size != cluster.world_size:
        errors.append(f"dp_replicate ({lay.dp_replicate}) x dp_shard ({lay.dp_shard}) x tp ({lay.tp}) "
                      f"x pp ({lay.pp}) = {lay.world_size}, but {cluster.describe()} has "
                      f"{cluster.world_size} devices")
    if m.n_heads % lay.tp:
        errors.append(f"tp = {lay.tp} does not divide the {m.n_heads} attention heads")
    if lay.pp > m.n_layers:
        errors.append(f"pp = {lay.pp} exceeds the {m.n_layers} layers")
    if lay.ep > 1 and (not w.experts or w.experts % lay.ep or lay.dp_shard % lay.ep):
        errors.append(f"ep = {lay.ep} must divide the experts ({w.experts}) and dp_shard "
                      f"({lay.dp_shard})")
    if s.zero_stage not in (0, 1, 2, 3):
        errors.append(f"zero stage {s.zero_stage}: choose 0, 1, 2 or 3")
    if s.recompute not in RECOMPUTE_MODES:
        errors.append(f"activation checkpoint {s.recompute!r}: choose {', '.join(RECOMPUTE_MODES)}")
    for name, tier in (("offload_optimizer", s.offload_optimizer), ("offload_params", s.offload_params)):
        if tier not in OFFLOAD_TIERS:
            errors.append(f"{name} = {tier!r}: choose {', '.join(OFFLOAD_TIERS)}")
    if s.offload_params != "none" and s.zero_stage != 3:
        errors.append(f"offload_params = {s.offload_params!r} needs ZeRO stage 3 (stage {s.zero_stage} "
                      f"keeps whole parameters on every rank)")
    if s.offload_optimizer != "none" and s.zero_stage == 0:
        errors.append("offload_optimizer needs ZeRO stage >= 1 (the offloaded states are the shard)")
    if s.dtypes.compute not in cluster.device.peak:
        have = ", ".join(cluster.device.peak)
        errors.append(f"{cluster.device.name} has no {s.dtypes.compute} (it has {have})")
    if w.seq_len > m.max_seq_len and m.position == "learned":
        errors.append(f"seq {w.seq_len} exceeds the model's {m.max_seq_len} learned positions")
    if s.micro_batch * s.grad_accum * lay.dp != w.global_batch:
        errors.append(f"micro_batch {s.micro_batch} x grad_accum {s.grad_accum} x dp {lay.dp} != "
                      f"global batch {w.global_batch} sequences")
    if errors:
        raise ConfigError("this plan cannot run:\n  - " + "\n  - ".join(errors))


# ---------------------------------------------------------------------------------------------
# Where the parameters are


@dataclass(frozen=True)
class Shape:
    """Parameter counts by part, from models.flops.count_params (never re-derived here)."""

    total: float
    block: float
    """One transformer block, all its experts included."""
    block_replicated: float
    """Norms and row-parallel biases: not split by tensor parallelism."""
    expert: float
    """One expert's MLP (0 for a dense model)."""
    embedding: float
    positions: float
    final_norm: float
    head: float
    """Untied output head (0 when tied to the embedding)."""


def shape_of(w: Workload) -> Shape:
    # Memoised: the search asks for the same workload's shape thousands of times.
    return _shape(tuple(vars(w.model).items()), w.params, w.experts)


@functools.lru_cache(maxsize=64)
def _shape(model_fields: tuple, params: float | None, experts: int) -> Shape:
    flops = models_module("flops")
    m = ModelConfig(**dict(model_fields))
    w = Workload(m, 1, 1, params, experts)
    root = flops.count_params(replace(m, n_layers=0))
    block = flops.count_params(replace(m, n_layers=1)) - root
    embedding = m.vocab_size * m.d_model
    positions = m.max_seq_len * m.d_model if m.position == "learned" else 0
    head = 0 if m.tie_embeddings else embedding
    final_norm = root - embedding - positions - head
    mlp = (3 if m.mlp == "swiglu" else 2) * m.d_model * flops.resolved_d_ff(m)
    if m.bias:
        mlp += flops.resolved_d_ff(m) * (2 if m.mlp == "swiglu" else 1) + m.d_model
    expert = mlp if w.experts else 0
    if w.experts:  # E expert MLPs and a router (h x E) instead of one MLP
        block += (w.experts - 1) * mlp + m.d_model * w.experts
    replicated = 2 * final_norm + (2 * m.d_model if m.bias else 0)
    shape = Shape(m.n_layers * block + root, block, replicated, expert, embedding, positions,
                  final_norm, head)
    if w.params:  # the user's Ψ is the truth; the synthesised shape only apportions it
        k = w.params / shape.total
        shape = Shape(w.params, *(getattr(shape, f) * k for f in
                                  ("block", "block_replicated", "expert", "embedding",
                                   "positions", "final_norm", "head")))
    return shape


@dataclass(frozen=True)
class StageParams:
    """Parameters one rank of a pipeline stage holds before ZeRO sharding."""

    name: str
    layers: int
    dense: float
    """Ψ_r: this rank's non-expert parameters (sharded over dp_shard)."""
    experts: float
    """This rank's expert parameters (sharded over dp_shard / ep)."""
    root_unit: float
    block_unit: float


def stage_params(w: Workload, lay: Layout) -> list[StageParams]:
    """The first and (if pp > 1) the last pipeline stage: the first holds the embeddings and
    the most layers, the last the head. Tensor parallelism splits every matrix (the
    embedding and head vocabulary-parallel) and replicates norms (Shoeybi et al. 2019)."""
    sh, t = shape_of(w), lay.tp
    experts_local = (w.experts // lay.ep) * sh.expert if w.experts else 0
    dense_block = sh.block_replicated + (sh.block - sh.block_replicated - w.experts * sh.expert) / t
    first_layers = -(-w.model.n_layers // lay.pp)
    last_layers = w.model.n_layers - (lay.pp - 1) * (w.model.n_layers // lay.pp)
    inputs = sh.embedding / t + sh.positions
    # A tied head on its own last stage keeps a copy of the embedding (as Megatron-LM does).
    outputs = sh.final_norm + (sh.head or sh.embedding) / t
    if lay.pp == 1:
        roots = [("all layers", first_layers, sh.embedding / t + sh.positions + sh.final_norm + sh.head / t)]
    else:
        roots = [("first stage", first_layers, inputs), ("last stage", last_layers, outputs)]
    return [StageParams(name, n, n * dense_block + root, n * experts_local, root,
                        dense_block + experts_local) for name, n, root in roots]


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


def block_activation(m: ModelConfig, dt: ActivationDtypes, mode: str, tp: int = 1,
                     sp: bool = False, experts: tuple[int, int, float] = (0, 1, 1.0)) -> tuple[float, str]:
    """Bytes per token one block keeps for backward, and the formula.

    Korthikanti eq. (1): sbh(34 + 5as/h) in 16-bit for Megatron's GPT. Ours differs in two
    stated ways: no dropout (its 3 masks: 2sbh + as²b) and torch's scaled_dot_product_attention
    (flash / memory-efficient kernels keep Q, K, V, the output and a logsumexp, never the s x s
    scores: the 5as²b term becomes 4as bytes), so a 16-bit GPT-2 block keeps 32sbh + 4asb.
    tp divides what lives between the column- and row-parallel linears; sequence parallelism
    (sp) divides the rest (eq. 3-4). 'selective' is our runtime's policy (keep matmul and
    attention outputs, recompute element-wise ops), 'full' keeps the block input only.
    """
    h, a, e, r = m.d_model, m.n_heads, dt.compute, dt.residual
    hd = h // a
    kv = (m.n_kv_heads or a) * hd
    f = models_module("flops").resolved_d_ff(m)
    n_exp, top_k, capacity = experts
    mlp_scale = top_k * capacity if n_exp else 1.0  # each token visits top_k experts
    rope = m.position == "rope"
    mlp_mult = 4 if m.mlp == "swiglu" else 2
    if mode == "full":
        value = r * h / (tp if sp else 1)
        return value, f"{r}h{'/t' if sp and tp > 1 else ''} (block input only)"
    if mode == "selective":
        sharded = e * (h + 2 * kv) + 4 * a + e * h + mlp_scale * e * f * (mlp_mult // 2)
        replicated = r * h + 2 * e * h  # block input, attention and MLP output-projection outputs
        text = (f"{r}h + 2·{e}h + ({e}(h+2kv) + 4a + {e}h + {e}·{mlp_mult // 2}f)/t "
                "(matmul and attention outputs)")
    else:
        norm, norm_text = _norm_saved(m, dt)
        replicated = 2 * norm + 2 * e * h  # two norms' saved tensors, their outputs (linear inputs)
        sharded = (e * (h + 2 * kv) + 4 * a + e * h + mlp_scale * mlp_mult * e * f
                   + (e * (h + kv) + e * h if rope else 0))  # rotated q, k; proj-input copy
        text = (f"2·{norm_text} + 2·{e}h + ({e}(h+2kv) + 4a + {e}h + {mlp_mult}·{e}f"
                + (f" + {e}(2h+kv) rope" if rope else "") + ")/t")
    if tp > 1:
        replicated = replicated / tp if sp else replicated
    return replicated + sharded / tp, text


def activation_peak(m: ModelConfig, seq: int, micro: int, layers: int, in_flight: int,
                    dt: ActivationDtypes, mode: str, tp: int, sp: bool, with_loss: bool,
                    experts: tuple[int, int, float]) -> Item:
    """Saved activations of `in_flight` micro-batches (1F1B: the first stage holds p of them)
    plus the worst transient of backward: the loss, or one block's recomputation.

    The loss (trainer.loss_of): logits in e, an fp32 copy, fp32 log-probabilities saved; its
    backward holds the saved log-probs, their gradient and the logits' gradient in fp32:
    12V bytes per token (vocabulary-parallel with tp). A block's backward recomputes what its
    mode dropped and holds gradients: e(h + 2f) bytes per token (measured).
    """
    tokens = micro * seq
    per_layer, text = block_activation(m, dt, mode, tp, sp, experts)
    full, _ = block_activation(m, dt, "none", tp, sp, experts)
    saved = layers * in_flight * tokens * per_layer
    norm, _ = _norm_saved(m, dt)
    final = (norm + dt.compute * m.d_model) / (tp if sp else 1)
    # A block's backward holds the gradient of its output and, at the MLP, two f-wide
    # gradients at once (measured: silu/gelu backward), on top of what it recomputes; torch's
    # decomposed RMSNorm backward holds four fp32 h-vectors (worst at the final norm).
    mlp_scale = experts[1] * experts[2] if experts[0] else 1.0
    working = dt.compute * (m.d_model + 2 * mlp_scale * models_module("flops").resolved_d_ff(m) / tp)
    if m.norm == "rmsnorm":
        working = max(working, 16 * m.d_model)
    recompute = tokens * (full - per_layer + working)
    if m.norm == "rmsnorm" and with_loss:  # the final norm's backward, its inputs still saved
        recompute = max(recompute, tokens * (final + 16 * m.d_model))
    loss = tokens * (final + 12 * m.vocab_size / tp) if with_loss else 0.0
    ids = 16 * tokens * in_flight  # int64 inputs and targets
    parts = [Item("saved by blocks", saved,
                  f"L={layers} x {in_flight} micro-batch(es) x b·s={tokens} x {per_layer:,.0f} B"
                  f" = {text}"),
             Item("backward peak", max(loss, recompute),
                  f"max(loss: b·s x (final norm + 12V/t) = {loss / 1e9:.3g} GB, "
                  f"one block's {'recompute + ' if mode != 'none' else ''}gradients "
                  f"e(h+2f) = {recompute / 1e9:.3g} GB)"),
             Item("token ids", ids, "16 B x b·s (int64 inputs, targets)")]
    phases = {"loss": saved + loss + ids, "blocks": saved + recompute + ids}
    return Item("activations", max(phases.values()), f"{mode} recompute; flash attention "
                f"(no s² term)", parts, phases)


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
    """While building: the runtime materialises the whole model in fp32 before sharding."""
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
            return ("setup: the runtime builds the whole model in fp32 on every rank before "
                    "sharding it (4 B x Ψ_r)")
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


def effective_tier(tier: str, cluster: Cluster) -> str:
    """On a CPU machine the 'cpu' tier is where the states already are (zero/offload.py
    aliases them): nothing moves."""
    return "none" if tier == "cpu" and cluster.device.kind == "cpu" else tier


def _state_items(sp: StageParams, lay: Layout, s: Strategy, cluster: Cluster) -> tuple[list[Item], dict]:
    """Parameters, gradients, optimizer states: zero.partition.model_state_bytes (the ZeRO
    paper's table, section 5.1) for dense and expert parameters, minus what is offloaded."""
    d, local = s.dtypes, s.local
    p, g, k = (4, 4, 8) if local else (d.param_bytes, d.grad_bytes, d.optimizer_bytes)
    n_dense = lay.dp_shard if s.zero_stage else 1
    n_expert = max(1, lay.dp_shard // lay.ep) if s.zero_stage else 1
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
        matmul = models_module("flops").matmul_params(m) / m.n_layers * sp.layers
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
    if s.grad_accum > 1:
        items.append(Item("accumulated gradients", e * psi, f"{e} B x Ψ_r: param.grad of every "
                          f"parameter across {s.grad_accum} micro-steps (the engine reduces on the "
                          f"last only), unsharded"))
    else:
        items.append(Item("unit gradients", e * (root + block), f"{e} B x ({units}): param.grad "
                          f"until a unit's last gradient (the root's lives through all of backward)",
                          phases={"blocks": e * (root + block), "embedding": e * root, "root": e * root}))
    if s.zero_stage >= 2:
        items.append(Item("gradient reduction buffers", g * (root + block), f"{g} B x flat "
                          f"gradients: a block's being filled + one reducing; then the root's",
                          phases={"blocks": 2 * g * block, "embedding": 2 * g * block,
                                  "root": g * (root + block)}))
    if cluster.device.kind == "cpu" and s.zero_stage >= 1:
        # gloo's reduce-scatter copies its input (measured); stage 1 does not bound the
        # reductions in flight, so every unit's copy may be waiting at once.
        if s.zero_stage == 1:
            copies, text = {p: g * psi for p in ("blocks", "embedding", "root")}, "Ψ_r: all units in flight"
        else:
            copies = {"blocks": g * block, "embedding": g * block, "root": g * root}
            text = "the unit in flight"
        items.append(Item("gloo reduce-scatter copies", max(copies.values()), f"{g} B x {text}",
                          phases=copies))
    if s.zero_stage == 3:
        gathered = e * (root + 2 * block)
        gloo = cluster.device.kind == "cpu"  # gloo's all-gather allocates its output again
        phases = {"loss": gathered + (e * root if gloo else 0),
                  "blocks": gathered + (e * block if gloo else 0), "embedding": e * root}
        items.append(Item("gathered parameters", max(phases.values()), f"{e} B x ({units} x 2): the "
                          f"root stays gathered until its backward; the current block and the "
                          f"prefetched next" + (" (+ gloo's copy of the one gathering)" if gloo else ""),
                          phases=phases))
    if states["param_tier"] != "none":
        shard = states["p"] * max(root, block) / states["n"]
        items.append(Item("fetched parameter shard", shard, f"{states['p']} B x {_n(max(root, block))}"
                          f" / N: a unit's shard, brought from {states['param_tier']} for its gather"))
    return items


def estimate_memory(w: Workload, s: Strategy, cluster: Cluster) -> Memory:
    """The worst pipeline stage's per-rank memory, by category, for the run as the runtime
    builds it (or would, for tp/pp/ep, which it does not have yet)."""
    validate(w, s, cluster)
    results = [_stage_memory(w, s, cluster, sp) for sp in stage_params(w, s.layout)]
    return max(results, key=lambda m: m.peak)


def _stage_memory(w: Workload, s: Strategy, cluster: Cluster, sp: StageParams) -> Memory:
    lay, calib = s.layout, cluster.calibration
    items, states = _state_items(sp, lay, s, cluster)
    in_flight = min(lay.pp, s.grad_accum) if sp.name == "first stage" else 1
    items.append(activation_peak(w.model, w.seq_len, s.micro_batch, sp.layers, in_flight,
                                 activation_dtypes(s, cluster), s.recompute, lay.tp,
                                 s.sequence_parallel and lay.tp > 1, sp.name != "first stage",
                                 (w.experts, w.top_k, w.capacity_factor)))
    buffers = _buffer_items(w, sp, s, cluster, states)
    host = _host_memory(s, states, cluster)
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
    setup_peak = 0.0 if s.local else (4 * (sp.dense + sp.experts) + (states["p"] + 4) *
                                      max(sp.root_unit, sp.block_unit) + calib.runtime_reserve)
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
        notes.append(f"setup peaks highest ({_g(setup_peak)}): the runtime builds the whole model in "
                     f"fp32 on every rank (4 B x Ψ_r) before sharding it (trainer.build_run)")
    return Memory(sp.name, sp.dense + sp.experts, items, train_peak, step_peak, setup_peak,
                  cluster.device.memory, host, sum(i.bytes for i in host) * cluster.per_node,
                  0.9 * cluster.node.host_memory, notes)


def _host_memory(s: Strategy, states: dict, cluster: Cluster) -> list[Item]:
    """Host RAM per rank for offloaded states (zero/offload.py; ZeRO-Offload, Ren et al. 2021;
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
        items.append(Item("nvme stream buffers", z.nvme_buffers * 4 * z.nvme_chunk_mb * 2**20,
                          f"zero.nvme_buffers {z.nvme_buffers} x 4 x zero.nvme_chunk_mb "
                          f"{z.nvme_chunk_mb} MiB (defaults); the states are on disk"))
    if states["param_tier"] == "cpu":
        items.append(Item("parameter shards (cpu tier)", states["p"] * states["params"] / states["p"],
                          f"{states['p']} B x Ψ_r / N"))
    return items


# ---------------------------------------------------------------------------------------------
# Time


@dataclass
class Comm:
    name: str
    group: str
    """Which group and over what link: 'dp_shard (8, intra-node nvlink3)'."""
    bytes: float
    """Per rank per step, counted as the ZeRO paper counts (all-reduce = 2x its tensor)."""
    seconds: float
    exposed: float
    """What is left on the critical path after overlap with compute."""


@dataclass
class Timing:
    compute: float
    """Seconds of compute per step, recomputation and pipeline bubble included."""
    bubble: float
    comms: list[Comm]
    optimizer: float
    step: float
    tokens_per_s: float
    mfu: float
    model_flops_per_token: float

    @property
    def exposed_comm(self) -> float:
        return sum(c.exposed for c in self.comms)


def group_link(cluster: Cluster, size: int, stride: int) -> tuple[float, float, str]:
    """(bytes/s, latency, description) of a ring over `size` ranks `stride` apart.

    Ranks are laid out pp, dp_replicate, dp_shard, tp from outer to inner (mesh.py: dp_shard
    inside dp_replicate; tp innermost as in torchtitan). A group inside one node runs on the
    intra-node link. One that spans nodes is limited by its share of the node's network
    adapters (every such group runs at once, each rail-optimised adapter carrying one):
    adapters x bandwidth x (its members on the node / devices per node).
    """
    node, per_node = cluster.node, cluster.per_node
    members = min(size, max(1, per_node // stride)) if stride < per_node else 1
    nodes = ceil_div(size, members)
    if nodes == 1:
        return node.intra.effective, node.intra.latency, f"intra-node {node.intra.name}"
    inter = node.inter.effective * node.nics * members / per_node
    bandwidth = min(inter, node.intra.effective) if members > 1 else inter
    return bandwidth, node.inter.latency, f"{nodes} nodes, {node.inter.name}"


def collective_seconds(op: str, nbytes: float, size: int, bandwidth: float, latency: float,
                       calls: int = 1) -> float:
    """Alpha-beta cost of `calls` equal collectives moving `nbytes` in total (Thakur et al.
    2005; NCCL's ring and tree): a ring all-gather or reduce-scatter takes (N-1) steps of
    S/N bytes; an all-reduce is both, or a double binary tree (2 log2 N steps, full bandwidth)
    when latency dominates."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    each = nbytes / calls
    ring = (size - 1) * latency + (size - 1) / size * each / bandwidth
    if op == "all_reduce":
        one = min(2 * ring, 2 * log2_ceil(size) * latency + 2 * each / bandwidth)
    elif op == "p2p":
        one = latency + each / bandwidth
    else:  # all_gather, reduce_scatter, all_to_all
        one = ring
    return calls * one


def _hidden(seconds: float, window: float, overlap: float, fixed: float = 0.0) -> float:
    """Exposed part of asynchronous communication: `fixed` cannot overlap (nothing computes
    beside it); the rest hides in `overlap` x the compute window."""
    rest = max(0.0, seconds - fixed)
    return fixed + max(0.0, rest - overlap * window)


def _dp_comms(w: Workload, s: Strategy, cluster: Cluster, sp: StageParams,
              windows: tuple[float, float]) -> list[Comm]:
    """The data-parallel collectives of the ZeRO engine, per unit, as zero/engine.py issues
    them (volumes sum to zero.partition.comm_bytes_per_step)."""
    lay, d, calib = s.layout, s.dtypes, cluster.calibration
    overlap = calib.overlap
    e, g = d.param_bytes, d.grad_bytes
    backward, everything = windows
    units = sp.layers + 1
    psi, root = sp.dense + sp.experts, sp.root_unit
    out = []

    def add(name, op, nbytes, size, stride, window=0.0, fixed_fraction=1.0, calls=units, repeat=1):
        if size <= 1 or nbytes <= 0:
            return
        bw, lat, where = group_link(cluster, size, stride)
        seconds = repeat * collective_seconds(op, nbytes, size, bw, lat, calls) * calib.factor(op)
        volume = (2 if op == "all_reduce" else 1) * nbytes * repeat
        out.append(Comm(name, f"{size} ranks, {where}", volume, seconds,
                        _hidden(seconds, window, overlap, fixed_fraction * seconds)))

    root_share = root / psi
    if s.zero_stage == 0:  # the root unit's gradients complete last: its reduction is exposed
        add("all-reduce gradients", "all_reduce", g * psi, lay.dp, lay.tp, backward, root_share)
        return out
    shard, replicas = lay.dp_shard, lay.dp_replicate
    add("reduce-scatter gradients", "reduce_scatter", g * psi, shard, lay.tp, backward, root_share)
    if s.zero_stage in (1, 2):  # after the step, before the next forward: nothing to hide in
        add("all-gather updated parameters", "all_gather", e * psi, shard, lay.tp)
    else:  # gathered before forward and (reshard_after_forward) again before backward, every
        # micro-step; the root is gathered first each time, with nothing to overlap
        passes = 2 * s.grad_accum
        add("all-gather parameters", "all_gather", e * psi, shard, lay.tp, everything,
            root_share, repeat=passes)
    add("all-reduce shards across replicas", "all_reduce", g * psi / shard, replicas,
        lay.tp * shard)
    return out


def _model_parallel_comms(w: Workload, s: Strategy, cluster: Cluster, sp: StageParams) -> list[Comm]:
    """Tensor, pipeline and expert parallel traffic, all on the critical path."""
    lay, e, m = s.layout, s.dtypes.param_bytes, w.model
    tokens = s.micro_batch * w.seq_len
    micro = s.grad_accum
    out = []
    if lay.tp > 1:  # Megatron's f/g: 2 all-reduces forward, 2 backward per layer (+2 recompute);
        # with sequence parallelism the same volume as all-gathers + reduce-scatters
        calls = (6 if s.recompute == "full" else 4) * sp.layers * micro
        bw, lat, where = group_link(cluster, lay.tp, 1)
        sec = collective_seconds("all_reduce", e * tokens * m.d_model * calls, lay.tp, bw, lat, calls)
        out.append(Comm("tensor-parallel all-reduces", f"{lay.tp} ranks, {where}",
                        2 * e * tokens * m.d_model * calls, sec, sec))
    if lay.pp > 1:  # one activation forward, one gradient back, per micro-batch and boundary
        size = e * tokens * m.d_model / (lay.tp if s.sequence_parallel else 1)
        bw, lat, where = group_link(cluster, 2, lay.tp * lay.dp)
        sec = collective_seconds("p2p", 2 * micro * size, 2, bw, lat, 2 * micro)
        out.append(Comm("pipeline send/recv", f"stage boundary, {where}", 2 * micro * size, sec, sec))
    if lay.ep > 1:  # dispatch + combine, forward and backward, per MoE layer
        calls = 4 * sp.layers * micro
        size = e * tokens * m.d_model * w.top_k * w.capacity_factor
        bw, lat, where = group_link(cluster, lay.ep, lay.tp)
        sec = collective_seconds("all_to_all", size * calls, lay.ep, bw, lat, calls)
        out.append(Comm("expert all-to-all", f"{lay.ep} ranks, {where}", size * calls, sec, sec))
    return out


def model_flops_per_token(w: Workload, recompute: str = "none") -> float:
    """models.flops.flops_per_token (PaLM appendix B: 6N + 12·L·h·s), with top_k experts'
    MLPs and the router for a mixture of experts."""
    flops = models_module("flops")
    m = w.model
    value = flops.flops_per_token(m, w.seq_len, recompute)
    if w.experts:
        mlp = (3 if m.mlp == "swiglu" else 2) * m.d_model * flops.resolved_d_ff(m)
        value += 6 * m.n_layers * ((w.top_k - 1) * mlp + m.d_model * w.experts)
    if w.params:
        value *= w.params / shape_of(replace(w, params=None)).total
    return value


def _optimizer_seconds(s: Strategy, cluster: Cluster, psi_opt: float) -> float:
    """Fused AdamW is memory-bound: ADAM_BYTES_PER_PARAM of traffic per parameter at the
    device's bandwidth; offloaded (ZeRO-Offload), at the host's share per device, plus the
    gradient down and the parameters up over PCIe; on NVMe (ZeRO-Infinity) also reading and
    writing the states."""
    d, node, per_node = s.dtypes, cluster.node, cluster.per_node
    tier = effective_tier(s.offload_optimizer, cluster)
    if tier == "none":
        return psi_opt * ADAM_BYTES_PER_PARAM / cluster.device.memory_bandwidth
    seconds = psi_opt * ADAM_BYTES_PER_PARAM / (node.host_bandwidth / per_node)
    if cluster.device.kind != "cpu":  # the gradient shard down, the parameters back up
        seconds += (d.grad_bytes + d.param_bytes) * psi_opt / node.pcie.effective
    if tier == "nvme":  # read and write master, m, v
        seconds += 2 * 3 * DTYPE_BYTES[d.master] * psi_opt / (node.nvme_bandwidth / per_node)
    return seconds


def estimate_time(w: Workload, s: Strategy, cluster: Cluster) -> Timing:
    """Seconds per optimizer step on the slowest (first) pipeline stage."""
    validate(w, s, cluster)
    lay, m, dev = s.layout, w.model, cluster.device
    sp = stage_params(w, lay)[0]
    model_flops = model_flops_per_token(w)
    run_flops = model_flops_per_token(w, s.recompute)
    # Small matrices fill less of the chip: efficiency x h/(h + half_width) (docs/planner.md).
    size_factor = m.d_model / (m.d_model + cluster.calibration.half_width)
    rate = dev.peak[s.dtypes.compute] * dev.efficiency * size_factor
    stage_share = sp.layers / m.n_layers  # the first stage has the most layers
    tokens = s.micro_batch * w.seq_len
    per_micro = run_flops * tokens * stage_share / lay.tp / rate
    if s.recompute == "selective":  # element-wise ops redone: memory-bound, write + read
        sp_on = s.sequence_parallel and lay.tp > 1
        dt = activation_dtypes(s, cluster)
        redone = (block_activation(m, dt, "none", lay.tp, sp_on)[0]
                  - block_activation(m, dt, "selective", lay.tp, sp_on)[0])
        per_micro += 2 * redone * tokens * sp.layers / dev.memory_bandwidth
    micro = s.grad_accum
    compute = per_micro * (micro + lay.pp - 1)  # 1F1B: bubble (p-1)/(m+p-1) of the pipeline time
    backward = per_micro * (run_flops - model_flops / 3) / run_flops
    comms = _model_parallel_comms(w, s, cluster, sp)
    if not s.local:
        comms += _dp_comms(w, s, cluster, sp, (backward, compute))
    n_opt = lay.dp_shard if s.zero_stage else 1
    psi_opt = sp.dense / n_opt + sp.experts / (max(1, lay.dp_shard // lay.ep) if s.zero_stage else 1)
    optimizer = _optimizer_seconds(s, cluster, psi_opt)
    if effective_tier(s.offload_params, cluster) != "none":  # each gather fetches the shard
        up = 2 * micro * s.dtypes.param_bytes * sp.dense / lay.dp_shard
        seconds = 0.0 if dev.kind == "cpu" else up / cluster.node.pcie.effective
        if s.offload_params == "nvme":
            seconds += up / (cluster.node.nvme_bandwidth / cluster.per_node)
        comms.append(Comm("parameter shards from host", s.offload_params, up, seconds,
                          _hidden(seconds, compute, cluster.calibration.overlap)))
    step = compute + sum(c.exposed for c in comms) + optimizer
    tokens_per_s = w.global_batch * w.seq_len / step
    mfu = model_flops * tokens_per_s / (lay.world_size * dev.peak[s.dtypes.compute])
    return Timing(compute, (lay.pp - 1) / (micro + lay.pp - 1), comms, optimizer, step,
                  tokens_per_s, mfu, model_flops)


def describe_dtypes(d: Dtypes, local: bool) -> str:
    if local:
        return f"{d.compute} autocast over fp32 parameters and gradients, fp32 Adam (K = 8)"
    return (f"{d.compute} compute / {d.compute if d.reduce == 'auto' else d.reduce} gradients / "
            f"{d.master} master (K = {d.optimizer_bytes})")


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def log2_ceil(n: int) -> int:
    return max(1, math.ceil(math.log2(n))) if n > 1 else 0
