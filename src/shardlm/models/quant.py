"""A frozen base stored quantised (QLoRA, Dettmers et al. 2023), dequantised per layer in forward:
the layers, and which weights of a model are stored how. The formats and their kernels (NF4,
int8: bitsandbytes' own, one byte table per weight) are models/quant_format.py.

Which weights: every LoRA-wrapped linear and every dense attention / MLP linear of the blocks
(`quantizable`), and MoE experts; never the embeddings, the head or the norms (bitsandbytes'
load_in_4bit through transformers leaves the head and every non-linear module in the compute
dtype too). A fused weight (our `attn.qkv`, `mlp.gate_up`) is double-quantised per tensor the
checkpoint holds (q, k, v; gate, up: `segments`), as bitsandbytes quantises each. With tensor
parallelism (tp > 1) the linears whose input it cuts (ROW_PARALLEL) store their columns as rows
(QuantFormat.transposed), so the cut falls between stored rows, never inside a 64-block (at
tp = 1 the blocks run along the input, as bitsandbytes': docs/finetuning.md).

Gradients: QuantizedLinearFn keeps only the packed bytes for backward (not the dequantised
weight, which would be the compute-dtype base again) and dequantises a second time there; the
weight has no gradient, the input has one (the adapters need it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardlm.config.families import family as registered_family
from shardlm.errors import ConfigError
from shardlm.models.flops import head_dim, resolved_d_ff
from shardlm.models.init import Initializer
from shardlm.models.placement import Split
from shardlm.models.precision import fp32_gemm_active, gemm
from shardlm.models.quant_format import (QUANTIZE_KINDS, QuantFormat, product_weight, quantize,
                                         quantize_stacked, weight_of)

log = logging.getLogger("shardlm")

def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


class QuantizedLinearFn(torch.autograd.Function):
    """y = x W^T + b with W dequantised from its bytes in forward and again in backward: the
    bytes are what autograd keeps. W and b are frozen (no gradient); x gets one."""

    @staticmethod
    def forward(ctx, x, packed, bias, fmt):
        ctx.save_for_backward(packed)
        ctx.fmt, ctx.fp32_gemm = fmt, fp32_gemm_active()
        return F.linear(x, product_weight(packed, fmt, _compute_dtype(x)), bias)

    @staticmethod
    def backward(ctx, grad):
        (packed,) = ctx.saved_tensors
        grad_x = gemm(grad, product_weight(packed, ctx.fmt, grad.dtype), ctx.fp32_gemm)  # (…, out) @ (out, in)
        return grad_x, None, None, None


def quantized_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                     fmt: QuantFormat) -> torch.Tensor:
    if bias is not None and bias.requires_grad:
        raise ValueError("a quantised linear layer's bias is frozen (lora.quantize)")
    return QuantizedLinearFn.apply(x, packed, bias, fmt)


class QuantizedLinear(nn.Module):
    """A frozen nn.Linear whose weight is stored as `weight_q` (a byte table, QuantFormat)."""

    def __init__(self, base: nn.Linear, fmt: QuantFormat) -> None:
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.bias = base.bias
        self.quant = fmt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quantized_linear(x, self.weight_q, self.bias, self.quant)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.quant.kind}"


def quantize_layer(layer: nn.Module, fmt: QuantFormat) -> nn.Module:
    """`layer` (on meta, a linear with `weight` of fmt.shape) with that weight stored as a byte
    table `weight_q` in `fmt` instead, its bytes left to the initializer; sets `layer.quant`,
    which the layer's forward reads (a tensor-parallel piece: parallel/tensor/decoder.py)."""
    del layer.weight
    layer.quant = fmt
    layer.weight_q = nn.Parameter(torch.empty(fmt.stored_shape, dtype=torch.uint8, device="meta"),
                                  requires_grad=False)
    return layer


def table_split(split: Split, fmt: QuantFormat, name: str) -> Split:
    """Where a piece of weight `name` (its Split: the weight's rows, or with fmt.transposed its
    columns) sits in the byte table: the same ranges of stored rows, dim 0. A cut across the
    stored rows would split blocks: a ConfigError."""
    if split.dim != (1 if fmt.transposed else 0):
        raise ConfigError(f"{name}: its weight is cut along dim {split.dim}, across the quantised "
                          f"rows' blocks; set lora.quantize = 'none' or parallel.tp = 1")
    whole = QuantFormat(fmt.kind, split.shape, fmt.transposed)
    return Split(whole.stored_shape, 0, split.ranges, split.copies)


ROW_PARALLEL = ("attn.proj", "mlp.proj", "mlp.down")
"""Our decoder's linears whose input tensor parallelism cuts (parallel/tensor/decoder.py's row-parallel
layers): stored by columns (QuantFormat.transposed), so a cut falls between stored rows."""


@dataclass
class QuantState:
    kind: str
    layers: int
    numel: int
    """Parameters of the quantised weights, in the whole model."""
    nbytes: int
    """Their bytes as stored (codes and scales)."""

    def summary(self, compute_bytes: int = 2) -> str:
        return (f"lora.quantize = {self.kind}: {self.layers} frozen linear weights, {self.numel:,} "
                f"parameters in {self.nbytes:,} bytes ({8 * self.nbytes / max(self.numel, 1):.3f} "
                f"bits each; {compute_bytes * self.numel:,} bytes at {compute_bytes} B/param)")


def quantize_experts(experts: nn.Module, kind: str) -> dict[str, QuantFormat]:
    """Store each batched weight `attr` (E, out, in) of a MoE experts module (models/moe.Experts:
    its `stacked_weights()`) as `<attr>_q` bytes (E, nbytes), one row per expert,
    (E, *stored_shape), made now from a materialised weight or left on meta for the initializer. Sets
    `experts.quant` (attr -> each expert's QuantFormat), which the experts' forward reads."""
    formats = {}
    for attr in experts.stacked_weights():
        weight = getattr(experts, attr)
        fmt = QuantFormat(kind, (weight.shape[1], weight.shape[2]))
        data = (torch.empty(weight.shape[0], *fmt.stored_shape, dtype=torch.uint8, device="meta")
                if weight.is_meta else quantize_stacked(weight, kind))
        delattr(experts, attr)
        setattr(experts, f"{attr}_q", nn.Parameter(data, requires_grad=False))
        formats[attr] = fmt
    experts.quant = formats
    return formats


def by_columns(layout: str, tp: int) -> bool:
    """lora.quantize_layout: whether the ROW_PARALLEL linears are stored by columns."""
    return layout == "columns" or (layout == "auto" and tp > 1)


def quantize_base(model: nn.Module, kind: str, names: list[str], initializer: Initializer | None = None,
                  columns: bool = False) -> tuple[QuantState, Initializer | None]:
    """Store the weight of each linear layer in `names` (a LoRALinear or a frozen nn.Linear) as
    `<layer>.weight_q` bytes in format `kind`, and each MoE experts module in `names` (one with
    `stacked_weights`) as `<experts>.<attr>_q` (quantize_experts). On the meta device the bytes
    are made later, by the returned initializer, from `initializer`'s values of the float weight
    (one weight at a time: the sharded build); a materialised model's weights are quantised now.
    `columns`: ROW_PARALLEL linears stored by columns (by_columns: lora.quantize_layout, which
    tensor parallelism needs). Stored as `model.quant`."""
    if kind not in QUANTIZE_KINDS[1:]:
        raise ValueError(f"quantize kind {kind!r}: expected one of {', '.join(QUANTIZE_KINDS[1:])}")
    formats: dict[str, QuantFormat] = {}
    stacked: dict[str, QuantFormat] = {}  # MoE experts' weights: a format per expert
    sizes: list[tuple[int, int]] = []  # (parameters, bytes) of each weight
    fused: dict[str, tuple[int, ...]] = {}  # a fused weight's tensors' rows (segments)
    for name in names:
        module = model.get_submodule(name)
        if hasattr(module, "stacked_weights"):  # MoE experts: (E, out, in) weights
            for attr, fmt in quantize_experts(module, kind).items():
                stacked[f"{name}.{attr}_q"] = formats[f"{name}.{attr}_q"] = fmt
                sizes.append((module.count * fmt.numel, module.count * fmt.nbytes))
            continue
        weight = module.weight
        fmt = QuantFormat(kind, (module.out_features, module.in_features),
                          columns and any(name == p or name.endswith("." + p) for p in ROW_PARALLEL))
        cuts = segments(model, name, fmt)
        if type(module) is nn.Linear:
            quantized = QuantizedLinear(module, fmt)
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, quantized)
            module = quantized
        else:  # LoRALinear: its base forward reads `quant` and `weight_q`
            del module.weight
            module.quant = fmt
        data = (torch.empty(fmt.stored_shape, dtype=torch.uint8, device="meta") if weight.is_meta
                else quantize(weight, kind, fmt.transposed, cuts))
        module.weight_q = nn.Parameter(data, requires_grad=False)
        formats[f"{name}.weight_q"] = fmt
        fused[f"{name}.weight_q"] = cuts
        sizes.append((fmt.numel, fmt.nbytes))
    state = QuantState(kind, len(formats), sum(n for n, _ in sizes), sum(b for _, b in sizes))
    model.quant = state
    log.info("%s", state.summary())
    if initializer is None:
        return state, None

    def init(name: str) -> torch.Tensor:
        fmt = formats.get(name)
        if fmt is None:
            return initializer(name)
        whole = initializer(name[:-len("_q")])
        if name in stacked:
            return quantize_stacked(whole, fmt.kind)
        return quantize(whole, fmt.kind, fmt.transposed, fused[name])
    return state, init


@torch.no_grad()
def dequantize_base(model: nn.Module) -> None:
    """Back to plain `weight` parameters holding the dequantised values (fp32), for inference
    and export of a quantised run: the model the adapters were trained against."""
    for name, module in list(model.named_modules()):
        fmt = getattr(module, "quant", None)
        if isinstance(fmt, dict):  # MoE experts: each expert's row of bytes
            for attr, each in fmt.items():
                packed = getattr(module, f"{attr}_q")
                delattr(module, f"{attr}_q")
                setattr(module, attr, nn.Parameter(torch.stack(
                    [weight_of(table, each, torch.float32) for table in packed]), requires_grad=False))
            module.quant = None
            continue
        if not isinstance(fmt, QuantFormat):
            continue
        weight = nn.Parameter(weight_of(module.weight_q, fmt, torch.float32).contiguous(), requires_grad=False)
        del module.weight_q
        if isinstance(module, QuantizedLinear):
            plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                              device=weight.device)
            plain.weight, plain.bias = weight, module.bias
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, plain)
        else:
            module.quant = None
            module.weight = weight


def quantizable(model: nn.Module, patterns: list[str]) -> list[str]:
    """The linear layers of the blocks to quantise: every LoRA-wrapped one and every dense
    attention / MLP linear matching `patterns` (a name or its dotted suffix); and every MoE
    experts module (its batched weights, frozen: LoRA adapts attention's linears beside them)."""
    out = []
    for name, module in model.named_modules():
        if hasattr(module, "stacked_weights"):  # MoE experts (models/moe.Experts)
            out.append(name)
            continue
        lora = hasattr(module, "lora_A")
        dense = type(module) is nn.Linear and any(name == p or name.endswith("." + p) for p in patterns)
        if lora or dense:
            out.append(name)
    return out


FUSED = {"attn.qkv": 3, "mlp.gate_up": 2}
"""Our fused linears and how many tensors a LLaMA checkpoint holds for each (q, k, v; gate, up)."""


def segments(model: nn.Module, name: str, fmt: QuantFormat) -> tuple[int, ...]:
    """The stored rows of each tensor the checkpoint holds for weight `name`, in order, where our
    decoder fuses several (`attn.qkv` = q_proj, k_proj, v_proj rows; `mlp.gate_up` = gate_proj,
    up_proj), as model.family's record names them (Phi-3's qkv_proj is one tensor; no family: a
    SwiGLU model as LLaMA, else as GPT-2, whose c_attn is one); () = the weight is one tensor."""
    cfg = getattr(model, "cfg", None)
    part = next((p for p in FUSED if name.endswith("." + p)), None)
    if part is None or fmt.transposed or not hasattr(cfg, "n_kv_heads"):
        return ()
    record = registered_family(cfg.family) if cfg.family else None
    count = (len(record.names.get(part, ())) or FUSED[part]) if record else (FUSED[part] if cfg.mlp == "swiglu" else 1)
    if part == "mlp.gate_up":
        rows = (resolved_d_ff(cfg),) * 2
    else:
        width = head_dim(cfg)
        rows = (cfg.n_heads * width,) + (((cfg.n_kv_heads or cfg.n_heads) * width,) * 2)
    if count != len(rows) or sum(rows) != fmt.rows[0]:
        return ()
    return rows
