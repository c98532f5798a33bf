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

Under pipeline parallelism (`hold_for_step`) a stage runs the forwards and backwards of many
micro-batches interleaved (parallel/pipeline/stages.py), so a unit is gathered at its first forward of
the step and stays whole through every micro-batch until the step's last backward is done
(ZeroEngine.finish_backward: release_all), as torchtitan's FSDP x PP does it (reshard after
forward and after backward off, gradients reduce-scattered after the last micro-batch): one
all-gather and one reduce-scatter of the stage's parameters per step, the stage's parameters
whole for the step. parallel.reshard_after_forward applies to runs without a pipeline.

A unit of FP8 linear weights (precision.fp8_all_gather: unit.fp8_gather) is gathered in E4M3
instead, into its own byte buffer, by the same hooks (parallel/data/zero/fp8_gather.py); a forward's gather
computes the weights' scales, a backward's reuses them. Its bf16 flat buffer is gathered only
inside all_gathered (whole parameters in the compute dtype).
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
    def __init__(self, units: list, opts, store, hold_for_step: bool = False):
        """`units`: every unit in forward order, a frozen unit right after the trainable unit of
        the same module (parallel/data/zero/units.py); the hooks work per module ("slot"), gathering all of
        its units. Each unit gathers over its own group (unit.comm: the shard group, or for an
        expert unit the ranks holding the same experts). `hold_for_step`: a pipeline stage's
        units stay gathered from their first forward of a step to release_all (module doc)."""
        self.units, self.opts = units, opts
        self.hold_for_step = hold_for_step
        self.store = store
        """Where shards live between gathers (parallel/data/zero/tiers/: resident, cpu or nvme)."""
        self.slots: list[list[int]] = []  # per module, its units' indices
        for i, unit in enumerate(units):
            if self.slots and units[self.slots[-1][0]].module is unit.module:
                self.slots[-1].append(i)
            else:
                self.slots.append([i])
        self.index = {id(u): i for i, u in enumerate(units)}
        self.slot_of = {i: s for s, members in enumerate(self.slots) for i in members}
        inner = [{id(m) for m in units[members[0]].module.modules()} for members in self.slots]
        # ancestors[s]: the slots whose module holds slot s's (s itself included)
        self.ancestors = [{t for t in range(len(self.slots)) if id(units[self.slots[s][0]].module) in inner[t]}
                          for s in range(len(self.slots))]
        self.handles: dict[int, object] = {}  # unit index -> pending all-gather
        self.gathered: set[int] = set()  # unit indices
        self.in_backward: set[int] = set()  # slots
        self.frozen_held: set[int] = set()  # slots whose frozen units stay gathered for backward
        self.whole = False  # inside all_gathered: every unit in the compute dtype, fp8 ones too
        for index in range(len(units)):
            self._free_unit(index)
        for slot, members in enumerate(self.slots):
            module = units[members[0]].module
            module.register_forward_pre_hook(self._pre_forward(slot))
            module.register_forward_hook(self._post_forward(slot))

    def _storage(self, index: int):
        return self.units[index].flat_param.untyped_storage()

    def _start_gather(self, slot: int, for_backward: bool = False) -> None:
        if not 0 <= slot < len(self.slots):
            return
        for index in self.slots[slot]:
            if index in self.gathered or index in self.handles:
                continue
            unit = self.units[index]
            if unit.fp8_gather is not None and not self.whole:  # E4M3 bytes, their own buffer
                handle = unit.fp8_gather.start(unit.comm, self.store.fetch(unit), rescale=not for_backward)
                self.handles[index] = (handle, contextlib.nullcontext())
                continue
            self._storage(index).resize_(unit.flat_param.numel() * unit.flat_param.element_size())
            # Refilling the buffer restores the very values autograd saved: the version counter
            # is captured now and put back once the gather is complete (the backend may write
            # into the buffer on its own thread), or backward would see the parameters as
            # modified in place.
            keep_version = torch.autograd._unsafe_preserve_version_counter(unit.flat_param)
            with keep_version:
                self.handles[index] = (unit.comm.all_gather(unit.flat_param, self.store.fetch(unit)), keep_version)

    def _gather(self, slot: int, for_backward: bool = False) -> None:
        self._start_gather(slot, for_backward)
        for index in self.slots[slot]:
            pending = self.handles.pop(index, None)
            if pending is not None:
                handle, keep_version = pending
                with keep_version:
                    handle.wait()
                self.store.release(self.units[index])
                self.gathered.add(index)

    def _free_unit(self, index: int) -> None:
        self._storage(index).resize_(0)
        if self.units[index].fp8_gather is not None:
            self.units[index].fp8_gather.free()
        self.gathered.discard(index)

    def _free(self, slot: int) -> None:
        for index in self.slots[slot]:
            self._free_unit(index)

    def _pre_forward(self, slot: int):
        def hook(module, args):
            self._gather(slot)
            # Not during activation-checkpoint recompute: the next unit's backward is done.
            if self.opts.prefetch and slot not in self.in_backward:
                self._start_gather(slot + 1)
        return hook

    def _post_forward(self, slot: int):
        def hook(module, args, output):
            if slot in self.in_backward:  # activation-checkpoint recompute inside backward
                return output
            if not torch.is_grad_enabled():
                self._free(slot)
                return output
            if self.hold_for_step:  # whole until the step's last backward: nothing to gather again
                return output
            if self.opts.reshard_after_forward:
                self._free(slot)

            def gather_for_backward():
                self._release_frozen(slot)
                self.in_backward.add(slot)
                self._gather(slot, for_backward=True)
                if any(self.units[i].frozen for i in self.slots[slot]):
                    self.frozen_held.add(slot)
                if self.opts.prefetch:
                    self._start_gather(self._next_in_backward(slot), for_backward=True)

            wrap = lambda t: (_GatherBeforeBackward.apply(gather_for_backward, t)  # noqa: E731
                              if isinstance(t, torch.Tensor) and t.requires_grad else t)
            return tree_map(wrap, output)
        return hook

    def _release_frozen(self, slot: int) -> None:
        """Backward reached `slot`'s output: every module whose backward began before and that
        does not hold `slot`'s is done, frozen parameters included (a frozen weight is used
        only on the way to its module's input gradient, which this output's gradient needs).
        Trainable units are freed as soon as their gradients are in (after_backward); a frozen
        one has no gradient to say so, so it is freed here."""
        for held in [h for h in self.frozen_held if h not in self.ancestors[slot]]:
            self.frozen_held.discard(held)
            for index in self.slots[held]:
                if self.units[index].frozen and index not in self.handles:
                    self._free_unit(index)

    def _next_in_backward(self, slot: int) -> int:
        """Backward meets the root (0) first, at the head, then the blocks last to first; the
        root stays gathered until the embedding's gradient at the very end."""
        if slot == 0:
            return len(self.slots) - 1
        return slot - 1 if slot > 1 else -1

    @contextlib.contextmanager
    def all_gathered(self) -> Iterator[None]:
        """Every unit whole in the compute dtype (FP8 weights too: their bf16 values) inside."""
        self.whole = True
        for index in [i for i in self.handles if self.units[i].fp8_gather is not None]:
            handle, _ = self.handles.pop(index)  # an E4M3 gather still in flight (a prefetch)
            handle.wait()
            self.store.release(self.units[index])
        for index in [i for i in self.gathered if self.units[i].fp8_gather is not None]:
            self._free_unit(index)  # gathered in E4M3: gathered again in the compute dtype
        for slot in range(len(self.slots)):
            self._gather(slot)
        try:
            yield
        finally:
            for slot in range(len(self.slots)):
                self._free(slot)
            self.whole = False

    def release_all(self) -> None:
        """End of backward: nothing stays gathered into the next step, where the shards will
        have changed (a stale full copy would silently be used)."""
        for index, (handle, keep_version) in list(self.handles.items()):
            with keep_version:
                handle.wait()
            self.store.release(self.units[index])
        self.handles.clear()
        self.in_backward.clear()
        self.frozen_held.clear()
        for index in range(len(self.units)):
            self._free_unit(index)

    def after_backward(self, unit) -> None:
        """The unit's gradients are all in: its full parameters are no longer needed (held for
        the step: the next micro-batch's forward or backward needs them, release_all frees)."""
        if self.hold_for_step:
            return
        index = self.index[id(unit)]
        self.in_backward.discard(self.slot_of[index])
        if index not in self.handles:
            self._free_unit(index)
