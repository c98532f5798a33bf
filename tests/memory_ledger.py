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
    def __init__(self, exclude: tuple[torch.Tensor, ...] = ()):
        """`exclude`: tensors whose storage is never counted (parameters, inputs made before),
        however many views of it the ops return."""
        super().__init__()
        self.tracked: list[weakref.ref] = []
        self.peak = 0
        self.excluded = {t.untyped_storage().data_ptr() for t in exclude}

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
            if storage.data_ptr() not in self.excluded:
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


def decoder_peak_bytes(model, batch: int, seq: int) -> int:
    """Peak bytes of live tensors (parameters excluded) during one forward, loss and backward of
    a shardlm Decoder's blocks, final norm and head, from the first block's input (which counts:
    made outside, added here), without document masks."""
    import torch.nn.functional as F

    d = model.cfg.d_model
    idx = torch.randint(0, model.cfg.vocab_size, (batch, seq))
    x0 = torch.randn(batch, seq, d, dtype=torch.float32, requires_grad=True)
    rope = (model.rope_cos[:seq], model.rope_sin[:seq]) if model.cfg.position == "rope" else None
    with StorageLedger(exclude=(*model.parameters(), *model.buffers(), x0)) as ledger:
        mask = model._attention_mask(None, seq, x0)  # math's causal mask: once per forward
        x = x0
        for block in model.blocks:
            x = block(x, rope) if mask is None else block(x, rope, mask=mask)
        logits = model.head(model.norm_f(x))
        del x
        loss = F.cross_entropy(logits.float().flatten(0, 1), idx.flatten())
        del logits
        torch.autograd.grad(loss, [x0])
    return ledger.peak + x0.numel() * x0.element_size()
