"""Tensor parallelism (Megatron-LM: Shoeybi et al. 2019) and sequence parallelism (Korthikanti
et al. 2022) for our Decoder, with our own autograd functions over plain tensors.

Per block, with T ranks in the tensor-parallel group:

    attention  q/k/v projection column-parallel (this rank's heads: n_heads/T query heads and
               n_kv_heads/T key/value heads), attention on those heads, output projection
               row-parallel; MLP: fc (or SwiGLU's fused gate/up) column-parallel, proj (down)
               row-parallel; the token embedding and the head vocabulary-parallel, and the loss
               a vocabulary-parallel cross-entropy that never gathers the logits.

Without sequence parallelism each half-block costs one all-reduce of the activations forward
(after the row-parallel projection: `g`) and one backward (before the column-parallel one: `f`).
With it, norms, dropout and residuals run on this rank's 1/T of the sequence; the all-reduces
become an all-gather before the column-parallel projection and a reduce-scatter after the
row-parallel one (same bytes, 1/T of those activations held), and the norm weights' gradients,
now computed from different tokens on each rank, are summed over the group.

LoRA's adapters (models/lora.py) are cut with the linears they wrap, as Megatron and PEFT cut
them: A whole and B by output rows beside a column-parallel base, A by input columns and B whole
beside a row-parallel one, whose update's partial sum joins the base's before the one reduction;
the whole factor's gradient (a partial sum per rank) summed over the group. A layer replaced here
keeps its parameters frozen where they were (frozen_kept: LoRA's base stays frozen).

Why our own functions and not DTensor's parallel styles: the ZeRO engine flattens each unit's
parameters into one flat buffer of plain tensors and shards it over the data-parallel ranks. A
tensor-parallel parameter is then just a smaller plain tensor (its `placement.Split` says where
it sits in the whole), ZeRO-sharded like any other — the 2-D sharding of FSDP2 + TP without a
tensor subclass to dispatch through on every op. Every collective goes through `comm.Comm`, so
it is in the byte ledger and under the watchdog. See docs/architecture.md.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from shardlm.comm.collectives import Comm
from shardlm.data.sft import IGNORE
from shardlm.parallel.collective_ops import all_reduce, gather_seq, op_group, reduce_scatter_seq
from shardlm.errors import ConfigError
from shardlm.models.flops import head_dim
from shardlm.models.quant import QuantFormat, quantize_layer, quantized_linear, table_split
from shardlm.placement import Split, even_range

log = logging.getLogger("shardlm")


@dataclass
class TPState:
    """The tensor-parallel group of one model, and whether this forward runs sequence-parallel
    (decided per forward by the embedding: only when the sequence divides by the group)."""

    comm: Comm
    sequence_parallel: bool
    sharded: bool = False
    """True while this forward's activations outside attention and MLP are sequence-sharded."""
    splits: dict[str, Split] = field(default_factory=dict)
    group: str = ""
    """The group's key for the collective ops (collective_ops.op_group), set from `comm`."""

    def __post_init__(self) -> None:
        self.group = op_group(self.comm)

    @property
    def size(self) -> int:
        return self.comm.size

    @property
    def rank(self) -> int:
        return self.comm.rank

    def decide(self, ids: torch.Tensor) -> None:
        """This forward's mode, from its (B, T) token ids: sequence-sharded only when the
        sequence divides by the group."""
        self.sharded = self.sequence_parallel and ids.shape[1] % self.size == 0


# ---------------------------------------------------------------------------------------------
# Collectives as autograd functions


class _CopyToGroup(torch.autograd.Function):
    """Identity forward, all-reduce backward (Megatron's f): before a column-parallel matmul,
    and on a replicated parameter whose gradient each rank computes from different tokens.
    `group`: the group's key (collective_ops.op_group), so a compiled block traces it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    """All-reduce forward, identity backward (Megatron's g): after a row-parallel matmul."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence forward, reduce-scatter backward (sequence parallelism's
    replacement for f)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_seq(grad, ctx.group), None


class _ReduceScatterSequence(torch.autograd.Function):
    """Reduce-scatter along the sequence forward, all-gather backward (the replacement for g)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_seq(grad, ctx.group), None


def into_parallel_region(x: torch.Tensor, tp: TPState) -> torch.Tensor:
    """Before a column-parallel matmul: the whole sequence on every rank."""
    if tp.sharded:
        return _GatherSequence.apply(x, tp.group)
    return _CopyToGroup.apply(x, tp.group)


def out_of_parallel_region(x: torch.Tensor, tp: TPState) -> torch.Tensor:
    """After a row-parallel matmul (or the vocabulary-parallel embedding): partial sums summed,
    whole (plain TP) or this rank's sequence chunk (sequence parallel)."""
    if tp.sharded:
        return _ReduceScatterSequence.apply(x, tp.group)
    return _ReduceFromGroup.apply(x, tp.group)


def copy_to_group(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Identity forward, the group's sum of the gradient backward (Megatron's f)."""
    return _CopyToGroup.apply(x, op_group(comm))


def reduce_from_group(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """The group's sum of x forward, identity backward (Megatron's g): each rank's gradient
    goes to its own addend (also a MoE block's router statistics over the ranks' token shares)."""
    return _ReduceFromGroup.apply(x, op_group(comm))


def summed(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """The group's sum of x, outside autograd (a copy; x is unchanged)."""
    return all_reduce(x.detach(), op_group(comm))


def synced(param: torch.Tensor, tp: TPState) -> torch.Tensor:
    """A replicated parameter used on sequence-sharded activations: its gradient summed over
    the group (each rank saw different tokens). Plain TP: every rank's gradient is the same."""
    return _CopyToGroup.apply(param, tp.group) if tp.sharded else param


@contextmanager
def frozen_kept(model: nn.Module) -> Iterator[None]:
    """Layers replaced inside keep, by name, which parameters are frozen (LoRA's base: apply_lora
    froze every parameter but the adapters, and a new layer's parameters would otherwise train).
    Used by every step that replaces layers after apply_lora (apply_tp, parallel/expert.py)."""
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    yield
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)


# ---------------------------------------------------------------------------------------------
# Layers (built on the meta device by apply_tp; the ZeRO engine materialises them)


class ColumnParallelLinear(nn.Module):
    """y_local = x W_localᵀ + b_local: this rank's output features; the input whole.

    `gather_input=False` when the caller has already brought the input into the parallel
    region: several projections of one input (a transformers model's separate q, k and v) then
    share one backward all-reduce instead of each doing its own (parallel/tensor_plan.py)."""

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

    def base(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant is None:
            return F.linear(x, self.weight, bias)
        return quantized_linear(x, self.weight_q, bias, self.quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gather_input:
            x = into_parallel_region(x, self.tp)
        return self.base(x, self.bias)


class SharedKVLinear(nn.Module):
    """The fused q/k/v projection when tp > n_kv_heads (each key/value head then serves the
    query heads of tp / n_kv_heads ranks): this rank's query rows, and every key/value row,
    replicated across the group (placement.Split.copies: tp rank 0 saves them). The forward
    uses only the one key/value head its query heads read; each rank's gradient of the shared
    rows is its queries' share, summed over the group (Megatron's f on those rows) — one small
    all-reduce of 2·n_kv_heads·head_dim·d_model per block."""

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
        shared = _CopyToGroup.apply(t[self.q_rows:], self.tp.group)
        k, v = shared[:self.kv_rows], shared[self.kv_rows:]
        return torch.cat([t[:self.q_rows], k[self.used], v[self.used]])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self._pick(self.bias) if self.bias is not None else None
        return F.linear(into_parallel_region(x, self.tp), self._pick(self.weight), bias)


class RowParallelLinear(nn.Module):
    """y = Σ_ranks x_local W_localᵀ + b: this rank's input features; the bias, replicated, is
    added once, after the sum."""

    def __init__(self, in_local: int, out_features: int, bias: bool, tp: TPState):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_local))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.tp = tp

    quant: QuantFormat | None = None
    base = ColumnParallelLinear.base

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = out_of_parallel_region(self.base(x, None), self.tp)
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
        x = into_parallel_region(x, self.tp)
        a = _CopyToGroup.apply(self.lora_A.weight, self.tp.group)
        update = F.linear(F.linear(self.dropout(x), a), self.lora_B.weight)  # (…, r) -> (…, out_local)
        return self.base(x, self.bias) + self.scaling * update


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
        a = _CopyToGroup.apply(self.lora_A.weight, self.tp.group)
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
        b = _CopyToGroup.apply(self.lora_B.weight, self.tp.group)
        update = F.linear(F.linear(self.dropout(x), self.lora_A.weight), b)  # partial sum (…, out)
        y = out_of_parallel_region(self.base(x, None) + self.scaling * update, self.tp)
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

        w = _CopyToGroup.apply(self.weight, self.tp.group)
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


# ---------------------------------------------------------------------------------------------
# The loss


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


# ---------------------------------------------------------------------------------------------
# Applying it to a Decoder


def _check(cfg, tp: int) -> None:
    kv = cfg.n_kv_heads or cfg.n_heads
    if cfg.n_heads % tp or (kv % tp and tp % kv):
        raise ConfigError(f"parallel.tp = {tp} must divide model.n_heads ({cfg.n_heads}), and either "
                          f"divide the key/value heads ({kv}) or be a multiple of them (each key/value "
                          f"head then replicated on tp / n_kv_heads ranks): each rank computes whole heads")


def apply_tp(model: nn.Module, comm: Comm, sequence_parallel: bool) -> TPState | None:
    """Replace a meta-device Decoder's layers by their tensor-parallel versions over `comm`'s
    group, in place; parameter names stay. Returns the TPState (its `splits`: each cut
    parameter's place in the whole), or None for a group of one. A transformers model is cut
    by its config's base_model_tp_plan instead (parallel/tensor_plan.py)."""
    from shardlm.models.decoder import Decoder

    if comm.size == 1:
        return None
    if not isinstance(model, Decoder):
        raise ConfigError(f"apply_tp cuts shardlm's Decoder (got {type(model).__name__}): a "
                          f"transformers model is cut by its config's base_model_tp_plan "
                          f"(parallel/tensor_plan.py; parallelize chooses)")
    if any(not p.is_meta for p in model.parameters()):
        raise ConfigError("tensor parallelism is applied to a model on the meta device (the trainer "
                          "builds it so); this one is already materialised")
    cfg, n, r = model.cfg, comm.size, comm.rank
    _check(cfg, n)
    with torch.device("meta"), frozen_kept(model):  # unallocated: the ZeRO engine builds them
        tp = _replace_layers(model, cfg, comm, n, r, sequence_parallel)
    quantize_splits(model, tp)
    log.info("tensor parallel: %d ranks, %s; %d parameters cut (heads %d/%d per rank)", n,
             "sequence parallel" if sequence_parallel else "no sequence parallelism",
             len(tp.splits), cfg.n_heads // n, cfg.n_heads)
    return tp


def _replace_layers(model, cfg, comm: Comm, n: int, r: int, sequence_parallel: bool) -> TPState:
    from shardlm.models.moe import MoE

    tp = TPState(comm, sequence_parallel)
    d, hd = cfg.d_model, head_dim(cfg)
    kv = cfg.n_kv_heads or cfg.n_heads

    def cut(name: str, shape: tuple[int, ...], dim: int, ranges) -> None:
        tp.splits[name] = Split(tuple(shape), dim, tuple(ranges))

    for i, block in enumerate(model.blocks):
        pre = f"blocks.{i}"
        attn = block.attn
        q_lo, q_hi = (x * hd for x in even_range(cfg.n_heads, n, r))
        nq, nkv = cfg.n_heads * hd, kv * hd
        whole, bias = (attn.qkv.out_features, attn.qkv.in_features), attn.qkv.bias is not None
        copies = ()
        lora = _lora_of(attn.qkv)
        if kv % n == 0:  # this rank's key/value heads
            k_lo, k_hi = (x * hd for x in even_range(kv, n, r))
            qkv_ranges = [(q_lo, q_hi), (nq + k_lo, nq + k_hi), (nq + nkv + k_lo, nq + nkv + k_hi)]
            attn.qkv = _column(d, sum(hi - lo for lo, hi in qkv_ranges), bias, tp, attn.qkv)
        else:  # tp > n_kv_heads: every key/value row on every rank, one head used
            qkv_ranges, copies = [(q_lo, q_hi), (nq, nq + nkv), (nq + nkv, nq + 2 * nkv)], (1, 2)
            if getattr(attn.qkv, "quant", None) is not None:
                raise ConfigError(f"lora.quantize with parallel.tp = {n} > model.n_kv_heads = {kv}: "
                                  f"the key/value rows every rank keeps are not cut from a quantised "
                                  f"base yet; set parallel.tp <= {kv} or lora.quantize = 'none'")
            shared = (d, q_hi - q_lo, kv, hd, r // (n // kv), bias, tp)
            attn.qkv = SharedKVLinear(*shared) if lora is None else LoRASharedKVLinear(*shared, lora)
        tp.splits[f"{pre}.attn.qkv.weight"] = Split(whole, 0, tuple(qkv_ranges), copies)
        if bias:
            tp.splits[f"{pre}.attn.qkv.bias"] = Split((whole[0],), 0, tuple(qkv_ranges), copies)
        if lora is not None:
            tp.splits[f"{pre}.attn.qkv.lora_B.weight"] = Split((whole[0], lora.rank), 0,
                                                               tuple(qkv_ranges), copies)
        attn.proj = _row(attn.proj, f"{pre}.attn.proj", (q_lo, q_hi), tp)
        attn.n_heads, attn.n_kv_heads = cfg.n_heads // n, max(1, kv // n)
        if cfg.qk_norm:
            attn.q_norm, attn.k_norm = HeadNorm(attn.q_norm, tp), HeadNorm(attn.k_norm, tp)
        if not isinstance(block.mlp, MoE):  # a MoE block: parallel/expert.py spread_over_tp
            cut_mlp(block.mlp, f"{pre}.mlp", d, tp)
        block.attn_norm, block.mlp_norm = SyncedNorm(block.attn_norm, tp), SyncedNorm(block.mlp_norm, tp)
        if hasattr(block, "attn_post_norm"):  # sandwich norms (Gemma 2, 3)
            block.attn_post_norm = SyncedNorm(block.attn_post_norm, tp)
            block.mlp_post_norm = SyncedNorm(block.mlp_post_norm, tp)
    v_lo, v_hi = even_range(cfg.vocab_size, n, r)
    model.tok_emb = VocabParallelEmbedding(v_lo, v_hi, d, tp)
    cut("tok_emb.weight", (cfg.vocab_size, d), 0, [(v_lo, v_hi)])
    if cfg.position == "learned":
        model.pos_emb = SyncedEmbedding(model.pos_emb, tp)
    model.norm_f = SyncedNorm(model.norm_f, tp)
    model.head = VocabParallelHead(model.tok_emb if cfg.tie_embeddings else None, v_lo, v_hi, d,
                                   cfg.vocab_size, tp)
    if not cfg.tie_embeddings:
        cut("head.weight", (cfg.vocab_size, d), 0, [(v_lo, v_hi)])
    model.tp = tp
    return tp


def cut_mlp(mlp: nn.Module, pre: str, d: int, tp: TPState) -> None:
    """A dense MLP (named `pre`, width d in and out) column- then row-parallel: this rank's 1/T
    of its hidden width; the cut parameters' Splits recorded in tp.splits."""
    from shardlm.models.decoder import GeluMLP, SwiGLU

    n, r = tp.size, tp.rank

    def cut(name: str, shape: tuple[int, ...], dim: int, ranges) -> None:
        tp.splits[name] = Split(tuple(shape), dim, tuple(ranges))

    if isinstance(mlp, SwiGLU):
        h_lo, h_hi = even_range(mlp.hidden, n, r)
        ranges = [(h_lo, h_hi), (mlp.hidden + h_lo, mlp.hidden + h_hi)]
        bias = mlp.gate_up.bias is not None
        lora = _lora_of(mlp.gate_up)
        mlp.gate_up = _column(d, 2 * (h_hi - h_lo), bias, tp, mlp.gate_up)
        cut(f"{pre}.gate_up.weight", (2 * mlp.hidden, d), 0, ranges)
        if bias:
            cut(f"{pre}.gate_up.bias", (2 * mlp.hidden,), 0, ranges)
        if lora is not None:
            cut(f"{pre}.gate_up.lora_B.weight", (2 * mlp.hidden, lora.rank), 0, ranges)
        mlp.down = _row(mlp.down, f"{pre}.down", (h_lo, h_hi), tp)
        mlp.hidden = h_hi - h_lo
    elif isinstance(mlp, GeluMLP):
        hidden = mlp.fc.out_features
        h_lo, h_hi = even_range(hidden, n, r)
        bias = mlp.fc.bias is not None
        lora = _lora_of(mlp.fc)
        mlp.fc = _column(d, h_hi - h_lo, bias, tp, mlp.fc)
        cut(f"{pre}.fc.weight", (hidden, d), 0, [(h_lo, h_hi)])
        if bias:
            cut(f"{pre}.fc.bias", (hidden,), 0, [(h_lo, h_hi)])
        if lora is not None:
            cut(f"{pre}.fc.lora_B.weight", (hidden, lora.rank), 0, [(h_lo, h_hi)])
        mlp.proj = _row(mlp.proj, f"{pre}.proj", (h_lo, h_hi), tp)


def _lora_of(layer: nn.Module) -> nn.Module | None:
    """The LoRALinear (models/lora.py) a layer is, or None for a plain linear."""
    from shardlm.models.lora import LoRALinear

    return layer if isinstance(layer, LoRALinear) else None


def _quantized(new: nn.Module, old: nn.Module, shape: tuple[int, int]) -> nn.Module:
    """`new` (on meta) with `old`'s quantised base (models/quant.py) for its piece of `shape`:
    whole stored rows of the table (quantize_splits records where they sit)."""
    fmt = getattr(old, "quant", None)
    return new if fmt is None else quantize_layer(new, fmt.local(shape))


def quantize_splits(model: nn.Module, tp: TPState) -> None:
    """Each quantised layer's Split of `weight` becomes its byte table's (models.quant.table_split)."""
    for name, module in model.named_modules():
        fmt = getattr(module, "quant", None)
        if isinstance(fmt, QuantFormat) and f"{name}.weight" in tp.splits:
            tp.splits[f"{name}.weight_q"] = table_split(tp.splits.pop(f"{name}.weight"), fmt, name)


def _column(in_features: int, out_local: int, bias: bool, tp: TPState,
            old: nn.Module) -> ColumnParallelLinear:
    """A column-parallel linear, with LoRA's adapters and quantised base where `old` had them."""
    lora = _lora_of(old)
    if lora is None:
        new = ColumnParallelLinear(in_features, out_local, bias, tp)
    else:
        new = LoRAColumnParallelLinear(in_features, out_local, bias, tp, lora)
    return _quantized(new, old, (out_local, in_features))


def _row(old: nn.Module, name: str, local: tuple[int, int], tp: TPState) -> RowParallelLinear:
    """`old` (named `name`, an nn.Linear, LoRALinear or QuantizedLinear) row-parallel: this rank's
    input columns [lo, hi) of its weight (and of LoRA's A); their Splits recorded in tp.splits."""
    lo, hi = local
    out_features, in_features = old.out_features, old.in_features
    bias, lora = old.bias is not None, _lora_of(old)
    tp.splits[f"{name}.weight"] = Split((out_features, in_features), 1, ((lo, hi),))
    if lora is None:
        new = RowParallelLinear(hi - lo, out_features, bias, tp)
    else:
        tp.splits[f"{name}.lora_A.weight"] = Split((lora.rank, in_features), 1, ((lo, hi),))
        new = LoRARowParallelLinear(hi - lo, out_features, bias, tp, lora)
    return _quantized(new, old, (out_features, hi - lo))
