"""Rank-side functions for the context-parallel tests (importable by spawned ranks)."""

from __future__ import annotations

import torch


def ring_attention_case(rank: int, world_size: int, heads: int, kv_heads: int, length: int,
                        math_path: bool = False) -> dict:
    """Ring attention on this rank's load-balanced chunks of the same random q, k, v on every
    rank: its output and the gradients of its chunks, for a loss that weights every output."""
    import torch.distributed as dist

    from shardlm.comm.collectives import Comm, CommLedger
    from shardlm.parallel.context import ring_blocks
    from shardlm.parallel.context.attention import CPState, ring_attention

    if math_path:  # the portable path (what a device without a fused kernel runs)
        ring_blocks._has_cpu_flash = lambda q: False
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, length, 8, generator=g)
    k = torch.randn(2, kv_heads, length, 8, generator=g)
    v = torch.randn(2, kv_heads, length, 8, generator=g)
    weight = torch.randn(2, heads, length, 8, generator=g)
    ledger = CommLedger()
    cp = CPState(Comm(dist.group.WORLD, "cp", ledger))
    mine = cp.positions(length)
    lq, lk, lv = (t[:, :, mine].clone().requires_grad_() for t in (q, k, v))
    cp.sharded = True
    out = ring_attention(lq, lk, lv, cp)
    (out * weight[:, :, mine]).sum().backward()
    return {"positions": mine, "out": out.detach(), "dq": lq.grad, "dk": lk.grad, "dv": lv.grad,
            "q": q, "k": k, "v": v, "weight": weight, "bytes": dict(ledger.bytes)}


def document_positions(length: int) -> torch.Tensor:
    """(2, length) positions within documents: row 0 three documents (one crossing the ranks'
    chunk boundaries), row 1 one document."""
    cuts = [0, length // 3 + 1, length - 3]
    row = torch.arange(length) - torch.tensor([max(c for c in cuts if c <= i) for i in range(length)])
    return torch.stack([row, torch.arange(length)])


def cp_attention_cases(rank: int, world_size: int, cases: list[tuple]) -> list[dict]:
    """cp_attention_case for each (mode, a2a, heads, kv_heads, length, documents): one spawn."""
    return [cp_attention_case(rank, world_size, *case) for case in cases]


def cp_attention_case(rank: int, world_size: int, mode: str, a2a: int, heads: int, kv_heads: int,
                      length: int, documents: bool, softcap: float = 0.0, window: int = 0) -> dict:
    """Context-parallel attention by `mode` (ring / ulysses / hybrid, all-to-all degree `a2a`)
    on this rank's chunks of the same random q, k, v on every rank, with or without document
    masks, scores soft-capped at `softcap` (> 0), a sliding window of `window` (> 0; the ring and
    the hybrid): its output and the gradients of its chunks, as ring_attention_case."""
    import torch.distributed as dist

    from shardlm.comm.collectives import Comm, CommLedger
    from shardlm.models.attention import prepare
    from shardlm.parallel.context.attention import CPState, RingAttention
    from shardlm.parallel.context.attention import UlyssesAttention
    from shardlm.parallel.context.ulysses import hybrid_groups

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, length, 8, generator=g)
    k = torch.randn(2, kv_heads, length, 8, generator=g)
    v = torch.randn(2, kv_heads, length, 8, generator=g)
    weight = torch.randn(2, heads, length, 8, generator=g)
    docs = document_positions(length) if documents else None
    ledger = CommLedger()
    comm = Comm(dist.group.WORLD, "cp", ledger)
    cp = CPState(comm, a2a=a2a)
    if mode == "ring":
        core = RingAttention(cp, softcap=softcap, window=window)
    elif mode == "ulysses":
        core = UlyssesAttention(cp, comm, softcap=softcap)
    else:
        a2a_comm, ring_comm = hybrid_groups(comm, a2a)
        core = UlyssesAttention(cp, a2a_comm, CPState(ring_comm), softcap=softcap, window=window)
    mine = cp.positions(length)
    lq, lk, lv = (t[:, :, mine].clone().requires_grad_() for t in (q, k, v))
    cp.sharded, cp.documents = True, docs
    mask = prepare("math" if softcap else "sdpa", docs, length, q.device, q.dtype) if mode == "ulysses" else None
    out = core(lq, lk, lv, mask=mask)
    (out * weight[:, :, mine]).sum().backward()
    return {"positions": mine, "out": out.detach(), "dq": lq.grad, "dk": lk.grad, "dv": lv.grad,
            "q": q, "k": k, "v": v, "weight": weight, "docs": docs, "bytes": dict(ledger.bytes)}


def cp_world(rank: int, world_size: int, train: list, modes: list, rings: list, runs: list) -> dict:
    """Several independent checks in one spawned world (one set of processes, not one per
    check): `train_cases` of `train`, `cp_attention_cases` of `modes`, `ring_attention_case` of
    each (heads, kv_heads, length, math_path) in `rings`, and a whole `train_run` (checkpoints
    written) of each overrides dict in `runs`. The rings run after the training, and the
    portable-path switch a ring case flips is put back after it: nothing else sees it."""
    from ckpt_cases import train_run
    from shardlm.parallel.context import ring_blocks
    from zero_cases import train_cases

    out = {"train": train_cases(rank, world_size, train), "runs": [train_run(o) for o in runs],
           "modes": cp_attention_cases(rank, world_size, modes), "rings": []}
    for ring in rings:
        fused = ring_blocks._has_cpu_flash
        try:
            out["rings"].append(ring_attention_case(rank, world_size, *ring))
        finally:
            ring_blocks._has_cpu_flash = fused
    return out


def ring_work_case(rank: int, world_size: int, heads: int, length: int, dim: int, dtype: str) -> dict:
    """The ring's forward and backward (parallel/context/attention.py, called directly: the custom op
    would hide its insides from a dispatch tracker) on this rank's chunks of a (2, heads,
    length, dim) sequence, tracked op by op (dispatch_count): {pass: (ops, bytes written to new
    tensors)}."""
    import torch
    import torch.distributed as dist

    from dispatch_count import dispatched
    from shardlm.comm.collectives import Comm, CommLedger
    from shardlm.parallel.context.attention import CPState, ring_backward, ring_forward

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, length, dim, generator=g).to(getattr(torch, dtype)) for _ in range(3))
    cp = CPState(Comm(dist.group.WORLD, "cp", CommLedger()))
    mine = cp.positions(length)
    lq, lk, lv = (t[:, :, mine].contiguous() for t in (q, k, v))
    cp.sharded = True
    held = {}

    def forward():
        held["out"], held["lse"] = ring_forward(lq, lk, lv, cp, dim ** -0.5, None, 0)

    out = {}
    rows = dispatched(forward)
    out["forward"] = (len(rows), sum(nbytes for _, view, _, _, nbytes, _ in rows if not view))
    dout = torch.ones_like(held["out"])
    rows = dispatched(lambda: ring_backward(dout, lq, lk, lv, held["out"], held["lse"], cp, dim ** -0.5, None, 0))
    out["backward"] = (len(rows), sum(nbytes for _, view, _, _, nbytes, _ in rows if not view))
    return out
