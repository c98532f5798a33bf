"""A byte ledger of live tensor storage, for tests that bound a phase's peak memory.

Every tensor an aten op returns inside the ledger is tracked (weakly); the live bytes are the
sizes, at that moment, of the distinct storages of tracked tensors still alive. A storage freed
by resizing it to zero (ZeRO-3's release of a gathered unit) counts zero from then on. RSS
cannot show this on tiny models (torch's own ~300 MB dominate it) and glibc keeps freed memory
mapped; this counts what the tensors hold.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class StorageLedger(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.tracked: list[weakref.ref] = []
        self.peak = 0

    def track(self, *tensors: torch.Tensor) -> None:
        """Count tensors made outside an aten op (an nn.Parameter wraps its data in a new
        tensor object: the op's output dies, the storage lives on in the parameter)."""
        self.tracked += [weakref.ref(t) for t in tensors]
        self.peak = max(self.peak, self.live_bytes())

    def live_bytes(self) -> int:
        alive = [t for t in (r() for r in self.tracked) if t is not None]
        self.tracked = [weakref.ref(t) for t in alive]
        storages = {}
        for t in alive:
            storage = t.untyped_storage()
            storages[storage._cdata] = storage.nbytes()
        return sum(storages.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        fresh = [t for t in tree_flatten(out)[0]
                 if isinstance(t, torch.Tensor) and not t.is_meta and t.device.type != "meta"]
        if fresh:
            self.tracked += [weakref.ref(t) for t in fresh]
            self.peak = max(self.peak, self.live_bytes())
        return out
