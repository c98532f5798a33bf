"""Rank-side functions for the tensor-parallel tests (importable by spawned ranks)."""

from __future__ import annotations

import torch

from shardlm.models.placement import Split


def cross_entropy_case(rank: int, world_size: int, vocab: int, ignored: bool = False) -> dict:
    """The vocabulary-parallel cross-entropy and its gradient on this rank's vocabulary rows,
    for the same random logits on every rank (`ignored`: some targets -100, as SFT's prompts)."""
    import torch.distributed as dist

    from shardlm.comm.collectives import Comm, CommLedger
    from shardlm.parallel.tensor.layers import VocabParallelHead, vocab_parallel_cross_entropy
    from shardlm.parallel.tensor.regions import TPState
    from shardlm.models.placement import even_range

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, vocab, generator=g) * 4
    targets = torch.randint(0, vocab, (3, 5), generator=g)
    if ignored:
        targets[0, :4] = targets[2, 1] = -100
    lo, hi = even_range(vocab, world_size, rank)
    ledger = CommLedger()
    tp = TPState(Comm(dist.group.WORLD, "tp", ledger), sequence_parallel=False)
    head = VocabParallelHead(None, lo, hi, 4, vocab, tp)
    mine = logits[..., lo:hi].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(mine, targets, head)
    loss.backward()
    gathered = head.gather(mine.detach())
    return {"loss": float(loss.detach()), "grad": mine.grad, "lo": lo, "hi": hi, "gathered": gathered,
            "bytes": dict(ledger.bytes), "logits": logits, "targets": targets}



def whole_params(results: list[dict]) -> dict[str, torch.Tensor]:
    """The whole parameters, put together from every tensor-parallel rank's pieces."""
    whole: dict[str, torch.Tensor] = {}
    for result in results:
        for name, piece in result["params"].items():
            split: Split | None = result["splits"].get(name)
            if split is None:
                whole.setdefault(name, piece)
                continue
            target = whole.setdefault(name, torch.full(split.shape, float("nan")))
            at = 0
            for lo, hi in split.ranges:
                target.narrow(split.dim, lo, hi - lo).copy_(piece.narrow(split.dim, at, hi - lo))
                at += hi - lo
    return whole


def tp_world(rank: int, world_size: int, train: list, vocabs: list, runs: list) -> dict:
    """Several independent checks in one spawned world (one set of processes, not one per
    check): `train_cases` of `train`, `cross_entropy_case` of each (vocab, ignored) in `vocabs`,
    and a whole `train_run` (its checkpoints written) of each overrides dict in `runs`."""
    from ckpt_cases import train_run
    from zero_cases import train_cases

    return {"train": train_cases(rank, world_size, train),
            "cross_entropy": [cross_entropy_case(rank, world_size, vocab, ignored) for vocab, ignored in vocabs],
            "runs": [train_run(overrides) for overrides in runs]}
