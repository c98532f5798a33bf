"""What is planned: the workload, the strategy, and the parameters each rank holds.

Shared by memory.py (per-rank memory) and timing.py (time per step). Pure functions of
(workload, strategy, cluster); no torch, no process group, no allocation. Every formula, its
source and the assumptions are in docs/planner.md; the comments here say which term is which.
Notation (all of the planner): Ψ parameters, N ranks a state is sharded over, L layers, h
width, a heads, V vocabulary, f MLP width, s sequence length, b micro-batch, t tensor-parallel
degree, c context-parallel degree, p pipeline stages, m micro-batches per step; e / g / r bytes
per element of the compute dtype, the gradient (reduce) dtype and the residual stream.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

from shardlm.config.model import ModelConfig
from shardlm.config.dims import ParallelDims
from shardlm.errors import ConfigError
from shardlm.models import flops
from shardlm.hardware.catalog import Cluster
from shardlm.parallel.pipeline.tables import V_SHAPED

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
OFFLOAD_TIERS = ("none", "cpu", "nvme")
RECOMPUTE_MODES = ("none", "selective", "full")
CP_MODES = ("ring", "ulysses", "hybrid", "auto")
"""parallel.cp_mode's values (parallel/context/attention.py apply_cp; 'auto' decided before a run)."""
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb", "zbv", "dualpipev")
"""parallel.pp_schedule's values (parallel/pipeline/executor.py SCHEDULES); pp_in_flight and pp_bubble
model each."""


# ---------------------------------------------------------------------------------------------
# What is being planned


@dataclass(frozen=True)
class Dtypes:
    """The mixed-precision policy (config [precision]): compute, gradient reduction, master."""

    compute: str = "bf16"
    reduce: str = "auto"
    """'auto' = the compute dtype (what DeepSpeed, FSDP and the ZeRO formulas assume)."""
    master: str = "fp32"
    fp8: bool = False
    """precision.compute = 'fp8': `compute` is then the dtype parameters, gradients and
    activations are kept in (bf16), and the blocks' linears multiply at the device's fp8 peak
    where the catalog has one, else (the CPU emulation) at `compute`'s (planner/timing.py)."""
    fp8_all_gather: bool = False
    """precision.fp8_all_gather (with fp8, at stage 3): the blocks' FP8 linear weights are gathered
    at 1 byte per element (traffic.fp8_gathered_elements; planner/timing.py)."""

    @property
    def precision(self) -> str:
        """The precision.compute a plan with these dtypes runs ('fp8' or `compute`)."""
        return "fp8" if self.fp8 else self.compute

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
class Strategy:
    layout: ParallelDims
    """The ranks: dp_replicate x dp_shard x cp x tp x pp (ep experts' ranks come out of the
    data-parallel ones): the one ParallelDims a run resolves (shardlm.config.dims)."""
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
    pp_schedule: str = "1f1b"
    """With pp > 1 (parallel.pp_schedule): 'gpipe', '1f1b', 'interleaved', 'zb', 'zbv' or 'dualpipev'."""
    pp_virtual: int = 1
    """Model chunks per pipeline rank ('interleaved': >= 2; parallel.pp_virtual)."""
    pp_layers: str = ""
    """Blocks per pipeline stage, '4,4,3,5' (parallel.pp_layers); '' = the balanced split."""
    activation_offload: str = "none"
    """activation.offload: 'none' or 'cpu' (the chosen blocks' saved activations go to host
    memory in forward and come back for their backward; parallel/blocks/activation.py)."""
    activation_offload_blocks: int = 0
    """activation.offload_blocks: the first N blocks of each rank's stage; 0 = every block."""
    prefetch: bool = True
    """parallel.prefetch (stage 3): gather the next unit while this one computes (prefetch depth
    1, parallel/data/zero/params.py), or only when it is reached (nothing hides a gather; one block fewer
    gathered at a time)."""
    cp_mode: str = "ring"
    """With cp > 1 (parallel.cp_mode): 'ring', 'ulysses', 'hybrid' (all-to-all degree
    `cp_ulysses`) or 'auto' (the least exposed time: planner/cp_modes.py choose_cp_mode)."""
    cp_ulysses: int = 0
    """parallel.cp_ulysses: the hybrid's all-to-all degree (0 = 2)."""
    pp_scatter_gather: bool = False
    """Megatron-LM's scatter/gather between pipeline stages (Narayanan et al. 2021, section
    4.1): with tp > 1 and no sequence parallelism each tensor-parallel rank sends 1/t of the
    stage's output over its own network adapter and the receiving stage all-gathers it over
    the node's link, instead of every tp rank sending the whole tensor. Not what our runtime
    does (parallel/pipeline/stages.py sends the whole tensor): set only to model a published
    Megatron-LM run (tests/test_planner_published.py)."""
    optimizer: str = "adamw"
    """train.optimizer: 'adamw' or 'muon' (its momentum, collectives and Newton-Schulz: muon.py)."""
    local_sgd_every: int = 0
    """train.local_sgd.every: the dp_replicate replicas reduce gradients among their own ranks
    only, and every this many steps meet in one all-reduce of the fp32 pseudo-gradient shard
    (parallel/data/zero/local_sgd.py); 0 = off."""
    local_sgd_outer: str = "diloco"
    """train.local_sgd.outer: 'diloco' keeps the outer model and its momentum (8 B per sharded
    parameter), 'average' the outer model only (4 B)."""
    async_tp: bool = False
    """parallel.async_tp: with sequence parallelism, the tp collectives overlap the matmuls they
    feed (timing._async_tp_overlap)."""

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

    @functools.cached_property
    def model_key(self) -> tuple:
        """The model's fields as a hashable key, made once per workload: the memoised shape,
        pipeline split and FLOPs (a search asks for them tens of thousands of times) are keyed
        by it. A Workload is not changed once made (frozen; nothing assigns to its model)."""
        return tuple(vars(self.model).items())

    # A mixture of experts is the model's (ModelConfig.experts, top_k, capacity_factor).
    @property
    def experts(self) -> int:
        return self.model.experts

    @property
    def top_k(self) -> int:
        return self.model.top_k

    @property
    def capacity_factor(self) -> float:
        """Rows per token-choice the busiest expert computes at most: the capacity factor; 1
        when dropless (balanced routing assumed: an imbalanced router makes it more)."""
        return self.model.capacity_factor or 1.0


def validate(w: Workload, s: Strategy, cluster: Cluster) -> None:
    """User mistakes, all at once, before any arithmetic."""
    lay, m, errors = s.layout, w.model, []
    if lay.world_size != cluster.world_size:
        errors.append(f"dp_replicate ({lay.dp_replicate}) x dp_shard ({lay.dp_shard}) x cp ({lay.cp}) "
                      f"x tp ({lay.tp}) x pp ({lay.pp}) = {lay.world_size}, but {cluster.describe()} has "
                      f"{cluster.world_size} devices")
    if lay.cp > 1 and w.seq_len % (2 * lay.cp):
        errors.append(f"cp = {lay.cp} cuts each sequence into 2·cp = {2 * lay.cp} load-balanced chunks: "
                      f"seq {w.seq_len} must divide by {2 * lay.cp}")
    if m.n_heads % lay.tp:
        errors.append(f"tp = {lay.tp} does not divide the {m.n_heads} attention heads")
    errors += _pipeline_errors(w, s)
    if s.cp_mode not in CP_MODES:
        errors.append(f"cp_mode {s.cp_mode!r}: choose {', '.join(CP_MODES)}")
    if lay.ep > 1 and (not w.experts or w.experts % (lay.ep * lay.tp) or zero_ranks(lay) % lay.ep):
        errors.append(f"ep = {lay.ep} must divide dp_shard x cp ({lay.dp_shard} x {lay.cp}), and ep x tp "
                      f"({lay.ep} x {lay.tp}) the experts ({w.experts})")
    if s.zero_stage not in (0, 1, 2, 3):
        errors.append(f"zero stage {s.zero_stage}: choose 0, 1, 2 or 3")
    if s.recompute not in RECOMPUTE_MODES:
        errors.append(f"activation checkpoint {s.recompute!r}: choose {', '.join(RECOMPUTE_MODES)}")
    for name, tier in (("offload_optimizer", s.offload_optimizer), ("offload_params", s.offload_params)):
        if tier not in OFFLOAD_TIERS:
            errors.append(f"{name} = {tier!r}: choose {', '.join(OFFLOAD_TIERS)}")
    if s.activation_offload not in ("none", "cpu"):
        errors.append(f"activation_offload = {s.activation_offload!r}: choose none, cpu")
    elif s.activation_offload != "none" and s.recompute != "none":
        errors.append(f"activation offload with {s.recompute} recompute: recomputation rebuilds "
                      f"activations outside the offload hooks; choose one (as config/schema.py does)")
    if s.activation_offload_blocks < 0:
        errors.append(f"activation_offload_blocks = {s.activation_offload_blocks}: 0 (every block) or more")
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
    if s.micro_batch * s.grad_accum * lay.dp_size != w.global_batch:
        errors.append(f"micro_batch {s.micro_batch} x grad_accum {s.grad_accum} x dp {lay.dp_size} != "
                      f"global batch {w.global_batch} sequences")
    if errors:
        raise ConfigError("this plan cannot run:\n  - " + "\n  - ".join(errors))


def schedule_takes(schedule: str, pp: int, virtual: int, grad_accum: int) -> bool:
    """Whether a pipeline schedule runs `grad_accum` micro-batches a step: one of several chunks
    a rank takes them in groups of pp, and DualPipeV at least 2·pp (its two directions' warm-ups;
    _pipeline_errors words the same for a plan given whole)."""
    if virtual > 1 and grad_accum % pp:
        return False
    return not (schedule == "dualpipev" and grad_accum < 2 * pp)


def _pipeline_errors(w: Workload, s: Strategy) -> list[str]:
    """The pipeline keys' mistakes (as config/schema.py's validation words them for a run)."""
    lay, n = s.layout, w.model.n_layers
    stages = lay.pp * s.pp_virtual
    if s.pp_schedule not in PP_SCHEDULES and not s.pp_schedule.startswith("file:"):
        return [f"pp_schedule {s.pp_schedule!r}: choose {', '.join(PP_SCHEDULES)} or 'file:PATH'"]
    if s.pp_schedule.startswith("file:"):
        pass  # a user's table: config validation checked it against pp, pp_virtual and grad_accum
    elif s.pp_schedule in V_SHAPED:
        if s.pp_virtual != 2 or (s.pp_schedule == "dualpipev" and s.grad_accum < 2 * lay.pp):
            return [f"pp_schedule {s.pp_schedule!r} runs pp_virtual = 2 chunks per rank in a V"
                    + (f" and grad_accum >= 2·pp = {2 * lay.pp}" if s.pp_schedule == "dualpipev" else "")]
    elif (s.pp_schedule == "interleaved") != (s.pp_virtual > 1):
        return [f"pp_schedule {s.pp_schedule!r} with pp_virtual = {s.pp_virtual}: 'interleaved' runs "
                f"pp_virtual >= 2 chunks per rank, the others one"]
    if stages > n:
        return [f"pp = {lay.pp}" + (f" x pp_virtual {s.pp_virtual}" if s.pp_virtual > 1 else "")
                + f" = {stages} stages exceed the {n} layers"]
    errors = []
    if s.pp_schedule == "interleaved" and s.grad_accum % lay.pp:
        errors.append(f"the interleaved schedule sends micro-batches in groups of pp = {lay.pp}: "
                      f"grad_accum {s.grad_accum} must divide by it")
    if s.pp_layers:
        if lay.pp == 1:
            errors.append(f"pp_layers {s.pp_layers!r} with pp = 1")
        else:
            try:
                flops.pipeline_split(w.model, w.seq_len, stages, s.pp_layers)
            except ConfigError as e:
                errors.append(str(e))
    return errors


def zero_ranks(lay: ParallelDims) -> int:
    """N for ZeRO: the ranks model states are sharded over, dp_shard x cp (context-parallel ranks
    hold the same parameters and reduce their gradients together: comm/mesh.py)."""
    return lay.dp_shard * lay.cp


def describe_dtypes(d: Dtypes, local: bool) -> str:
    if local:
        return f"{d.compute} autocast over fp32 parameters and gradients, fp32 Adam (K = 8)"
    return (f"{d.compute} compute / {d.compute if d.reduce == 'auto' else d.reduce} gradients / "
            f"{d.master} master (K = {d.optimizer_bytes})")


def offloaded_blocks(s: Strategy, layers: int, cluster: Cluster) -> int:
    """Blocks of a stage with `layers` blocks whose saved activations go to host memory
    (parallel/blocks/activation.py apply_offload: the first activation_offload_blocks of the rank's
    blocks, 0 = all). None on a CPU device: the host is the device, the runtime keeps every
    saved tensor where it is (nothing moves, nothing changes)."""
    if s.activation_offload == "none" or cluster.device.kind == "cpu":
        return 0
    n = s.activation_offload_blocks
    return min(n, layers) if n else layers


def effective_tier(tier: str, cluster: Cluster) -> str:
    """On a CPU machine the 'cpu' tier is where the states already are (parallel/data/zero/tiers/
    aliases them): nothing moves."""
    return "none" if tier == "cpu" and cluster.device.kind == "cpu" else tier


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
    """One routed expert's MLP (0 for a dense model)."""
    routed: float
    """The routed experts' parameters of the mean block (all of a MoE block's, times the share
    of blocks that are MoE)."""
    embedding: float
    positions: float
    final_norm: float
    head: float
    """Untied output head (0 when tied to the embedding)."""


def shape_of(w: Workload) -> Shape:
    # Memoised: the search asks for the same workload's shape thousands of times.
    return _shape(w.model_key, w.params)


@functools.lru_cache(maxsize=64)
def _shape(model_fields: tuple, params: float | None) -> Shape:
    m = ModelConfig(**dict(model_fields))
    root = flops.count_params(replace(m, n_layers=0))
    block = (flops.count_params(m) - root) / m.n_layers  # the mean block (MoE ones and dense ones)
    embedding = m.vocab_size * m.d_model
    positions = m.max_seq_len * m.d_model if m.position == "learned" else 0
    head = 0 if m.tie_embeddings else embedding
    final_norm = root - embedding - positions - head
    f = flops.expert_d_ff(m)
    expert = (3 if m.mlp == "swiglu" else 2) * m.d_model * f if m.experts else 0
    if m.experts and m.bias:
        expert += f * (2 if m.mlp == "swiglu" else 1) + m.d_model
    routed = m.experts * expert * len(flops.moe_layers(m)) / m.n_layers  # per mean block
    replicated = 2 * final_norm + (2 * m.d_model if m.bias else 0)
    shape = Shape(m.n_layers * block + root, block, replicated, expert, routed, embedding, positions,
                  final_norm, head)
    if params:  # the user's Ψ is the truth; the synthesised shape only apportions it
        k = params / shape.total
        shape = Shape(params, *(getattr(shape, f) * k for f in
                                  ("block", "block_replicated", "expert", "routed", "embedding",
                                   "positions", "final_norm", "head")))
    return shape


@dataclass(frozen=True)
class StageParams:
    """Parameters one rank of a pipeline stage holds before ZeRO sharding."""

    name: str
    layers: int
    dense: float
    """Ψ_r: this rank's non-expert parameters (sharded over dp_shard x cp)."""
    experts: float
    """This rank's expert parameters (sharded over dp_shard x cp / ep)."""
    root_unit: float
    block_unit: float
    index: int = 0
    """The rank's position in the pipeline group (0 = the embedding's, pp - 1 = the head's)."""


def pipeline_layers(w: Workload, s: Strategy) -> list[int]:
    """Blocks per global pipeline stage (pp x pp_virtual of them), split as the runtime splits
    (models.flops.pipeline_split: parallel.pp_layers, or balanced by forward FLOPs with the
    head's counted on the last stage); always sums to n_layers."""
    return list(_split(w.model_key, w.seq_len, s.layout.pp * s.pp_virtual, s.pp_layers,
                       s.pp_virtual))


@functools.lru_cache(maxsize=256)
def _split(model_fields: tuple, seq_len: int, stages: int, explicit: str, virtual: int) -> tuple[int, ...]:
    return tuple(flops.pipeline_split(ModelConfig(**dict(model_fields)), seq_len, stages, explicit, virtual))


def stage_params(w: Workload, lay: ParallelDims, split: list[int] | None = None) -> list[StageParams]:
    """Every pipeline rank's parameters (one entry when pp = 1). `split`: blocks per global stage
    (pipeline_layers; None = the balanced split, one chunk per rank); rank r holds global stages
    r, pp + r, ... (the interleaved schedule's chunks). The first rank holds the embeddings, the
    last the final norm and the head: a tied head keeps a copy of the embedding there (as
    Megatron-LM does). Tensor parallelism splits every matrix (the embedding and head
    vocabulary-parallel) and replicates norms (Shoeybi et al. 2019)."""
    sh, t, p = shape_of(w), lay.tp, lay.pp
    # Experts are spread (not cut) over ep ranks, or over the tp ranks under tensor parallelism.
    experts_local = sh.routed / (lay.ep * t)
    dense_block = sh.block_replicated + (sh.block - sh.block_replicated - sh.routed) / t
    if split is None:
        split = list(_split(w.model_key, w.seq_len, p, "", 1))
    assert sum(split) == w.model.n_layers and len(split) % p == 0, (split, p)
    if p == 1:
        roots = [("all layers", sh.embedding / t + sh.positions + sh.final_norm + sh.head / t)]
    else:
        inputs = sh.embedding / t + sh.positions
        outputs = sh.final_norm + (sh.head or sh.embedding) / t
        roots = ([("first stage", inputs)] + [(f"stage {r}", 0.0) for r in range(1, p - 1)]
                 + [("last stage", outputs)])
    out = []
    for r, (name, root) in enumerate(roots):
        n = sum(split[r::p])
        out.append(StageParams(name, n, n * dense_block + root, n * experts_local, root,
                               dense_block + experts_local, r))
    return out


def matmul_shapes(m: ModelConfig, tokens: int, tp: int = 1) -> list[tuple[str, int, int, int, int]]:
    """The forward matmuls of one micro-batch of `tokens` tokens, as models/decoder.py runs them
    on one tensor-parallel rank (column-parallel outputs and row-parallel inputs / tp): (name, m,
    k, n, how many per step's forward: per block x L, the head once). What `shardlm calibrate`
    times (hardware/probe.py matmul_curve); a backward runs each twice more, with the same three
    sizes in other orders (dX = dY·Wᵀ: m x n x k; dW = Xᵀ·dY: k x m x n). A mixture of experts'
    expert matmuls (fewer rows each) are not listed: its dense MLP width stands for them."""
    h, layers = m.d_model, m.n_layers
    q, kv = flops.attention_width(m), (m.n_kv_heads or m.n_heads) * flops.head_dim(m)
    f = flops.resolved_d_ff(m)
    up = 2 * f if m.mlp == "swiglu" else f
    shapes = [("qkv", tokens, h, (q + 2 * kv) // tp, layers), ("attention out", tokens, q // tp, h, layers),
              ("mlp up" + (" (gate|up)" if m.mlp == "swiglu" else ""), tokens, h, up // tp, layers),
              ("mlp down", tokens, f // tp, h, layers), ("head", tokens, h, -(-m.vocab_size // tp), 1)]
    return shapes


# ---------------------------------------------------------------------------------------------
# What memory.py and activations.py report: one line of the per-rank table


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
