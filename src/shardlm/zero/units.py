"""Which parameters form a sharding unit, for our models and for any nn.Module.

A unit is a module subtree whose parameters share one flat buffer: each transformer block, and
the "root" unit holding everything else (embeddings, final norm, head). For a model we did not
write, the units are the instances of the classes the user names, or else the children of the
model's largest nn.ModuleList (the repeated layers of almost every transformer).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from shardlm.errors import ConfigError


@dataclass
class ParamRef:
    """One parameter and every (module, attribute) that holds it — several when weights are
    tied, as GPT-2's embedding and output head are."""

    param: nn.Parameter
    name: str
    places: list[tuple[nn.Module, str]] = field(default_factory=list)


@dataclass
class UnitSpec:
    name: str
    module: nn.Module
    params: list[ParamRef]
    frozen: bool = False
    """Parameters with requires_grad = False (a LoRA run's base): materialised and, at stage 3,
    sharded and gathered like the others, but with no gradient, reduction or optimizer state."""
    dtype: torch.dtype | None = None
    """The flat buffer's dtype when it is not the compute dtype: a frozen unit of integer
    parameters (lora.quantize's packed bytes, models/quant.py), held and gathered as bytes."""


def _largest_module_list(model: nn.Module) -> nn.ModuleList | None:
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 1]
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()), default=None)


def unit_modules(model: nn.Module, class_names: str = "") -> list[tuple[str, nn.Module]]:
    """(name, module) of every non-root unit, in forward order (module registration order)."""
    names = {n.strip() for n in class_names.split(",") if n.strip()}
    if names:
        found = [(n, m) for n, m in model.named_modules() if type(m).__name__ in names]
        if not found:
            classes = sorted({type(m).__name__ for m in model.modules()})
            raise ConfigError(f"parallel.units = {class_names!r} matches no module of "
                              f"{type(model).__name__}; its classes are: {', '.join(classes)}")
        # A named class nested in another named one belongs to the outer unit.
        return [(n, m) for n, m in found if not any(n.startswith(o + ".") for o, _ in found)]
    layers = _largest_module_list(model)
    if layers is None:
        return []
    prefix = next(n for n, m in model.named_modules() if m is layers)
    return [(f"{prefix}.{i}", m) for i, m in enumerate(layers)]


def _param_places(model: nn.Module) -> dict[int, ParamRef]:
    refs: dict[int, ParamRef] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr, p in module.named_parameters(recurse=False):
            if p is None:
                continue
            ref = refs.setdefault(id(p), ParamRef(p, f"{mod_name}.{attr}".lstrip(".")))
            if (module, attr) not in [(m, a) for m, a in ref.places]:
                ref.places.append((module, attr))
    return refs


def collect_units(model: nn.Module, class_names: str = "", inner: list[str] = ()) -> list[UnitSpec]:
    """The root unit first, then the layer units, each followed by its frozen unit (its
    parameters with requires_grad = False), when it has them. A parameter belongs to the innermost unit
    that holds all its places; one tied across units belongs to the root. `inner`: names of
    modules inside a layer that are units of their own (expert parallelism's experts), placed
    right after their layer (forward order)."""
    refs = _param_places(model)
    layers = unit_modules(model, class_names)
    if inner:
        order = {name: i for i, (name, _) in enumerate(model.named_modules())}
        layers = sorted(layers + [(n, model.get_submodule(n)) for n in inner], key=lambda nm: order[nm[0]])
    owner_of_module = {}
    for index, (_, module) in enumerate(layers):
        for sub in module.modules():
            owner_of_module[id(sub)] = index
    # Per unit, its trainable parameters and its frozen ones (each its own flat buffer).
    assigned: list[tuple[list[ParamRef], list[ParamRef]]] = [([], []) for _ in layers]
    root: tuple[list[ParamRef], list[ParamRef]] = ([], [])
    for ref in refs.values():
        owners = {owner_of_module.get(id(m)) for m, _ in ref.places}
        owner = owners.pop() if len(owners) == 1 else None
        (root if owner is None else assigned[owner])[0 if ref.param.requires_grad else 1].append(ref)
    units = []
    for name, module, (trained, frozen) in [("root", model, root)] + [
            (name, module, params) for (name, module), params in zip(layers, assigned)]:
        floating = [r for r in frozen if r.param.is_floating_point()]
        units += [UnitSpec(name, module, trained), UnitSpec(f"{name}[frozen]", module, floating, True)]
        for dtype in sorted({r.param.dtype for r in frozen} - {r.param.dtype for r in floating}, key=str):
            units.append(UnitSpec(f"{name}[{str(dtype).removeprefix('torch.')}]", module,
                                  [r for r in frozen if r.param.dtype == dtype], True, dtype))
    return [u for u in units if u.params]
