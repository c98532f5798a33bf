"""Context parallelism by all-to-all over heads (DeepSpeed-Ulysses: Jacobs et al. 2023), and its
hybrid with the ring (USP: Fang & Zhao 2024, "unified sequence parallelism"; Megatron-Core's
hierarchical a2a + p2p context parallelism).

Ulysses. Each of the U ranks holds T/U tokens of every head. Around attention an all-to-all
trades that for every token of h/U heads: rank j sends its tokens of head group i to rank i and
receives head group j's tokens from every rank; it then attends the whole sequence with its own
heads — any mask the one-process kernel takes (causal, documents, a sliding window, soft-capped
scores) works unchanged, since the whole sequence is in hand — and a second all-to-all sends
each rank's tokens back, all heads. q, k and v travel in one exchange (one call, their heads
packed per destination), the output in another: per block forward about (U-1)/U of
(2·h + 2·h_kv)/U·T/U·d per rank, shrinking with U, against the ring's (U-1) key/value blocks.
Query heads must divide by U; key/value heads too or, fewer than U (GQA), they are replicated
to U first (as tensor parallelism replicates them; their gradients sum back through the copy).

This module is the exchange itself; the attention core that runs it, UlyssesAttention, lives
beside the ring in parallel/context/attention.py, with apply_cp.

Hybrid (parallel.cp_mode = 'hybrid'): cp = U x R ranks, U consecutive ones an all-to-all group,
the R groups a ring (each ring: the ranks of the same all-to-all position). After the exchange
each all-to-all group holds, for its heads, exactly the tokens one ring rank of an R-rank ring
holds (chunks j and 2R-1-j of 2R: parallel/context/attention.py's load balance), so the ring's own code
runs on them. Rank c = j·U + u of the cp group therefore holds piece u of U of each of those two
chunks (CPState.positions); the exchange gathers [front_0 back_0 front_1 back_1 ...], reordered
to [front back] by a transpose. Ulysses alone is the hybrid with R = 1.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardlm.comm.collectives import Comm
from shardlm.parallel.context.ops import all_to_all_rows


def replicate_kv(kv: torch.Tensor, degree: int) -> torch.Tensor:
    """(B, h_kv, t, d) -> at least `degree` heads: each key/value head repeated degree / h_kv
    times when there are fewer (validated: one divides the other), so each rank gets the head
    its query heads share."""
    heads = kv.shape[1]
    return kv if heads >= degree else kv.repeat_interleave(degree // heads, dim=1)


def heads_to_sequence(tensors: list[torch.Tensor], comm: Comm, key: str) -> list[torch.Tensor]:
    """Each (B, n_i, t, d), this rank's t tokens [front piece, back piece] of every head ->
    (B, n_i/U, U·t, d): every rank's tokens of this rank's head group, in sequence order
    [all front pieces, all back pieces]. One all-to-all for all of them; `key`: comm's
    (collective_ops.op_group)."""
    U = comm.size
    B, _, t, d = tensors[0].shape
    widths = [x.shape[1] // U for x in tensors]
    rows = torch.cat([x.reshape(B, U, w, t, d) for x, w in zip(tensors, widths)], dim=2)  # (B, U, Σw, t, d)
    got = all_to_all_rows(rows.transpose(0, 1), key)  # (U source ranks, B, Σw, t, d)
    half = t // 2  # each source's tokens: [front piece, back piece] -> fronts first, then backs
    whole = got.view(U, B, -1, 2, half, d).permute(1, 2, 3, 0, 4, 5).reshape(B, -1, U * t, d)
    return list(whole.split(widths, dim=1))


def sequence_to_heads(y: torch.Tensor, comm: Comm, key: str) -> torch.Tensor:
    """heads_to_sequence's inverse for one tensor: (B, n/U, U·t, d) -> (B, n, t, d)."""
    U = comm.size
    B, w, T, d = y.shape
    t = T // U
    rows = y.view(B, w, 2, U, t // 2, d).permute(3, 0, 1, 2, 4, 5).reshape(U, B, w, t, d)
    got = all_to_all_rows(rows, key)  # (U head groups, B, w, t, d)
    return got.transpose(0, 1).reshape(B, U * w, t, d)


def hybrid_groups(comm: Comm, a2a: int) -> tuple[Comm, Comm]:
    """The all-to-all group (a2a consecutive ranks of `comm`'s group) and the ring group (the
    ranks of the same position in each) of this rank, both named 'cp' in the ledger (their
    operations, all_to_all and send_recv, tell them apart). Only the members of a group create
    it (use_local_synchronization), so each cp group of a larger mesh builds its own."""
    ranks = dist.get_process_group_ranks(comm.group)  # global ranks, in cp-group order
    j, u = divmod(comm.rank, a2a)
    groups = []
    for members in (ranks[j * a2a:(j + 1) * a2a], ranks[u::a2a]):
        groups.append(Comm(dist.new_group(members, use_local_synchronization=True), comm.name,
                           comm.ledger, comm.watchdog))
    return groups[0], groups[1]
