"""What a piece of code dispatches, op by op (a TorchDispatchMode): the planner's memory-bound
counts (planner/memory_bound.py) are checked against it. Importable by spawned ranks."""

from __future__ import annotations


def dispatched(fn) -> list[tuple[str, bool, int, int, int, tuple]]:
    """Run fn() under a dispatch tracker: per op (name, whether its outputs are views of its
    inputs, input elements, output elements, output bytes, the first output's shape)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    rows = []

    class Tracker(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            storages = {t.untyped_storage().data_ptr() for t in ins}
            view = bool(outs) and all(t.untyped_storage().data_ptr() in storages for t in outs)
            rows.append((func.overloadpacket.__name__, view, sum(t.numel() for t in ins),
                         sum(t.numel() for t in outs), sum(t.numel() * t.element_size() for t in outs),
                         tuple(outs[0].shape) if outs else ()))
            return out

    with Tracker():
        fn()
    return rows
