"""Stage-3 parameter shards on NVMe (`zero.offload_params = 'nvme'`): each shard in a file of the
run's private directory, in memory only from a gather's start to its end and during the
optimizer step. The file primitives (O_DIRECT, private directories) are nvme.py's."""

from __future__ import annotations

import ctypes
import logging
import os
import weakref
from pathlib import Path

import torch

from shardlm.launch.preflight import disk_error
from shardlm.parallel.data.zero.tiers.memory import ResidentParams
from shardlm.launch.allocator import host_tensor
from shardlm.parallel.data.zero.tiers.nvme import PrivateDir, _aligned, _short_write

log = logging.getLogger("shardlm")


class FileParams(ResidentParams):
    """'nvme': each shard in a file, in memory only from a gather's start to its end and
    during the optimizer step. Freeing resizes the shard's storage to zero bytes, so the views
    the optimizer tier holds stay valid and see the values again after a read."""

    def __init__(self, units: list, directory: Path):
        self.private = PrivateDir(directory, "params")
        self.path = self.private.path / "params.bin"
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as e:
            self.private.remove()
            raise disk_error("nvme offload: creating", self.path, e) from None
        weakref.finalize(self, _close_params, self.fd, self.path, self.private)
        self.units, self.offsets, at = units, {}, 0
        self.read_bytes = self.write_bytes = 0
        # On a GPU the file I/O goes through one pinned host buffer (a device pointer is no
        # address the kernel can read or write: EFAULT, seen on an H200); on the CPU, none.
        on_device = [u for u in units if u.shard_param.device.type != "cpu"]
        self.staging = (host_tensor((max(self._nbytes(u) for u in on_device),), torch.uint8, pinned=True)
                        if on_device else None)
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

    def _staged(self, unit) -> torch.Tensor | None:
        """The pinned host bytes a device shard goes through, or None for a host shard."""
        if unit.shard_param.device.type == "cpu":
            return None
        return self.staging[:self._nbytes(unit)]

    def _write(self, unit) -> None:
        staged = self._staged(unit)
        if staged is not None:  # device -> pinned host, complete before the write reads it
            staged.copy_(unit.shard_param.detach().reshape(-1).view(torch.uint8))
        data = self._bytes_of(unit) if staged is None else memoryview(staged.numpy())
        try:
            written = os.pwritev(self.fd, [data], self.offsets[id(unit)])
        except OSError as e:
            raise disk_error("nvme offload: writing", self.path, e) from None
        if written != len(data):
            raise disk_error("nvme offload: writing", self.path, _short_write())
        self.write_bytes += written

    def _free(self, unit) -> None:
        unit.shard_param.untyped_storage().resize_(0)

    def _read(self, unit) -> None:
        unit.shard_param.untyped_storage().resize_(self._nbytes(unit))
        staged = self._staged(unit)
        try:
            self.read_bytes += os.preadv(self.fd, [self._bytes_of(unit) if staged is None
                                                   else memoryview(staged.numpy())], self.offsets[id(unit)])
        except OSError as e:
            raise disk_error("nvme offload: reading", self.path, e) from None
        if staged is not None:  # a blocking copy: the buffer is the next read's
            unit.shard_param.detach().reshape(-1).view(torch.uint8).copy_(staged)

    def fetch(self, unit) -> torch.Tensor:
        self._read(unit)
        return unit.shard_param

    def release(self, unit) -> None:
        self._free(unit)

    def materialize_all(self, frozen: bool = True) -> None:
        for unit in self.units:
            if frozen or not unit.frozen:
                self._read(unit)

    def store_all(self, frozen: bool = True) -> None:
        for unit in self.units:
            if frozen or not unit.frozen:
                self._write(unit)
                self._free(unit)

    def held_bytes(self) -> dict[str, int]:
        return {"nvme": self.total}

    def take_io_bytes(self) -> tuple[int, int]:
        out = self.read_bytes, self.write_bytes
        self.read_bytes = self.write_bytes = 0
        return out


def _close_params(fd: int, path: Path, private: PrivateDir) -> None:
    os.close(fd)
    path.unlink(missing_ok=True)
    private.remove()
