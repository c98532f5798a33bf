"""Parameters cut by tensor or expert parallelism (placement.Split: where this rank's piece sits
in the whole): the whole tensors put back together (final weights, exports), and an initializer
of whole parameters turned into one of pieces (every layout starts from the same model)."""

from __future__ import annotations

import torch
from torch import nn

from shardlm.models.init import piece_of
from shardlm.models.placement import Split


@torch.no_grad()
def whole_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (CPU, contiguous), by name: a piece cut by tensor or expert
    parallelism (model.tp / model.ep: their `splits`, `comm`, `rank`) put together from its
    group's pieces (each rank places its owned ranges in a zero tensor of the whole shape, and
    the group sums them: each element has one non-zero addend, so the sum is exact), a
    replicated one as it is. A collective over those groups: every rank of them calls.
    Parameters must be materialised (stage 3: inside full_parameters())."""
    owners = [o for o in (getattr(model, "tp", None), getattr(model, "ep", None)) if o is not None]
    out = {}
    for name, param in model.named_parameters():
        owner = next((o for o in owners if name in o.splits), None)
        if owner is None:
            out[name] = param.detach().cpu().contiguous().clone()
            continue
        split = owner.splits[name]
        whole = torch.zeros(split.shape, dtype=param.dtype, device=param.device)
        piece, at = param.detach(), 0
        for i, (lo, hi) in enumerate(split.ranges):
            if owner.rank == 0 or i not in split.copies:
                whole.narrow(split.dim, lo, hi - lo).copy_(piece.narrow(split.dim, at, hi - lo))
            at += hi - lo
        owner.comm.all_reduce(whole).wait()
        out[name] = whole.cpu()
    return out


def sliced(initializer, splits: dict[str, Split]):
    """An initialiser of whole parameters (models/init.py) -> one of this rank's pieces: the
    whole tensor's initial values, cut (or only the piece read, where the initializer can:
    a checkpoint's rows), so every layout starts from the same model."""
    return lambda name: piece_of(initializer, name, splits[name]) if name in splits else initializer(name)
