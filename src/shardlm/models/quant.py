"""A frozen base stored quantised (QLoRA, Dettmers et al. 2023), dequantised per layer in forward.

Formats (lora.quantize), each weight packed into ONE plain uint8 tensor, so that the ZeRO engine
holds it in a flat byte buffer like any frozen parameter — sharded by bytes at stage 3 and
all-gathered per unit (a tensor subclass such as torchao's NF4Tensor, or bitsandbytes'
Params4bit with its QuantState object, does not survive being a view of a flat buffer). The
tensor is a table: one row of bytes per stored row of the weight (R rows of K elements: the
weight's rows, or for the linears tensor parallelism cuts by input (ROW_PARALLEL) its columns),
each row packed on its own, so that a tensor-parallel piece — whole stored rows — is a plain
Split of the table (dim 0) and dequantises to exactly the one-process weight's piece:

    nf4   4-bit NormalFloat in blocks of 64 with an absmax each; double quantisation: the row's
          absmaxes minus their mean ("offset") quantised to 8 bits with bitsandbytes' dynamic
          map in blocks of 256, each with an fp32 absmax. A row's bytes, in order:
          offset (fp32) | absmax2 (fp32 x ceil(nb/256)) | absmax codes (u8 x nb) | codes (u8 x ceil(K/2))
          with nb = ceil(K/64) blocks and two codes per byte, the first in the high nibble:
          0.5 + 1/64 + (4 + 4 ceil(nb/256)) / K bytes per parameter (4.14 bits at K = 4096,
          5.1 at K = 64; bitsandbytes' whole-tensor layout 4.127).
    int8  LLM.int8's weight format (Dettmers et al. 2022): per stored row, an fp32 absmax and
          round(127 w / absmax) as int8. A row's bytes: absmax (fp32) | codes (int8 x K).

Each row's codes, scales and dequantised values equal bitsandbytes' quantize_4bit(quant_type=
'nf4', blocksize=64, compress_statistics=True) / dequantize_4bit and int8_vectorwise_quant /
_dequant of that row (tests/test_qlora.py), but for the 8-bit absmax codes: ours is always the
nearest level (bitsandbytes' torch and CUDA rule), its CPU C kernel's search sometimes the next.
Quantising is torch ops (once, at build); dequantising is torch ops in fp32 on the CPU (one gather
of each byte's two levels, as fast there as bitsandbytes' C kernel and able to write into a reused
buffer: product_weight), else bitsandbytes' dequantize_4bit kernel (C on CPU, CUDA on GPU) when the
package is installed, else torch ops: the same values. MoE
experts' batched weights (E, out, in) are a table per expert, stacked (E, R, row bytes):
expert parallelism cuts dim 0 as it cuts the experts.

Gradients: QuantizedLinearFn keeps only the packed bytes for backward (not the dequantised
weight, which would be the compute-dtype base again) and dequantises a second time there; the
weight has no gradient, the input has one (the adapters below need it).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardlm.errors import ConfigError
from shardlm.models.init import Initializer
from shardlm.models.placement import Split
from shardlm.models.precision import fp32_gemm_active, gemm

log = logging.getLogger("shardlm")

QUANTIZE_KINDS = ("none", "nf4", "int8")
BLOCK = 64
"""NF4: elements per absmax."""
ABSMAX_BLOCK = 256
"""Double quantisation: absmaxes per second-level (fp32) absmax."""
CHUNK = 1 << 20
"""quantize works on this many elements at a time (a multiple of BLOCK)."""
INT8_STEP = 7.874015718698502e-3
"""1 / 127 as bitsandbytes' int8_vectorwise_dequant multiplies by it."""
NF4_CODE = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
            -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
            0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
            0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)
"""The 16 NormalFloat levels: quantiles of N(0, 1) scaled to [-1, 1], zero exact (QLoRA's
appendix; bitsandbytes' and torchao's table)."""


def dynamic_map() -> torch.Tensor:
    """bitsandbytes' signed 8-bit dynamic map (create_dynamic_map(signed=True)), 256 values in
    [-1, 1]: a dynamic exponent (powers of ten) and a linear fraction, finer near zero."""
    data: list[float] = []
    for i in range(7):  # max_exponent_bits = 7, total_bits = 8; fp32 products, as theirs
        bounds = torch.linspace(0.1, 1, 2 ** i + 1, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        data += ((10 ** (-6 + i)) * means).tolist() + ((-(10 ** (-6 + i))) * means).tolist()
    return torch.tensor(sorted(data + [0.0, 1.0]), dtype=torch.float32)


def _nearest(values: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """Index into `code` of the nearest level to each value (fp32), by bucketize on the midpoints
    of the sorted levels (bitsandbytes' own rule)."""
    levels, order = torch.sort(code)
    midpoints = (levels[:-1] + levels[1:]) / 2
    index = torch.bucketize(values, midpoints, out_int32=True)
    return index if torch.equal(order, torch.arange(len(code), device=code.device)) else order[index]


@dataclass(frozen=True)
class QuantFormat:
    """How one weight of `shape` (out, in) is packed (module doc): a table of bytes, one row per
    stored row (`rows`: the weight's rows, or with `transposed` its columns), each row packed on
    its own."""

    kind: str
    shape: tuple[int, int]
    transposed: bool = False
    """Rows are the weight's columns: the blocks run down its dim 0. A row-parallel linear's
    (ROW_PARALLEL), whose input columns tensor parallelism cuts: the cut then falls between
    stored rows, never inside a block."""

    @property
    def rows(self) -> tuple[int, int]:
        """(R, K): stored rows and the elements of each."""
        return (self.shape[1], self.shape[0]) if self.transposed else self.shape

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def blocks(self) -> int:
        """NF4 blocks of one row."""
        return -(-self.rows[1] // BLOCK)

    @property
    def blocks2(self) -> int:
        """Double quantisation's blocks of one row."""
        return -(-self.blocks // ABSMAX_BLOCK)

    @property
    def row_nbytes(self) -> int:
        k = self.rows[1]
        if self.kind == "int8":
            return 4 + k
        return 4 + 4 * self.blocks2 + self.blocks + -(-k // 2)

    @property
    def stored_shape(self) -> tuple[int, int]:
        return (self.rows[0], self.row_nbytes)

    @property
    def nbytes(self) -> int:
        return self.rows[0] * self.row_nbytes

    def local(self, shape: tuple[int, int]) -> QuantFormat:
        """The same format for a piece of `shape` (a tensor-parallel cut between stored rows)."""
        return QuantFormat(self.kind, shape, self.transposed)


def _fp32_bytes(t: torch.Tensor) -> torch.Tensor:
    """(r, n) -> (r, 4 n) bytes."""
    return t.float().contiguous().view(torch.uint8)


def _fp32_from(packed: torch.Tensor, start: int, count: int) -> torch.Tensor:
    # A copy: a slice of a byte table need not sit at a 4-byte boundary for .view(float32).
    return packed[:, start:start + 4 * count].contiguous().view(torch.float32)  # (r, count)


@torch.no_grad()
def quantize(weight: torch.Tensor, kind: str, transposed: bool = False) -> torch.Tensor:
    """`weight` (out, in), any float dtype -> its byte table (uint8, QuantFormat.stored_shape):
    each stored row (a row of the weight, or with `transposed` a column) packed on its own.
    Worked in pieces of about CHUNK elements, so the fp32 temporaries stay a few MiB whatever the
    weight's size (the build's peak is the weight itself, not five copies of it)."""
    fmt = QuantFormat(kind, tuple(weight.shape), transposed)
    w = weight.detach().t() if transposed else weight.detach()  # (R, K)
    step = max(1, CHUNK // (fmt.blocks * BLOCK))
    pack = _int8_rows if kind == "int8" else _nf4_rows
    return torch.cat([pack(w[lo:lo + step].float(), fmt) for lo in range(0, fmt.rows[0], step)])


def _int8_rows(rows: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    absmax = rows.abs().amax(dim=1, keepdim=True)  # (r, 1)
    codes = torch.round(rows * (127.0 / absmax.clamp(min=1e-38))).to(torch.int8)
    return torch.cat([_fp32_bytes(absmax), codes.view(torch.uint8)], dim=1)


def _nf4_rows(rows: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    r, k = rows.shape
    nb, nb2 = fmt.blocks, fmt.blocks2
    part = F.pad(rows, (0, nb * BLOCK - k)).view(r, nb, BLOCK)
    absmax = part.abs().amax(dim=2)  # (r, nb)
    scaled = torch.clamp(part * (1.0 / absmax.clamp(min=1e-38)).unsqueeze(2), -1, 1)
    nf4 = torch.tensor(NF4_CODE, device=rows.device)
    codes = _nearest(scaled.reshape(-1), nf4).to(torch.uint8).view(r, nb * BLOCK)[:, :2 * -(-k // 2)]
    packed = (codes[:, 0::2] << 4) | codes[:, 1::2]  # (r, ceil(K/2))
    # Double quantisation of the row's absmaxes: centred, then 8-bit dynamic codes in blocks of 256.
    offset = absmax.mean(dim=1, keepdim=True)  # (r, 1)
    centred = F.pad(absmax - offset, (0, nb2 * ABSMAX_BLOCK - nb)).view(r, nb2, ABSMAX_BLOCK)
    absmax2 = centred.abs().amax(dim=2)  # (r, nb2)
    scaled2 = torch.clamp(centred * (1.0 / absmax2.clamp(min=1e-38)).unsqueeze(2), -1, 1)
    absmax_codes = _nearest(scaled2.reshape(-1), dynamic_map().to(rows.device)).to(torch.uint8)
    absmax_codes = absmax_codes.view(r, nb2 * ABSMAX_BLOCK)[:, :nb]
    return torch.cat([_fp32_bytes(offset), _fp32_bytes(absmax2), absmax_codes, packed], dim=1)


def dequantize(packed: torch.Tensor, fmt: QuantFormat, dtype: torch.dtype,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """The stored rows (R, K) in `dtype` from their byte table: the arithmetic in fp32, then
    cast (the weight is this, or its transpose with fmt.transposed: `weight_of`). NF4 in fp32 on
    the CPU goes through torch ops (a gather of each byte's two levels, then the blocks'
    absmaxes: as fast as bitsandbytes' C kernel there, and into `out`, an fp32 (R, K) buffer,
    when given); else through bitsandbytes' dequantize_4bit kernel (C on CPU, CUDA on GPU) when
    it is installed and the rows are whole blocks, else torch ops (dequantize_torch): the same
    values."""
    if fmt.kind == "int8":
        return dequantize_torch(packed, fmt, dtype)
    kernel = _bnb_kernel()
    r, k = fmt.rows
    on_cpu = packed.device.type == "cpu" and dtype == torch.float32
    if kernel is not None and not on_cpu and k % BLOCK == 0 and dtype in (torch.float32, torch.bfloat16, torch.float16):
        codes = packed[:, 4 + 4 * fmt.blocks2 + fmt.blocks:].reshape(-1)
        return kernel(codes, _nf4_absmax(packed, fmt).reshape(-1), BLOCK, "nf4", [r, k], dtype)
    if dtype == torch.float32:
        return _nf4_values(packed[:, 4 + 4 * fmt.blocks2 + fmt.blocks:], _nf4_absmax(packed, fmt), fmt, out)
    return dequantize_torch(packed, fmt, dtype)


def dequantize_torch(packed: torch.Tensor, fmt: QuantFormat, dtype: torch.dtype) -> torch.Tensor:
    """dequantize in torch ops only (no bitsandbytes)."""
    if fmt.kind == "int8":
        absmax = _fp32_from(packed, 0, 1)  # (R, 1)
        codes = packed[:, 4:].contiguous().view(torch.int8).float()
        return (codes * absmax * INT8_STEP).to(dtype)
    codes = packed[:, 4 + 4 * fmt.blocks2 + fmt.blocks:]
    return _nf4_values(codes, _nf4_absmax(packed, fmt), fmt).to(dtype)


def weight_of(packed: torch.Tensor, fmt: QuantFormat, dtype: torch.dtype) -> torch.Tensor:
    """The weight (out, in) (a transposed view with fmt.transposed)."""
    rows = dequantize(packed, fmt, dtype)
    return rows.t() if fmt.transposed else rows


_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def _table(name: str, device: torch.device) -> torch.Tensor:
    """A lookup table, made once per device: 'dynamic' the 256 levels of dynamic_map (fp32);
    'nf4 pairs' (256,) int64 whose 8 bytes are a byte's two NF4 levels as fp32, the high
    nibble's first (a byte's two values in one gather)."""
    table = _TABLES.get((name, device))
    if table is None:
        if name == "dynamic":
            table = dynamic_map()
        else:
            levels = torch.tensor(NF4_CODE, dtype=torch.float32)
            pairs = torch.stack([levels.repeat_interleave(16), levels.repeat(16)], dim=1)  # byte -> (high, low)
            table = pairs.contiguous().view(torch.int64).reshape(256)
        table = _TABLES[(name, device)] = table.to(device)
    return table


def _nf4_absmax(packed: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """The blocks' absmaxes (fp32, (R, blocks)) undone from their double quantisation."""
    at, nb, nb2 = 4 + 4 * fmt.blocks2, fmt.blocks, fmt.blocks2
    offset, absmax2 = _fp32_from(packed, 0, 1), _fp32_from(packed, 4, nb2)  # (R, 1), (R, nb2)
    codes = packed[:, at:at + nb].int()  # (R, nb)
    levels = torch.index_select(_table("dynamic", packed.device), 0, codes.view(-1)).view(codes.shape)
    if nb2 == 1:  # K <= 16,384: one second-level absmax per row
        return levels.mul_(absmax2).add_(offset)
    levels = F.pad(levels, (0, nb2 * ABSMAX_BLOCK - nb)).view(-1, nb2, ABSMAX_BLOCK).mul_(absmax2.unsqueeze(2))
    return levels.view(-1, nb2 * ABSMAX_BLOCK)[:, :nb].add(offset)


def _nf4_values(codes: torch.Tensor, absmax: torch.Tensor, fmt: QuantFormat,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 (R, K) (into `out` when given): each byte's two levels by one gather from a (256,)
    table of pairs (_table), times the block's absmax."""
    (r, k), nb = fmt.rows, fmt.blocks
    pairs = _table("nf4 pairs", codes.device)
    if k % BLOCK == 0:  # whole blocks: straight into the output, scaled in place
        values = torch.empty((r, k), dtype=torch.float32, device=codes.device) if out is None else out
        torch.index_select(pairs, 0, codes.int().view(-1), out=values.view(torch.int64).view(-1))
        values.view(r, nb, BLOCK).mul_(absmax.unsqueeze(2))
        return values
    values = torch.index_select(pairs, 0, codes.int().view(-1)).view(torch.float32).view(r, -1)  # (R, 2 ceil(K/2))
    values = F.pad(values, (0, nb * BLOCK - values.shape[1])).view(r, nb, BLOCK)
    values.mul_(absmax.unsqueeze(2))
    values = values.reshape(r, -1)[:, :k]
    return values if out is None else out.copy_(values)


_BNB: object = None


def _bnb_kernel():
    """bitsandbytes' dequantize_4bit operator when the package is installed, else None."""
    global _BNB
    if _BNB is None:
        try:
            import bitsandbytes  # noqa: F401  (registers torch.ops.bitsandbytes)

            _BNB = torch.ops.bitsandbytes.dequantize_4bit.default
        except ImportError:
            _BNB = False
    return _BNB or None


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


@torch.library.custom_op("shardlm::dequantize", mutates_args=())
def dequantize_op(packed: torch.Tensor, kind: str, shape: list[int], transposed: bool,
                  dtype: torch.dtype) -> torch.Tensor:
    """dequantize as a torch custom op: a compiled block (train.compile, parallel/compile.py,
    fullgraph) holds it as one opaque node whose output shape it is told, so the format's
    lookups (the dynamic map's Python list, bitsandbytes' kernel) stay outside the graph."""
    # contiguous: the fake's layout (a row shorter than its blocks is a slice of them)
    return dequantize(packed, QuantFormat(kind, (shape[0], shape[1]), transposed), dtype).contiguous()


@dequantize_op.register_fake
def _(packed: torch.Tensor, kind: str, shape: list[int], transposed: bool,
      dtype: torch.dtype) -> torch.Tensor:
    return packed.new_empty(QuantFormat(kind, (shape[0], shape[1]), transposed).rows, dtype=dtype)


def _weight(packed: torch.Tensor, fmt: QuantFormat, dtype: torch.dtype) -> torch.Tensor:
    rows = dequantize_op(packed, fmt.kind, list(fmt.shape), fmt.transposed, dtype)
    return rows.t() if fmt.transposed else rows


_SCRATCH = threading.local()


def product_weight(packed: torch.Tensor, fmt: QuantFormat, dtype: torch.dtype) -> torch.Tensor:
    """The weight (out, in) for one product that keeps nothing of it (QuantizedLinearFn, LoRA's
    fused layer): NF4 in fp32 on the CPU, outside a compiled graph, dequantised into this
    thread's one reusable buffer, sized to the largest weight so far, which the next call
    overwrites (no fresh pages per layer and pass); else a new tensor (`_weight`)."""
    if (fmt.kind != "nf4" or dtype != torch.float32 or packed.device.type != "cpu"
            or torch.compiler.is_compiling()):
        return _weight(packed, fmt, dtype)
    numel = fmt.numel
    buffer = getattr(_SCRATCH, "buffer", None)
    if buffer is None or buffer.numel() < numel:
        buffer = _SCRATCH.buffer = torch.empty(numel, dtype=torch.float32)
    rows = dequantize(packed, fmt, dtype, out=buffer[:numel].view(fmt.rows))
    return rows.t() if fmt.transposed else rows


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
    which the layer's forward reads (a tensor-parallel piece: parallel/tensor.py)."""
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
"""Our decoder's linears whose input tensor parallelism cuts (parallel/tensor.py's row-parallel
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


@torch.no_grad()
def quantize_stacked(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """A batched weight (E, out, in), e.g. MoE's experts, -> (E, *QuantFormat.stored_shape)
    bytes: each expert's matrix its own table, so the experts expert parallelism cuts (dim 0)
    dequantise exactly as in the whole."""
    return torch.stack([quantize(w, kind) for w in weight.unbind(0)])


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


def quantize_base(model: nn.Module, kind: str, names: list[str],
                  initializer: Initializer | None = None) -> tuple[QuantState, Initializer | None]:
    """Store the weight of each linear layer in `names` (a LoRALinear or a frozen nn.Linear) as
    `<layer>.weight_q` bytes in format `kind`, and each MoE experts module in `names` (one with
    `stacked_weights`) as `<experts>.<attr>_q` (quantize_experts). On the meta device the bytes
    are made later, by the returned initializer, from `initializer`'s values of the float weight
    (one weight at a time: the sharded build); a materialised model's weights are quantised now.
    Stored as `model.quant`."""
    if kind not in QUANTIZE_KINDS[1:]:
        raise ValueError(f"quantize kind {kind!r}: expected one of {', '.join(QUANTIZE_KINDS[1:])}")
    formats: dict[str, QuantFormat] = {}
    stacked: dict[str, QuantFormat] = {}  # MoE experts' weights: a format per expert
    sizes: list[tuple[int, int]] = []  # (parameters, bytes) of each weight
    for name in names:
        module = model.get_submodule(name)
        if hasattr(module, "stacked_weights"):  # MoE experts: (E, out, in) weights
            for attr, fmt in quantize_experts(module, kind).items():
                stacked[f"{name}.{attr}_q"] = formats[f"{name}.{attr}_q"] = fmt
                sizes.append((module.count * fmt.numel, module.count * fmt.nbytes))
            continue
        weight = module.weight
        fmt = QuantFormat(kind, (module.out_features, module.in_features),
                          any(name == p or name.endswith("." + p) for p in ROW_PARALLEL))
        if type(module) is nn.Linear:
            quantized = QuantizedLinear(module, fmt)
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, quantized)
            module = quantized
        else:  # LoRALinear: its base forward reads `quant` and `weight_q`
            del module.weight
            module.quant = fmt
        data = (torch.empty(fmt.stored_shape, dtype=torch.uint8, device="meta") if weight.is_meta
                else quantize(weight, kind, fmt.transposed))
        module.weight_q = nn.Parameter(data, requires_grad=False)
        formats[f"{name}.weight_q"] = fmt
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
        return quantize_stacked(whole, fmt.kind) if name in stacked else quantize(whole, fmt.kind, fmt.transposed)
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


def format_bound(kind: str) -> float:
    """The largest round-trip error per unit of a block's (or row's) absmax, before double
    quantisation: half the widest gap between adjacent levels."""
    if kind == "int8":
        return 0.5 / 127
    return max(b - a for a, b in zip(NF4_CODE, NF4_CODE[1:])) / 2

