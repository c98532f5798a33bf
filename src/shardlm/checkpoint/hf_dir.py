"""Read slices of tensors from a local Hugging Face model directory (safetensors), reading only
the rows a rank needs — the same `read_range` / `read(slices)` as a shardlm checkpoint's reader
(checkpoint/sharded.py), so the sharded build can fill a rank's ZeRO shards from either.

A directory holds `model.safetensors`, or shards listed by `model.safetensors.index.json`
(`{"weight_map": {tensor name: file name}}`). Tensors are addressed by their names in the files;
mapping them onto a model's parameter names (GPT-2's `transformer.h.0.attn.c_attn.weight` and
its transposed Conv1D layout, say) is the caller's business. A flat range [start, end) of a
row-major tensor is read as the rows it touches (safetensors slices the first dimension
without reading the rest), then cut. Nothing is downloaded; names are confined to the directory.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from shardlm.errors import ConfigError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class HFDirError(ConfigError):
    """The directory is not a usable local transformers checkpoint; the message says why."""


def _confined(root: Path, name: str) -> Path:
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", ".."):
        raise HFDirError(f"{root / INDEX} names the file {name!r}: only plain file names inside "
                         f"the directory are read")
    path = root / name
    if path.is_symlink() and path.resolve().parent != root.resolve():
        raise HFDirError(f"{path} is a symlink out of {root}; copy the file in instead")
    return path


class HFDirReader:
    """Tensors of one local transformers directory, read slice by slice."""

    def __init__(self, directory: str | Path):
        self.root = Path(directory)
        self._handles: dict[Path, Any] = {}
        self.elements_read = 0
        """Elements read_block has copied out (what a rank's piece reads cost it)."""
        if not self.root.is_dir():
            raise HFDirError(f"{str(directory)!r} is not a directory (expected a local transformers "
                             f"checkpoint: config.json and {SINGLE} or {INDEX} with its shards)")
        if (self.root / INDEX).is_file():
            try:
                weight_map = json.loads((self.root / INDEX).read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise HFDirError(f"{self.root / INDEX} is not a safetensors index ({e!r})") from None
            self.files = {tensor: _confined(self.root, name) for tensor, name in weight_map.items()}
        elif (self.root / SINGLE).is_file():
            self.files = {name: self.root / SINGLE for name in self._open(self.root / SINGLE).keys()}
        else:
            raise HFDirError(f"{self.root} has neither {SINGLE} nor {INDEX}: not a safetensors "
                             f"checkpoint (a .bin checkpoint must be converted to safetensors first)")
        self._handles: dict[Path, Any] = {}

    def _open(self, path: Path):
        if path not in self._handles:
            from safetensors import safe_open

            if not path.is_file():
                raise HFDirError(f"{path} is missing: {self.root / INDEX} lists it")
            try:
                self._handles[path] = safe_open(str(path), framework="pt", device="cpu")
            except Exception as e:
                raise HFDirError(f"{path} is not a readable safetensors file: {e}") from None
        return self._handles[path]

    def names(self) -> list[str]:
        return sorted(self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def _slice(self, name: str):
        path = self.files.get(name)
        if path is None:
            raise HFDirError(f"{self.root} has no tensor {name!r} (it has {len(self.files)}, e.g. "
                             f"{', '.join(self.names()[:4])})")
        return self._open(path).get_slice(name)

    def read_range(self, name: str, shape: tuple[int, ...], start: int, end: int,
                   out: torch.Tensor) -> None:
        """Copy elements [start, end) of the flattened tensor `name` into `out` (1-D), converting
        to out's dtype; `shape` is what the model expects (checked)."""
        source = self._slice(name)
        found = tuple(source.get_shape())
        if found != tuple(shape):
            raise HFDirError(f"{self.root}: {name!r} has shape {found}, the model expects "
                             f"{tuple(shape)}: the directory holds a different model")
        if not 0 <= start <= end <= math.prod(shape):
            raise ValueError(f"range [{start}, {end}) outside {name!r} of shape {shape}")
        if start == end:
            return
        if len(shape) <= 1:
            out.copy_(source[start:end])
            return
        row = math.prod(shape[1:])
        first, last = start // row, -(-end // row)
        rows = source[first:last].reshape(-1)
        out.copy_(rows[start - first * row:end - first * row])

    def read_block(self, name: str, shape: tuple[int, ...], dim: int, lo: int, hi: int) -> torch.Tensor:
        """Indices [lo, hi) of dimension `dim` (0 or 1) of the tensor `name`, every other
        dimension whole, as fp32: only those elements are copied out of the file (safetensors
        slices the mapped file). `shape` is what the model expects (checked)."""
        source = self._slice(name)
        found = tuple(source.get_shape())
        if found != tuple(shape):
            raise HFDirError(f"{self.root}: {name!r} has shape {found}, the model expects "
                             f"{tuple(shape)}: the directory holds a different model")
        if dim not in (0, 1) or not 0 <= lo <= hi <= shape[dim]:
            raise ValueError(f"block [{lo}, {hi}) of dimension {dim} outside {name!r} of shape {shape}")
        block = (source[lo:hi] if dim == 0 else source[:, lo:hi]).float()
        self.elements_read += block.numel()
        return block

    def read(self, slices) -> None:
        """Fill StateSlices (name, shape, start, end, tensor)."""
        for s in slices:
            self.read_range(s.name, s.shape, s.start, s.end, s.tensor)


def module_initializer(directory: str | Path, model: torch.nn.Module, prefix: str = "model."):
    """model.hf_path for a transformers model trained as it is (models/hf_build.py: an
    encoder-decoder or a causal LM our decoder does not map, in its adapter: its parameter
    `model.X` is the directory's tensor `X`) as an
    Initializer: name -> fp32 values, read whole (the sharded build cuts this rank's piece). A
    tied parameter (T5's shared embedding = encoder/decoder embed_tokens = lm_head) is found
    under whichever of its names the checkpoint saved. A tensor the model has and the directory
    lacks, or one of another shape, is an HFDirError naming it."""
    reader = HFDirReader(directory)
    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name.removeprefix(prefix))
    names = {name: aliases[id(param)] for name, param in model.named_parameters()}
    shapes = {name: tuple(param.shape) for name, param in model.named_parameters()}

    def initial_value(name: str) -> torch.Tensor:
        found = [n for n in names[name] if n in reader.files]
        if not found:
            raise HFDirError(f"model.hf_path {str(directory)!r} has no tensor {names[name][0]!r} "
                             f"(nor {', '.join(names[name][1:]) or 'another name for it'}): the "
                             f"checkpoint is incomplete, or not the architecture its config.json names")
        flat = torch.empty(math.prod(shapes[name]), dtype=torch.float32)
        reader.read_range(found[0], shapes[name], 0, flat.numel(), flat)
        return flat.view(shapes[name])

    return initial_value


IDENTITY_DIR, IDENTITY_RECORD = "hf_identity", "identity.json"
"""A run started from model.hf_path keeps the checkpoint's identity in run_dir/hf_identity/: its
tokenizer files, chat template and generation config, byte for byte, and identity.json (each
file's sha256, config.json's special token ids, where they came from)."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "tokenizer.model", "vocab.json", "merges.txt")
"""What transformers' tokenizer `save_pretrained` writes (fast and slow files, the template)."""
GENERATION_CONFIG = "generation_config.json"
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
TEMPLATES_DIR = "additional_chat_templates"


def _sha256(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def _identity_names(root: Path) -> list[str]:
    """The identity files `root` holds: TOKENIZER_FILES, generation_config.json and the named
    templates in additional_chat_templates/ (relative names)."""
    names = [n for n in (*TOKENIZER_FILES, GENERATION_CONFIG) if (root / n).is_file()]
    names += [f"{TEMPLATES_DIR}/{p.name}" for p in sorted((root / TEMPLATES_DIR).glob("*.jinja"))]
    return names


def carry_identity(hf_path: str | Path, run_dir: str | Path, write: bool = True) -> dict | None:
    """Copy model.hf_path's identity into run_dir/hf_identity/ (byte for byte, at the start of a
    run; `write`: this rank writes, rank 0) and record it there: {"source", "files": {name:
    sha256}, "token_ids": config.json's bos/eos/pad ids (an eos list kept as a list)}. Returns
    the record, or None when `hf_path` is empty (our own BPE: nothing to carry) or not `write`.
    A resumed run keeps the identity it started with. Read through links (a hub snapshot's
    files are links into its blobs); never written through one."""
    from shardlm.launch.files import atomic_write

    if not hf_path or not write:
        return None
    root, out = Path(hf_path), Path(run_dir) / IDENTITY_DIR
    if (out / IDENTITY_RECORD).is_file():  # a resumed run: what it started from
        return read_identity(run_dir)
    try:
        config = json.loads((root / "config.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        config = {}
    files = {}
    for name in _identity_names(root):
        data = (root / name).read_bytes()
        target = out / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink():
            raise HFDirError(f"{target} is a link: the run directory's identity is not written through it")
        target.write_bytes(data)
        files[name] = _sha256(data)
    record = {"source": str(root.resolve()), "files": files,
              "token_ids": {k: config[k] for k in TOKEN_ID_KEYS if config.get(k) is not None}}
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / IDENTITY_RECORD, json.dumps(record, indent=2) + "\n")
    return record


def read_identity(run_dir: str | Path) -> dict | None:
    """run_dir/hf_identity/'s record with every file checked against its sha256, or None (a run
    of our own BPE, or one written before identities were carried). A changed or missing file
    is an HFDirError naming it."""
    out = Path(run_dir) / IDENTITY_DIR
    if not (out / IDENTITY_RECORD).is_file():
        return None
    record = json.loads((out / IDENTITY_RECORD).read_text())
    for name, digest in record["files"].items():
        path = out / name
        if not path.is_file() or _sha256(path.read_bytes()) != digest:
            raise HFDirError(f"{path} is missing or changed since the run started (sha256 "
                             f"{digest[:16]}... recorded in {out / IDENTITY_RECORD}): the "
                             f"checkpoint's identity cannot be written back; restore it from "
                             f"{record.get('source')}")
    return record


def write_identity(run_dir: str | Path, directory: str | Path, record: dict,
                   tokenizer_only: bool = False) -> list[str]:
    """Copy the carried files (`read_identity`'s `record`) into `directory` byte for byte
    (replacing what save_pretrained wrote there); `tokenizer_only`: not generation_config.json
    (beside a PEFT adapter). Returns the names written."""
    src, dst = Path(run_dir) / IDENTITY_DIR, Path(directory)
    names = [n for n in record["files"] if not (tokenizer_only and n == GENERATION_CONFIG)]
    for name in names:
        (dst / name).parent.mkdir(parents=True, exist_ok=True)
        (dst / name).write_bytes((src / name).read_bytes())
    return names


def is_hf_dir(path: str | Path) -> bool:
    """A transformers checkpoint directory (its config.json names a model_type), not a run
    directory of ours (whose config.json is our Config)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(config, dict) and "model_type" in config
