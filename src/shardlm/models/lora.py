"""LoRA (Hu et al. 2021): low-rank adapters beside frozen linear layers.

    y = W x + b + (alpha / r) · B (A (dropout(x)))      A (r, in), B (out, r)

A starts as PEFT starts it (kaiming-uniform, a = sqrt(5): uniform(±1/sqrt(in))), B at zero, so
the adapted model begins exactly as the base model. The wrapped layer keeps its parameters under
their own names (`blocks.0.attn.qkv.weight` stays), so a checkpoint of the base, or model.hf_path,
maps unchanged; the adapters are `<layer>.lora_A.weight` and `<layer>.lora_B.weight`.

apply_lora runs on the meta device (parallel/build.py, before anything else): adapters are
parameters like every other one, initialised from (seed, name) by Decoder.initial_value, and
only they keep requires_grad — the ZeRO engine (parallel/data/zero/engine.py) holds the rest as frozen units.
Under tensor parallelism apply_tp replaces each LoRALinear by a column- or row-parallel layer
with the same parameter names and the adapters cut alongside (parallel/tensor/decoder.py).
"""

from __future__ import annotations

import fnmatch
import logging
import math
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardlm.errors import ConfigError
from shardlm.models.init import Initializer, parameter_generator
from shardlm.models.quant import quantized_linear
from shardlm.models.quant_format import QuantFormat, product_weight, weight_of

log = logging.getLogger("shardlm")

DEFAULT_TARGETS = {"gelu": "attn.qkv,attn.proj,mlp.fc,mlp.proj",
                   "swiglu": "attn.qkv,attn.proj,mlp.gate_up,mlp.down"}
"""lora.targets = '' means every dense linear of attention and the MLP, by model.mlp."""
ADAPTER_NAMES = ("lora_A", "lora_B")


class LoRALinear(nn.Module):
    """A linear layer's own weight and bias (frozen) plus a trainable low-rank update."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight  # the same Parameter objects, under the same names
        self.bias = base.bias
        device = base.weight.device
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, device=device)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, device=device)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank

    quant: QuantFormat | None = None
    """Set by models/quant.py quantize_base (lora.quantize): the base weight is then stored as
    `weight_q` bytes and dequantised in forward."""

    fp8: Fp8Quantiser | None = None  # noqa: F821 (models/fp8.py imports the Decoder, which imports this)
    """Set by models/fp8.py apply_fp8 (precision.compute = 'fp8'): the frozen base multiplies in
    FP8 (QLoRA's dequantised from its bytes, then scaled into FP8); the adapters stay in the
    compute dtype."""

    def use_fp8(self, make) -> None:
        self.fp8 = make()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused(x):
            base = self.weight if self.quant is None else self.weight_q
            return LoRALinearFn.apply(x, base, self.bias, self.lora_A.weight, self.lora_B.weight,
                                      self.scaling, self.quant)
        hidden = self.lora_A(self.dropout(x))  # (…, rank)
        if self.quant is None:
            base = (F.linear(x, self.weight, self.bias) if self.fp8 is None
                    else self.fp8.linear(x, self.weight, self.bias))
        elif self.fp8 is None:
            base = quantized_linear(x, self.weight_q, self.bias, self.quant)
        else:  # fp8 keeps the fp32 dequantised weight for backward (not the bytes, as QLoRA alone)
            with torch.no_grad():
                weight = weight_of(self.weight_q, self.quant, torch.float32)  # (out, in)
            base = self.fp8.linear(x, weight, self.bias)
        # base + scaling · B hidden as one GEMM (addmm's beta = 1, alpha = scaling): no (…, out)
        # product, scaled copy and sum apart (forward or backward), which cost as much as the
        # rank-r GEMM itself on a CPU
        out = torch.addmm(base.reshape(-1, base.shape[-1]), hidden.reshape(-1, hidden.shape[-1]),
                          self.lora_B.weight.t(), alpha=self.scaling)
        return out.view(base.shape)

    def _fused(self, x: torch.Tensor) -> bool:
        """Whether LoRALinearFn computes this layer: fp32 without autocast (bf16 and fp16 go
        through autocast's kernels, precision.py's fp32 GEMMs among them), no dropout and no FP8,
        the base frozen."""
        frozen = self.quant is not None or not self.weight.requires_grad
        return (x.dtype == torch.float32 and not torch.is_autocast_enabled(x.device.type)
                and self.fp8 is None and isinstance(self.dropout, nn.Identity) and frozen
                and (self.bias is None or not self.bias.requires_grad))

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rank={self.rank}, alpha={self.alpha}"


class LoRALinearFn(torch.autograd.Function):
    """LoRALinear in fp32 as one autograd node: y = x W^T + b + s (x A^T) B^T with W (or, QLoRA,
    its bytes: dequantised in forward and again in backward, models/quant.py) and b frozen, A
    (r, in) and B (out, r) trained. The same products as autograd of the three ops, laid out as
    the CPU's BLAS runs them fastest (MKL on a Zen 3: s g B as (B^T g^T)^T and B's gradient
    (h^T g)^T, 2.7x and 4x faster than autograd's g B and g^T h), the update added into the base's
    product in place (addmm_) and x's two gradients summed by the second GEMM (addmm_), not a
    separate (…, in) sum. Saves x, the base, A, B and h = x A^T, as autograd of the three would."""

    @staticmethod
    def forward(ctx, x, base, bias, a, b, scaling, fmt):
        flat = x.reshape(-1, x.shape[-1])  # (N, in)
        weight = base if fmt is None else product_weight(base, fmt, torch.float32)  # (out, in)
        out = F.linear(flat, weight, bias)  # (N, out)
        hidden = F.linear(flat, a)  # (N, r)
        out.addmm_(hidden, b.t(), alpha=scaling)
        ctx.save_for_backward(x, base, a, b, hidden)
        ctx.scaling, ctx.fmt = scaling, fmt
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, base, a, b, hidden = ctx.saved_tensors
        flat, g = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])  # (N, in), (N, out)
        grad_hidden_t = torch.mm(b.t(), g.t()).mul_(ctx.scaling)  # (r, N) = (s g B)^T
        grad_x = grad_a = grad_b = None
        if ctx.needs_input_grad[4]:
            grad_b = torch.mm(hidden.t(), g).mul_(ctx.scaling).t()  # (out, r) = (s h^T g)^T
        if ctx.needs_input_grad[3]:
            grad_a = torch.mm(grad_hidden_t, flat)  # (r, in)
        if ctx.needs_input_grad[0]:
            weight = base if ctx.fmt is None else product_weight(base, ctx.fmt, torch.float32)
            grad_x = torch.mm(g, weight).addmm_(grad_hidden_t.t(), a).view(x.shape)  # (…, in)
        return grad_x, None, None, grad_a, grad_b, None, None


def is_adapter(name: str) -> bool:
    """Whether parameter `name` is a LoRA adapter's (lora_A / lora_B weight)."""
    return any(f"{a}." in name for a in ADAPTER_NAMES)


def adapter_initial_value(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A: kaiming-uniform(a=sqrt(5)) from (seed, name), PEFT's and nn.Linear's own; B: zeros."""
    if ".lora_B." in name:
        return torch.zeros(shape)
    value = torch.empty(shape)
    nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=parameter_generator(seed, name))
    return value


def with_adapters(base: Initializer, own: Initializer) -> Initializer:
    """`base` (e.g. a checkpoint's values) for the model's parameters, `own` for the adapters;
    a piece (models/init.piece_of) read from `base` where it can."""
    def initial_value(name: str) -> torch.Tensor:
        return own(name) if is_adapter(name) else base(name)

    if hasattr(base, "piece"):
        initial_value.piece = lambda name, split: (split.take(own(name)) if is_adapter(name)
                                                   else base.piece(name, split))
    return initial_value


def _matches(name: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*." + pattern)


@dataclass
class LoRAState:
    rank: int
    alpha: float
    targets: list[str]
    """The wrapped layers' names."""
    trainable: int
    """Adapter parameters (elements), in the whole model."""
    total: int

    def summary(self) -> str:
        return (f"lora: rank {self.rank}, alpha {self.alpha:g} on {len(self.targets)} linear layers: "
                f"{self.trainable:,} trainable of {self.total:,} parameters "
                f"({self.trainable / max(self.total, 1):.2%})")


def _output_head(model: nn.Module) -> nn.Module | None:
    """A transformers model's output head (lm_head), in our adapter or not; None for others."""
    inner = getattr(model, "model", model)
    find = getattr(inner, "get_output_embeddings", None)
    return find() if callable(find) else None


def lora_layers(model: nn.Module, targets: str, mlp: str) -> dict[str, nn.Linear]:
    """The nn.Linear layers lora.targets picks (see apply_lora), by name; with no targets and
    `mlp` = '' (a transformers model: no model.mlp of ours describes it), every nn.Linear but the
    output head, as PEFT's 'all-linear'. A pattern given by the user that matches no linear
    layer, or none matching at all, is a ConfigError."""
    given = bool(targets.strip())
    linears = {n: m for n, m in model.named_modules() if type(m) is nn.Linear and n}
    if not given and not mlp:  # a transformers model: PEFT's 'all-linear'
        head = _output_head(model)
        return {n: m for n, m in linears.items() if m is not head}
    patterns = [p.strip() for p in (targets if given else DEFAULT_TARGETS[mlp]).split(",") if p.strip()]
    chosen = [n for n in linears if any(_matches(n, p) for p in patterns)]
    unmatched = [p for p in patterns if not any(_matches(n, p) for n in linears)]
    if (given and unmatched) or not chosen:
        names = sorted({n.split(".", 2)[-1] if n.startswith("blocks.") else re.sub(r"\.\d+\.", ".*.", n)
                        for n in linears})  # a transformers model's layer index as *
        raise ConfigError(f"lora.targets: {', '.join(unmatched or patterns)} match no linear layer; "
                          f"the model's are: {', '.join(names)}")
    return {n: linears[n] for n in chosen}


def check_rank(rank: int, layers: dict[str, nn.Linear]) -> None:
    """A rank above min(in_features, out_features) of a layer it adapts is a ConfigError naming
    the layers and their dims: B·A of such a layer cannot have more than that rank, so the excess
    is parameters, memory and compute that add nothing (and scale alpha / rank shrinks)."""
    over: dict[str, tuple[int, int]] = {}
    for name, m in layers.items():
        if rank > min(m.in_features, m.out_features):  # blocks.3.attn.qkv -> blocks.*.attn.qkv
            parts = name.split(".")
            key = ".".join("*" if p.isdigit() else p for p in parts)
            over.setdefault(key, (m.in_features, m.out_features))
    if over:
        limit = min(min(dims) for n, dims in over.items())
        listed = ", ".join(f"{n} ({i} -> {o}, so at most rank {min(i, o)})" for n, (i, o) in over.items())
        raise ConfigError(f"lora.rank = {rank} is larger than the layers it adapts: {listed}. A "
                          f"layer's update B·A has rank at most min(in_features, out_features): set "
                          f"lora.rank <= {limit}, or leave those layers out of lora.targets")


def apply_lora(model: nn.Module, rank: int, alpha: float, dropout: float, targets: str,
               mlp: str, seed: int = 0) -> LoRAState:
    """Wrap every nn.Linear whose name matches a pattern of `targets` (comma-separated; a pattern
    matches a whole name or its dotted suffix, fnmatch wildcards allowed; '' = DEFAULT_TARGETS
    by model.mlp, or with `mlp` = '' every linear but the output head) in LoRALinear, and freeze every parameter but the adapters. A pattern given
    by the user that matches no linear layer, or a rank above a chosen layer's smaller dimension
    (check_rank), is a ConfigError. Stored as `model.lora`."""
    linears = lora_layers(model, targets, mlp)
    check_rank(rank, linears)
    chosen = list(linears)
    for name in chosen:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        wrapped = LoRALinear(linears[name], rank, alpha, dropout)
        if not wrapped.weight.is_meta:  # a materialised model: the adapters' values now
            with torch.no_grad():
                for a in ADAPTER_NAMES:
                    p = getattr(wrapped, a).weight
                    p.copy_(adapter_initial_value(f"{name}.{a}.weight", tuple(p.shape), seed))
        setattr(parent, attr, wrapped)
    total = trainable = 0
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    state = LoRAState(rank, alpha, chosen, trainable, total)
    model.lora = state
    log.info("%s", state.summary())
    return state


@torch.no_grad()
def remove_lora(model: nn.Module, merge: bool = False) -> int:
    """Every LoRALinear of a materialised model back to a plain nn.Linear holding its weight
    and bias (the frozen base), or with `merge` W + (alpha / r) · B A (in fp32, then W's dtype):
    the model a library's own class saves (export). A weight shared with another parameter
    (a tied head) cannot take the merge alone: a ConfigError. Returns the layers unwrapped."""
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]
    shared: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False) if merge else ():
        shared[id(p)] = shared.get(id(p), 0) + 1
    for name, layer in layers:
        if layer.quant is not None:
            raise ConfigError(f"{name}: a quantised base (lora.quantize) is not unwrapped here")
        weight = layer.weight
        if merge:
            if shared[id(weight)] > 1:
                raise ConfigError(f"--merge: the adapters on {name} would untie its weight from the "
                                  f"parameter it shares (a tied head); export with --format peft instead")
            update = layer.scaling * (layer.lora_B.weight.float() @ layer.lora_A.weight.float())
            weight = nn.Parameter((weight.float() + update).to(weight.dtype), requires_grad=False)
        plain = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                          device="meta")
        plain.weight, plain.bias = weight, layer.bias
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, plain)
    if hasattr(model, "lora"):
        del model.lora
    return len(layers)
