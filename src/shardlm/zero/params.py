"""ZeRO stage 3: a unit's parameters exist in full only while the unit computes.

Lifecycle of a unit (the FSDP / ZeRO-3 schedule):
  forward pre-hook   all-gather the shards into the flat buffer (or wait for the prefetch),
                     then start gathering the next unit
  forward post-hook  free the flat buffer (reshard_after_forward), and wrap the outputs so
                     that backward reaching them first gathers the unit again
  backward           gather (prefetching the unit before it); when its last gradient has
                     arrived the engine reduce-scatters it and frees the flat buffer
Freeing resizes the flat buffer's storage to zero bytes: the parameter views and the tensors
autograd saved keep pointing at that storage, so after a gather they see the values again.
The root unit (embeddings, head) is the model itself: gathered before the first block and
freed after the head.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.utils._pytree import tree_map



class _GatherBeforeBackward(torch.autograd.Function):
    """Identity in forward; in backward, first makes the producing unit's parameters whole."""

    @staticmethod
    def forward(ctx, gather, x):
        ctx.gather = gather
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.gather()
        return None, grad


class ParamSharding:
    def __init__(self, units: list, opts, store):
        """Each unit gathers over its own group (unit.comm: the shard group, or for an expert
        unit the ranks holding the same experts)."""
        self.units, self.opts = units, opts
        self.store = store
        """Where shards live between gathers (zero/tiers/: resident, cpu or nvme)."""
        self.handles: dict[int, object] = {}  # unit index -> pending all-gather
        self.gathered: set[int] = set()
        self.in_backward: set[int] = set()
        for index, unit in enumerate(units):
            self._free(index)
            unit.module.register_forward_pre_hook(self._pre_forward(index))
            unit.module.register_forward_hook(self._post_forward(index))

    def _storage(self, index: int):
        return self.units[index].flat_param.untyped_storage()

    def _start_gather(self, index: int) -> None:
        if index in self.gathered or index in self.handles or not 0 <= index < len(self.units):
            return
        unit = self.units[index]
        self._storage(index).resize_(unit.flat_param.numel() * unit.flat_param.element_size())
        # Refilling the buffer restores the very values autograd saved: the version counter is
        # captured now and put back once the gather is complete (the backend may write into the
        # buffer on its own thread), or backward would see the parameters as modified in place.
        keep_version = torch.autograd._unsafe_preserve_version_counter(unit.flat_param)
        with keep_version:
            self.handles[index] = (unit.comm.all_gather(unit.flat_param, self.store.fetch(unit)), keep_version)

    def _gather(self, index: int) -> None:
        self._start_gather(index)
        pending = self.handles.pop(index, None)
        if pending is not None:
            handle, keep_version = pending
            with keep_version:
                handle.wait()
            self.store.release(self.units[index])
            self.gathered.add(index)

    def _free(self, index: int) -> None:
        self._storage(index).resize_(0)
        self.gathered.discard(index)

    def _pre_forward(self, index: int):
        def hook(module, args):
            self._gather(index)
            # Not during activation-checkpoint recompute: the next unit's backward is done.
            if self.opts.prefetch and index not in self.in_backward:
                self._start_gather(index + 1)
        return hook

    def _post_forward(self, index: int):
        def hook(module, args, output):
            if index in self.in_backward:  # activation-checkpoint recompute inside backward
                return output
            if not torch.is_grad_enabled():
                self._free(index)
                return output
            if self.opts.reshard_after_forward:
                self._free(index)

            def gather_for_backward():
                self.in_backward.add(index)
                self._gather(index)
                if self.opts.prefetch:
                    self._start_gather(self._next_in_backward(index))

            wrap = lambda t: (_GatherBeforeBackward.apply(gather_for_backward, t)  # noqa: E731
                              if isinstance(t, torch.Tensor) and t.requires_grad else t)
            return tree_map(wrap, output)
        return hook

    def _next_in_backward(self, index: int) -> int:
        """Backward meets the root (0) first, at the head, then the blocks last to first; the
        root stays gathered until the embedding's gradient at the very end."""
        if index == 0:
            return len(self.units) - 1
        return index - 1 if index > 1 else -1

    @contextlib.contextmanager
    def all_gathered(self) -> Iterator[None]:
        for index in range(len(self.units)):
            self._gather(index)
        try:
            yield
        finally:
            for index in range(len(self.units)):
                self._free(index)

    def release_all(self) -> None:
        """End of backward: nothing stays gathered into the next step, where the shards will
        have changed (a stale full copy would silently be used)."""
        for index, (handle, keep_version) in list(self.handles.items()):
            with keep_version:
                handle.wait()
            self.store.release(self.units[index])
        self.handles.clear()
        self.in_backward.clear()
        for index in range(len(self.units)):
            self._free(index)

    def after_backward(self, unit) -> None:
        """The unit's gradients are all in: its full parameters are no longer needed."""
        index = self.units.index(unit)
        self.in_backward.discard(index)
        if index not in self.handles:
            self._free(index)
