"""The cost model: per-rank memory by category, and time per optimizer step, for one strategy.

Pure functions of (workload, strategy, cluster); no torch, no process group, no allocation.
Every formula, its source and the assumptions are in docs/planner.md; the comments here say
which term is which. Notation: Ψ parameters, N ranks a state is sharded over, L layers, h
width, a heads, V vocabulary, f MLP width, s sequence length, b micro-batch, t tensor-parallel
degree, p pipeline stages, m micro-batches per step; e / g / r bytes per element of the
compute dtype, the gradient (reduce) dtype and the residual stream.
"""

from __future__ import annotations

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
    if cluster.device.kind == "cpu" and "cpu" in (s.offload_optimizer, s.offload_params):
        errors.append("offload to 'cpu' on a CPU run moves nothing (the device is host memory); "
                      "use 'nvme' or 'none'")
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
    flops = models_module("flops")
    m = w.model
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


@dataclass
class Activations:
    total: float
    formula: str
    parts: list


def activation_peak(m: ModelConfig, seq: int, micro: int, layers: int, in_flight: int,
                    dt: ActivationDtypes, mode: str, tp: int, sp: bool, with_loss: bool,
                    experts: tuple[int, int, float]) -> Activations:
    """Saved activations of `in_flight` micro-batches (1F1B: the first stage holds p of them)
    plus the worst transient of backward: the loss, or one block's recomputation.

    The loss (trainer.loss_of): logits in e, an fp32 copy, fp32 log-probabilities saved; its
    backward holds the saved log-probs, their gradient and the logits' gradient in fp32:
    12V bytes per token (vocabulary-parallel with tp). A block's backward recomputes what its
    mode dropped and holds ~3 fp32 h-vectors of gradients (12h bytes), measured.
    """
    from shardlm.planner.cost import Item  # noqa: F811  (defined below; same module)

    tokens = micro * seq
    per_layer, text = block_activation(m, dt, mode, tp, sp, experts)
    full, _ = block_activation(m, dt, "none", tp, sp, experts)
    saved = layers * in_flight * tokens * per_layer
    norm, _ = _norm_saved(m, dt)
    final = (norm + dt.compute * m.d_model) / (tp if sp else 1)
    recompute = tokens * (full - per_layer + 12 * m.d_model)
    loss = tokens * (final + 12 * m.vocab_size / tp) if with_loss else 0.0
    ids = 16 * tokens * in_flight  # int64 inputs and targets
    parts = [Item("saved by blocks", saved,
                  f"L={layers} x {in_flight} micro-batch(es) x b·s={tokens} x {per_layer:,.0f} B"
                  f" = {text}"),
             Item("backward peak", max(loss, recompute),
                  f"max(loss: b·s x (final norm + 12V/t) = {loss / 1e9:.3g} GB, "
                  f"one block's {'recompute + ' if mode != 'none' else ''}gradients "
                  f"(+12h) = {recompute / 1e9:.3g} GB)"),
             Item("token ids", ids, "16 B x b·s (int64 inputs, targets)")]
    total = saved + max(loss, recompute) + ids
    return Activations(total, f"{mode} recompute; flash attention (no s² term)", parts)


# ---------------------------------------------------------------------------------------------
# Memory


@dataclass
class Item:
    name: str
    bytes: float
    formula: str
    parts: list["Item"] = field(default_factory=list)


@dataclass
class Memory:
    stage: str
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
    return f"{x / 1e9:.3g}e9" if x >= 1e8 else f"{x / 1e6:.3g}e6"


def _state_items(sp: StageParams, lay: Layout, s: Strategy, local: bool) -> tuple[list[Item], dict]:
    """Parameters, gradients, optimizer states: zero.partition.model_state_bytes (the ZeRO
    paper's table, section 5.1) for dense and expert parameters, minus what is offloaded."""
    d = s.dtypes
    p, g, k = (4, 4, 8) if local else (d.param_bytes, d.grad_bytes, d.optimizer_bytes)
    n_dense = lay.dp_shard if s.zero_stage else 1
    n_expert = max(1, lay.dp_shard // lay.ep) if s.zero_stage else 1
    dense = model_state_bytes(sp.dense, n_dense, s.zero_stage, p, g, k)
    expert = model_state_bytes(sp.experts, n_expert, s.zero_stage, p, g, k)
    total = {key: dense[key] + expert[key] for key in dense}
    offloaded = {"params": total["params"] if s.offload_params != "none" else 0.0,
                 "optimizer": total["optimizer"] if s.offload_optimizer != "none" else 0.0}
    psi = f"Ψ_r = {_n(sp.dense + sp.experts)}"
    shard = lambda on: f" / N={n_dense}" if on else ""  # noqa: E731
    why_local = " (one process: fp32 parameters and gradients, fp32 master is the parameter)" if local else ""
    items = [
        Item("parameters", total["params"] - offloaded["params"],
             f"{p} B x {psi}{shard(s.zero_stage >= 3)}" + (f"; on {s.offload_params}" if offloaded["params"] else "")
             + why_local),
        Item("gradients", total["grads"], f"{g} B x Ψ_r{shard(s.zero_stage >= 2)} (persistent, "
             f"{'fp32' if local else d.compute if d.reduce == 'auto' else d.reduce})"),
        Item("optimizer states", total["optimizer"] - offloaded["optimizer"],
             f"K={k} B x Ψ_r{shard(s.zero_stage >= 1)}"
             + ("" if local else f" (Adam m, v in {d.master}" + (f" + {d.master} master" if k > 2 * DTYPE_BYTES[d.master] else "") + ")")
             + (f"; on {s.offload_optimizer}" if offloaded["optimizer"] else "")),
    ]
    return items, {**total, **{f"offloaded_{k_}": v for k_, v in offloaded.items()},
                   "p": p, "g": g, "k": k, "n": n_dense}


def _buffer_items(w: Workload, sp: StageParams, s: Strategy, cluster: Cluster,
                  local: bool, states: dict) -> list[Item]:
    """Transient buffers of the engine (zero/engine.py, zero/params.py), one line each."""
    d, items = s.dtypes, []
    e, g = (4, 4) if local else (d.param_bytes, d.grad_bytes)
    units = f"root unit {_n(sp.root_unit)} + block {_n(sp.block_unit)}"
    psi_r = sp.dense + sp.experts
    if local:
        if d.compute != "fp32":
            matmul = models_module("flops").matmul_params(w.model) / w.model.n_layers * sp.layers
            items.append(Item("autocast weight copies", d.param_bytes * matmul,
                              f"{d.param_bytes} B x {_n(matmul)} matmul weights cast for forward, "
                              f"kept for backward"))
    elif s.grad_accum > 1:
        items.append(Item("accumulated gradients", e * psi_r,
                          f"{e} B x Ψ_r: param.grad of every parameter across {s.grad_accum} "
                          f"micro-steps (the engine reduces on the last only), unsharded"))
    else:
        items.append(Item("unit gradients", e * (sp.root_unit + sp.block_unit),
                          f"{e} B x ({units}): param.grad until a unit's last gradient "
                          f"(the root's lives through all of backward)"))
    biggest = max(sp.root_unit, sp.block_unit)
    if s.zero_stage >= 2 and not local:
        copies = 3 if cluster.device.kind == "cpu" else 2
        items.append(Item("gradient reduction buffers", copies * g * biggest,
                          f"{copies} x {g} B x {_n(biggest)}: flat gradient being filled + one "
                          f"reduce-scatter in flight" + (" + gloo's copy" if copies == 3 else "")))
    if s.zero_stage == 3:
        items.append(Item("gathered parameters", e * (sp.root_unit + 2 * sp.block_unit),
                          f"{e} B x ({units} x 2): the root stays gathered all step; the current "
                          f"block and the prefetched next"))
    if s.offload_optimizer == "nvme" or s.offload_params == "nvme":
        items.append(Item("nvme staging", min(2e9, states["optimizer"] + states["params"]),
                          "pinned buffers for asynchronous NVMe reads and writes (<= 2 GB)"))
    return items


def estimate_memory(w: Workload, s: Strategy, cluster: Cluster) -> Memory:
    """The worst pipeline stage's per-rank memory, by category, for the run as the runtime
    builds it (or would, for tp/pp/ep, which it does not have yet)."""
    validate(w, s, cluster)
    results = [_stage_memory(w, s, cluster, sp) for sp in stage_params(w, s.layout)]
    return max(results, key=lambda m: m.peak)


def _stage_memory(w: Workload, s: Strategy, cluster: Cluster, sp: StageParams) -> Memory:
    lay, local = s.layout, s.local
    calib = cluster.calibration
    items, states = _state_items(sp, lay, s, local)
    act_dtypes = ActivationDtypes(
        compute=DTYPE_BYTES[s.dtypes.compute], residual=4 if local else DTYPE_BYTES[s.dtypes.compute],
        norms_in_fp32=calib.norms_in_fp32 and s.dtypes.compute != "fp32")
    in_flight = min(lay.pp, s.grad_accum) if sp.name == "first stage" else 1
    act = activation_peak(w.model, w.seq_len, s.micro_batch, sp.layers, in_flight, act_dtypes,
                          s.recompute, lay.tp, s.sequence_parallel and lay.tp > 1,
                          with_loss=sp.name != "first stage", experts=(w.experts, w.top_k, w.capacity_factor))
    items.append(Item("activations", act.total, act.formula, act.parts))
    buffers = _buffer_items(w, sp, s, cluster, local, states)
    transient = sum(b.bytes for b in buffers)
    buffers.append(Item("runtime reserve", calib.runtime_reserve,
                        "measured baseline RSS of a worker (python, torch, gloo)" if cluster.device.kind == "cpu"
                        else "CUDA/HIP context, cuBLAS workspace, NCCL buffers (assumed)"))
    items.append(Item("buffers", sum(b.bytes for b in buffers), "transient and fixed, below", buffers))
    frag = FRAGMENTATION * (act.total + transient)
    items.append(Item("fragmentation allowance", frag,
                      f"{FRAGMENTATION:.0%} x (activations + transient buffers)"))
    held = sum(i.bytes for i in items[:3])
    train_peak = sum(i.bytes for i in items)
    grad_copy = 0.0
    if not local and s.offload_optimizer == "none" and states["g"] != DTYPE_BYTES[s.dtypes.master]:
        grad_copy = DTYPE_BYTES[s.dtypes.master] * (sp.dense + sp.experts) / (states["n"] if s.zero_stage else 1)
    step_peak = held + grad_copy + calib.runtime_reserve
    setup_peak = 0.0 if local else (4 * (sp.dense + sp.experts * 1.0) + (states["p"] + 4) *
                                    max(sp.root_unit, sp.block_unit) + calib.runtime_reserve)
    host, host_node = _host_memory(s, states, cluster)
    notes = []
    if step_peak > train_peak:
        notes.append(f"the optimizer step peaks higher ({_g(step_peak)}): it casts the gradient "
                     f"shard to {s.dtypes.master} ({_g(grad_copy)})")
    if setup_peak > max(train_peak, step_peak):
        notes.append(f"setup peaks highest ({_g(setup_peak)}): the runtime builds the whole model in "
                     f"fp32 on every rank (4 B x Ψ_r) before sharding it (trainer.build_run)")
    return Memory(sp.name, items, train_peak, step_peak, setup_peak, cluster.device.memory, host,
                  host_node, 0.9 * cluster.node.host_memory, notes)


def _host_memory(s: Strategy, states: dict, cluster: Cluster) -> tuple[list[Item], float]:
    """Host RAM per node for offloaded states (ZeRO-Offload, Ren et al. 2021; ZeRO-Infinity,
    Rajbhandari et al. 2021): only the cpu tier holds them in RAM; nvme keeps them on disk."""
    items = []
    if s.offload_optimizer == "cpu":
        staging = 4 * states["optimizer"] / states["k"]
        items.append(Item("optimizer states (cpu)", states["optimizer"] + staging,
                          f"K={states['k']} B x Ψ_r / N + 4 B x Ψ_r / N fp32 gradient staging"))
    if s.offload_params == "cpu":
        items.append(Item("parameter shards (cpu)", states["params"], f"{states['p']} B x Ψ_r / N"))
    if not items:
        return [], 0.0
    per_rank = sum(i.bytes for i in items) + HOST_PROCESS_BYTES
    items.append(Item("worker process", HOST_PROCESS_BYTES, "torch + CUDA libraries (assumed)"))
    return items, per_rank * cluster.per_node


def describe_dtypes(d: Dtypes, local: bool) -> str:
    if local:
        return f"{d.compute} autocast over fp32 parameters and gradients, fp32 Adam (K = 8)"
    return (f"{d.compute} compute / {d.compute if d.reduce == 'auto' else d.reduce} gradients / "
            f"{d.master} master (K = {d.optimizer_bytes})")


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def log2_ceil(n: int) -> int:
    return max(1, math.ceil(math.log2(n))) if n > 1 else 0
