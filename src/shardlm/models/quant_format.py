"""The packed formats of a frozen base (QLoRA: models/quant.py) and their kernels: NF4 and int8,
each weight packed into ONE plain uint8 tensor, so that the ZeRO engine holds it in a flat byte
buffer like any frozen parameter — sharded by bytes at stage 3 and all-gathered per unit (a tensor
subclass such as torchao's NF4Tensor, or bitsandbytes' Params4bit with its QuantState object, does
not survive being a view of a flat buffer). The tensor is a table: one row of bytes per stored row
of the weight (R rows of K elements: the weight's rows, or with `transposed` its columns), each
row dequantising on its own, so that a tensor-parallel piece — whole stored rows — is a plain
Split of the table (dim 0) and dequantises to exactly the one-process weight's piece:

    nf4   bitsandbytes' quantize_4bit(quant_type='nf4', blocksize=64, compress_statistics=True) of
          the weight: 4-bit NormalFloat in blocks of 64 along the stored row, each with an fp32
          absmax; double quantisation over the whole tensor (`segments`: each of the checkpoint's
          tensors a fused weight is made of, e.g. q, k, v): its absmaxes in row order minus their
          mean ("offset"), quantised to 8 bits with the dynamic map in groups of 256, each group
          with an fp32 absmax2. So that a row dequantises alone, it carries its tensor's offset,
          its first block's place in its group ("phase") and the absmax2 of every group its blocks
          fall in. A row's bytes, in order:
            offset (fp32) | phase (int32) | absmax2 (fp32 x G) | absmax codes (u8 x nb) | codes (u8 x ceil(K/2))
          nb = ceil(K/64) blocks, G = (nb + 254) // 256 + 1 groups (unused ones 0), two codes per
          byte, the first in the high nibble: 0.5 + 1/64 + (8 + 4 G) / K bytes per parameter
          (4.16 bits at K = 4096, 4.127 bitsandbytes' whole-tensor layout).
    int8  LLM.int8's weight format (Dettmers et al. 2022): per stored row, an fp32 absmax and
          round(127 w / absmax) as int8. A row's bytes: absmax (fp32) | codes (int8 x K).

The rounding rules are bitsandbytes' own torch and CUDA ones (tests/test_qlora.py compares with
the installed package): scaled = x * (1 / absmax) clamped to [-1, 1], the nearest level by
bucketize on the levels' midpoints (a tie to the lower level), a tensor's last partial group
scaled by division; dequantisation is code x absmax in fp32, then one cast. Where a weight's rows
are whole blocks (K % 64 == 0) and it is not `transposed`, its dequantised values are bit for bit
bitsandbytes' dequantize_4bit of it, but for one thing: bitsandbytes' CPU C kernel for the 8-bit
absmax codes (quantize_blockwise on a CPU) searches the map with a binary search that now and then
(~0.1% of codes) returns the level next to the nearest; ours is always the nearest, as its CUDA
and torch kernels are (docs/finetuning.md, "QLoRA against bitsandbytes").

Quantising is torch ops (once, at build); dequantising is torch ops in fp32 on the CPU (one gather
of each byte's two levels, as fast there as bitsandbytes' C kernel and able to write into a reused
buffer: product_weight), else bitsandbytes' dequantize_4bit kernel (C on CPU, CUDA on GPU) when the
package is installed, else torch ops: the same values. MoE experts' batched weights (E, out, in)
are a table per expert, stacked (E, R, row bytes): expert parallelism cuts dim 0 as it cuts the
experts.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

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
    def groups(self) -> int:
        """Double quantisation's groups one row's blocks can fall in (module doc: G)."""
        return (self.blocks + ABSMAX_BLOCK - 2) // ABSMAX_BLOCK + 1

    @property
    def codes_at(self) -> int:
        """nf4: where a row's absmax codes start (after offset, phase and the G absmax2)."""
        return 8 + 4 * self.groups

    @property
    def row_nbytes(self) -> int:
        k = self.rows[1]
        if self.kind == "int8":
            return 4 + k
        return self.codes_at + self.blocks + -(-k // 2)

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


def _fp32_from(packed: torch.Tensor, start: int, count: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    # A copy: a slice of a byte table need not sit at a 4-byte boundary for .view(float32).
    # (r, count); reshape + clone: a one-row slice counts as contiguous with the table's stride
    return packed[:, start:start + 4 * count].reshape(-1).clone().view(dtype).view(-1, count)


@torch.no_grad()
def quantize(weight: torch.Tensor, kind: str, transposed: bool = False,
             segments: tuple[int, ...] = ()) -> torch.Tensor:
    """`weight` (out, in), any float dtype -> its byte table (uint8, QuantFormat.stored_shape):
    each stored row (a row of the weight, or with `transposed` a column) packed on its own, the
    absmaxes double-quantised over each of `segments` (stored rows of each tensor the weight
    concatenates, in order; () = one tensor). Worked in pieces of about CHUNK elements, so the
    fp32 temporaries stay a few MiB whatever the weight's size."""
    fmt = QuantFormat(kind, tuple(weight.shape), transposed)
    w = weight.detach().t() if transposed else weight.detach()  # (R, K)
    step = max(1, CHUNK // (fmt.blocks * BLOCK))
    chunks = range(0, fmt.rows[0], step)
    if kind == "int8":
        return torch.cat([_int8_rows(w[lo:lo + step].float()) for lo in chunks])
    segments = segments or (fmt.rows[0],)
    if sum(segments) != fmt.rows[0]:
        raise ValueError(f"segments {segments} do not add up to the {fmt.rows[0]} stored rows")
    absmax = torch.cat([_block_absmax(w[lo:lo + step].float(), fmt) for lo in chunks])  # (R, nb)
    header, absmax_codes = _double_quantize(absmax, fmt, segments)
    codes = torch.cat([_nf4_codes(w[lo:lo + step].float(), absmax[lo:lo + step], fmt) for lo in chunks])
    return torch.cat([header, absmax_codes, codes], dim=1)


def _int8_rows(rows: torch.Tensor) -> torch.Tensor:
    absmax = rows.abs().amax(dim=1, keepdim=True)  # (r, 1)
    codes = torch.round(rows * (127.0 / absmax.clamp(min=1e-38))).to(torch.int8)
    return torch.cat([_fp32_bytes(absmax), codes.view(torch.uint8)], dim=1)


def _blocks(rows: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    r, k = rows.shape
    return F.pad(rows, (0, fmt.blocks * BLOCK - k)).view(r, fmt.blocks, BLOCK)


def _block_absmax(rows: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    return _blocks(rows, fmt).abs().amax(dim=2)  # (r, nb)


def _nf4_codes(rows: torch.Tensor, absmax: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """(r, ceil(K/2)) bytes: each element's nearest NF4 level, two to a byte (high nibble first)."""
    r, k = rows.shape
    scaled = torch.clamp(_blocks(rows, fmt) * (1.0 / absmax.clamp(min=1e-38)).unsqueeze(2), -1, 1)
    nf4 = torch.tensor(NF4_CODE, device=rows.device)
    codes = _nearest(scaled.reshape(-1), nf4).to(torch.uint8).view(r, -1)[:, :2 * -(-k // 2)]
    return (codes[:, 0::2] << 4) | codes[:, 1::2]


def _double_quantize(absmax: torch.Tensor, fmt: QuantFormat,
                     segments: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' headers (R, codes_at) bytes — offset, phase, the absmax2 of the groups each row's
    blocks fall in — and their absmax codes (R, nb) u8: each segment's absmaxes, in row order,
    minus their mean, to 8 bits in groups of ABSMAX_BLOCK (bitsandbytes' quantize_blockwise)."""
    nb, g = fmt.blocks, fmt.groups
    headers, all_codes, lo = [], [], 0
    levels = dynamic_map().to(absmax.device)
    for rows in segments:
        flat = absmax[lo:lo + rows].reshape(-1).clone()  # a fresh 1-D tensor: the mean's own layout
        offset = flat.mean()
        centred = flat - offset
        full = flat.numel() - flat.numel() % ABSMAX_BLOCK
        absmax2 = centred[:full].view(-1, ABSMAX_BLOCK).abs().amax(dim=1)
        scaled = centred[:full].view(-1, ABSMAX_BLOCK) * (1.0 / absmax2.clamp(min=1e-38)).unsqueeze(1)
        scaled = torch.clamp(scaled, -1, 1).reshape(-1)
        if full < flat.numel():  # the last, partial group: divided, as theirs
            last = centred[full:].abs().amax()
            absmax2 = torch.cat([absmax2, last.unsqueeze(0)])
            scaled = torch.cat([scaled, torch.clamp(centred[full:] / last.clamp(min=1e-38), -1, 1)])
        all_codes.append(_nearest(scaled, levels).to(torch.uint8).view(rows, nb))
        first = torch.arange(rows, device=absmax.device) * nb  # each row's first block in the segment
        groups = (first // ABSMAX_BLOCK).unsqueeze(1) + torch.arange(g, device=absmax.device)  # (rows, G)
        padded = torch.cat([absmax2, absmax2.new_zeros(g)])
        headers.append(torch.cat([_fp32_bytes(offset.reshape(1, 1).repeat(rows, 1)),
                                  (first % ABSMAX_BLOCK).to(torch.int32).view(rows, 1).view(torch.uint8),
                                  _fp32_bytes(padded[groups.clamp(max=len(absmax2) + g - 1)])], dim=1))
        lo += rows
    return torch.cat(headers), torch.cat(all_codes)


def dequantize(packed: torch.Tensor, fmt: QuantFormat, dtype: torch.dtype,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """The stored rows (R, K) in `dtype` from their byte table: the arithmetic in fp32, then
    cast (the weight is this, or its transpose with fmt.transposed: `weight_of`). NF4 goes
    through bitsandbytes' dequantize_4bit kernel (C on a CPU, CUDA on a GPU) when it is
    installed and the rows are whole blocks (`_kernel_takes`): on an AVX-512 Xeon 3-5x the torch
    ops below in fp32 (the 135M shape's weights, 2026-11-30; bitwise the same values); else
    through torch ops (a gather of each byte's two levels, then the blocks' absmaxes), in fp32
    into `out`, an fp32 (R, K) buffer, when given."""
    if fmt.kind == "int8":
        return dequantize_torch(packed, fmt, dtype)
    r, k = fmt.rows
    codes = packed[:, fmt.codes_at + fmt.blocks:]
    if _kernel_takes(fmt, dtype):
        return _bnb_kernel()(codes.reshape(-1), _nf4_absmax(packed, fmt).reshape(-1), BLOCK, "nf4", [r, k], dtype)
    if dtype == torch.float32:
        return _nf4_values(codes, _nf4_absmax(packed, fmt), fmt, out)
    return dequantize_torch(packed, fmt, dtype)


def dequantize_torch(packed: torch.Tensor, fmt: QuantFormat, dtype: torch.dtype) -> torch.Tensor:
    """dequantize in torch ops only (no bitsandbytes)."""
    if fmt.kind == "int8":
        absmax = _fp32_from(packed, 0, 1)  # (R, 1)
        codes = packed[:, 4:].contiguous().view(torch.int8).float()
        return (codes * absmax * INT8_STEP).to(dtype)
    codes = packed[:, fmt.codes_at + fmt.blocks:]
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
    """The blocks' absmaxes (fp32, (R, blocks)) undone from their double quantisation: level x
    its group's absmax2, plus the offset (two fp32 roundings, as bitsandbytes' dequantize_4bit)."""
    at, nb, g = fmt.codes_at, fmt.blocks, fmt.groups
    header = _fp32_from(packed, 0, at // 4)  # (R, 2 + G): offset, phase (int32 bits), absmax2
    offset, phase, absmax2 = header[:, :1], header[:, 1:2].view(torch.int32), header[:, 2:]
    codes = packed[:, at:at + nb].int()  # (R, nb)
    levels = torch.index_select(_table("dynamic", packed.device), 0, codes.view(-1)).view(codes.shape)
    block = torch.arange(nb, dtype=torch.int32, device=packed.device)
    if g <= 2:  # a row's blocks span at most two groups (K <= 16,448): the second from 256 - phase on
        scale = torch.where(block >= ABSMAX_BLOCK - phase, absmax2[:, g - 1:], absmax2[:, :1])
    else:
        scale = torch.gather(absmax2, 1, block.add(phase).div_(ABSMAX_BLOCK, rounding_mode="floor").long())
    return levels.mul_(scale).add_(offset)


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


def _kernel_takes(fmt: QuantFormat, dtype: torch.dtype) -> bool:
    """Whether `dequantize` runs bitsandbytes' kernel for `fmt` in `dtype`."""
    return (fmt.kind == "nf4" and fmt.rows[1] % BLOCK == 0 and dtype in (torch.float32, torch.bfloat16, torch.float16)
            and _bnb_kernel() is not None)


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


@torch.library.custom_op("shardlm::dequantize", mutates_args=())
def dequantize_op(packed: torch.Tensor, kind: str, shape: list[int], transposed: bool,
                  dtype: torch.dtype) -> torch.Tensor:
    """dequantize as a torch custom op: a compiled block (train.compile, parallel/blocks/compile.py,
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
    fused layer): NF4 in fp32 on the CPU by torch ops (no bitsandbytes), outside a compiled
    graph, dequantised into this thread's one reusable buffer, sized to the largest weight so
    far, which the next call overwrites (no fresh pages per layer and pass); else a new tensor
    (`_weight`; bitsandbytes' kernel writes its own)."""
    if (fmt.kind != "nf4" or dtype != torch.float32 or packed.device.type != "cpu"
            or torch.compiler.is_compiling() or _kernel_takes(fmt, dtype)):
        return _weight(packed, fmt, dtype)
    numel = fmt.numel
    buffer = getattr(_SCRATCH, "buffer", None)
    if buffer is None or buffer.numel() < numel:
        buffer = _SCRATCH.buffer = torch.empty(numel, dtype=torch.float32)
    rows = dequantize(packed, fmt, dtype, out=buffer[:numel].view(fmt.rows))
    return rows.t() if fmt.transposed else rows


@torch.no_grad()
def quantize_stacked(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """A batched weight (E, out, in), e.g. MoE's experts, -> (E, *QuantFormat.stored_shape)
    bytes: each expert's matrix its own table, so the experts expert parallelism cuts (dim 0)
    dequantise exactly as in the whole."""
    return torch.stack([quantize(w, kind) for w in weight.unbind(0)])


def format_bound(kind: str) -> float:
    """The largest round-trip error per unit of a block's (or row's) absmax, before double
    quantisation: half the widest gap between adjacent levels."""
    if kind == "int8":
        return 0.5 / 127
    return max(b - a for a, b in zip(NF4_CODE, NF4_CODE[1:])) / 2

