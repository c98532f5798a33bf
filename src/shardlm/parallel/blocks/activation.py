"""Activation checkpointing: trade recomputation in backward for activation memory.

"full" keeps only each block's input and recomputes the whole block in backward (Chen et al.
2016). "selective" (Korthikanti et al. 2022) keeps the outputs of the expensive ops, matmuls and
attention, and recomputes only the cheap element-wise ones (norms, activations, RoPE, residual
adds), so backward does no extra matmul FLOPs.

Each block gets torch's composable, non-reentrant `checkpoint` (forward pre/post hooks), not the
`checkpoint_wrapper` module: the wrapper inserts `_checkpoint_wrapped_module.` into every name the
parent's `named_parameters()` yields (only its `state_dict` hooks strip it), while the hooks leave
the module tree, parameter names and state_dict keys exactly as they were.
"""

from __future__ import annotations

import functools
import logging
import weakref

import torch
from torch import nn
from torch.distributed._composable import checkpoint
import torch.utils.checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from shardlm.launch.allocator import host_tensor
from shardlm.parallel.data.zero.units import unit_modules

logger = logging.getLogger("shardlm")

AC_MODES = ("none", "full", "selective")

_aten = torch.ops.aten
# Ops whose outputs "selective" keeps. `linear` decomposes to mm/addmm before dispatch, so it is
# listed only for backends that keep it whole. Attention ops vary by device; missing ones skipped.
_SAVE_OP_NAMES = (
    "mm", "addmm", "bmm", "linear",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)
SAVE_OPS = frozenset(getattr(_aten, name).default for name in _SAVE_OP_NAMES if hasattr(_aten, name))


def _save_matmuls_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Keep matmul and attention outputs; recompute everything else in backward."""
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_save_matmuls_policy)


def apply_ac(model: nn.Module, mode: str, compiled: bool = False) -> nn.Module:
    """Checkpoint every layer in place ("none" | "full" | "selective"): the blocks of our
    models, the children of the largest nn.ModuleList of any other. `compiled`: the blocks'
    forwards will be compiled (parallel/blocks/compile.py).

    Returns the same model object; with "none" nothing is touched.
    """
    if mode not in AC_MODES:
        raise ValueError(f"activation checkpoint mode {mode!r}; choose one of {', '.join(AC_MODES)}")
    if mode == "none":
        return model
    kwargs = {"context_fn": _selective_context} if mode == "selective" else {}
    blocks = [m for _, m in unit_modules(model)]  # our blocks, or any model's repeated layers
    for block in blocks:
        if mode == "selective" and compiled:
            # The policy picks aten ops; a compiled block runs fused kernels, so the hooks'
            # dispatch mode would see none of them. Inside the forward that is compiled, the
            # compiler traces the checkpoint and its policy instead (torch's selective
            # checkpointing under torch.compile) and keeps what the policy keeps.
            block.forward = functools.partial(torch.utils.checkpoint.checkpoint, block.forward,
                                              use_reentrant=False, **kwargs)
            continue
        checkpoint(block, use_reentrant=False, **kwargs)
    logger.info("activation checkpointing: %s on %d blocks%s", mode, len(blocks),
                " (saving matmul and attention outputs)" if mode == "selective" else "")
    return model


# --- Activation offload -------------------------------------------------------------------------

OFFLOAD_MODES = ("none", "cpu")

FORCE_HOST_COPY = False
"""Test-only: when the device *is* the host (CPU), offload normally keeps each saved tensor where
it is (a copy to the same memory saves nothing). Set True before `apply_offload` runs (in a
spawned rank too) to make every offloaded saved tensor a real, separate host copy, so the pack /
unpack path is exercised and its results can be compared bitwise."""


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage that the view `t` reads: [first, last + 1) (a strided view with
    gaps — q, k, v sliced out of one qkv projection — or an expanded one reads fewer bytes than
    its shape says, or more than its elements)."""
    size = t.element_size()
    reach = sum((n - 1) * abs(step) for n, step in zip(t.shape, t.stride()))
    return t.storage_offset() * size, (t.storage_offset() + reach + 1) * size


class _Offloaded:
    """Bytes of one saved storage in host memory (pinned on CUDA): the whole storage, or the span
    a view reads where that is less than half of it; and once fetched back, the device copy with
    the event that says it is there. Every saved view of those bytes shares this record."""

    __slots__ = ("host", "device", "block", "offloaded", "fetched", "ready", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, block: int, offloaded=None):
        self.host, self.device, self.block, self.offloaded = host, device, block, offloaded
        self.fetched: torch.Tensor | None = None
        self.ready = None


class _View:
    """A saved tensor as packed: its record's bytes, and the view of them it was (dtype, offset,
    shape, strides: the same strides come back, which a compiled graph's backward relies on)."""

    __slots__ = ("record", "dtype", "offset", "size", "stride")

    def __init__(self, record: _Offloaded, t: torch.Tensor, start: int):
        self.record, self.dtype, self.size, self.stride = record, t.dtype, t.size(), t.stride()
        self.offset = (t.storage_offset() * t.element_size() - start) // t.element_size()

    def on(self, data: torch.Tensor) -> torch.Tensor:
        """The view rebuilt over `data` (the record's bytes, on the host or fetched back)."""
        out = torch.empty(0, dtype=self.dtype, device=data.device)
        return out.set_(data.untyped_storage(), self.offset, self.size, self.stride)


class ActivationOffload:
    """saved_tensors_hooks around the forward of each chosen block: what autograd saves for
    backward inside it is packed to host memory and unpacked back before its backward op uses it.

    - Parameters and buffers (the module's own storage, checked by storage data_ptr at pack time,
      so ZeRO-3's freshly gathered flat buffers are recognised) are never copied: autograd keeps
      a reference and ZeRO-3 refills their storage before backward.
    - On CUDA: each pack copies device -> pinned host on a side stream (after the compute stream's
      pending work, recorded with an event; the device tensor is `record_stream`ed so its memory
      is not reused before the copy ends). The first unpack of block b queues block b-1's host
      -> device copies on the side stream (prefetch: its tensors arrive while block b's backward
      computes); each unpack makes the compute stream wait for its tensor's event only.
      At the end of block b's forward the host waits for block b-1's copies (they ran beside
      block b's compute): a device tensor is reusable only once its copy is done, and a host
      that ran ahead of copies slower than the compute would allocate every block's activations
      anyway (measured on an H200 with a small model: the peak fell by 0.41 of the bytes moved
      without this bound).
    - What moves is storage, not tensors: a saved view takes its whole storage to the host
      (or, where it reads less than half of it, just the bytes it reads), once per block
      while the first view packed lives (a weak reference, so a freed tensor's reused address
      is never taken for it), and comes back as the same view (dtype, offset, shape and
      strides: a compiled graph's backward checks them). The attention probabilities saved as
      (B, h, T, T) and as (B·h, T, T), q, k, v sliced out of one projection, a norm's output
      read by several linears: one copy each, the bytes the device frees. Measured on an H200
      (bench/gpu_check.py, 2026-11-29): copied tensor by tensor, the bytes moved were 2.4x the
      peak's fall, and compiled flex attention's backward refused the compact copies' strides.
    - On a CPU device the host is the device: pack returns the tensor itself (nothing moves,
      nothing is counted as offloaded), unless FORCE_HOST_COPY (tests) makes it a separate copy.
    - With recomputation (apply_ac, activation.checkpoint): a checkpointed block keeps only its
      inputs, which torch's checkpoint saves in its own pre-hook through the saved-tensor hooks
      then active, and everything inside the block goes to the checkpoint's own (inner) hooks.
      These hooks come first among the block's pre-hooks, so they meet those inputs and offload
      them (what Megatron-LM offloads with recomputation); the recomputation, a forward run
      inside backward, enters no hooks here: its saved tensors are the checkpoint's. With
      'selective' the outputs the policy keeps are the checkpoint's cache, not saved tensors:
      they stay on the device.
    """

    def __init__(self, blocks: list[nn.Module], force_copy: bool = False):
        self.blocks = blocks
        self.force_copy = force_copy
        self.packed_bytes = 0
        """Bytes copied to host memory so far (a counter for tests and logs)."""
        self.packed_tensors = 0
        self.deduplicated = 0
        """Saves that reused the record of a tensor this block had already packed."""
        self.skipped_params = 0
        """Saved tensors left in place because they are the block's parameters or buffers."""
        self.kept = 0
        """Saved tensors left in place because the device is the host (CPU, no forced copy)."""
        self._active: int | None = None  # index of the block whose forward runs
        self._own: set[int] | None = None  # its parameters' and buffers' storage pointers
        self._groups: dict[int, list] = {}  # block index -> weak references to its records
        self._seen: dict[tuple, tuple] = {}  # this block's packs: key -> (weakref(tensor), record)
        self._stream = None
        self._in_flight = None  # the event after the previous block's device -> host copies
        self._handles = []
        for index, block in enumerate(blocks):
            # First of the block's pre-hooks: a checkpoint's (apply_ac) saves the block's inputs
            # inside its own pre-hook, and those saves must meet these hooks.
            self._handles.append(block.register_forward_pre_hook(self._enter(index), prepend=True))
            self._handles.append(block.register_forward_hook(self._exit(index), always_call=True))

    def _enter(self, index: int):
        def hook(module, args):
            if torch._C._current_graph_task_id() != -1:
                # A forward inside backward is a checkpoint's recomputation: what it saves belongs
                # to the checkpoint (its inner hooks), not to offload.
                return
            self._active, self._own = index, None
            self._groups[index] = []
            self._seen.clear()
            ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            ctx.__enter__()
            module._shardlm_offload_ctx = ctx
        return hook

    def _exit(self, index: int):
        def hook(module, args, output):
            ctx = module.__dict__.pop("_shardlm_offload_ctx", None)
            if ctx is None:  # a recomputation (see _enter)
                return
            ctx.__exit__(None, None, None)
            self._active, self._own = None, None
            self._seen.clear()
            if self._stream is not None:  # CUDA: this block's copies queued; bound those in flight
                done = torch.cuda.Event()
                done.record(self._stream)
                if self._in_flight is not None:
                    self._in_flight.synchronize()
                self._in_flight = done
        return hook

    def _own_storage(self) -> set[int]:
        if self._own is None:  # at the first pack: after ZeRO-3's pre-hook gathered the block
            block = self.blocks[self._active]
            self._own = {t.untyped_storage().data_ptr()
                         for t in (*block.parameters(), *block.buffers()) if t.device.type != "meta"}
        return self._own

    def _pack(self, t: torch.Tensor):
        if self._active is None or t.device.type == "meta" or t.numel() == 0:
            return t
        storage = t.untyped_storage()
        if storage.data_ptr() in self._own_storage():
            self.skipped_params += 1
            return t
        cuda = t.device.type == "cuda"
        if not (cuda or self.force_copy):
            self.kept += 1
            return t
        start, stop = _byte_span(t)
        if 2 * (stop - start) >= storage.nbytes():  # most of it: the whole storage, once
            start, stop = 0, storage.nbytes()
        key = (storage.data_ptr(), start, stop, t._version)
        seen = self._seen.get(key)
        if seen is not None and seen[0]() is not None:  # alive: the address is still its own
            self.deduplicated += 1
            return _View(seen[1], t, start)
        record = self._copy_out(storage, start, stop, t.device)
        self._groups[self._active].append(weakref.ref(record))
        self._seen[key] = (weakref.ref(t), record)
        self.packed_bytes += stop - start
        self.packed_tensors += 1
        return _View(record, t, start)

    def _copy_out(self, storage, start: int, stop: int, device: torch.device) -> _Offloaded:
        """Bytes [start, stop) of a device storage to host memory (on CUDA: on the side stream,
        after the compute stream's pending work; the storage is `record_stream`ed so its memory
        is not reused before the copy ends)."""
        src = torch.empty(0, dtype=torch.uint8, device=device).set_(storage, start, (stop - start,), (1,))
        cuda = device.type == "cuda"
        host = host_tensor((stop - start,), torch.uint8, pinned=cuda)
        event = None
        if cuda:
            stream = self._side_stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                host.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            src.record_stream(stream)
        else:
            host.copy_(src)
        return _Offloaded(host, device, self._active, event)

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        record = packed.record
        if record.device.type != "cuda":  # forced copy on a CPU device: host memory is device memory
            return packed.on(record.host)
        self._prefetch(record.block - 1)
        self._fetch(record)
        current = torch.cuda.current_stream(record.device)
        current.wait_event(record.ready)
        # kept on the record (the host copy too: a retained graph may unpack again) while a view
        # of it is saved: the record goes when autograd frees the last of them
        record.fetched.record_stream(current)  # allocated on the side stream, used on the compute stream
        return packed.on(record.fetched)

    def _side_stream(self, device: torch.device):
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _fetch(self, record: _Offloaded) -> None:
        if record.fetched is not None:
            return
        stream = self._side_stream(record.device)
        with torch.cuda.stream(stream):
            stream.wait_event(record.offloaded)
            out = torch.empty_like(record.host, device=record.device)
            out.copy_(record.host, non_blocking=True)
            record.ready = torch.cuda.Event()
            record.ready.record(stream)
        record.fetched = out

    def _prefetch(self, block: int) -> None:
        """Queue the host -> device copies of `block`'s saved tensors (backward reaches it next).
        Once per forward of that block; records already freed (their backward ran) are skipped."""
        refs = self._groups.pop(block, None)
        for ref in refs or ():
            record = ref()
            if record is not None:
                self._fetch(record)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def apply_offload(model: nn.Module, mode: str, blocks: int = 0) -> ActivationOffload | None:
    """Offload the saved activations of the first `blocks` blocks (0 = every block) to host memory
    ("none" | "cpu"). The first blocks are the ones whose activations wait longest (through the
    rest of forward and backward); the last block's are used at once. Returns the hooks' owner
    (its counters say what moved), also kept as `model._activation_offload`; None with "none"."""
    if mode not in OFFLOAD_MODES:
        raise ValueError(f"activation offload {mode!r}; choose one of {', '.join(OFFLOAD_MODES)}")
    if mode == "none":
        return None
    every = [m for _, m in unit_modules(model)]
    chosen = every[:blocks] if blocks else every
    offload = ActivationOffload(chosen, force_copy=FORCE_HOST_COPY)
    model._activation_offload = offload
    logger.info("activation offload: saved activations of %d of %d blocks to host memory%s",
                len(chosen), len(every), " (forced copies)" if FORCE_HOST_COPY else "")
    return offload
