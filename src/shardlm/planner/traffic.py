"""Bytes each model-parallel axis moves per rank, counted as the runtime's byte ledger counts
them (comm/collectives.py): tensor parallelism (parallel/tensor/decoder.py), the context-parallel ring
(parallel/context/attention.py), the expert all-to-all (parallel/expert/dispatch.py), the pipeline's sends
(parallel/pipeline/stages.py). timing.py turns them into seconds; the runtime's tests compare them with
the ledger (tests/test_tensor_parallel.py, test_context_parallel.py, test_planner_axes.py).

Pure functions; no torch. Notation: workload.py.
"""

from __future__ import annotations

from shardlm.models import flops
from shardlm.planner.pipeline import pp_hidden_bytes, pp_sends


def tp_comm_bytes(m, tokens: int, tp: int, sequence_parallel: bool, e: int, recompute: str = "none",
                  layers: int | None = None, embedding: bool = True, head: bool = True,
                  async_tp: bool = False) -> int:
    """Bytes the tensor-parallel group moves per micro-batch of `tokens` tokens, counted as the
    byte ledger counts them (comm/collectives.py: an all-reduce 2x its tensor, an all-gather its
    output, a reduce-scatter its input), for parallel/tensor/decoder.py's layers; `e` bytes per
    activation element (the compute dtype).

    Per block, Megatron's 2 all-reduces of tokens·h forward (after the row-parallel
    projections) and 2 backward (before the column-parallel ones): 8·tokens·h·e as counted.
    Sequence parallelism turns each into an all-gather + reduce-scatter pair of the same bytes
    (Korthikanti et al. 2022), and adds the gradient all-reduces of the parameters applied to
    sequence-sharded activations: norms, row-parallel biases, learned positions. The embedding
    adds one all-reduce forward (reduce-scatter forward, all-gather backward under SP), the head
    one backward (all-gather forward, reduce-scatter backward under SP), the vocabulary-parallel
    loss three fp32 numbers per token; with tp > n_kv_heads, the all-reduce of the shared
    key/value rows' gradients per block. Recomputation ("full", and "selective" too: its policy
    saves matmul and attention outputs, not a collective's) repeats each block's forward
    collectives in backward but the last: torch's non-reentrant checkpoint stops recomputing
    once every tensor backward needs is back (early stop), and the block's last collective
    (the MLP's all-reduce, or its reduce-scatter under SP) only feeds the residual add, whose
    backward saves nothing (measured: tests/test_tensor_parallel.py). With parallel.async_tp
    (parallel/tensor/async_tp.py) that reduce-scatter is recomputed too: it is fused with the matmul
    whose saved input backward needs, so the early stop comes after it (tests/test_async_tp.py)."""
    if tp == 1:
        return 0
    h, layers = m.d_model, m.n_layers if layers is None else layers
    act = tokens * h * e
    recomputed = (3 + (1 if async_tp else 0) if sequence_parallel else 2) if recompute != "none" else 0
    per_block = 8 * act + recomputed * act
    moe = layers * len(flops.moe_layers(m)) / m.n_layers  # this stage's MoE blocks (their mean share)
    total = (layers - moe) * per_block + moe * moe_tp_bytes(m, tokens, tp, sequence_parallel, e, recompute)
    if embedding:
        total += 2 * act
    if head:
        total += 2 * act + 2 * 3 * tokens * 4
    kv = m.n_kv_heads or m.n_heads
    if kv % tp:  # tp > n_kv_heads: the shared key/value rows' gradients summed (SharedKVLinear)
        total += layers * 2 * 2 * kv * flops.head_dim(m) * (m.d_model + (1 if m.bias else 0)) * e
    if sequence_parallel:  # gradients of replicated parameters that saw different tokens
        total += 2 * sp_replicated_grads(m, layers, embedding, head)[0] * e
    return total


def moe_tp_bytes(m, tokens: int, tp: int, sequence_parallel: bool, e: int, recompute: str = "none") -> float:
    """Bytes a MoE block moves over the tensor-parallel group per micro-batch besides its expert
    exchange (ep_comm_bytes; parallel/expert/dispatch.py spreads the experts over the tp ranks instead of
    cutting them), as the ledger counts them: attention's Megatron pair (all-reduces of
    tokens·h forward and backward, or their all-gather + reduce-scatter under sequence
    parallelism) and the shared experts' (cut like a dense MLP); without sequence parallelism the
    all-gather of the routed output (each rank routed 1/T of the tokens) and of its gradient
    (_SplitRows); the balancing statistics summed forward (f and P: E fp32 each) and the
    router's weight gradient (E·h fp32) in backward. Recomputation repeats attention's forward
    collectives, the statistics and the routed output's all-gather (the ledger: tp = 2, moe-mini,
    activation.checkpoint = full)."""
    act = tokens * m.d_model * e
    pairs = 1 + (1 if m.shared_experts else 0)  # attention's, the shared experts'
    stats = 2 * 2 * m.experts * 4
    total = pairs * 4 * act + stats + 2 * m.experts * m.d_model * 4 + (0 if sequence_parallel else 2 * act)
    if recompute != "none":
        total += 2 * act + stats + (0 if sequence_parallel else act)
    return total


def moe_tp_calls(m, sequence_parallel: bool, recompute: str = "none") -> int:
    """Collective calls of moe_tp_bytes per MoE block and micro-batch, counted as
    _model_parallel_comms counts a dense block's 4 (an all-reduce each, or an all-gather +
    reduce-scatter pair under sequence parallelism): attention's 2 and the shared experts' 2,
    the statistics' 2 and the router gradient's all-reduce, the routed output's 2 all-gathers
    (not under sequence parallelism); recomputed, attention's forward, the statistics' and the
    gather again (the ledger, tp = 2, 4 MoE blocks, one micro-batch: 24 all-reduces and 8
    all-gathers; recomputing, 36 and 12)."""
    calls = 2 * (1 + (1 if m.shared_experts else 0)) + 3 + (0 if sequence_parallel else 2)
    return calls + ((3 + (0 if sequence_parallel else 1)) if recompute != "none" else 0)


def sp_replicated_grads(m, layers: int, embedding: bool, head: bool) -> tuple[int, int]:
    """(elements, tensors) of the parameters sequence parallelism applies to sequence-sharded
    activations (norms, row-parallel biases, learned positions), whose gradients each tp rank
    all-reduces, one all-reduce per tensor per micro-batch (parallel/tensor/norms.py)."""
    h = m.d_model
    norm_tensors = 2 if m.norm == "layernorm" and m.bias else 1
    block_tensors = 2 * norm_tensors + (2 if m.bias else 0)
    elements = layers * block_tensors * h + (norm_tensors * h if head else 0)
    tensors = layers * block_tensors + (norm_tensors if head else 0)
    if m.position == "learned" and embedding:
        elements, tensors = elements + m.max_seq_len * h, tensors + 1
    return elements, tensors


def cp_comm_bytes(m, tokens: int, cp: int, tp: int, e: int, recompute: str = "none",
                  layers: int | None = None) -> int:
    """Bytes a context-parallel rank sends per micro-batch of `tokens` tokens (the whole
    sequence's, before the split), as the ledger counts them (send_recv: bytes sent), for
    parallel/context/attention.py's ring: per block, forward cp-1 hops of this rank's keys and values
    (2·tokens/cp·h_kv/tp·e: its tensor-parallel share of the key/value heads); backward cp-1
    hops again plus cp hops of their fp32 gradients; recomputation ("full" or "selective")
    runs the forward ring again."""
    if cp == 1:
        return 0
    layers = m.n_layers if layers is None else layers
    kv_heads = max(1, (m.n_kv_heads or m.n_heads) // tp)  # tp > n_kv_heads: the one it uses
    elems = 2 * tokens // cp * kv_heads * flops.head_dim(m)  # k and v of one rank
    hops = (cp - 1) * (3 if recompute != "none" else 2)
    return layers * (hops * elems * e + cp * elems * 4)


def expert_group(m, lay) -> tuple[int, int]:
    """(ranks, tokens divisor) of a MoE block's expert exchange (parallel/expert/dispatch.py): the ep
    ranks, and under tensor parallelism their tp ranks too (the ep × tp grid; tp alone when ep
    = 1), each tp rank exchanging 1/tp of the tokens; (1, 1) for a dense model or no exchange."""
    if not m.experts:
        return 1, 1
    return lay.ep * lay.tp, lay.tp


def ep_comm_bytes(m, tokens: int, ep: int, e: int) -> float:
    """Bytes an expert-parallel rank sends in one all-to-all of a MoE block (parallel/expert/dispatch.py),
    as the ledger counts them (`all_to_all/ep`: rows sent to the other ranks), for balanced
    routing: its tokens' top_k choices, (ep-1)/ep of them to other ranks' experts, d_model x e
    each (the activations' dtype; the runtime sends rows, never pads to a capacity). Four per
    MoE block and micro-batch: dispatch and combine forward, their gradients backward."""
    return tokens * m.top_k * (ep - 1) / ep * m.d_model * e


def pp_comm_bytes(m, tokens_per_micro: int, micro: int, stage_index: int, pp: int, tp: int, cp: int,
                  sequence_parallel: bool, e: int, tied: bool, virtual: int = 1) -> int:
    """Bytes pipeline rank `stage_index` sends per step as the ledger counts them (parallel/
    pipeline/stages.py): `send/pp`, each micro-batch's hidden states forward from every chunk but the
    model's last and the gradient of its input back from every chunk but the model's first
    (pp_hidden_bytes: b·s/cp x h x e, /t under sequence parallelism; `tokens_per_micro` = b·s,
    `micro` = M micro-batches, `virtual` chunks per rank); and with a tied head, on the first
    and the last rank, `all_reduce/pp_ends` of the embedding's gradient (its vocabulary-parallel
    rows: ceil(V/t) x h), counted 2x its tensor. The 4-int64 header the first step sends ahead
    of the first activation is left out (not in a steady-state step)."""
    if pp == 1:
        return 0
    activations, gradients = pp_sends(stage_index, pp, micro, virtual)
    total = (activations + gradients) * pp_hidden_bytes(m, tokens_per_micro, tp, cp, sequence_parallel, e)
    if tied and stage_index in (0, pp - 1):
        total += 2 * -(-m.vocab_size // tp) * m.d_model * e
    return total


def fp8_gathered_elements(m) -> int:
    """Weight elements ZeRO-3 gathers in E4M3 (1 byte each) under precision.fp8_all_gather
    (parallel/data/zero/fp8_gather.py), over all blocks: the FP8 linears' weights (models/fp8.py Fp8Linear) —
    attention's qkv and proj, a dense block's MLP, a MoE block's shared experts. The experts'
    batched weights, the router, norms, biases, embeddings and head gather in the compute dtype."""
    d, hd, kv = m.d_model, flops.head_dim(m), m.n_kv_heads or m.n_heads
    attention = d * (m.n_heads + 2 * kv) * hd + m.n_heads * hd * d
    total = 0
    for i in range(m.n_layers):
        width = (m.shared_experts * flops.expert_d_ff(m) if flops.is_moe_block(m, i)
                 else flops.resolved_d_ff(m))
        total += attention + (3 if m.mlp == "swiglu" else 2) * d * width
    return total


def local_sgd_comm_bytes(params: int, shard_ranks: int, every: int) -> float:
    """Bytes a rank sends across replicas per step under train.local_sgd (parallel/data/zero/local_sgd.py), as
    the ledger counts them (`all_reduce/dp_replicate`, 2x its tensor): one all-reduce of this
    rank's fp32 pseudo-gradient (Ψ/N elements, N = the replica's shard ranks) every `every` steps,
    and no gradient across replicas in between — in place of hybrid sharding's per-step
    all-reduce of the gradient shards. `params` = Ψ, the trained parameters."""
    return 2 * 4 * params / shard_ranks / every
