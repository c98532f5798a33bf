"""FP8 training (precision.compute = 'fp8'): the blocks' linear layers multiply in float8.

Forward: input and weight in E4M3 (3 mantissa bits, max 448); backward: the output gradient in
E5M2 (2 mantissa bits, max 57344: gradients need range more than precision) — the recipe of
Micikevicius et al. 2022 ("FP8 Formats for Deep Learning") that torchao's float8 training uses.
Embeddings, norms, attention's softmax and the LM head stay in bf16 / fp32, as in torchao.

Each tensor is scaled into the format's range before the cast, then unscaled after it:

    q = clamp(x * s, -max, max).to(fp8)        dequantised: q / s
    'tensorwise' (current scaling): s = max / amax(x) of this very tensor
    'delayed':  s = max / max(amax history): the last FP8_HISTORY steps' amaxes of this tensor
                (the scale stays fixed within a step, so a recomputed forward rounds the same)
    'blockwise': one s per tile — 1 x B for activations and gradients, B x B for weights
                (precision.fp8_block = B; DeepSeek-V3's 1x128 / 128x128)

Where FP8 hardware exists (CUDA, compute capability >= 8.9) and fp8_emulate is off, torchao's
Float8Linear does this with real FP8 GEMMs ('tensorwise'). Elsewhere, and whenever
precision.fp8_emulate is set, Fp8Linear *emulates* it: the same rounding through torch's float8
dtypes, then a bf16 matmul of the dequantised values. The emulation is for numerics, not speed:
it is slower than plain bf16. Tiles are where the emulation and a GPU kernel differ in cost, not
in the rounding model: each tensor is rounded once with its tiles (a kernel re-tiles along the
reduction dimension for the weight-gradient GEMM, as DeepSeek-V3 does).

Every quantisation counts the elements clamped at the format's max (overflow) and the nonzero
ones that round to zero (underflow): Fp8Stats, reported per step in the JSONL.

The swapped layer holds the same Parameter objects under the same names (Fp8Linear is an
nn.Linear), so checkpoints, initialisation by name and the ZeRO engine's flat buffers are
unchanged; the weight is saved for backward and re-quantised there (ZeRO-3 gathers it again),
like torchao's force_recompute_fp8_weight_in_bwd. With precision.fp8_all_gather, ZeRO-3 gathers
the weight already in E4M3 with its scale (GatheredWeight; parallel/data/zero/fp8_gather.py), as torchao's
float8 all-gather under FSDP2 does, and the matmul takes those bits as they are.
"""

from __future__ import annotations

import importlib.util
import logging
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from shardlm.config.schema import PrecisionConfig
from shardlm.errors import ConfigError

log = logging.getLogger("shardlm")

FP8_HISTORY = 16
"""'delayed': steps of amax history per tensor (torchao's delayed scaling default)."""
EPS = 1e-12
"""Floor of an amax (torchao's): an all-zero tensor gets a finite scale."""
ROLES = ("input", "weight", "grad_output")
"""The three tensors a linear layer quantises; Fp8Stats counts each apart."""
MIN_CAPABILITY = (8, 9)
"""CUDA compute capability with FP8 tensor cores (Ada, Hopper and later)."""


@dataclass(frozen=True)
class Fp8Format:
    name: str
    dtype: torch.dtype
    mantissa_bits: int

    @property
    def max(self) -> float:
        return float(torch.finfo(self.dtype).max)

    @property
    def overflow_at(self) -> float:
        """Magnitudes from here on are clamped (overflow): the max plus half its ulp. Below it a
        value rounds to the max on its own — as the amax of a tensor, scaled to the max with an
        fp32 scale, may land a rounding error above it."""
        return self.max + 2.0 ** (math.floor(math.log2(self.max)) - self.mantissa_bits - 1)


E4M3 = Fp8Format("e4m3", torch.float8_e4m3fn, 3)
"""Forward: input and weight (max 448, smallest subnormal 2^-9)."""
E5M2 = Fp8Format("e5m2", torch.float8_e5m2, 2)
"""Backward: the output gradient (max 57344, smallest subnormal 2^-16)."""
FORMAT_OF = {"input": E4M3, "weight": E4M3, "grad_output": E5M2}


def _tiles(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """(R, C) zero-padded to multiples of (rows, cols), viewed as (R/rows, rows, C/cols, cols)."""
    r, c = x.shape
    padded = nn.functional.pad(x, (0, -c % cols, 0, -r % rows))
    return padded.view(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols)


def amax(x: torch.Tensor, tile: tuple[int, int] | None) -> torch.Tensor:
    """max |x| of the whole 2-D tensor (tile None), or of each (rows, cols) tile, in fp32."""
    if tile is None:
        return x.detach().abs().amax().float()
    return _tiles(x.detach().abs().float(), *tile).amax(dim=(1, 3), keepdim=True)


def quantise(x: torch.Tensor, fmt: Fp8Format, scale: torch.Tensor, tile: tuple[int, int] | None = None,
             out_dtype: torch.dtype = torch.bfloat16, fixed_scale: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Round the 2-D `x` through `fmt` at `scale` (a scalar, or one per `tile` as `amax` gives):
    returns (dequantised x in `out_dtype`, [overflow, underflow] counts). A value beyond the
    format's max is clamped to it (overflow: counted from Fp8Format.overflow_at); a nonzero
    value that becomes 0 is an underflow. A non-finite value stays non-finite (a diverging run
    must stay visible): a scale from x's own amax makes it NaN; a `fixed_scale` (delayed) would
    clamp an infinity to the max, so it is made NaN here."""
    r, c = x.shape
    scaled = x.float() * scale if tile is None else _tiles(x.float(), *tile) * scale
    clamped = scaled.clamp(-fmt.max, fmt.max)
    if fixed_scale:
        clamped = torch.where(torch.isinf(scaled), torch.full_like(scaled, float("nan")), clamped)
    q = clamped.to(fmt.dtype).float()
    counts = torch.stack([(scaled.abs() >= fmt.overflow_at).sum(), ((q == 0) & (scaled != 0)).sum()])
    dequantised = q / scale
    if tile is not None:  # back from tiles, the padding dropped
        dequantised = dequantised.view(dequantised.shape[0] * tile[0], -1)[:r, :c]
    return dequantised.to(out_dtype), counts


def round_to_fp8(x: torch.Tensor, fmt: Fp8Format, scale: torch.Tensor,
                 count: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`x` (any shape) times `scale` (broadcast: a scalar, or one per element) rounded to `fmt`,
    as `quantise` rounds it at a scale from x's amax: (the values in fmt.dtype, [overflow,
    underflow] counts, or None without `count`). ZeRO-3's fp8 all-gather rounds each rank's
    shard so, at the whole weight's scale (parallel/data/zero/fp8_gather.py)."""
    scaled = x.float() * scale
    q = scaled.clamp(-fmt.max, fmt.max).to(fmt.dtype)
    if not count:
        return q, None
    counts = torch.stack([(scaled.abs() >= fmt.overflow_at).sum(), ((q.float() == 0) & (scaled != 0)).sum()])
    return q, counts


def dequantise(q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """FP8 values `q` back at `scale`, in `out_dtype`: what `quantise` returns for them."""
    return (q.float() / scale).to(out_dtype)


@dataclass
class GatheredWeight:
    """A weight that arrives already rounded to E4M3: ZeRO-3's fp8 all-gather
    (precision.fp8_all_gather, parallel/data/zero/fp8_gather.py) gathers its bytes, rounded on each rank at
    the scale of the whole weight's amax (tensorwise: the bits one process rounds the whole
    weight to). Views of the unit's gathered buffers, refilled by each gather: the E4M3 values
    (out, in), the scale (a 0-d fp32) and the [overflow, underflow, elements] counts of this
    rank's cast (fp32, weighted so that the sum over the ranks counts the weight once per rank,
    as each rank counts a whole weight it rounds itself). Used while `live` (gathered); else
    the layer rounds its weight itself (stage 3's whole parameters: evaluation, generation)."""

    data: torch.Tensor
    scale: torch.Tensor
    counts: torch.Tensor
    live: bool = False


class Fp8Stats:
    """Overflow and underflow counts of every quantisation since `reset`, per role (input,
    weight, grad_output), and the elements quantised, kept on the device (one read per step).

    The counts arrive as the gradient of `sink`, a (3 roles x [overflow, underflow, elements])
    leaf every fp8 matmul takes as an input: its backward returns its forward's and its own
    counts as the sink's gradient, which autograd sums over the layers and micro-batches. No
    Python state changes inside the matmul, so a compiled block traces it whole (train.compile,
    fullgraph), and a recomputed forward (activation checkpointing) is counted once."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.sink = torch.zeros(len(ROLES), 3, device=device, requires_grad=True)

    def reset(self) -> None:
        self.sink.grad = None

    def totals(self, device: torch.device) -> torch.Tensor:
        """(3 roles x [overflow, underflow, elements]) flat, in fp32: what the trainer sums over
        the ranks with the loss (exact below 2^24 elements per role and step; beyond, the
        fractions keep fp32's 7 digits)."""
        counts = self.sink.grad
        return (counts if counts is not None else torch.zeros(len(ROLES), 3, device=device)).float().flatten()

    @staticmethod
    def record(totals: torch.Tensor) -> dict:
        """JSONL keys from (summed) `totals`: fp8_overflow and fp8_underflow, the fractions of
        all quantised elements, and the same per role."""
        by_role = totals.view(len(ROLES), 3).double()
        whole = by_role.sum(0)
        frac = lambda n, d: float(n / d) if d > 0 else 0.0  # noqa: E731
        return {"fp8_overflow": frac(whole[0], whole[2]), "fp8_underflow": frac(whole[1], whole[2]),
                "fp8_overflow_by_tensor": {r: frac(v[0], v[2]) for r, v in zip(ROLES, by_role)},
                "fp8_underflow_by_tensor": {r: frac(v[1], v[2]) for r, v in zip(ROLES, by_role)}}


class DelayedScale:
    """One tensor's amax history ('delayed' scaling, Micikevicius et al. 2022): the scale comes
    from past steps' amaxes and is fixed within a step; this step's amax joins the history at
    the next `roll`. Before any history exists the tensor is scaled by its own amax. The step's
    amaxes are only listed until then: the ops a forward runs must not depend on this state
    (selective recomputation replays the forward's ops and checks they are the same)."""

    def __init__(self) -> None:
        self.history: torch.Tensor | None = None  # (FP8_HISTORY,), newest first
        self.scale: torch.Tensor | None = None
        self.step_amaxes: list[torch.Tensor] = []

    def scale_for(self, current: torch.Tensor, fmt: Fp8Format, record: bool) -> torch.Tensor:
        """The scale this step, given the tensor's `current` amax (whole: Fp8Quantiser.amax)."""
        if record:
            self.step_amaxes.append(current)
        if self.scale is None:
            return fmt.max / current.clamp_min(EPS)
        return self.scale

    def roll(self, fmt: Fp8Format) -> None:
        if not self.step_amaxes:
            return
        step_amax = torch.stack(self.step_amaxes).max()
        history = torch.zeros(FP8_HISTORY, device=step_amax.device) if self.history is None else self.history
        self.history = torch.cat([step_amax.view(1), history[:-1]])
        self.scale = fmt.max / self.history.max().clamp_min(EPS)
        self.step_amaxes = []


class Fp8Quantiser:
    """One recipe, applied to one linear layer's three tensors; shares the run's Fp8Stats.

    A layer whose tensors are pieces of the whole (tensor parallelism: parallel/tensor/decoder.py) gives
    the roles it holds a piece of an `amax_reducers` entry (`share_amax`: the max over the
    group), so each piece is scaled by the amax of the whole tensor — the scale, and so the
    bits, one process has."""

    def __init__(self, recipe: str, block: int, stats: Fp8Stats) -> None:
        self.recipe, self.block, self.stats = recipe, block, stats
        self.delayed = {role: DelayedScale() for role in ROLES} if recipe == "delayed" else {}
        self.amax_reducers: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
        self.gathered: GatheredWeight | None = None
        """The weight as ZeRO-3's fp8 all-gather delivers it (GatheredWeight), where it does."""

    def share_amax(self, roles: tuple[str, ...], reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """The tensors of `roles` are pieces: their amax is `reduce`d (a max over the pieces'
        group) before it scales them. Blockwise tiles are the pieces' own (config_rules refuses
        'blockwise' with tensor parallelism: a tile would straddle the cut)."""
        assert self.recipe != "blockwise", "blockwise tiles are not shared over a group"
        self.amax_reducers.update({role: reduce for role in roles})

    def amax(self, x: torch.Tensor, role: str, reduce: Callable | None = None) -> torch.Tensor:
        """max |x| of the whole tensor `x` is (a piece of, where the role is shared, or where
        `reduce` is given: async TP's sequence pieces, parallel/tensor/async_fp8.py)."""
        current = amax(x, None)
        reduce = reduce or self.amax_reducers.get(role)
        return current if reduce is None else reduce(current)

    def scale(self, x: torch.Tensor, role: str, record: bool, reduce: Callable | None = None) -> torch.Tensor:
        """The scale that takes the 2-D `x` into its role's format: a scalar, or one per tile."""
        fmt = FORMAT_OF[role]
        if self.recipe == "blockwise":
            tile = (self.block, self.block) if role == "weight" else (1, self.block)
            return fmt.max / amax(x, tile).clamp_min(EPS)
        if self.recipe == "delayed":
            return self.delayed[role].scale_for(self.amax(x, role, reduce), fmt, record)
        return fmt.max / self.amax(x, role, reduce).clamp_min(EPS)

    def cast(self, x: torch.Tensor, role: str, record: bool,
             scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The 2-D `x` rounded through its role's format (at `scale`, default its own), dequantised
        to bf16, and [overflow, underflow, elements] counts (fp32)."""
        fmt = FORMAT_OF[role]
        tile = None
        if self.recipe == "blockwise":
            tile = (self.block, self.block) if role == "weight" else (1, self.block)
        scale = self.scale(x, role, record) if scale is None else scale
        out, counts = quantise(x, fmt, scale, tile, fixed_scale=self.recipe == "delayed")
        return out, torch.cat([counts.float(), counts.new_full((1,), x.numel()).float()])

    def roll(self) -> None:
        for role, delayed in self.delayed.items():
            delayed.roll(FORMAT_OF[role])

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """fp8_linear through this quantiser: what a layer holding one calls (models/lora.py and
        models/moe.py call it so, without importing this module, which imports their Decoder)."""
        return fp8_linear(x, weight, bias, self)


class _Fp8Matmul(torch.autograd.Function):
    """y = x W^T + b with x, W in E4M3 and, in backward, dy in E5M2; the matmuls in bf16 over
    the dequantised values (fp32 accumulation inside the bf16 kernel). The weight is saved as
    it is (ZeRO-3 has gathered it again for backward) and rounded again there at the forward's
    scale; a frozen weight (LoRA's, QLoRA's dequantised one) gets no gradient computed. A
    weight ZeRO-3 gathers in fp8 (Fp8Quantiser.gathered) is multiplied as gathered, and read
    again in backward from its bytes gathered again. The three roles' counts leave as the
    gradient of `sink` (Fp8Stats)."""

    @staticmethod
    def forward(ctx, x, weight, bias, sink, quantiser: Fp8Quantiser, record: bool):
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.reshape(-1, x.shape[-1])  # (B*T, in)
            xq, x_counts = quantiser.cast(x2, "input", record)
            gathered = quantiser.gathered if quantiser.gathered is not None and quantiser.gathered.live else None
            if gathered is None:
                w_scale = quantiser.scale(weight, "weight", record)
                wq, w_counts = quantiser.cast(weight, "weight", record, w_scale)  # (out, in)
            else:  # rounded before the gather: the same bits, not rounded twice
                w_scale, w_counts = gathered.scale.clone(), gathered.counts.clone()
                wq = dequantise(gathered.data, w_scale)  # (out, in)
            out = xq @ wq.t()  # (B*T, out) bf16
            if bias is not None:
                out = out + bias.to(out.dtype)
        # A gathered weight is read again in backward from its re-gathered bytes, not saved.
        ctx.save_for_backward(xq, weight if gathered is None else None, w_scale, torch.stack([x_counts, w_counts]))
        ctx.quantiser, ctx.x_shape, ctx.x_dtype, ctx.has_bias = quantiser, x.shape, x.dtype, bias is not None
        ctx.w_dtype, ctx.gathered = weight.dtype, gathered
        return out.view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad_out):
        xq, weight, w_scale, forward_counts = ctx.saved_tensors
        q = ctx.quantiser
        need_x, need_w, need_b, need_counts = ctx.needs_input_grad[:4]
        with torch.autocast(grad_out.device.type, enabled=False):
            g2 = grad_out.reshape(-1, grad_out.shape[-1])  # (B*T, out)
            gq, g_counts = q.cast(g2, "grad_output", True)
            if ctx.gathered is None:
                wq, _ = q.cast(weight, "weight", False, w_scale)
            else:  # ZeRO-3 gathered the bytes again for backward (parallel/data/zero/params.py)
                assert ctx.gathered.live, "an fp8-gathered weight is not gathered for backward"
                wq = dequantise(ctx.gathered.data, w_scale)
            grad_x = (gq @ wq).view(ctx.x_shape).to(ctx.x_dtype) if need_x else None  # (B*T, in)
            grad_w = (gq.t() @ xq).to(ctx.w_dtype) if need_w else None  # (out, in)
            grad_b = g2.float().sum(0).to(ctx.w_dtype) if ctx.has_bias and need_b else None
        counts = torch.cat([forward_counts, g_counts[None]]).to(g_counts.device) if need_counts else None
        return grad_x, grad_w, grad_b, counts, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               fp8: Fp8Quantiser | None) -> torch.Tensor:
    """F.linear(x, weight, bias), through FP8 where `fp8` is given (emulated): the one matmul
    every fp8 layer calls — Fp8Linear, LoRA's frozen base (and QLoRA's dequantised one), the
    tensor-parallel linears, the experts' per-expert matmuls. Counted only where gradients
    flow (the backward hands the counts to Fp8Stats); evaluation leaves the statistics alone."""
    if fp8 is None or x.numel() == 0:  # no tokens (an expert none chose): nothing to scale
        return F.linear(x, weight, bias)
    return _Fp8Matmul.apply(x, weight, bias, fp8.stats.sink, fp8, torch.is_grad_enabled())


class Fp8Linear(nn.Linear):
    """An nn.Linear whose matmuls round through FP8 (emulated); same parameters, same names."""

    fp8: Fp8Quantiser

    @classmethod
    def from_linear(cls, linear: nn.Linear, quantiser: Fp8Quantiser) -> "Fp8Linear":
        new = cls(linear.in_features, linear.out_features, bias=False, device="meta")
        new.weight, new.bias = linear.weight, linear.bias  # the same Parameter objects
        new.fp8 = quantiser
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias, self.fp8)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.fp8.recipe} (emulated)"


def take_over(new: nn.Module, old: nn.Module, pieces: tuple[str, ...],
              reduce: Callable[[torch.Tensor], torch.Tensor]) -> nn.Module:
    """`new`, a layer built to replace `old` from a piece of it (a column- or row-parallel
    linear: parallel/tensor/decoder.py), multiplies in FP8 where `old` did (an Fp8Linear, or LoRA's layer
    with an fp8 base): `old`'s quantiser, the amaxes of the tensors of `pieces` (those `new`
    holds a piece of) `reduce`d to the whole tensor's (a max over the group). Each piece is then
    scaled as one process scales the whole, so its FP8 values are the bits of one process's (the
    matmul's partial sums add up in another order, as they do without FP8). Returns `new`."""
    fp8: Fp8Quantiser | None = getattr(old, "fp8", None)
    if fp8 is not None:
        fp8.share_amax(pieces, reduce)
        new.fp8 = fp8
    return new


@dataclass
class Fp8State:
    """What apply_fp8 did: the trainer calls `begin_step` before each step and reads `stats`."""

    recipe: str
    emulated: bool
    layers: list[str]
    quantisers: list[Fp8Quantiser]
    stats: Fp8Stats | None
    """Overflow / underflow counts (the emulation only: torchao does not count them)."""

    def begin_step(self) -> None:
        """Delayed scaling takes the last step's amaxes into its history; the counts restart."""
        for q in self.quantisers:
            q.roll()
        if self.stats is not None:
            self.stats.reset()


def fp8_hardware(device: torch.device) -> bool:
    """Whether `device` has FP8 matmul units (CUDA compute capability >= 8.9)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= MIN_CAPABILITY


def fp8_problem(recipe: str, emulate: bool, device: torch.device) -> str | None:
    """Why precision.compute = 'fp8' cannot run on `device` as configured, or None."""
    if emulate:
        return None
    if not fp8_hardware(device):
        what = (f"CUDA compute capability {'.'.join(map(str, torch.cuda.get_device_capability(device)))}"
                if device.type == "cuda" else device.type)
        return (f"precision.compute = 'fp8' needs FP8 hardware (CUDA compute capability >= 8.9: Ada, "
                f"Hopper or later), and this device is {what}. Set precision.fp8_emulate = true to "
                f"emulate the FP8 rounding with bf16 matmuls (for numerics, not speed), or use "
                f"precision.compute = 'bf16'")
    if recipe != "tensorwise":
        return (f"precision.fp8_recipe = {recipe!r} on FP8 hardware: torchao's float8 training (what "
                f"runs there) scales per tensor dynamically ('tensorwise'); use fp8_recipe = "
                f"'tensorwise', or precision.fp8_emulate = true to study {recipe!r} numerically")
    if importlib.util.find_spec("torchao") is None:
        return ("precision.compute = 'fp8' on FP8 hardware runs torchao's float8 training, and "
                "torchao is not installed: pip install 'shardlm[fp8]' (torchao>=0.10)")
    return None


def check_fp8_device(precision: PrecisionConfig, device: torch.device) -> None:
    """ConfigError if `precision` asks for fp8 that `device` cannot run."""
    if precision.compute == "fp8":
        problem = fp8_problem(precision.fp8_recipe, precision.fp8_emulate, device)
        if problem:
            raise ConfigError(problem)


def block_linears(model: nn.Module) -> dict[str, nn.Module]:
    """name -> what apply_fp8 converts inside the blocks (the LM head and embeddings are outside):
    every plain nn.Linear but LoRA's adapters (they stay in the compute dtype), and every layer
    that multiplies through `fp8_linear` itself and says so with a `use_fp8` method (LoRA's
    layer: its frozen base; the experts' stacked weights: models/moe.py)."""
    found = {}
    for n, m in model.blocks.named_modules():
        adapter = n.rpartition(".")[2] in ("lora_A", "lora_B")
        if (type(m) is nn.Linear and not adapter) or hasattr(m, "use_fp8"):
            found[f"blocks.{n}"] = m
    return found


def apply_fp8(model: nn.Module, precision: PrecisionConfig, device: torch.device) -> Fp8State:
    """The linear layers inside our decoder's blocks through FP8, in place (on the meta device or
    materialised), as `precision` (compute = 'fp8') says: torchao's Float8Linear on FP8
    hardware, else (fp8_emulate) each plain nn.Linear swapped for Fp8Linear and each `use_fp8`
    layer given its quantisers (LoRA's frozen base, QLoRA's dequantised one, the experts). The
    layers later steps build in their place (tensor parallelism, expert parallelism) take the
    quantisers over (parallel/tensor/decoder.py, parallel/expert/dispatch.py)."""
    from shardlm.models.decoder import Decoder

    check_fp8_device(precision, device)
    if not isinstance(model, Decoder):
        raise ConfigError(f"precision.compute = 'fp8' converts our decoder's block linears; a "
                          f"{type(model).__name__} is not converted yet: use precision.compute = 'bf16'")
    linears = block_linears(model)
    recipe, block = precision.fp8_recipe, precision.fp8_block
    if not precision.fp8_emulate:
        return _apply_torchao(model, {n: m for n, m in linears.items() if type(m) is nn.Linear})
    stats = Fp8Stats(device)
    quantisers: list[Fp8Quantiser] = []

    def make() -> Fp8Quantiser:
        quantisers.append(Fp8Quantiser(recipe, block, stats))
        return quantisers[-1]

    for name, layer in linears.items():
        if hasattr(layer, "use_fp8"):
            layer.use_fp8(make)
        else:
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, Fp8Linear.from_linear(layer, make()))
    log.info("fp8: EMULATED on %s, recipe %s%s, %d layers, %d matmuls (E4M3 forward, E5M2 backward; "
             "embeddings, norms and the head under bf16 autocast): for numerics, not speed — the "
             "FP8 rounding is emulated and the matmuls run in bf16, slower than bf16 alone",
             device.type, recipe, f" ({block}-wide tiles)" if recipe == "blockwise" else "",
             len(linears), len(quantisers))
    return Fp8State(recipe, True, list(linears), quantisers, stats)


def _apply_torchao(model: nn.Module, linears: dict[str, nn.Linear]) -> Fp8State:
    """torchao's float8 training, tensorwise; its FP8 GEMMs need both dimensions divisible by 16,
    so a layer that is not stays in bf16 (logged)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    chosen = {n for n, m in linears.items() if m.in_features % 16 == 0 and m.out_features % 16 == 0}
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"),
                               module_filter_fn=lambda module, fqn: fqn in chosen)
    log.info("fp8: torchao float8 training (tensorwise) on %d linear layers%s", len(chosen),
             f"; {len(linears) - len(chosen)} left in bf16 (dimensions not divisible by 16)"
             if len(chosen) < len(linears) else "")
    return Fp8State("tensorwise", False, sorted(chosen), [], None)
