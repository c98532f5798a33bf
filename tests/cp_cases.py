"""Rank-side functions for the context-parallel tests (importable by spawned ranks)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def ring_attention_case(rank: int, world_size: int, heads: int, kv_heads: int, length: int,
                        math_path: bool = False) -> dict:
    """Ring attention on this rank's load-balanced chunks of the same random q, k, v on every
    rank: its output and the gradients of its chunks, for a loss that weights every output."""
    import torch.distributed as dist

    from shardlm.comm.collectives import Comm, CommLedger
    from shardlm.parallel import context
    from shardlm.parallel.context import CPState, ring_attention

    if math_path:  # the portable path (what a device without a fused kernel runs)
        context._has_cpu_flash = lambda q: False
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
