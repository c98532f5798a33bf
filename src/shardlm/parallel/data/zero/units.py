"""Which parameters form a sharding unit, for our models and for any nn.Module.

A unit is a module subtree whose parameters share one flat buffer: each transformer block, and
the "root" unit holding everything else (embeddings, final norm, head). For a model we did not
write, the units are the instances of the classes the user names, or else the children of the
model's largest nn.ModuleList (the repeated layers of almost every transformer). `Unit` is
a unit at run time (its flat buffers, this rank's shards, the views its parameters are bound
to); `ZeroOptions` what the engine runs every unit with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from shardlm.comm.collectives import Comm
from shardlm.errors import ConfigError
from shardlm.models.fp8 import Fp8Quantiser
from shardlm.models.init import Initializer
from shardlm.parallel.data.zero.fp8_gather import Fp8Gather
from shardlm.parallel.data.zero.partition import UnitLayout, layout_for


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
    gather_fp8: bool = False
    """The FP8 linear weights of a module (precision.fp8_all_gather): held and trained like the
    others, gathered at stage 3 in E4M3 with one scale per weight (parallel/data/zero/fp8_gather.py)."""


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


def _fp8_weight(ref: ParamRef) -> bool:
    """Whether `ref` is the weight of layers that multiply it whole through one FP8 quantiser,
    and nothing else: models/fp8.py's Fp8Linear, a tensor-parallel linear that took one over
    (parallel/tensor/decoder.py: its weight a piece, the scale's amax a max over the tp group), LoRA's
    frozen base (models/lora.py use_fp8). Not the experts' stacked weights (one quantiser per
    expert) nor QLoRA's base (its bytes are `weight_q`)."""
    return all(a == "weight" and isinstance(getattr(m, "fp8", None), Fp8Quantiser)
               and getattr(m, "quant", None) is None for m, a in ref.places)


def collect_units(model: nn.Module, class_names: str = "", inner: list[str] = (),
                  fp8_weights: bool = False) -> list[UnitSpec]:
    """The root unit first, then the layer units, each followed by its frozen unit (its
    parameters with requires_grad = False), when it has them. A parameter belongs to the innermost unit
    that holds all its places; one tied across units belongs to the root. `inner`: names of
    modules inside a layer that are units of their own (expert parallelism's experts), placed
    right after their layer (forward order). `fp8_weights` (precision.fp8_all_gather): a unit's
    trainable FP8 linear weights are split off into a unit of their own, right after it
    ("<name>[fp8]", gathered in E4M3), so that its shards hold those weights only; the frozen
    ones (LoRA's base) likewise ("<name>[fp8 frozen]")."""
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
        fp8 = [r for r in trained + frozen if fp8_weights and _fp8_weight(r)]
        floating = [r for r in frozen if r.param.is_floating_point() and not any(r is f for f in fp8)]
        units += [UnitSpec(name, module, [r for r in trained if not any(r is f for f in fp8)]),
                  UnitSpec(f"{name}[fp8]", module, [r for r in fp8 if r.param.requires_grad], gather_fp8=True),
                  UnitSpec(f"{name}[fp8 frozen]", module, [r for r in fp8 if not r.param.requires_grad], True,
                           gather_fp8=True),
                  UnitSpec(f"{name}[frozen]", module, floating, True)]
        for dtype in sorted({r.param.dtype for r in frozen if not r.param.is_floating_point()}, key=str):
            units.append(UnitSpec(f"{name}[{str(dtype).removeprefix('torch.')}]", module,
                                  [r for r in frozen if r.param.dtype == dtype], True, dtype))
    return [u for u in units if u.params]


# ---------------------------------------------------------------------------------------------
# A unit at run time: its flat buffers, this rank's shards, the views its parameters are bound to


@dataclass(frozen=True)
class ZeroOptions:
    stage: int
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    master_dtype: torch.dtype
    reshard_after_forward: bool = True
    prefetch: bool = True
    unit_classes: str = ""
    offload_optimizer: str = "none"
    """Where masters and AdamW moments live: 'none' (the device), 'cpu', 'nvme' (parallel/data/zero/tiers/)."""
    offload_params: str = "none"
    """Stage 3: where each unit's parameter shard lives between uses: 'none', 'cpu', 'nvme'."""
    fp8_all_gather: bool = False
    """Stage 3 under precision.compute = 'fp8': FP8 linear weights gathered in E4M3 (parallel/data/zero/fp8_gather.py)."""
    nvme_dir: Path | None = None
    nvme_chunk_bytes: int = 64 << 20
    nvme_buffers: int = 4


class Unit:
    """One unit's flat buffers and its place in this rank's shard."""

    def __init__(self, spec: UnitSpec, comm: Comm, shard_rank: int, opts: ZeroOptions,
                 device: torch.device, initializer: Initializer | None = None, expert: bool = False):
        """`comm`: the group this unit's gradients are reduced over and (stage >= 1) its states
        sharded over, this rank at `shard_rank` in it; `expert`: an expert-parallel unit (its
        group the ranks holding the same experts). A frozen unit (spec.frozen) has no gradient
        buffer: only its parameters, whole at stages 0-2, sharded at stage 3."""
        self.name, self.module, self.stage = spec.name, spec.module, opts.stage
        self.comm, self.expert, self.frozen = comm, expert, spec.frozen
        self.gather_fp8 = spec.gather_fp8 and opts.stage == 3
        self.fp8_gather = None
        """Stage 3, a unit of FP8 weights (spec.gather_fp8): its E4M3 gather (parallel/data/zero/fp8_gather.py),
        made once its parameters are bound."""
        shard_world = comm.size if opts.stage >= 1 else 1
        numels = [r.param.numel() for r in spec.params]
        decay = [r.param.dim() >= 2 for r in spec.params]
        self.layout: UnitLayout
        self.layout, order = layout_for(numels, decay, shard_world)
        self.refs: list[ParamRef] = [spec.params[i] for i in order]
        self.lo, self.hi = self.layout.shard_range(shard_rank)
        self.segments = self.layout.segments(shard_rank)
        # fp32 copy of the initial values: the master is made from it, not from a rounded cast.
        # A parameter still on the meta device is initialised here, for this unit only (the
        # sharded build: a rank never holds more than its shards and one unit in full).
        initial = torch.zeros(self.layout.padded, dtype=torch.float32, device=device)
        for ref, offset in zip(self.refs, self.layout.offsets):
            if ref.param.is_meta:
                if initializer is None:
                    raise TypeError(f"parameter {ref.name} is on the meta device and the model has "
                                    f"no initializer (models/init.py)")
                values = initializer(ref.name)
            else:
                values = ref.param.detach()
            initial[offset:offset + ref.param.numel()] = values.reshape(-1)
            del values
        self.flat_param = initial.to(spec.dtype or opts.compute_dtype)  # (padded,)
        self.shard_param = (self.flat_param[self.lo:self.hi].clone() if self.stage == 3
                            else self.flat_param[self.lo:self.hi])  # (shard,)
        self.initial_shard = initial[self.lo:self.hi]
        self.full_grad: torch.Tensor | None = None
        self.grad_dtype = opts.reduce_dtype
        self.shard_grad: torch.Tensor | None = None  # stages 2-3: from the reduction to the step
        if self.stage <= 1 and not self.frozen:
            self.full_grad = torch.zeros(self.layout.padded, dtype=opts.reduce_dtype, device=device)
        self.arrived = 0
        self.reduced = False
        self.params: list[nn.Parameter] = []

    def bind_params(self) -> None:
        """Point every module attribute at a view of the flat buffer (tied places share one)."""
        self.params = []
        for ref, offset in zip(self.refs, self.layout.offsets):
            view = self.flat_param[offset:offset + ref.param.numel()].view(ref.param.shape)
            param = nn.Parameter(view, requires_grad=not self.frozen)
            for module, attr in ref.places:
                setattr(module, attr, param)
            ref.param = param  # drop the pre-flatten tensor, or every rank keeps 4Ψ bytes alive
            self.params.append(param)
        if self.gather_fp8:
            self.fp8_gather = Fp8Gather(self)

    def attach_grads(self) -> None:
        """Stages 0-1, gradients in the parameters' dtype: each param.grad a view of the flat
        gradient buffer, zeroed, so autograd accumulates in place there (DDP's gradient as
        bucket view): no second copy of the gradients exists, the flatten copies nothing."""
        if self.full_grad is None or self.full_grad.dtype != self.flat_param.dtype:
            return
        self.full_grad.zero_()
        for param, offset in zip(self.params, self.layout.offsets):
            param.grad = self.full_grad[offset:offset + param.numel()].view(param.shape)

    def grad_shard(self) -> torch.Tensor:
        """This rank's reduced gradient slice (shard,), in the reduce dtype."""
        if self.stage <= 1:
            return self.full_grad[self.lo:self.hi]
        if self.shard_grad is None:  # stages 2-3: the reduction's output, written in full
            self.shard_grad = torch.empty(self.layout.shard_size, dtype=self.grad_dtype,
                                          device=self.flat_param.device)
        return self.shard_grad

    def full_grad_buffer(self) -> torch.Tensor:
        if self.full_grad is None:  # stages 2-3: allocated for one step's backward only
            self.full_grad = torch.empty(self.layout.padded, dtype=self.grad_dtype,
                                         device=self.flat_param.device)
            self.full_grad[self.layout.total:].zero_()  # the slots are all written by the flatten
        return self.full_grad
