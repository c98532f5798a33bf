"""Where the optimizer's state lives: the offload tiers of ZeRO-Offload (Ren et al. 2021) and
ZeRO-Infinity (Rajbhandari et al. 2021), chosen once when the engine is built.

    device  fp32 masters and AdamW moments next to the parameters (no offload)
    cpu     in host memory (pinned where CUDA exists): the gradient shard comes over, torch's
            fused AdamW runs on the CPU, the updated parameters go back
    nvme    in files under zero.nvme_path. The step streams them in chunks through a fixed ring
            of aligned buffers: read chunk k+1 while updating chunk k while writing chunk k-1,
            so host memory stays `nvme_buffers` chunks whatever the model's size, and the
            disk is busy in both directions while the CPU computes

Every tier runs the same kernel (torch's fused AdamW; it is element-wise, so a chunked step is
bitwise the whole-tensor step) over the same segments: contiguous pieces of this rank's shard,
one per (unit, weight-decay group). A tier is given each segment's target — the compute-dtype
parameter slice it must refresh after the step — and its fp32 initial values.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from shardlm.config import TrainConfig
from shardlm.optim import init_adam_state

log = logging.getLogger("shardlm")

ALIGN = 4096
"""O_DIRECT needs buffer addresses, file offsets and lengths aligned to the logical block."""


@dataclass
class TierStats:
    """What the last step moved and how long it took (telemetry)."""

    read_bytes: int = 0
    write_bytes: int = 0
    step_s: float = 0.0
    io_wait_s: float = 0.0
    """Time the step waited for reads or writes (the part the pipeline did not hide)."""


class InMemoryTier:
    """Device or cpu: masters and moments as tensors on `home`, stepped by torch's AdamW.
    When the master would be an exact copy of its target (same dtype, same device) the target
    itself is the master (no second copy)."""

    def __init__(self, home: torch.device, master_dtype: torch.dtype, may_alias: bool = True):
        self.home, self.master_dtype, self.may_alias = home, master_dtype, may_alias
        self.masters: list[nn.Parameter] = []
        self.targets: list[torch.Tensor] = []
        self.decay: list[bool] = []
        self.aliased: list[bool] = []
        self.stats = TierStats()

    def add(self, target: torch.Tensor, initial: torch.Tensor, decay: bool) -> None:
        alias = self.may_alias and target.dtype == self.master_dtype and target.device == self.home
        if alias:
            master = target
        else:
            master = torch.empty(target.shape, dtype=self.master_dtype, device=self.home,
                                 pin_memory=self.home.type == "cpu" and torch.cuda.is_available())
            master.copy_(initial)
        self.masters.append(nn.Parameter(master))
        self.targets.append(target)
        self.decay.append(decay)
        self.aliased.append(alias)

    def build_optimizer(self, train: TrainConfig) -> None:
        groups = [{"params": [m for m, d in zip(self.masters, self.decay) if d], "weight_decay": train.weight_decay},
                  {"params": [m for m, d in zip(self.masters, self.decay) if not d], "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=train.lr, betas=(train.beta1, train.beta2),
                                           eps=train.eps, fused=True)
        init_adam_state(self.optimizer)

    def step(self, grads: list[torch.Tensor]) -> None:
        start = time.perf_counter()
        for master, grad in zip(self.masters, grads):
            master.grad = grad.to(master.device, master.dtype, non_blocking=True)
        self.optimizer.step()
        for master, target, alias in zip(self.masters, self.targets, self.aliased):
            master.grad = None
            if not alias:
                target.copy_(master.detach(), non_blocking=True)
        self.stats = TierStats(step_s=time.perf_counter() - start)

    def segment_state(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        state = self.optimizer.state[self.masters[i]]
        return self.masters[i].detach(), state["exp_avg"], state["exp_avg_sq"]

    def refresh_targets(self) -> None:
        """After a checkpoint load wrote the masters: the targets from them."""
        for master, target, alias in zip(self.masters, self.targets, self.aliased):
            if not alias:
                target.copy_(master.detach())

    def held_bytes(self) -> dict[str, int]:
        """Optimizer-state bytes by where they live (aliased masters are the parameters')."""
        nbytes = sum(m.numel() * m.element_size() for m, a in zip(self.masters, self.aliased) if not a)
        nbytes += sum(t.numel() * t.element_size() for s in self.optimizer.state.values()
                      for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
        return {("cpu" if self.home.type == "cpu" else "device"): nbytes}


# ---------------------------------------------------------------------------------------------
# NVMe


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class _AlignedBuffer:
    """Page-aligned host memory (an anonymous mapping) seen as a tensor."""

    def __init__(self, nbytes: int, dtype: torch.dtype):
        self._map = mmap.mmap(-1, _aligned(nbytes))
        self.tensor = torch.frombuffer(self._map, dtype=dtype)


class _File:
    """A state file read and written with O_DIRECT where the file system allows it (no page
    cache: the bandwidth is the disk's, and host memory is ours alone to account)."""

    def __init__(self, path: Path):
        self.path = path
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
        try:
            self.fd = os.open(path, flags | getattr(os, "O_DIRECT", 0))
            self.direct = hasattr(os, "O_DIRECT")
        except OSError:  # e.g. tmpfs: buffered I/O, the page cache then holds what we wrote
            self.fd = os.open(path, flags)
            self.direct = False

    def read(self, offset: int, buffer: _AlignedBuffer, nbytes: int) -> int:
        view = memoryview(buffer._map)[:_aligned(nbytes)]
        return os.preadv(self.fd, [view], offset)

    def write(self, offset: int, buffer: _AlignedBuffer, nbytes: int) -> int:
        view = memoryview(buffer._map)[:_aligned(nbytes)]
        return os.pwritev(self.fd, [view], offset)

    def close(self) -> None:
        os.close(self.fd)
        self.path.unlink(missing_ok=True)


@dataclass
class _Segment:
    target: torch.Tensor
    decay: bool
    offset: int
    """Element offset in each state file (ALIGN-aligned in bytes)."""
    numel: int


@dataclass
class _Slot:
    """One ring position: a chunk's master and both moments, plus its gradient in fp32."""

    master: _AlignedBuffer
    exp_avg: _AlignedBuffer
    exp_avg_sq: _AlignedBuffer
    grad: torch.Tensor
    pending_write: Future | None = None


class StreamedAdamW:
    """The part of torch's Optimizer interface the loop and checkpoints use — param_groups
    (lr, betas, eps, weight_decay) and a step counter — for state that is not in memory."""

    def __init__(self, train: TrainConfig):
        common = dict(lr=train.lr, betas=(train.beta1, train.beta2), eps=train.eps, params=[])
        self.param_groups = [{**common, "weight_decay": train.weight_decay},
                             {**common, "weight_decay": 0.0}]
        self.state = {0: {"step": torch.zeros((), dtype=torch.float32)}}


class NvmeTier:
    """Masters and moments in three files (master, exp_avg, exp_avg_sq) on `directory`."""

    name = "nvme"

    def __init__(self, directory: Path, master_dtype: torch.dtype, chunk_bytes: int, buffers: int):
        directory.mkdir(parents=True, exist_ok=True)
        self.directory, self.master_dtype = directory, master_dtype
        self.itemsize = torch.empty((), dtype=master_dtype).element_size()
        self.chunk = max(ALIGN, chunk_bytes // ALIGN * ALIGN) // self.itemsize  # elements
        self.files = {k: _File(directory / f"{k}.bin") for k in ("master", "exp_avg", "exp_avg_sq")}
        self.segments: list[_Segment] = []
        self.size = 0  # elements per file, with alignment padding
        self.n_buffers = max(3, buffers)
        self.slots: list[_Slot] = []
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="nvme-read")
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="nvme-write")
        self.stats = TierStats()
        # The files are scratch space: gone when the tier is (or the process ends normally).
        weakref.finalize(self, _close_files, list(self.files.values()), self.reader, self.writer)

    @property
    def direct_io(self) -> bool:
        return self.files["master"].direct

    def _slot(self, i: int) -> _Slot:
        if not self.slots:
            nbytes = self.chunk * self.itemsize
            self.slots = [_Slot(*(_AlignedBuffer(nbytes, self.master_dtype) for _ in range(3)),
                                grad=torch.empty(self.chunk, dtype=self.master_dtype))
                          for _ in range(self.n_buffers)]
        return self.slots[i % self.n_buffers]

    def add(self, target: torch.Tensor, initial: torch.Tensor, decay: bool) -> None:
        """Write the segment's initial master to its file, chunk by chunk (the moments start
        as zeros: the files' holes, see build_optimizer)."""
        segment = _Segment(target, decay, self.size, target.numel())
        self.segments.append(segment)
        self.size += _aligned(segment.numel * self.itemsize) // self.itemsize
        slot = self._slot(0)
        for start in range(0, segment.numel, self.chunk):
            n = min(self.chunk, segment.numel - start)
            slot.master.tensor[:n].copy_(initial[start:start + n])
            self.files["master"].write((segment.offset + start) * self.itemsize, slot.master,
                                       n * self.itemsize)

    def build_optimizer(self, train: TrainConfig) -> None:
        for f in self.files.values():  # sparse: unwritten ranges read as zeros
            os.ftruncate(f.fd, self.size * self.itemsize)
        self.optimizer = StreamedAdamW(train)
        log.info("nvme offload: %.1f MB of optimizer state in %s (%s I/O), %d buffers of %.1f MB",
                 3 * self.size * self.itemsize / 1e6, self.directory,
                 "direct" if self.direct_io else "buffered", self.n_buffers,
                 3 * self.chunk * self.itemsize / 1e6)

    def _chunks(self) -> list[tuple[_Segment, int, int]]:
        return [(seg, a, min(a + self.chunk, seg.numel))
                for seg in self.segments for a in range(0, seg.numel, self.chunk)]

    def _io(self, op: str, slot: _Slot, seg: _Segment, a: int, b: int) -> int:
        at, nbytes = (seg.offset + a) * self.itemsize, (b - a) * self.itemsize
        for key in ("master", "exp_avg", "exp_avg_sq"):
            getattr(self.files[key], op)(at, getattr(slot, key), nbytes)
        return 3 * _aligned(nbytes)

    def step(self, grads: list[torch.Tensor]) -> None:
        """AdamW over every chunk: read ahead one chunk, write behind, compute in between."""
        start = time.perf_counter()
        stats = TierStats()
        step_count = self.optimizer.state[0]["step"]
        step_count += 1
        grad_of = {id(seg): g for seg, g in zip(self.segments, grads)}
        chunks = self._chunks()
        reads: dict[int, Future] = {}

        def submit_read(k: int) -> None:
            slot = self._slot(k)
            if slot.pending_write is not None:  # the ring wrapped: that write must land first
                waited = time.perf_counter()
                stats.write_bytes += slot.pending_write.result()
                stats.io_wait_s += time.perf_counter() - waited
                slot.pending_write = None
            reads[k] = self.reader.submit(self._io, "read", slot, *chunks[k])

        if chunks:
            submit_read(0)
        for k, (seg, a, b) in enumerate(chunks):
            if k + 1 < len(chunks):
                submit_read(k + 1)
            waited = time.perf_counter()
            stats.read_bytes += reads.pop(k).result()
            stats.io_wait_s += time.perf_counter() - waited
            slot, n = self._slot(k), b - a
            group = self.optimizer.param_groups[0 if seg.decay else 1]
            grad = slot.grad[:n]
            grad.copy_(grad_of[id(seg)][a:b])
            master = slot.master.tensor[:n]
            torch._fused_adamw_([master], [grad], [slot.exp_avg.tensor[:n]], [slot.exp_avg_sq.tensor[:n]],
                                [], [step_count], lr=group["lr"], beta1=group["betas"][0],
                                beta2=group["betas"][1], weight_decay=group["weight_decay"],
                                eps=group["eps"], amsgrad=False, maximize=False)
            seg.target[a:b].copy_(master)
            slot.pending_write = self.writer.submit(self._io, "write", slot, seg, a, b)
        waited = time.perf_counter()
        for slot in self.slots:
            if slot.pending_write is not None:
                stats.write_bytes += slot.pending_write.result()
                slot.pending_write = None
        stats.io_wait_s += time.perf_counter() - waited
        stats.step_s = time.perf_counter() - start
        self.stats = stats

    def segment_state(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The segment's state as file-backed tensors (shared mappings: a checkpoint reads them
        through the page cache, a load writes through it; the step's direct I/O sees both)."""
        seg = self.segments[i]
        return tuple(torch.from_file(str(self.files[k].path), shared=True, size=self.size,
                                     dtype=self.master_dtype)[seg.offset:seg.offset + seg.numel]
                     for k in ("master", "exp_avg", "exp_avg_sq"))

    def refresh_targets(self) -> None:
        for i, seg in enumerate(self.segments):
            seg.target.copy_(self.segment_state(i)[0])

    def held_bytes(self) -> dict[str, int]:
        return {"nvme": 3 * self.size * self.itemsize}



def _close_files(files: list[_File], *pools: ThreadPoolExecutor) -> None:
    for pool in pools:
        pool.shutdown()
    for f in files:
        f.close()


def build_tier(kind: str, device: torch.device, master_dtype: torch.dtype, directory: Path,
               chunk_bytes: int, buffers: int, params_offloaded: bool = False):
    """The tier `zero.offload_optimizer` names. When the parameter shards themselves leave
    memory (offload_params = 'nvme') a master can no longer be the parameter it updates."""
    if kind == "nvme":
        return NvmeTier(directory, master_dtype, chunk_bytes, buffers)
    return InMemoryTier(torch.device("cpu") if kind == "cpu" else device, master_dtype,
                        may_alias=not params_offloaded)


# ---------------------------------------------------------------------------------------------
# Parameter shards (stage 3): `zero.offload_params`


class ResidentParams:
    """'none': each unit's parameter shard stays where it is."""

    def fetch(self, unit) -> torch.Tensor:
        """The shard, ready to be the source of the unit's all-gather."""
        return unit.shard_param

    def release(self, unit) -> None:
        """The gather that needed the shard is complete."""

    def materialize_all(self) -> None:
        """Every shard in memory (the optimizer step writes them)."""

    def store_all(self) -> None:
        """The step is done: shards back to their tier."""

    def held_bytes(self) -> dict[str, int]:
        return {}

    def take_io_bytes(self) -> tuple[int, int]:
        """(read, written) bytes since the last call."""
        return 0, 0


class HostParams(ResidentParams):
    """'cpu': each shard in (pinned) host memory, on the device only from a gather's start to
    its end and during the optimizer step — the same lifecycle as FileParams, with host memory
    for the file. On a CPU-only machine the host memory is the device's: nothing moves."""

    def __init__(self, units: list, device: torch.device):
        self.units, self.moves = units, device.type != "cpu"
        self.host: dict[int, torch.Tensor] = {}
        if self.moves:
            for unit in units:
                self.host[id(unit)] = unit.shard_param.detach().to("cpu").pin_memory()
                unit.shard_param.untyped_storage().resize_(0)

    def _read(self, unit) -> None:
        param = unit.shard_param
        param.untyped_storage().resize_(param.numel() * param.element_size())
        param.copy_(self.host[id(unit)], non_blocking=True)

    def fetch(self, unit) -> torch.Tensor:
        if self.moves:
            self._read(unit)
        return unit.shard_param

    def release(self, unit) -> None:
        if self.moves:
            unit.shard_param.untyped_storage().resize_(0)

    def materialize_all(self) -> None:
        for unit in self.units if self.moves else ():
            self._read(unit)

    def store_all(self) -> None:
        for unit in self.units if self.moves else ():
            self.host[id(unit)].copy_(unit.shard_param)
            unit.shard_param.untyped_storage().resize_(0)

    def held_bytes(self) -> dict[str, int]:
        return {"cpu": sum(t.numel() * t.element_size() for t in self.host.values())}


class FileParams(ResidentParams):
    """'nvme': each shard in a file, in memory only from a gather's start to its end and
    during the optimizer step. Freeing resizes the shard's storage to zero bytes, so the views
    the optimizer tier holds stay valid and see the values again after a read."""

    def __init__(self, units: list, directory: Path):
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / "params.bin"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        weakref.finalize(self, _close_params, self.fd, self.path)
        self.units, self.offsets, at = units, {}, 0
        self.read_bytes = self.write_bytes = 0
        for unit in units:
            self.offsets[id(unit)] = at
            at += _aligned(self._nbytes(unit))
            self._write(unit)
            self._free(unit)
        self.total = at

    @staticmethod
    def _nbytes(unit) -> int:
        return unit.shard_param.numel() * unit.shard_param.element_size()

    @classmethod
    def _bytes_of(cls, unit) -> memoryview:
        # A raw view of the storage (not .numpy(), which would pin the storage's size).
        return memoryview((ctypes.c_char * cls._nbytes(unit)).from_address(unit.shard_param.data_ptr())).cast("B")

    def _write(self, unit) -> None:
        self.write_bytes += os.pwritev(self.fd, [self._bytes_of(unit)], self.offsets[id(unit)])

    def _free(self, unit) -> None:
        unit.shard_param.untyped_storage().resize_(0)

    def _read(self, unit) -> None:
        unit.shard_param.untyped_storage().resize_(self._nbytes(unit))
        self.read_bytes += os.preadv(self.fd, [self._bytes_of(unit)], self.offsets[id(unit)])

    def fetch(self, unit) -> torch.Tensor:
        self._read(unit)
        return unit.shard_param

    def release(self, unit) -> None:
        self._free(unit)

    def materialize_all(self) -> None:
        for unit in self.units:
            self._read(unit)

    def store_all(self) -> None:
        for unit in self.units:
            self._write(unit)
            self._free(unit)

    def held_bytes(self) -> dict[str, int]:
        return {"nvme": self.total}

    def take_io_bytes(self) -> tuple[int, int]:
        out = self.read_bytes, self.write_bytes
        self.read_bytes = self.write_bytes = 0
        return out


def _close_params(fd: int, path: Path) -> None:
    os.close(fd)
    path.unlink(missing_ok=True)


def build_param_store(kind: str, units: list, device: torch.device, directory: Path):
    """The store `zero.offload_params` names (stage 3)."""
    if kind == "nvme":
        return FileParams(units, directory)
    if kind == "cpu":
        return HostParams(units, device)
    return ResidentParams()
