"""Time per optimizer step for one strategy: compute (with recomputation and the pipeline
bubble), each collective on the link its group spans and what of it overlap hides, the
optimizer step, offload traffic.

Pure functions; no torch, no process group, no allocation. Formulas and sources:
docs/planner.md; notation: workload.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardlm.models import flops
from shardlm.hardware.catalog import Cluster
from shardlm.planner.links import (ceil_div, collective_parts, collective_seconds,  # noqa: F401 (re-exported)
                                   group_link, log2_ceil)
from shardlm.planner.compute import compute_rate, model_flops_per_token
from shardlm.planner.memory import nvme_first_chunk, offloaded_activations, peak_candidates
from shardlm.planner.activations import activation_dtypes, block_activation
from shardlm.config.layout_rules import cp_degrees
from shardlm.planner.cp_modes import attention_seconds, choose_cp_mode, cp_a2a_bytes
from shardlm.planner.muon import newton_schulz_term
from shardlm.planner.traffic import (cp_comm_bytes, ep_comm_bytes, expert_group, moe_tp_calls, pp_comm_bytes,
                                     sp_replicated_grads, tp_comm_bytes)
from shardlm.planner.memory_bound import (ADAM_BYTES_PER_PARAM, WorkTerm,  # noqa: F401 (re-exported)
                                          memory_bound_terms, optimizer_term)
from shardlm.planner.comms import (CommTerm, CommTime, Windows, dp_comms, hidden,  # noqa: F401 (re-exported)
                                   measured_factor)
from shardlm.planner.in_situ import in_situ_factor
from shardlm.planner.pipeline import pp_bubble, pp_hidden_bytes
from shardlm.planner.workload import (DTYPE_BYTES, StageParams, Strategy, Workload, effective_tier,
                                      pipeline_layers, stage_params, validate, zero_ranks)

@dataclass
class Timing:
    compute: float
    """Seconds of compute per step, recomputation and pipeline bubble included."""
    bubble: float
    comms: list[CommTime]
    optimizer: float
    step: float
    tokens_per_s: float
    mfu: float
    """Model FLOPs utilisation: model FLOPs (PaLM appendix B, no recomputation) per second over
    the devices' dense peak."""
    model_flops_per_token: float
    stage: str = "all layers"
    """The pipeline stage whose communication and optimizer step are shown: the one that
    finishes last after the pipeline drains."""
    hfu: float = 0.0
    """Hardware FLOPs utilisation: as mfu, with the recomputation's FLOPs counted (activation
    checkpointing 'full' redoes each block's forward; 'selective' redoes element-wise ops only,
    0 matmul FLOPs, so its HFU is its MFU). Both count attention as PaLM does (dense)."""
    calibration: str = ""
    """What the compute rate came from: a measured matmul curve (which) or the catalog's
    efficiency (compute_rate)."""
    memory_bound: float = 0.0
    """Seconds per step of the memory-bound work beside the matmuls (memory_bound.py: element-
    wise traffic, fresh memory, per-op dispatch, ZeRO's copies), the pipeline's bubble included."""
    work: list[WorkTerm] = field(default_factory=list)
    """memory_bound and the optimizer step, term by term, as `shardlm estimate` prints them."""

    @property
    def exposed_comm(self) -> float:
        return sum(c.exposed for c in self.comms)


def _pipeline_comms(w: Workload, s: Strategy, cluster: Cluster, sp: StageParams) -> list[CommTime]:
    """The pipeline's point-to-point traffic and the tied embedding's all-reduce (bytes:
    pp_comm_bytes, this rank's). Time on the critical path: each of the M·V + P - 1 slots of
    the schedule (pp_bubble) waits for one activation and one gradient across a boundary (a
    receive blocks; between neighbours, world/pp ranks apart); after the last backward the two
    ends sum the tied embedding's gradient, with nothing to overlap."""
    lay, e, m, calib = s.layout, s.dtypes.param_bytes, w.model, cluster.calibration
    tokens, micro, sp_on = s.micro_batch * w.seq_len, s.grad_accum, s.sequence_parallel
    stride = lay.world_size // lay.pp
    hidden = pp_hidden_bytes(m, tokens, lay.tp, lay.cp, sp_on, e)
    sent = pp_comm_bytes(m, tokens, micro, sp.index, lay.pp, lay.tp, lay.cp, sp_on, e, False, s.pp_virtual)
    hops = 2 * ({"interleaved": s.pp_virtual * micro}.get(s.pp_schedule, micro) + lay.pp - 1)
    bw, lat, where = group_link(cluster, 2, stride)
    scatter = s.pp_scatter_gather and lay.tp > 1 and not sp_on
    # Megatron-LM's scatter/gather: 1/t of each tensor crosses the boundary, then an all-gather
    # over the tp group (inside the node) rebuilds it on the receiving stage
    sec, latency = collective_parts("p2p", hops * hidden / (lay.tp if scatter else 1), 2, bw, lat, hops)
    terms = [CommTerm(f"{hops} transfers, one per schedule slot and direction: a receive blocks"
                      + (f" (1/{lay.tp} of each: scatter/gather)" if scatter else ""), sec, sec)]
    if scatter:
        tp_bw, tp_lat, _ = group_link(cluster, lay.tp, 1)
        gather, gather_latency = collective_parts("all_gather", hops * hidden, lay.tp, tp_bw, tp_lat, hops)
        terms.append(CommTerm(f"{hops} all-gathers over the tp group rebuilding each tensor", gather, gather))
        sec, latency, sent = sec + gather, latency + gather_latency, sent / lay.tp
    out = [CommTime("pipeline send/recv", f"stage boundary, {where}", sent, sec, sec, latency, terms)]
    if m.tie_embeddings and sp.index in (0, lay.pp - 1):
        rows = -(-m.vocab_size // lay.tp) * m.d_model * e
        bw, lat, where = group_link(cluster, 2, stride * (lay.pp - 1))
        sec = collective_seconds("all_reduce", rows, 2, bw, lat) * calib.factor("all_reduce")
        out.append(CommTime("tied embedding all-reduce", f"first and last stage, {where}", 2 * rows,
                            sec, sec))
    return out


def _async_tp_overlap(w: Workload, s: Strategy, windows: Windows, overlap: float, seconds: float,
                      latency: float, calls: float) -> tuple[float, float, float, list[CommTerm]]:
    """parallel.async_tp (parallel/tensor/async_tp.py; Wang et al. 2023, torchtitan's async TP): each
    sequence-parallel all-gather / reduce-scatter is cut into tp pieces, each in flight while
    the matmuls it feeds run. Returns (seconds, latency, exposed, terms): the pieces add tp - 1
    latencies per call; exposed = one piece's latency per call (the last reduce-scatter piece
    has nothing beside it) + max(0, the rest - overlap x the fed matmuls' compute), never more
    than the time. The fed matmuls: the matmul share (6N of the kernel FLOPs) of the step's
    block compute; `overlap` the device's (Calibration.overlap: 0 on a CPU, where gloo's threads
    need the cores the matmuls use)."""
    pieces = s.layout.tp
    seconds += (pieces - 1) * latency
    share = 6 * flops.matmul_params(w.model) / flops.kernel_flops_per_token(w.model, w.seq_len, s.recompute)
    matmuls = (windows.forward + windows.backward) * s.grad_accum * min(1.0, share)
    exposed = latency + max(0.0, seconds - latency - overlap * matmuls)
    term = CommTerm(f"{calls:g} calls in {pieces} pieces each, overlapped with the {matmuls * 1e3:.3g} ms "
                    f"of matmuls they feed (async TP)", seconds, exposed)
    return seconds, pieces * latency, exposed, [term]


def _model_parallel_comms(w: Workload, s: Strategy, cluster: Cluster, sp: StageParams,
                          windows: Windows | None = None) -> list[CommTime]:
    """Tensor, pipeline and expert parallel traffic, all on the critical path (but async TP's)."""
    lay, e, m = s.layout, s.dtypes.param_bytes, w.model
    tokens = s.micro_batch * w.seq_len // lay.cp  # this rank's: context parallelism splits them
    micro = s.grad_accum
    out = []
    if lay.tp > 1:  # Megatron's f/g: 2 all-reduces forward, 2 backward per layer (+2 recompute);
        # with sequence parallelism the same volume as all-gathers + reduce-scatters
        moe = sp.layers * len(flops.moe_layers(m)) / m.n_layers  # a MoE block's are moe_tp_calls
        calls = ((4 if s.recompute == "none" else 6) * (sp.layers - moe)
                 + moe_tp_calls(m, s.sequence_parallel, s.recompute) * moe + 3) * micro
        counted = micro * tp_comm_bytes(m, tokens, lay.tp, s.sequence_parallel, e, s.recompute,
                                        sp.layers, embedding=sp.index == 0,
                                        head=sp.index == lay.pp - 1,
                                        async_tp=s.async_tp and s.sequence_parallel)
        bw, lat, where = group_link(cluster, lay.tp, 1)
        grads = (0, 0)  # sequence parallelism's replicated parameters: one all-reduce per tensor
        if s.sequence_parallel:
            elements, tensors = sp_replicated_grads(m, sp.layers, sp.index == 0, sp.index == lay.pp - 1)
            grads = (micro * 2 * elements * e, micro * tensors)
            # all-gathers and reduce-scatters, at the device's measured factor for each (gloo's
            # are not rings: hardware/probe.py)
            parts = [measured_factor(cluster, op, *collective_parts(op, (counted - grads[0]) / 2, lay.tp, bw,
                                                                    lat, calls))
                     for op in ("all_gather", "reduce_scatter")]
            sec, latency = (sum(p[i] for p in parts) for i in (0, 1))
        else:
            sec, latency = collective_parts("all_reduce", counted / 2, lay.tp, bw, lat, calls)
        exposed, terms = sec, [CommTerm(f"{calls:g} calls inside the blocks: the next matmul needs "
                                        f"each result, nothing to hide behind", sec, sec)]
        if s.async_tp and s.sequence_parallel and windows is not None:
            sec, latency, exposed, terms = _async_tp_overlap(w, s, windows, cluster.calibration.overlap,
                                                             sec, latency, calls)
        if grads[1]:
            g_sec, g_lat = collective_parts("all_reduce", grads[0] / 2, lay.tp, bw, lat, grads[1])
            sec, latency, exposed = sec + g_sec, latency + g_lat, exposed + g_sec
            terms.append(CommTerm(f"{grads[1]:g} all-reduces of the gradients of parameters applied to "
                                  f"sequence-sharded activations (norms, row biases), in backward", g_sec, g_sec))
        out.append(CommTime("tensor-parallel all-reduces", f"{lay.tp} ranks, {where}", counted, sec, exposed,
                            latency, terms))
    if lay.pp > 1:
        out += _pipeline_comms(w, s, cluster, sp)
    group, share = expert_group(m, lay)
    if group > 1:  # per MoE block: the row counts, dispatch + combine, their gradients (+ recomputed)
        moe = sp.layers * len(flops.moe_layers(m)) / m.n_layers
        recomputed = s.recompute != "none"
        calls = (4 + (2 if recomputed else 0)) * moe * micro
        counts = (1 + (1 if recomputed else 0)) * moe * micro  # E int64 each way: latency
        size = ep_comm_bytes(m, tokens // share, group, e)
        # the grid: each ep position's tp ranks side by side; ep alone (tp = 1): dp_shard ranks
        # cp apart, or the cp ranks themselves (ep over cp), side by side
        stride = 1 if lay.tp > 1 or lay.dp_shard % lay.ep else lay.cp
        bw, lat, where = group_link(cluster, group, stride)
        sec, latency = collective_parts("all_to_all", size * calls, group, bw, lat, calls)
        c_sec, c_lat = collective_parts("all_to_all", counts * m.experts * 8 / group, group, bw, lat, counts)
        grid = (f"{lay.ep} ep x {lay.tp} tp = " if lay.ep > 1 and lay.tp > 1 else "tp: " if lay.tp > 1 else "")
        counted = size * calls + counts * m.experts // group * 8 * (group - 1)  # the ledger's splits too
        out.append(CommTime("expert all-to-all", f"{grid}{group} ranks, {where}", counted, sec + c_sec,
                            sec + c_sec, latency + c_lat,
                            [CommTerm(f"{calls:g} dispatches and combines: the experts wait for their "
                                      f"rows, nothing to hide behind", sec, sec),
                             CommTerm(f"{counts:g} exchanges of the rows' counts per expert", c_sec, c_sec)]))
    return out


def _cp_comms(w: Workload, s: Strategy, cluster: Cluster, sp: StageParams, rate: float,
              a2a: int, ring: int) -> list[CommTime]:
    """Context parallelism's traffic by parallel.cp_mode (planner/cp_modes.py has the bytes, as
    the ledger counts them): with an all-to-all degree U and a ring of R = C/U ranks (ring: U =
    1; ulysses: R = 1; hybrid: both; 'auto': the mode cp_modes.choose_cp_mode picks, as the run's
    resolve.decide does: estimate_time decides it once, `a2a` x `ring` = cp). The all-to-all
    group is U consecutive cp ranks (tp apart), the ring R groups of them (U·tp apart:
    parallel/context/ulysses.py hybrid_groups)."""
    out = []
    if a2a > 1:
        out.append(_cp_all_to_all(w, s, cluster, sp, a2a))
    if ring > 1:
        out.append(_cp_ring(w, s, cluster, sp, rate, ring, a2a))
    return out


def _cp_mode(w: Workload, s: Strategy, cluster: Cluster, rate: float) -> tuple[str, int]:
    """(mode, all-to-all degree) the run attends by: its own, or for 'auto' the one with the
    least exposed time per micro-batch (cp_modes.choose_cp_mode, resolve.decide's rule)."""
    if s.cp_mode != "auto":
        return s.cp_mode, s.cp_ulysses
    lay, m = s.layout, w.model
    bw, lat, _ = group_link(cluster, lay.cp, lay.tp)
    tokens = s.micro_batch * w.seq_len
    best = choose_cp_mode(m, tokens, lay.cp, lay.tp, s.dtypes.param_bytes, s.recompute, bw, lat,
                          _attention_seconds(w, s, rate, lay.cp), cluster.calibration.overlap,
                          cluster.calibration.factor("send_recv"))[0]
    return best.mode, best.ulysses


def _attention_seconds(w: Workload, s: Strategy, rate: float, cp: int) -> float:
    """One micro-batch's causal attention on this rank (cp_modes.attention_seconds)."""
    return attention_seconds(w.model, w.seq_len, s.micro_batch, s.layout.tp, cp, rate, s.recompute)


def _cp_all_to_all(w: Workload, s: Strategy, cluster: Cluster, sp: StageParams, a2a: int) -> CommTime:
    """Ulysses' all-to-alls over U ranks: per block and pass (forward, backward, a recomputed
    forward) one exchange of q, k, v and one of the output; attention needs the heads before it
    starts and the next matmul the output: nothing hides them. Volume: cp_modes.cp_a2a_bytes."""
    lay, m, e = s.layout, w.model, s.dtypes.param_bytes
    micro, passes = s.grad_accum, 3 if s.recompute != "none" else 2
    tokens = s.micro_batch * w.seq_len
    sent = micro * cp_a2a_bytes(m, tokens, lay.cp, a2a, lay.tp, e, s.recompute, sp.layers)
    calls = 2 * passes * sp.layers * micro
    bw, lat, where = group_link(cluster, a2a, lay.tp)
    # collective_parts takes each call's whole tensor and moves (U-1)/U of it
    sec, latency = measured_factor(cluster, "all_to_all",
                                    *collective_parts("all_to_all", sent * a2a / (a2a - 1), a2a, bw, lat, calls))
    return CommTime("context-parallel all-to-all (Ulysses)", f"{a2a} ranks, {where}", sent, sec, sec, latency,
                    [CommTerm(f"{calls:g} exchanges of q, k, v and of the output: attention waits for "
                              f"its heads, nothing to hide behind", sec, sec)])


def _cp_ring(w: Workload, s: Strategy, cluster: Cluster, sp: StageParams, rate: float, ring: int,
             a2a: int = 1) -> CommTime:
    """The context-parallel ring (parallel/context/attention.py) over `ring` ranks, U·tp apart (U = `a2a`
    > 1 in the hybrid: each rank then holds 1/U of its key/value heads, the tokens of the U
    ranks of its all-to-all group): per block and micro-batch, ring-1 hops of this rank's
    key/value block forward (again with recomputation) and backward, and `ring` hops of its fp32
    gradient; each hop is a send to the next rank and a receive from the previous one, all
    ranks at once (one block on each link). Volume: exactly cp_comm_bytes (the ledger's
    send_recv bytes).

    Overlap, as the implementation does it: a key/value hop is started before the attention of
    the block in hand and waited for after it, so the key/value hops hide behind the layer's
    attention compute (causal: half the dense 4·h·s FLOPs per token forward, twice that
    backward, per rank 1/(t·c) of it), up to the device's overlap fraction (none on a CPU:
    gloo's threads need the compute cores); the gradient hops are waited for at once (the block's
    gradient must arrive before the next block is computed on): on the critical path. A hop is
    one step of the link's model times the device's measured send_recv factor (a hop timed among
    matmuls: hardware/gloo_probe.py)."""
    lay, m, e = s.layout, w.model, s.dtypes.param_bytes
    micro, layers = s.grad_accum, sp.layers
    tokens = s.micro_batch * w.seq_len
    total = micro * cp_comm_bytes(m, tokens, ring, lay.tp * a2a, e, s.recompute, layers)
    kv_heads = max(1, (m.n_kv_heads or m.n_heads) // (lay.tp * a2a))
    block = 2 * tokens // ring * kv_heads * flops.head_dim(m)
    kv_hops = (ring - 1) * (3 if s.recompute != "none" else 2) * layers * micro
    grad_hops = ring * layers * micro
    bw, lat, where = group_link(cluster, ring, lay.tp * a2a)
    kv, kv_latency = measured_factor(cluster, "send_recv", *collective_parts("p2p", kv_hops * block * e, ring, bw,
                                                                              lat, kv_hops))
    grads, grads_latency = measured_factor(cluster, "send_recv", *collective_parts("p2p", grad_hops * block * 4,
                                                                                    ring, bw, lat, grad_hops))
    window = micro * _attention_seconds(w, s, rate, lay.cp) * layers / m.n_layers
    kv_exposed = hidden(kv, window, cluster.calibration.overlap)
    return CommTime("context-parallel ring", f"{ring} ranks, {where}", total, kv + grads, kv_exposed + grads,
                    kv_latency + grads_latency,
                    [CommTerm(f"{kv_hops:g} key/value hops, behind the attention", kv, kv_exposed),
                     CommTerm(f"{grad_hops:g} gradient hops, waited for at once", grads, grads)])


def estimate_time(w: Workload, s: Strategy, cluster: Cluster) -> Timing:
    """Seconds per optimizer step. A pipeline moves at its slowest stage's pace (the largest
    share of the FLOPs); after it drains, each stage reduces its gradients and steps its
    optimizer on its own: the step ends with the stage that takes longest over that."""
    validate(w, s, cluster)
    lay, m, dev = s.layout, w.model, cluster.device
    split = pipeline_layers(w, s)
    stages = stage_params(w, lay, split)
    model_flops = model_flops_per_token(w)
    run_flops = model_flops_per_token(w, s.recompute, "kernel")  # what the step executes
    rate, calibration = compute_rate(w, s, cluster)
    factor, in_situ = in_situ_factor(w, s, cluster)  # this CPU's parts run slower in a pass
    rate /= factor
    if in_situ:
        calibration = f"{calibration}; {in_situ}"
    if dev.memory_source:  # the memory-bound terms' rates (memory_bound.py), measured on this CPU
        calibration = f"{calibration}; {dev.memory_source}"
    # The pipeline moves at its slowest rank's pace: the largest share of the FLOPs (a rank's
    # chunks summed under the interleaved schedule).
    shares = flops.stage_shares(m, w.seq_len, split)
    stage_share = max(sum(shares[r::lay.pp]) for r in range(lay.pp))
    tokens = s.micro_batch * w.seq_len
    # tp splits every matmul, cp the tokens (and, load-balanced, the causal attention): each
    # rank does 1/(t·c) of a micro-batch's FLOPs
    per_micro = run_flops * tokens * stage_share / (lay.tp * lay.cp) / rate
    if s.recompute == "selective":  # element-wise ops redone: memory-bound, write + read
        sp_on = s.sequence_parallel and lay.tp > 1
        dt = activation_dtypes(s, cluster)
        redone = (block_activation(m, dt, "none", lay.tp, sp_on, seq=w.seq_len)[0]
                  - block_activation(m, dt, "selective", lay.tp, sp_on, seq=w.seq_len)[0])
        per_micro += 2 * redone * tokens / lay.cp * max(sp.layers for sp in stages) / dev.memory_bandwidth
    micro = s.grad_accum
    bubble = pp_bubble(s) if lay.pp > 1 else 0.0
    compute = per_micro * micro / (1 - bubble)  # the schedule idles `bubble` of the pipeline time
    forward = per_micro * model_flops_per_token(w, count="kernel-forward") / run_flops
    a2a, ring = cp_degrees(lay.cp, *_cp_mode(w, s, cluster, rate)) if lay.cp > 1 else (1, 1)
    after = [_stage_comms(w, s, cluster, sp, rate, Windows(forward, per_micro - forward, compute, sp.layers),
                          (a2a, ring)) for sp in peak_candidates(stages)]
    sp, comms, optimizer = max(after, key=lambda a: sum(c.exposed for c in a[1]) + a[2].seconds)
    # The memory-bound work runs on the heaviest stage's pace like its matmuls (the pipeline
    # paced by it: x 1 / (1 - bubble)); each stage's own figure, its optimizer step the one shown
    heaviest = max(stages, key=lambda st: st.layers)
    work = memory_bound_terms(w, s, cluster, heaviest if lay.pp > 1 else sp, factor / (1 - bubble), ring)
    memory_bound = sum(t.seconds for t in work)
    step = compute + memory_bound + sum(c.exposed for c in comms) + optimizer.seconds
    tokens_per_s = w.global_batch * w.seq_len / step
    peak = lay.world_size * dev.peak[s.dtypes.compute]
    mfu = model_flops * tokens_per_s / peak
    hfu = model_flops_per_token(w, s.recompute) * tokens_per_s / peak  # + recomputation
    return Timing(compute, bubble, comms, optimizer.seconds, step, tokens_per_s, mfu, model_flops, sp.name, hfu,
                  calibration, memory_bound, [*work, optimizer])


def _stage_comms(w: Workload, s: Strategy, cluster: Cluster, sp: StageParams, rate: float, windows: Windows,
                 cp_split: tuple[int, int]) -> tuple[StageParams, list[CommTime], WorkTerm]:
    """One pipeline rank's communication (what of it is exposed) and optimizer seconds;
    `cp_split`: context parallelism's (all-to-all degree, ring) as the run attends (_cp_mode)."""
    lay, dev = s.layout, cluster.device
    comms = _model_parallel_comms(w, s, cluster, sp, windows)
    if lay.cp > 1:
        comms += _cp_comms(w, s, cluster, sp, rate, *cp_split)
    if not s.local:
        comms += dp_comms(w, s, cluster, sp, windows)
    n_opt = zero_ranks(lay) if s.zero_stage else 1
    psi_opt = sp.dense / n_opt + sp.experts / (max(1, zero_ranks(lay) // lay.ep) if s.zero_stage else 1)
    first = 0.0
    if effective_tier(s.offload_optimizer, cluster) == "nvme":
        from shardlm.config.schema import ZeroConfig

        first = nvme_first_chunk(sp, n_opt, ZeroConfig().nvme_chunk_mb * 2**20, DTYPE_BYTES[s.dtypes.master])
    optimizer = optimizer_term(s, cluster, psi_opt, sp.dense + sp.experts if s.local else psi_opt, first)
    if s.optimizer == "muon":  # its Newton-Schulz products join the step (planner/muon.py)
        ns = newton_schulz_term(w, s, cluster, sp)
        optimizer = WorkTerm(optimizer.name, optimizer.seconds + ns.seconds, f"{optimizer.formula}; {ns.formula}")
    if effective_tier(s.offload_params, cluster) != "none":  # each gather fetches the shard
        gathers = 1 if lay.pp > 1 else 2 * s.grad_accum  # a pipeline stage holds its units for the step
        up = gathers * s.dtypes.param_bytes * sp.dense / zero_ranks(lay)
        seconds = 0.0 if dev.kind == "cpu" else up / cluster.node.pcie.effective
        if s.offload_params == "nvme":
            seconds += up / (cluster.node.nvme_bandwidth / cluster.per_node)
        comms.append(CommTime("parameter shards from host", s.offload_params, up, seconds,
                              hidden(seconds, windows.step, cluster.calibration.overlap)))
    blocks, per_micro = offloaded_activations(w, s, cluster, sp)  # 0 on a CPU device
    if blocks:  # down in forward, back up in backward, every micro-batch, on the side stream
        moved = 2 * s.grad_accum * per_micro
        seconds = moved / cluster.node.pcie.effective
        comms.append(CommTime("activation offload", f"{blocks} block(s), host <-> device over "
                              f"{cluster.node.pcie.name}", moved, seconds,
                              hidden(seconds, windows.step, cluster.calibration.overlap)))
    return sp, comms, optimizer
