"""Initialisation as a function of (seed, parameter name), so that a model can be materialised
one piece at a time — a ZeRO unit on each rank, never the whole — and still equal, bit for bit,
the model one process builds whole.

A model that supports this has `initial_value(name, seed) -> Tensor` (the parameter's initial
values, fp32 on the CPU) and `init_buffers()` (fills buffers derived from the config, e.g. RoPE
tables). Our Decoder does; `build_model` and `materialize` use the same functions.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Callable

import torch
from torch import nn

Initializer = Callable[[str], torch.Tensor]
"""A parameter's name (as named_parameters gives it) -> its initial values, fp32, on the CPU.
One may also have `piece(name, split)`: only a placement.Split's part of them (a tensor- or
expert-parallel rank's rows), read without the whole (a checkpoint: checkpoint/hf_names.py);
piece_of asks for it where there is one."""


def piece_of(initializer: Initializer, name: str, split) -> torch.Tensor:
    """`split`'s part of parameter `name`'s initial values: the initializer's own `piece` where
    it has one (reading only that part), else the whole, cut."""
    piece = getattr(initializer, "piece", None)
    return piece(name, split) if piece is not None else split.take(initializer(name))


def parameter_seed(seed: int, name: str) -> int:
    """A seed for one parameter (or module), from (seed, name) through SHA-256: stable across
    processes, platforms and runs (Python's hash() is salted per process), and independent of
    the order in which parameters are initialised."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def parameter_generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator seeded with parameter_seed(seed, name)."""
    return torch.Generator(device="cpu").manual_seed(parameter_seed(seed, name))


def initializer_for(model: nn.Module, seed: int) -> Initializer:
    """The model's per-parameter initialiser at `seed`; a clear error for a model without one."""
    if not hasattr(model, "initial_value"):
        raise TypeError(
            f"{type(model).__name__} is on the meta device but has no initial_value(name, seed): "
            f"shardlm cannot initialise it piece by piece. Build it on the CPU (every rank "
            f"identically) and pass that, or give it initial_value and init_buffers")
    # A copy taken now, while every parameter is still on the meta device (free): the engine
    # rebinds the live model's parameters unit by unit as it builds them (at stage 3 to freed
    # storage), and an initialiser may copy modules around the one it initialises.
    pristine = copy.deepcopy(model)
    return lambda name: pristine.initial_value(name, seed)


def materialize_buffers(model: nn.Module, device: torch.device) -> None:
    """Allocate the buffers still on the meta device on `device` and let the model fill them."""
    meta = [(m, n) for m in model.modules() for n, b in m.named_buffers(recurse=False) if b.is_meta]
    for module, name in meta:
        module._buffers[name] = torch.empty_like(module._buffers[name], device=device)
    if meta:
        model.init_buffers()


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device | str, seed: int,
                initializer: Initializer | None = None) -> nn.Module:
    """Allocate a meta model whole on `device` and initialise it (one process: no sharding)
    from `initializer` (e.g. a checkpoint's values), or else the model's own at `seed`."""
    init = initializer or initializer_for(model, seed)
    names = {id(p): n for n, p in model.named_parameters()}  # a tied parameter: its first name
    tied = [(m, a, names[id(p)]) for m in model.modules() for a, p in m.named_parameters(recurse=False)]
    values = {}
    for module, attr, name in tied:
        if name not in values:
            values[name] = nn.Parameter(init(name).to(device), requires_grad=module._parameters[attr].requires_grad)
        module._parameters[attr] = values[name]  # to_empty would untie GPT-2's head and embedding
    materialize_buffers(model, torch.device(device))
    return model
