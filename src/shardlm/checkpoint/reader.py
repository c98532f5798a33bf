"""Reading a sharded checkpoint (sharded.py writes it): every slice a rank needs, from whichever
rank files hold it, each file checked against the manifest's SHA-256 before it is read; nothing
unpickled. A rank that cannot read makes every rank raise (raise_on_every_rank), so a resume
tries an older checkpoint on all ranks at once."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from shardlm.checkpoint.manifest import CheckpointError, parse_manifest, read_manifest
from shardlm.checkpoint.sharded import _SAFETENSORS_DTYPES, StateSlice, _sha256

log = logging.getLogger("shardlm")


class CheckpointReader:
    """Fills StateSlices from a checkpoint, reading only the ranges they cover."""

    def __init__(self, ckpt: Path, manifest: dict):
        self.ckpt, self.manifest = ckpt, manifest
        self._open: dict[str, Any] = {}

    def _file(self, name: str):
        """The safetensors file, after checking its size and SHA-256 against the manifest."""
        if name not in self._open:
            from safetensors import safe_open

            path = self.ckpt / name  # a plain name: parse_manifest confined it to the directory
            expected = self.manifest["files"].get(name)
            if expected is None:
                raise CheckpointError(f"{path} is not among the files the manifest lists "
                                      f"({sorted(self.manifest['files'])})")
            actual = _sha256(path)  # never through a link
            if actual != expected["sha256"]:
                raise CheckpointError(
                    f"{path} is corrupt: its SHA-256 is {actual} but the manifest records "
                    f"{expected['sha256']} ({expected['bytes']} bytes expected, {path.stat().st_size} "
                    f"found). Resume from an earlier checkpoint in {self.ckpt.parent}")
            try:
                self._open[name] = safe_open(str(path), framework="pt", device="cpu")
            except Exception as e:  # a file that matches its checksum yet is not safetensors
                raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from None
        return self._open[name]

    def entry(self, name: str, shape: tuple[int, ...]) -> dict:
        entry = self.manifest["tensors"].get(name)
        if entry is None:
            raise CheckpointError(f"checkpoint {self.ckpt} has no tensor {name!r}: it was saved "
                                  f"from a different model")
        if tuple(entry["shape"]) != tuple(shape):
            if name.endswith("weight_q") and len(entry["shape"]) == 1 and len(shape) == 2:
                raise CheckpointError(
                    f"checkpoint {self.ckpt}: {name!r} is QLoRA's base stored as one byte string "
                    f"{tuple(entry['shape'])}, the layout before QLoRA stored whole rows "
                    f"{tuple(shape)} (so that tensor parallelism cuts whole rows). This "
                    f"shardlm cannot read it: export its adapters with the shardlm that saved it "
                    f"(`shardlm export`, a PEFT adapter), or train again")
            raise CheckpointError(f"checkpoint {self.ckpt}: {name!r} has shape {tuple(entry['shape'])}, "
                                  f"this model's is {tuple(shape)}: it was saved from a different model")
        for piece in entry["slices"]:
            if piece.get("box") is not None:
                raise CheckpointError(f"{name!r} in {self.ckpt} is sharded by tensor/pipeline "
                                      f"parallelism, which this version cannot read")
        return entry

    def read_range(self, name: str, shape: tuple[int, ...], start: int, end: int,
                   out: torch.Tensor) -> None:
        """Copy elements [start, end) of the flattened tensor `name` into `out` (1-D)."""
        covered = 0
        for piece in self.entry(name, shape)["slices"]:
            lo, hi = max(start, piece["start"]), min(end, piece["end"])
            if lo >= hi:
                continue
            source = self._slice(name, piece)
            out[lo - start:hi - start].copy_(source[lo - piece["start"]:hi - piece["start"]])
            covered += hi - lo
        if covered != end - start:
            raise CheckpointError(f"checkpoint {self.ckpt} covers {covered} of the {end - start} "
                                  f"elements [{start}, {end}) of {name!r}")

    def _slice(self, name: str, piece: dict):
        """The safetensors slice holding `piece` of tensor `name`, checked to be what the
        manifest says: 1-D, end - start elements, the tensor's dtype."""
        path = self.ckpt / piece["file"]
        try:
            source = self._file(piece["file"]).get_slice(piece["key"])
            shape, dtype = source.get_shape(), source.get_dtype()
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{path} has no readable tensor {piece['key']!r} ({e})") from None
        wanted = _SAFETENSORS_DTYPES[getattr(torch, self.manifest["tensors"][name]["dtype"])]
        if list(shape) != [piece["end"] - piece["start"]] or dtype != wanted:
            raise CheckpointError(f"{path}: {piece['key']!r} is {dtype} {list(shape)}, but the "
                                  f"manifest records {wanted} [{piece['end'] - piece['start']}]")
        return source

    def read(self, slices: list[StateSlice]) -> None:
        for s in slices:
            self.read_range(s.name, s.shape, s.start, s.end, s.tensor)

    def verify_all(self) -> None:
        """Everything a read can fail on, checked: every file's SHA-256 and every slice's key,
        length and dtype (the files stay open for the reads that follow)."""
        for name in self.manifest["files"]:
            self._file(name)
        for name, entry in self.manifest["tensors"].items():
            for piece in entry["slices"]:
                self._slice(name, piece)


def _as_checkpoint_error(ckpt: Path, e: Exception) -> CheckpointError:
    """A failed read as a CheckpointError (an I/O error too: the checkpoint cannot be read)."""
    return e if isinstance(e, CheckpointError) else CheckpointError(f"{ckpt} cannot be read: {e}")


def raise_on_every_rank(error: CheckpointError | None, runtime) -> None:
    """Every rank raises if any rank failed (`error`), with the first failing rank's message —
    so no rank trains on, or waits in a collective for, a rank that gave up, and a caller can
    try another checkpoint on all ranks at once. Two small collectives (a MIN, a broadcast)."""
    if runtime.world_size == 1:
        if error is not None:
            raise error
        return
    import torch.distributed as dist

    first = torch.tensor([runtime.rank if error is not None else runtime.world_size],
                         dtype=torch.int64, device=runtime.device)
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    src = int(first.item())
    if src == runtime.world_size:
        return
    # Its message as bytes in a tensor: nothing from another process is unpickled.
    data = str(error).encode() if runtime.rank == src else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=runtime.device)
    dist.broadcast(size, src=src)
    buffer = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(runtime.device)
              if runtime.rank == src else torch.empty(int(size.item()), dtype=torch.uint8,
                                                      device=runtime.device))
    dist.broadcast(buffer, src=src)
    if error is not None:  # a failing rank raises its own error, the others the first one's
        raise error
    raise CheckpointError(f"rank {src}: {bytes(buffer.cpu().numpy()).decode()}")


def load_slices(path: Path, slices: list[StateSlice], runtime, readers: str = "all") -> dict:
    """Fill this rank's slices from the checkpoint at `path`; returns its manifest. 'all': each
    rank reads (and checks) only the files holding what it needs. 'one': rank 0 reads each
    tensor whole and broadcasts it; the others touch no file. A CheckpointError on any rank (a
    missing or corrupt file, a tensor this model does not have) is raised on every rank
    (raise_on_every_rank), so the caller may try another checkpoint: a successful load fills
    every slice, so nothing of a failed attempt survives it."""
    ckpt = Path(path)
    if readers == "all" or runtime.world_size == 1:
        manifest, error = None, None
        try:
            manifest = read_manifest(ckpt)
            CheckpointReader(ckpt, manifest).read(slices)
        except (CheckpointError, OSError) as e:
            error = _as_checkpoint_error(ckpt, e)
        raise_on_every_rank(error, runtime)
        return manifest
    import torch.distributed as dist

    from shardlm.launch.runtime import broadcast_text

    main = runtime.rank == 0
    # Rank 0 reads and verifies the manifest and every file before the first broadcast (a file
    # found corrupt later would leave the other ranks waiting in one) — after its own slices'
    # names and shapes, which fail fast for another model's checkpoint; every rank verifies the
    # manifest it receives, and checks its own slices.
    reader, error = None, None
    if main:
        try:
            reader = CheckpointReader(ckpt, read_manifest(ckpt))
            for s in slices:
                reader.entry(s.name, s.shape)
            reader.verify_all()
        except (CheckpointError, OSError) as e:
            error = _as_checkpoint_error(ckpt, e)
    raise_on_every_rank(error, runtime)
    manifest = parse_manifest(ckpt, broadcast_text(json.dumps(reader.manifest) if main else None,
                                                   runtime))
    reader = reader or CheckpointReader(ckpt, manifest)
    wanted: dict[str, list[StateSlice]] = {}
    error = None
    try:
        for s in slices:
            reader.entry(s.name, s.shape)
            wanted.setdefault(s.name, []).append(s)
    except CheckpointError as e:
        error = e
    raise_on_every_rank(error, runtime)
    for name in sorted(manifest["tensors"]):
        entry = manifest["tensors"][name]
        numel = 1
        for n in entry["shape"]:
            numel *= n
        whole = torch.empty(numel, dtype=getattr(torch, entry["dtype"]), device=runtime.device)
        if main:
            reader.read_range(name, tuple(entry["shape"]), 0, numel, whole)
        dist.broadcast(whole, src=0)
        for s in wanted.get(name, []):
            s.tensor.copy_(whole[s.start:s.end])
    return manifest
