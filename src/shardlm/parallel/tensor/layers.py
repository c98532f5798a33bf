"""Tensor parallelism's layers (parallel/tensor/decoder.py puts them in place of a model's own): column-
and row-parallel linears (with LoRA's adapters cut as Megatron and PEFT cut them, a quantised
base as whole stored rows, FP8 scaled by the whole tensor's amax), the shared key/value linear
for tp > n_kv_heads, vocabulary-parallel embedding and head, norms kept in sync over the group,
and the vocabulary-parallel cross-entropy that never gathers the logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardlm.data.sft import IGNORE
from shardlm.models.fp8 import Fp8Quantiser, fp8_linear
from shardlm.models.quant import QuantFormat, quantized_linear, weight_of
from shardlm.models.placement import even_range
from shardlm.parallel.tensor.async_fp8 import fp8_all_gather_matmul, fp8_matmul_reduce_scatter
from shardlm.parallel.tensor.async_tp import all_gather_matmul, matmul_reduce_scatter
from shardlm.parallel.tensor.regions import (CopyToGroup, TPState, into_parallel_region, out_of_parallel_region,
                                             synced)


class ColumnParallelLinear(nn.Module):
    """y_local = x W_localᵀ + b_local: this rank's output features; the input whole.

    `gather_input=False` when the caller has already brought the input into the parallel
    region: several projections of one input (a transformers model's separate q, k and v) then
    share one backward all-reduce instead of each doing its own (parallel/tensor/plan.py)."""

    linear_map = True  # a piece of one y = x Wᵀ: its weight is a matrix Muon orthogonalises (parallel/data/zero/optim.muon_params)

    def __init__(self, in_features: int, out_local: int, bias: bool, tp: TPState,
                 gather_input: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_local, in_features))
        self.bias = nn.Parameter(torch.empty(out_local)) if bias else None
        self.tp = tp
        self.gather_input = gather_input

    quant: QuantFormat | None = None
    """Set by _quantized (lora.quantize): the piece's weight is then `weight_q`, whole stored
    rows of the one-process weight's byte table (models/quant.py), dequantised in forward."""
    fp8: Fp8Quantiser | None = None  # precision.compute = 'fp8': the replaced layer's (_with_fp8)
    FP8_PIECES = ("weight", "grad_output")  # cut here (output features); the input is whole

    def base(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The (frozen or trained) weight's matmul: dequantised from its bytes under QLoRA, in
        FP8 under precision.compute = 'fp8' (a quantised base dequantised, then scaled into FP8,
        as models/lora.py's LoRALinear does)."""
        if self.quant is None:
            return fp8_linear(x, self.weight, bias, self.fp8)
        if self.fp8 is None:
            return quantized_linear(x, self.weight_q, bias, self.quant)
        with torch.no_grad():
            weight = weight_of(self.weight_q, self.quant, torch.float32)
        return fp8_linear(x, weight, bias, self.fp8)

    def overlaps(self) -> bool:
        """parallel.async_tp on a sequence-sharded forward; in FP8 only on a plain base without
        LoRA's adapters (which read the unrounded gathered input: config.layout_rules refuses
        it); a column-parallel layer also only where it gathers its own input."""
        plain = self.fp8 is None or (self.quant is None and not hasattr(self, "lora_A"))
        return self.tp.overlapped and plain and getattr(self, "gather_input", True)

    def overlap_weight(self, x: torch.Tensor) -> torch.Tensor:
        """The weight the overlapped matmuls multiply: the parameter, or QLoRA's frozen base
        dequantised in the dtype its own matmul uses (models/quant.py QuantizedLinearFn) — a
        tensor of its own, which the decomposed op keeps for its backward, where the blocking
        layer keeps the 4-bit codes and dequantises again (docs/architecture.md, "Overlapped")."""
        if self.quant is None:
            return self.weight
        kind = x.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
        with torch.no_grad():
            return weight_of(self.weight_q, self.quant, dtype)

    def gathered(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the base's output, the whole-sequence input): all-gather then matmul, overlapped
        (parallel/tensor/async_tp.py; in FP8 async_fp8.py) or one after the other."""
        if self.overlaps():
            if self.fp8 is not None:
                return fp8_all_gather_matmul(x, self.weight, self.bias, self.fp8, self.tp.group, self.tp.size)
            return all_gather_matmul(x, self.overlap_weight(x), self.bias, self.tp.group, self.tp.size)
        if self.gather_input:
            x = into_parallel_region(x, self.tp)
        return self.base(x, self.bias), x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gathered(x)[0]


class SharedKVLinear(nn.Module):
    """The fused q/k/v projection when tp > n_kv_heads (each key/value head then serves the
    query heads of tp / n_kv_heads ranks): this rank's query rows, and every key/value row,
    replicated across the group (placement.Split.copies: tp rank 0 saves them). The forward
    uses only the one key/value head its query heads read; each rank's gradient of the shared
    rows is its queries' share, summed over the group (Megatron's f on those rows) — one small
    all-reduce of 2·n_kv_heads·head_dim·d_model per block."""

    linear_map = True  # a piece of one y = x Wᵀ: its weight is a matrix Muon orthogonalises (parallel/data/zero/optim.muon_params)

    def __init__(self, in_features: int, q_rows: int, kv_heads: int, head_dim: int, used: int,
                 bias: bool, tp: TPState):
        super().__init__()
        out = q_rows + 2 * kv_heads * head_dim
        self.weight = nn.Parameter(torch.empty(out, in_features))
        self.bias = nn.Parameter(torch.empty(out)) if bias else None
        self.q_rows, self.kv_rows, self.tp = q_rows, kv_heads * head_dim, tp
        self.used = slice(used * head_dim, (used + 1) * head_dim)  # in the k (and the v) rows

    def _pick(self, t: torch.Tensor) -> torch.Tensor:
        """[q rows | k rows of the used head | v rows of the used head], the k/v rows' gradient
        summed over the group."""
        shared = CopyToGroup.apply(t[self.q_rows:], self.tp.group)
        k, v = shared[:self.kv_rows], shared[self.kv_rows:]
        return torch.cat([t[:self.q_rows], k[self.used], v[self.used]])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self._pick(self.bias) if self.bias is not None else None
        return F.linear(into_parallel_region(x, self.tp), self._pick(self.weight), bias)


class RowParallelLinear(nn.Module):
    """y = Σ_ranks x_local W_localᵀ + b: this rank's input features; the bias, replicated, is
    added once, after the sum."""

    linear_map = True  # a piece of one y = x Wᵀ: its weight is a matrix Muon orthogonalises (parallel/data/zero/optim.muon_params)

    def __init__(self, in_local: int, out_features: int, bias: bool, tp: TPState):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_local))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.tp = tp

    quant: QuantFormat | None = None
    fp8: Fp8Quantiser | None = None  # precision.compute = 'fp8': the replaced layer's (_with_fp8)
    FP8_PIECES = ("weight", "input")  # cut here (input features); the output's gradient is whole
    base, overlaps = ColumnParallelLinear.base, ColumnParallelLinear.overlaps
    overlap_weight = ColumnParallelLinear.overlap_weight

    def scattered(self, x: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
        """The partial sums x W_localᵀ (+ extra) summed over the group (this rank's sequence chunk
        when sequence-parallel): matmul then reduction, overlapped under parallel.async_tp."""
        if self.overlaps():
            if self.fp8 is not None:
                return fp8_matmul_reduce_scatter(x, self.weight, self.fp8, self.tp.group, self.tp.size)
            return matmul_reduce_scatter(x, self.overlap_weight(x), extra, self.tp.group, self.tp.size)
        partial = self.base(x, None)
        return out_of_parallel_region(partial if extra is None else partial + extra, self.tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.scattered(x, None)
        return y if self.bias is None else y + synced(self.bias, self.tp)


def _add_adapters(layer: nn.Module, a_shape: tuple[int, int], b_shape: tuple[int, int],
                  lora: nn.Module) -> None:
    """LoRA's two factors on a tensor-parallel linear under LoRALinear's own names (models/
    lora.py: `lora_A.weight` (r, in), `lora_B.weight` (out, r)), cut the way Megatron/PEFT cut
    them: a column-parallel base keeps A whole and this rank's output rows of B; a row-parallel
    base, this rank's input columns of A and B whole. The replicated factor's gradient is a
    partial sum on each rank (it meets only this rank's rows or columns), so the layers sum it
    over the group (Megatron's f on the weight: one all-reduce of r·in or out·r elements)."""
    layer.lora_A = nn.Linear(a_shape[1], a_shape[0], bias=False)
    layer.lora_B = nn.Linear(b_shape[1], b_shape[0], bias=False)
    layer.dropout = lora.dropout
    layer.rank, layer.alpha, layer.scaling = lora.rank, lora.alpha, lora.scaling


class LoRAColumnParallelLinear(ColumnParallelLinear):
    """ColumnParallelLinear + scaling · B_local A x: A replicated (gradient summed over the
    group), B this rank's output rows, like the base's weight. The input's backward all-reduce
    (f) is shared by both paths."""

    def __init__(self, in_features: int, out_local: int, bias: bool, tp: TPState, lora: nn.Module):
        super().__init__(in_features, out_local, bias, tp)
        _add_adapters(self, (lora.rank, in_features), (out_local, lora.rank), lora)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, x = self.gathered(x)
        a = CopyToGroup.apply(self.lora_A.weight, self.tp.group)
        update = F.linear(F.linear(self.dropout(x), a), self.lora_B.weight)  # (…, r) -> (…, out_local)
        return y + self.scaling * update


class LoRASharedKVLinear(SharedKVLinear):
    """SharedKVLinear + scaling · B A x: A replicated (gradient summed over the group), B's rows
    laid out and picked as the base's (this rank's query rows, every key/value row)."""

    def __init__(self, in_features: int, q_rows: int, kv_heads: int, head_dim: int, used: int,
                 bias: bool, tp: TPState, lora: nn.Module):
        super().__init__(in_features, q_rows, kv_heads, head_dim, used, bias, tp)
        _add_adapters(self, (lora.rank, in_features), (self.weight.shape[0], lora.rank), lora)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = into_parallel_region(x, self.tp)
        bias = self._pick(self.bias) if self.bias is not None else None
        a = CopyToGroup.apply(self.lora_A.weight, self.tp.group)
        update = F.linear(F.linear(self.dropout(x), a), self._pick(self.lora_B.weight))
        return F.linear(x, self._pick(self.weight), bias) + self.scaling * update


class LoRARowParallelLinear(RowParallelLinear):
    """RowParallelLinear + scaling · B A_local x_local: A this rank's input columns, like the
    base's weight; B replicated (gradient summed over the group). B (A_local x_local) is this
    rank's partial sum of the update, so it joins the base's partial sum before the one
    reduction (all-reduce, or reduce-scatter when sequence-parallel): Σ_r B h_r = B Σ_r h_r."""

    def __init__(self, in_local: int, out_features: int, bias: bool, tp: TPState, lora: nn.Module):
        super().__init__(in_local, out_features, bias, tp)
        _add_adapters(self, (lora.rank, in_local), (out_features, lora.rank), lora)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = CopyToGroup.apply(self.lora_B.weight, self.tp.group)
        update = F.linear(F.linear(self.dropout(x), self.lora_A.weight), b)  # partial sum (…, out)
        y = self.scattered(x, self.scaling * update)
        return y if self.bias is None else y + synced(self.bias, self.tp)


class VocabParallelEmbedding(nn.Module):
    """This rank's rows [lo, hi) of the vocabulary; ids outside give zeros, and the sum over
    ranks is the embedding (reduce-scattered along the sequence when sequence-parallel)."""

    def __init__(self, lo: int, hi: int, dim: int, tp: TPState):
        super().__init__()
        self.lo, self.hi = lo, hi
        self.weight = nn.Parameter(torch.empty(hi - lo, dim))
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        tp = self.tp
        tp.decide(ids)  # this forward's mode
        outside = (ids < self.lo) | (ids >= self.hi)
        x = F.embedding((ids - self.lo).masked_fill(outside, 0), self.weight)
        return out_of_parallel_region(x.masked_fill(outside.unsqueeze(-1), 0.0), tp)


class VocabParallelHead(nn.Module):
    """Logits for this rank's vocabulary rows only (B, T, hi - lo); `vocab_parallel_cross_
    entropy` takes them as they are, and `gather` assembles the whole vocabulary (sampling)."""

    def __init__(self, embedding: VocabParallelEmbedding | None, lo: int, hi: int, dim: int,
                 vocab: int, tp: TPState):
        super().__init__()
        self.vocab = vocab
        if embedding is not None:  # tied: the same rows of the same Parameter
            self.weight = embedding.weight
        else:
            self.weight = nn.Parameter(torch.empty(hi - lo, dim))
        self.lo, self.hi, self.tp = lo, hi, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(into_parallel_region(x, self.tp), self.weight)

    def gather(self, logits: torch.Tensor) -> torch.Tensor:
        """(…, hi - lo) per rank -> (…, vocab), no gradient (sampling, evaluation output)."""
        sizes = [hi - lo for lo, hi in (even_range(self.vocab, self.tp.size, r) for r in range(self.tp.size))]
        width = max(sizes)
        padded = F.pad(logits, (0, width - logits.shape[-1])).contiguous()
        out = torch.empty((self.tp.size, *padded.shape), dtype=padded.dtype, device=padded.device)
        self.tp.comm.all_gather(out.view(-1), padded.view(-1)).wait()
        return torch.cat([out[r, ..., :sizes[r]] for r in range(self.tp.size)], dim=-1)


class SyncedNorm(nn.Module):
    """LayerNorm / RMSNorm whose weights' gradients are summed over the group when the
    activations are sequence-sharded (same parameters, same names, as the module it replaces)."""

    def __init__(self, norm: nn.Module, tp: TPState):
        from shardlm.models.decoder import OffsetRMSNorm

        super().__init__()
        self.kind = ("offset" if isinstance(norm, OffsetRMSNorm) else
                     "rms" if isinstance(norm, nn.RMSNorm) else "layer")
        self.shape, self.eps = tuple(norm.normalized_shape), norm.eps
        self.weight = norm.weight
        self.bias = getattr(norm, "bias", None)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from shardlm.models.decoder import offset_rms_norm

        w = synced(self.weight, self.tp)
        if self.kind == "offset":  # Gemma's (1 + w)
            return offset_rms_norm(x, w, self.eps)
        if self.kind == "rms":
            return F.rms_norm(x, self.shape, w, self.eps)
        b = synced(self.bias, self.tp) if self.bias is not None else None
        return F.layer_norm(x, self.shape, w, b, self.eps)


class HeadNorm(nn.Module):
    """A query or key RMSNorm (model.qk_norm) on this rank's heads: its weights, shared by every
    head, get a gradient from this rank's heads only, so it is summed over the group (Megatron's
    f on the weights), with or without sequence parallelism."""

    def __init__(self, norm: nn.Module, tp: TPState):
        from shardlm.models.decoder import OffsetRMSNorm

        super().__init__()
        self.offset = isinstance(norm, OffsetRMSNorm)  # Gemma 3's (1 + w)
        self.shape, self.eps = tuple(norm.normalized_shape), norm.eps
        self.weight = norm.weight
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from shardlm.models.decoder import offset_rms_norm

        w = CopyToGroup.apply(self.weight, self.tp.group)
        return offset_rms_norm(x, w, self.eps) if self.offset else F.rms_norm(x, self.shape, w, self.eps)


class SyncedEmbedding(nn.Module):
    """Learned positions added to sequence-sharded activations: this rank's chunk of positions,
    the gradient summed over the group."""

    def __init__(self, embedding: nn.Embedding, tp: TPState):
        super().__init__()
        self.weight = embedding.weight
        self.tp = tp

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        tp = self.tp
        if tp.sharded:
            lo, hi = even_range(positions.shape[0], tp.size, tp.rank)
            positions = positions[lo:hi]
        return F.embedding(positions, synced(self.weight, tp))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean over tokens of -log softmax(logits)[target], logits split over the vocabulary:
    three all-reduces of one number per token (the max, the sum of exponentials, the target's
    logit), never the logits themselves. Targets of -100 (the SFT formats' prompt tokens) are
    ignored, as F.cross_entropy's ignore_index: the mean is over the others, which alone get a
    gradient. Every tp rank holds every target, so the count needs no communication."""

    @staticmethod
    def forward(ctx, logits, targets, lo, hi, comm, count):
        import torch.distributed as dist

        ctx.dtype = logits.dtype
        logits = logits.float()  # (N, V_local): the softmax in fp32, as the unsplit loss does
        top = logits.max(dim=-1).values
        if comm.group is not None:
            comm.all_reduce(top, op=dist.ReduceOp.MAX).wait()
        shifted = logits - top.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        outside = (targets < lo) | (targets >= hi)  # -100 too: on no rank
        local_target = (targets - lo).masked_fill(outside, 0)
        picked = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        both = torch.stack([sum_exp, picked])
        comm.all_reduce(both).wait()
        sum_exp, picked = both[0], both[1]
        kept = targets != IGNORE
        if count is None:
            count = kept.sum()  # no kept target: nan, as F.cross_entropy gives
        ctx.save_for_backward(exp, sum_exp, local_target, outside, kept, count)
        return torch.where(kept, sum_exp.log() - picked, 0.0).sum() / count

    @staticmethod
    def backward(ctx, grad):
        exp, sum_exp, local_target, outside, kept, count = ctx.saved_tensors
        softmax = exp / sum_exp.unsqueeze(-1)
        rows = torch.arange(softmax.shape[0], device=softmax.device)
        softmax[rows, local_target] -= (~outside).to(softmax.dtype)
        softmax *= kept.unsqueeze(-1).to(softmax.dtype)  # an ignored target's row: no gradient
        return (softmax * (grad / count)).to(ctx.dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, head: VocabParallelHead,
                                 count: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy of (B, T, V_local) logits against (B, T) targets; equals
    F.cross_entropy of the gathered logits (tests/test_tensor_parallel.py). `count`: what the
    summed loss of the kept targets is divided by (default: how many there are)."""
    return _VocabParallelCrossEntropy.apply(logits.flatten(0, 1), targets.flatten(), head.lo, head.hi,
                                            head.tp.comm, count)
