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

Here: apply_tp, which cuts a model's layers; the layers are parallel/tensor/layers.py, the regions (the
autograd functions and the group's state) parallel/tensor/regions.py, the q/k norms over all heads
parallel/tensor/norms.py.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from shardlm.comm.collectives import Comm
from shardlm.parallel.tensor.ops import all_reduce_max
from shardlm.parallel.tensor.norms import split_qk_norms
from shardlm.errors import ConfigError
from shardlm.models.flops import head_dim
from shardlm.models.fp8 import take_over
from shardlm.models.quant import QuantFormat, quantize_layer, table_split
from shardlm.models.placement import Split, even_range
from shardlm.parallel.tensor.layers import (ColumnParallelLinear, HeadNorm, LoRAColumnParallelLinear,
                                            LoRARowParallelLinear, LoRASharedKVLinear, RowParallelLinear,
                                            SharedKVLinear, SyncedEmbedding, SyncedNorm, VocabParallelEmbedding,
                                            VocabParallelHead)
from shardlm.parallel.tensor.regions import TPState, frozen_kept

log = logging.getLogger("shardlm")


# ---------------------------------------------------------------------------------------------
# Collectives as autograd functions


# ---------------------------------------------------------------------------------------------
# Layers (built on the meta device by apply_tp; the ZeRO engine materialises them)


# ---------------------------------------------------------------------------------------------
# The loss


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
    by its config's base_model_tp_plan instead (parallel/tensor/plan.py)."""
    from shardlm.models.decoder import Decoder

    if comm.size == 1:
        return None
    if not isinstance(model, Decoder):
        raise ConfigError(f"apply_tp cuts shardlm's Decoder (got {type(model).__name__}): a "
                          f"transformers model is cut by its config's base_model_tp_plan "
                          f"(parallel/tensor/plan.py; parallelize chooses)")
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
            attn.qkv = _with_fp8(_column(d, sum(hi - lo for lo, hi in qkv_ranges), bias, tp, attn.qkv), attn.qkv, tp)
        else:  # tp > n_kv_heads: every key/value row on every rank, one head used
            qkv_ranges, copies = [(q_lo, q_hi), (nq, nq + nkv), (nq + nkv, nq + 2 * nkv)], (1, 2)
            if getattr(attn.qkv, "quant", None) is not None:
                raise ConfigError(f"lora.quantize with parallel.tp = {n} > model.n_kv_heads = {kv}: "
                                  f"the key/value rows every rank keeps are not cut from a quantised "
                                  f"base yet; set parallel.tp <= {kv} or lora.quantize = 'none'")
            shared = (d, q_hi - q_lo, kv, hd, r // (n // kv), bias, tp)
            if getattr(attn.qkv, "fp8", None) is not None:  # config_rules._fp8_composes refuses it
                raise ConfigError(f"precision.compute = 'fp8' with parallel.tp = {n} > the {kv} key/value "
                                  f"heads: the shared key/value rows are not scaled into FP8 as one "
                                  f"process scales them; use parallel.tp <= {kv}")
            attn.qkv = SharedKVLinear(*shared) if lora is None else LoRASharedKVLinear(*shared, lora)
        tp.splits[f"{pre}.attn.qkv.weight"] = Split(whole, 0, tuple(qkv_ranges), copies)
        if bias:
            tp.splits[f"{pre}.attn.qkv.bias"] = Split((whole[0],), 0, tuple(qkv_ranges), copies)
        if lora is not None:
            tp.splits[f"{pre}.attn.qkv.lora_B.weight"] = Split((whole[0], lora.rank), 0,
                                                               tuple(qkv_ranges), copies)
        attn.proj = _row(attn.proj, f"{pre}.attn.proj", (q_lo, q_hi), tp)
        attn.n_heads, attn.n_kv_heads = cfg.n_heads // n, max(1, kv // n)
        if cfg.qk_norm and cfg.qk_norm_width == "all":  # OLMo-2's: over every head (parallel/tensor/norms.py)
            split_qk_norms(attn, pre, qkv_ranges, tp)
        elif cfg.qk_norm:
            attn.q_norm, attn.k_norm = HeadNorm(attn.q_norm, tp), HeadNorm(attn.k_norm, tp)
        if not isinstance(block.mlp, MoE):  # a MoE block: parallel/expert/dispatch.py spread_over_tp
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
        mlp.gate_up = _with_fp8(_column(d, 2 * (h_hi - h_lo), bias, tp, mlp.gate_up), mlp.gate_up, tp)
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
        mlp.fc = _with_fp8(_column(d, h_hi - h_lo, bias, tp, mlp.fc), mlp.fc, tp)
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
    return _with_fp8(_quantized(new, old, (out_features, hi - lo)), old, tp)


def _with_fp8(new: nn.Module, old: nn.Module, tp: TPState) -> nn.Module:
    """`new` multiplies in FP8 where `old` did, each piece scaled by its whole tensor's amax (the
    max over the tp group): models/fp8.py take_over."""
    return take_over(new, old, new.FP8_PIECES, lambda amax, group=tp.group: all_reduce_max(amax, group))
