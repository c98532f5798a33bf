"""The memory-bound side of a step's time: what the matmul curve (compute.py) does not time.

- **element-wise traffic**: every op of a block that is not a matmul or attention (norms,
  activations, residual adds, RoPE, the copies autograd makes: the split's cat, a contiguous
  output) reads its inputs and writes its output; so does the loss over the vocabulary; at the
  device's bandwidth for tensors of that size (hardware.catalog.Device.bandwidth_at);
- **fresh memory**: every tensor a step allocates above glibc's mmap threshold is a fresh
  mapping on a CPU (a training process fixes the threshold at start-up, docs/allocator.md;
  Calibration.mmap_threshold, the run's):
  its first write pays a page fault and the kernel's zeroing per page, and its free the unmap
  (Device.fresh_bandwidth, measured; 0 on a GPU: CUDA's caching allocator reuses blocks);
- **per-op dispatch**: eager PyTorch pays a fixed cost per op, forward and backward
  (Device.op_seconds, measured; 0 on a GPU, whose kernels launch ahead of the device);
- **ZeRO's copies**: the engine flattens each unit's gradients into one buffer before its
  reduction, and at stage 3 writes each gathered unit into a fresh buffer;
- **the optimizer step**: torch's fused AdamW, at its measured rate on this CPU (Device.
  adamw_curve) or its bytes at the device's bandwidth; the gradient norm reads every gradient.

The per-token counts of a block (`block_work`) are the runtime's own ops, counted by structure
from models/decoder.py and checked op by op against what autograd dispatches for GPT-2- and
LLaMA-shaped blocks (tests/test_planner_memory_bound.py). Pure functions; no torch.
Sources and what is assumed: docs/planner.md section 4a.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlm.config.model import ModelConfig
from shardlm.hardware.catalog import Cluster, interpolate
from shardlm.hardware.gpu_calibration import device_curves
from shardlm.models import flops
from shardlm.planner.traffic import tp_comm_bytes
from shardlm.planner.workload import DTYPE_BYTES, StageParams, Strategy, Workload, effective_tier, zero_ranks

ADAM_BYTES_PER_PARAM = 36
"""Memory traffic of one fused AdamW update per parameter where it is not measured: read master,
gradient, m, v (4 B each, the gradient converted), write master, m, v, and the compute-dtype copy
(~9 x 4 B)."""


@dataclass(frozen=True)
class BlockWork:
    """One block's memory-bound work per token of a micro-batch, forward and backward, in
    elements of the activations' dtype (ops: per micro-batch, not per token)."""

    fresh: float
    """Elements written to newly allocated tensors (every op's output that is not a view)."""
    traffic: float
    """Elements read and written by the ops that are not matmuls or attention."""
    ops: int
    """Ops dispatched, views included (each costs a dispatch, forward or backward)."""
    widths: tuple[tuple[float, float], ...] = ()
    """`fresh` by the width of the tensors written: (elements per token of a row, elements), so
    that only tensors at or above the mmap threshold count as fresh mappings (fresh_elements)."""


def fresh_elements(work: BlockWork, tokens: int, element_bytes: float, threshold: float) -> float:
    """Of `work.fresh`, the elements written to tensors of at least `threshold` bytes (a micro-
    batch of `tokens` rows of each width, `element_bytes` each): those glibc maps afresh; the
    smaller ones come from the heap, reused without page faults (docs/allocator.md)."""
    return sum(n for width, n in work.widths if tokens * width * element_bytes >= threshold)


@dataclass(frozen=True)
class WorkTerm:
    """One memory-bound term of the step, as `shardlm estimate` prints it."""

    name: str
    seconds: float
    formula: str
    fresh_bytes: float = 0.0
    """Bytes of new mappings the term counts per step (the page faults bench_planner.py
    measures: ru_minflt x the page size)."""


def block_work(m: ModelConfig, tp: int = 1, sequence_parallel: bool = False) -> BlockWork:
    """The element counts of one block, piece by piece (h width, q / kv the query and key/value
    widths, f the MLP width; q, kv, f are a tensor-parallel rank's share; h-wide tensors are
    1/t under sequence parallelism). Counted from the ops models/decoder.py runs and their
    autograd backwards (forward + backward):

    | piece | fresh | traffic | ops |
    |---|---|---|---|
    | LayerNorm (each of 2) | h + h | 2h + 3h | |
    | RMSNorm (each of 2; torch's decomposed rms_norm) | 3h + 9h | 7h + 24h | +21 |
    | residual adds (2), and their gradients' sums | 2h + 2h | 6h + 6h | |
    | attention: q/k/v, output, projection; dX, the heads' gradients and their cat | (q + 2kv) + q + h + q + 2(q + 2kv) + h | 2(q + 2kv) (the cat) | |
    | RoPE on q and k, the output's contiguous copy | 4(q + kv) + q + 5.5(q + kv) | 21.5(q + kv) + 2q + 2kv | +39 |
    | GELU MLP: fc, GELU, proj; dX, GELU's backward | 2f + h + 2f + h | 2f + 3f | |
    | SwiGLU MLP: gate|up, SiLU, product, down; their backwards | 4f + h + 6f + h | 5f + 13f | +5 |
    | biases' gradients (sums over the tokens) | – | (q + 2kv) + 2h + f | +14 |

    ops: 87 for a LayerNorm / GELU block without biases or RoPE (t, view, addmm, split, the
    attention and their backwards), plus the column. The few elements of statistics (a norm's
    mean and rstd, attention's log-sum-exp) are left out."""
    h = m.d_model / (tp if sequence_parallel and tp > 1 else 1)
    q = flops.attention_width(m) / tp
    kv = max(1, (m.n_kv_heads or m.n_heads) // tp) * flops.head_dim(m)
    f = flops.resolved_d_ff(m) / tp
    rms = m.norm == "rmsnorm"
    # by width: h-wide (norms, residuals, the projections' outputs and dX), the fused q/k/v and
    # its gradients, q- and kv-wide (attention's output, RoPE), f-wide (the MLP)
    rope = m.position == "rope"
    swiglu = m.mlp == "swiglu"
    widths = ((h, 2 * ((3 + 9) * h if rms else 2 * h) + 4 * h + h + h + 2 * h),
              (q + 2 * kv, 3 * (q + 2 * kv)),
              (q, 2 * q + ((4 + 1 + 5.5) * q if rope else 0.0)),
              (kv, (4 + 5.5) * kv if rope else 0.0),
              (f, 10 * f if swiglu else 4 * f))
    fresh = sum(n for _, n in widths)
    traffic = 2 * ((7 + 24) * h if rms else 5 * h) + 12 * h
    traffic += 2 * (q + 2 * kv)
    if rope:
        traffic += 21.5 * (q + kv) + 2 * q + 2 * kv
    traffic += 18 * f if swiglu else 5 * f
    if m.bias:
        traffic += (q + 2 * kv) + 2 * h + f
    ops = 87 + 42 * rms + 39 * rope + 5 * swiglu + 14 * bool(m.bias)
    return BlockWork(fresh, traffic, ops, tuple((w, n) for w, n in widths if n))


def ring_work(m: ModelConfig, tp: int, ring: int, e: int) -> BlockWork:
    """What a block's context-parallel ring (parallel/context/attention.py ring_forward / ring_backward,
    over `ring` ranks) adds to its plain attention, per token of this rank's share, in
    elements of the activations' e-byte dtype: the fp32 running output and its merges, the
    stacked key/value blocks and those received, the rows a partial hop copies, the fp32
    gradient accumulators and the buffers they travel in, the casts back. Counted from the
    code per hop kind (the diagonal block; then, averaged, the 'front' and 'back' hops a rank
    alternates between) and checked under a dispatch tracker on two ranks (tests/
    test_planner_memory_bound.py, within 10%: fp32 and bf16). The traffic is twice the fresh
    bytes (each written, then read: 1.8-2.3x tracked); the ops as tracked at ring = 2 (45-49
    forward, 62-64 backward), the per-hop share growing with the ring. Grouped-query
    attention's expanded keys and values (`_expand`, `_fold`) are not counted."""
    if ring <= 1:
        return BlockWork(0.0, 0.0, 0)
    q = flops.attention_width(m) / tp  # a query row's elements on this rank; keys and values:
    kv = (m.n_kv_heads or m.n_heads) * flops.head_dim(m) / tp
    r = kv / q
    cast = 0.0 if e == 4 else 1.0  # fp32 activations need no copies back
    hops = ring - 1  # after the diagonal block
    # bytes per query element; forward: the fp32 output and its merges, the stacked blocks sent
    # and received, per hop the attention's output (+ its fp32 copy), the merge's product
    front_f, back_f = 2 * e * r / 2 + e + 4 * cast + 4, e / 2 + e / 2 + 2 * cast + 2
    forward = 4 + 2 * e * r * (1 + hops) + (e + 4 * cast + 4) + hops * (front_f + back_f) / 2 + e * cast
    # backward: the fp32 dq and dk/dv accumulators, a fresh buffer per hop they move in, the
    # blocks again; per hop the attention's three gradients and the rows a partial hop copies
    front_b, back_b = e * r + e + e * r, 1.5 * e + e / 2 + 2 * e * r
    backward = (4 + 8 * r + 2 * e * r * (1 + hops) + 8 * r * ring + (e + 2 * e * r)
                + hops * (front_b + back_b) / 2 + 2 * e * r + e * cast)
    fresh = (forward + backward - 4 * e) * q / e  # less the plain attention's output and gradients
    return BlockWork(fresh, 2 * fresh, 5 + 8 + ring * 47 - 11, ((q, fresh),))


def root_work(m: ModelConfig, tp: int, first: bool, last: bool) -> BlockWork:
    """The embedding's and the head's work per token (first / last pipeline stage): the
    lookup (and the learned positions' add), the final norm, the loss over the vocabulary (the
    ops counted by the same tracker on gpt-tiny and llama-tiny with no blocks; the
    log-probabilities, NLL's gradient and log-softmax's: V/t wide each, read and written in
    fp32, counted here in 4-byte elements' worth of the activations' dtype by the caller)."""
    h, v = m.d_model, -(-m.vocab_size // tp)
    narrow = wide = traffic = 0.0  # h-wide; vocabulary-wide
    ops = 0
    if first:
        learned = m.position == "learned"
        narrow += h + (2 * h if learned else 0)
        traffic += 3 * h if learned else 0
        ops += 9 if learned else 6  # lookups (and RoPE's tables), their backwards, views
    if last:
        rms = m.norm == "rmsnorm"
        narrow += ((3 + 9) * h if rms else 2 * h) + h  # the final norm; the head's dX
        traffic += (7 + 24) * h if rms else 5 * h
        wide += 4 * v  # logits, log-probs, NLL's gradient, log-softmax's
        traffic += 7 * v  # log_softmax r+w, NLL reads, its gradient written, the backward r 2 w 1
        ops += 47 if rms else 27  # final norm, head, loss, their backwards, views
    return BlockWork(narrow + wide, traffic, ops, tuple((w, n) for w, n in ((h, narrow), (v, wide)) if n))


def memory_bound_terms(w: Workload, s: Strategy, cluster: Cluster, sp: StageParams,
                       stretch: float, ring: int = 1) -> list[WorkTerm]:
    """The step's memory-bound terms on one rank of pipeline stage `sp` (seconds per step):
    element-wise traffic, fresh memory, per-op dispatch (each per micro-batch x m, x `stretch`:
    the in-situ factor (in_situ.py) x
    the pipeline's 1/(1 - bubble), as compute), and the engine's gradient flattening; `ring`
    > 1: each block's context-parallel ring over that many ranks (ring_work)."""
    dev, lay, m = cluster.device, s.layout, w.model
    e = s.dtypes.param_bytes
    micro = s.grad_accum
    tokens = s.micro_batch * w.seq_len // lay.cp
    sp_on = s.sequence_parallel and lay.tp > 1
    block = block_work(m, lay.tp, sp_on)
    if ring > 1:  # the context-parallel ring's own work (`ring` ranks: timing._cp_mode)
        extra = ring_work(m, lay.tp, ring, e)
        block = BlockWork(block.fresh + extra.fresh, block.traffic + extra.traffic, block.ops + extra.ops,
                          block.widths + extra.widths)
    root = root_work(m, lay.tp, sp.index == 0, sp.index == lay.pp - 1)
    layers = sp.layers * (4 / 3 if s.recompute == "full" else 1)  # a recomputed forward: ~ a third more
    traffic = tokens * (layers * block.traffic * e + root.traffic * 4)
    activation = tokens * m.d_model * e  # a typical element-wise operand: one micro-batch x h
    bandwidth = dev.bandwidth_at(activation)
    seconds = stretch * micro * traffic / bandwidth
    how = (f"{micro} micro-batch(es) x {traffic / 1e6:,.1f} MB (norms, activations, residuals, copies, "
           f"the loss) at {bandwidth / 1e9:,.1f} GB/s")
    # The catalog's efficiency is an end-to-end figure (published MFU: element-wise work, launches
    # and all): it already holds this work. Added only where the compute rate is a measured
    # matmul curve, which times nothing else (docs/planner.md section 4a).
    matmul_only = s.dtypes.compute in device_curves(dev)  # a CPU's, or a calibrated GPU's
    terms = [WorkTerm("element-wise traffic", seconds if matmul_only else 0.0,
                      how if matmul_only else f"inside the catalog's end-to-end efficiency ({how}: "
                      f"{seconds * 1e3:,.1f} ms)")]
    if dev.fresh_bandwidth > 0:
        threshold = cluster.calibration.mmap_threshold
        # every weight's gradient is a fresh matmul output: the whole stage's where one block's
        # smallest matrix (its output projection, q x h) is mapped, else none but the embedding's
        smallest = flops.attention_width(m) / lay.tp * m.d_model * e
        grads = (sp.dense + sp.experts) * e if smallest >= threshold else 0.0
        rows = -(-m.vocab_size // lay.tp) * m.d_model * 4
        if rows >= threshold:
            if sp.index == 0:  # the embedding's dense gradient (embedding_dense_backward)
                grads += rows
            if m.tie_embeddings and sp.index == lay.pp - 1 == 0:  # autograd's out-of-place sum of the
                grads += rows  # head's and the embedding's gradients of the one tied weight
        # activations: the tensors of a micro-batch at or above the threshold (the loss's in fp32)
        acts = tokens * (layers * fresh_elements(block, tokens, e, threshold) * e
                         + fresh_elements(root, tokens, 4, threshold) * 4)
        fresh = acts + grads
        terms.append(WorkTerm("fresh memory (page faults)", stretch * micro * fresh / dev.fresh_bandwidth,
                              f"{micro} micro-batch(es) x {fresh / 1e6:,.1f} MB of new tensors (activations "
                              f"{acts / 1e6:,.1f}, weight gradients {grads / 1e6:,.1f}) at "
                              f"{dev.fresh_bandwidth / 1e9:,.2f} GB/s", micro * fresh))
    if dev.op_seconds > 0:
        ops = layers * block.ops + root.ops
        terms.append(WorkTerm("per-op dispatch", stretch * micro * ops * dev.op_seconds,
                              f"{micro} micro-batch(es) x {ops:,.0f} ops x {dev.op_seconds * 1e6:.1f} us"))
    if lay.tp > 1 and dev.fresh_bandwidth > 0:  # parallel/tensor/ops.py: every collective's
        # result is a new tensor (the all-reduce works on a clone; under sequence parallelism the
        # all-gather and reduce-scatter copy their input transposed, then write their output)
        moved = tp_comm_bytes(m, tokens, lay.tp, sp_on, e, s.recompute, sp.layers, sp.index == 0,
                              sp.index == lay.pp - 1) / 2 * (2 if sp_on else 1)
        terms.append(WorkTerm("tensor-parallel copies", stretch * micro * (moved / dev.fresh_bandwidth
                                                                          + 2 * moved / bandwidth),
                              f"{micro} micro-batch(es) x {moved / 1e6:,.1f} MB of collective results "
                              f"written to new tensors", micro * moved))
    if not s.local and matmul_only:
        terms += _zero_copies(s, cluster, sp)
    return terms


def _zero_copies(s: Strategy, cluster: Cluster, sp: StageParams) -> list[WorkTerm]:
    """The ZeRO engine's own copies (parallel/data/zero/engine.py): each unit's gradients copied into its
    flat buffer before the reduction (read and write g·Ψ_r; at stages 2-3 the buffer is freed
    after its reduce-scatter, so new every step), once per step;
    at stage 3 every gather writes the whole unit into a fresh buffer (e·Ψ_r per gather: twice
    per micro-batch, once per step on a pipeline); on a CPU gloo's all-gather allocates its
    output once more (stage 3's gathers, stages 1-2's all-gather of the updated parameters); at
    stages 2-3 each unit's gradient shard is a new tensor from its reduction to the step
    (zero_grad drops it: memory.py), g·Ψ_r/N, counted where a unit's shard is above the mmap
    threshold (measured, bench_planner's page faults: stage 2 maps 53.2 MB a step more than
    stage 0 on 2 ranks of gpt-mini, 48.1 on 4; the flat buffers and gloo's copies are 42.6 of
    it, the shards 10.6 and 5.3)."""
    dev, d = cluster.device, s.dtypes
    psi = sp.dense + sp.experts
    g, e = d.grad_bytes, d.param_bytes
    unit = sp.block_unit * g
    seconds = 2 * g * psi / dev.bandwidth_at(unit)
    fresh = g * psi if s.zero_stage >= 2 else 0.0  # stages 0-1 keep the flat buffer between steps
    if s.zero_stage >= 2:  # the gradient shards, new each step
        n = zero_ranks(s.layout)
        units = [sp.root_unit] + [sp.block_unit] * sp.layers
        fresh += sum(g * u / n for u in units if g * u / n >= cluster.calibration.mmap_threshold) * psi / max(1.0, sum(units))
    # gloo's all-gather allocates its output again (memory.py); one rank gathers nothing
    gloo = 2 if dev.kind == "cpu" and zero_ranks(s.layout) > 1 else 1
    if s.zero_stage == 3:
        fresh += (1 if s.layout.pp > 1 else 2 * s.grad_accum) * e * psi * gloo
    elif s.zero_stage in (1, 2) and gloo == 2:  # the updated parameters' all-gather: gloo's copy
        fresh += e * psi
    if dev.fresh_bandwidth > 0:
        seconds += fresh / dev.fresh_bandwidth
    return [WorkTerm("ZeRO flatten / gather copies", seconds,
                     f"{2 * g * psi / 1e6:,.1f} MB copied into flat buffers, {fresh / 1e6:,.1f} MB of them new",
                     fresh if dev.fresh_bandwidth > 0 else 0.0)]


def cold_adamw(curve: tuple[tuple[float, float], ...], psi_opt: float) -> float:
    """Seconds per parameter of the fused AdamW inside a step: the measured curve (probe.
    memory_probe: one parameter of each size stepped back to back) at this many parameters, and
    never faster than its largest size's, where master, gradient and moments (16 B a parameter:
    256 MiB at 16 M) come from DRAM. The probe's smaller sizes keep their 4 and 32 MiB of state
    in the caches between tries; a step's pass writes its activations and gradients between two
    optimizer steps (gpt-mini: 114 MB), so the state is cold when the optimizer reads it.
    Measured ratios, largest size over 2 M: 2.0 (Intel Xeon, AMX) and 2.1-2.4 (AMD EPYC Zen 4)."""
    return max(interpolate(curve, psi_opt), max(curve)[1])


def optimizer_term(s: Strategy, cluster: Cluster, psi_opt: float, psi_grads: float,
                   first_chunk: float = 0.0) -> WorkTerm:
    """The optimizer step on this rank's Ψ_opt parameters: torch's fused AdamW at the rate
    measured for a parameter of that size (Device.adamw_curve) or ADAM_BYTES_PER_PARAM at the
    device's bandwidth; offloaded (ZeRO-Offload) at the host's share per device plus the gradient
    down and the parameters up over PCIe; on NVMe (ZeRO-Infinity) reading and writing master, m
    and v. Before it the gradient norm reads every gradient this rank holds (`psi_grads`).
    `first_chunk`: the parameters of the nvme tier's first chunk on this rank (memory.
    nvme_first_chunk): the tier reads it before anything else is in flight and, one chunk
    behind, writes as much after its last read; where the node's lone-request rate was measured
    (Node.nvme_lone_bandwidth) those bytes move at it, the rest at the streams' rate
    (read-ahead and write-behind in flight together, as the disk probe streams)."""
    d, node, dev, per_node = s.dtypes, cluster.node, cluster.device, cluster.per_node
    tier = effective_tier(s.offload_optimizer, cluster)
    norm = psi_grads * d.grad_bytes / dev.bandwidth_at(psi_grads * d.grad_bytes)
    if dev.adamw_curve and (tier == "none" or dev.kind == "cpu"):  # on a CPU the host is the device
        per_param = cold_adamw(dev.adamw_curve, psi_opt)
        how = f"fused AdamW, {per_param * 1e9:.2f} ns per parameter (measured; state from DRAM)"
    elif tier == "none":
        per_param = ADAM_BYTES_PER_PARAM / dev.memory_bandwidth
        how = f"{ADAM_BYTES_PER_PARAM} B per parameter at {dev.memory_bandwidth / 1e9:,.0f} GB/s"
    else:
        per_param = ADAM_BYTES_PER_PARAM / (node.host_bandwidth / per_node)
        how = f"{ADAM_BYTES_PER_PARAM} B per parameter at the host's {node.host_bandwidth / per_node / 1e9:,.0f} GB/s"
    seconds = psi_opt * per_param + norm
    if tier != "none" and dev.kind != "cpu":  # the gradient shard down, the parameters back up
        seconds += (d.grad_bytes + d.param_bytes) * psi_opt / node.pcie.effective
    if tier == "nvme":  # read and write master, m, v
        lone = min(first_chunk, psi_opt) if node.nvme_lone_bandwidth > 0 else 0.0
        state = 2 * 3 * DTYPE_BYTES[d.master]
        seconds += state * (psi_opt - lone) / (node.nvme_bandwidth / per_node)
        if lone:  # the first chunk's read and the last writes, one request in flight per rank
            seconds += state * lone / (node.nvme_lone_bandwidth / per_node)
    return WorkTerm("optimizer step", seconds, f"{psi_opt / 1e6:,.1f} M parameters: {how}; the "
                    f"gradient norm reads {psi_grads * d.grad_bytes / 1e6:,.1f} MB")
