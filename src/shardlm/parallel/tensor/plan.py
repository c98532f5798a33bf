"""Tensor parallelism for transformers models that carry a tensor-parallel plan: their config's
`base_model_tp_plan` (Llama, Qwen2, Mistral, ...), applied with our layers (parallel/tensor/decoder.py).

The plan maps module paths of the base model (`layers.*.self_attn.q_proj`, relative to the
`model` inside LlamaForCausalLM: its `base_model_prefix`) to 'colwise' or 'rowwise'. Each
matched nn.Linear becomes our ColumnParallelLinear (this rank's output rows; in an attention
module whole heads: q cut by query heads, k and v by key/value heads) or RowParallelLinear
(this rank's input columns), on the meta device, under the same parameter names; every cut
parameter's `placement.Split` goes into `TPState.splits`, so initialisation, the gradient norm
and checkpoints see whole-tensor coordinates exactly as for our Decoder.

Megatron's rule of one backward all-reduce per block half holds although q, k and v (gate and
up) are separate projections of one input: the first of them brings the input into the
parallel region (f) and the others reuse that tensor (`_SharedInput`), so their gradients meet
before the one all-reduce.

Plain tensor parallelism only: the embedding and the LM head stay replicated (their gradients
are the same on every rank, the loss the ordinary one; a plan's 'embedding_rowwise', GPT-J's,
is left out). A fused projection the plan cuts (CodeGen's qkv_proj, interleaved in its own
layout) is refused: contiguous heads of it are not heads of q, k and v. The checks run before
spawning too (check_tp_plan, from train.build.check_inputs). A vocabulary-parallel embedding and
head for these models, and sequence parallelism (the norms and residuals live inside the
library's modules), are follow-ups.
"""

from __future__ import annotations

import logging
import re

import torch
from torch import nn

from shardlm.comm.collectives import Comm
from shardlm.errors import ConfigError
from shardlm.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from shardlm.parallel.tensor.regions import TPState, into_parallel_region
from shardlm.models.placement import Split, even_range

log = logging.getLogger("shardlm")

STYLES = ("colwise", "rowwise")


def apply_tp_plan(model: nn.Module, comm: Comm, sequence_parallel: bool) -> TPState:
    """Cut the plan's linear layers of a meta-device transformers model (or our adapter around
    one: `model.model`) over `comm`'s group, in place; parameter names stay. Returns the
    TPState, its `splits` keyed by the names `model.named_parameters()` gives."""
    hf = _transformers_model(model)
    plan = check_tp_plan(hf, comm.size)
    if sequence_parallel:
        raise ConfigError(f"parallel.sequence_parallel needs shardlm's Decoder: {type(hf).__name__} "
                          f"is tensor-parallel through its base_model_tp_plan, whose norms and "
                          f"residuals are the library's own modules; set parallel.sequence_parallel "
                          f"= false")
    if any(not p.is_meta for p in model.parameters()):
        raise ConfigError("tensor parallelism is applied to a model on the meta device (the trainer "
                          "builds it so); this one is already materialised: build it under "
                          "torch.device('meta')")
    base = hf.base_model
    prefix = {id(m): n for n, m in model.named_modules()}[id(base)]
    targets = _matched(base, plan)
    tp = TPState(comm, sequence_parallel=False)
    with torch.device("meta"):  # the new layers stay unallocated: the ZeRO engine builds them
        for name, style in targets:
            _cut_linear(base, name, style, tp, f"{prefix}.{name}" if prefix else name)
    for parent in {name.rpartition(".")[0] for name, _ in targets}:
        _set_local_heads(base.get_submodule(parent), comm.size)
    _share_inputs(base, [name for name, style in targets if style == "colwise"], tp)
    model.tp = tp  # where tools and tests find the splits, as on our Decoder
    log.info("tensor parallel (base_model_tp_plan of %s): %d ranks, %d linear layers cut, %d "
             "parameters; embedding and head replicated", type(hf).__name__, comm.size, len(targets),
             len(tp.splits))
    return tp


def check_tp_plan(model: nn.Module, tp: int) -> dict[str, str]:
    """The plan apply_tp_plan will cut `model` (a transformers model, or our adapter around one,
    on any device) by at tensor-parallel size `tp`, or the ConfigError apply_tp_plan would
    raise: no plan, styles we do not apply, heads tp does not divide, keys matching no nn.Linear.
    Cheap: `shardlm train` calls it before spawning (train.build.check_inputs)."""
    hf = _transformers_model(model)
    plan = _plan_of(hf)
    _check_heads(hf, tp)
    _check_unfused(hf, _matched(hf.base_model, plan))
    return plan


def _check_unfused(hf: nn.Module, targets: list[tuple[str, str]]) -> None:
    """In an attention module (one with a head_dim) a cut layer must be one projection: its
    heads (outputs of a 'colwise', inputs of a 'rowwise' one) the query or the key/value heads.
    A fused one (CodeGen's qkv_proj, q, k and v interleaved in its own layout) would be cut by
    contiguous heads into pieces that are not whole heads of q, k and v: refused."""
    config = hf.config
    heads = config.num_attention_heads
    allowed = {heads, getattr(config, "num_key_value_heads", None) or heads}
    for name, style in targets:
        parent = hf.base_model.get_submodule(name.rpartition(".")[0])
        head_dim = getattr(parent, "head_dim", None)
        linear = hf.base_model.get_submodule(name)
        features = linear.out_features if style == "colwise" else linear.in_features
        if isinstance(head_dim, int) and (features % head_dim or features // head_dim not in allowed):
            raise ConfigError(f"{type(hf).__name__}'s base_model_tp_plan makes {name} {style}, but "
                              f"its {features} features are not the query or key/value heads "
                              f"({sorted(allowed)} of {head_dim}): a fused projection shardlm cannot "
                              f"cut by heads; use parallel.tp = 1")


def _transformers_model(model: nn.Module) -> nn.Module:
    """The transformers PreTrainedModel: the model itself, or the one our adapter wraps."""
    for candidate in (model, getattr(model, "model", None)):
        if isinstance(candidate, nn.Module) and hasattr(candidate, "base_model"):
            return candidate  # PreTrainedModel.base_model: the model under base_model_prefix
    raise ConfigError(f"parallel.tp > 1 needs shardlm's Decoder or a transformers model with a "
                      f"tensor-parallel plan (got {type(model).__name__}): use parallel.tp = 1")


def _plan_of(hf: nn.Module) -> dict[str, str]:
    plan = getattr(hf.config, "base_model_tp_plan", None)
    if not plan:
        raise ConfigError(f"{type(hf).__name__} has no base_model_tp_plan in its config, so shardlm "
                          f"does not know which of its layers to cut: use parallel.tp = 1 (and "
                          f"data parallelism / ZeRO for scale), or a model whose config carries a "
                          f"plan (Llama, Qwen2, Mistral, ...)")
    # An embedding's style (GPT-J's 'wte': 'embedding_rowwise'): the embedding stays replicated,
    # as for every model here (the module docstring); the layers it feeds are cut as planned.
    plan = {k: v for k, v in plan.items() if not v.startswith("embedding")}
    unsupported = {k: v for k, v in plan.items() if v not in STYLES}
    if unsupported:
        raise ConfigError(f"{type(hf).__name__}'s base_model_tp_plan uses styles shardlm does not "
                          f"apply yet: {unsupported} (supported: {', '.join(STYLES)}); use "
                          f"parallel.tp = 1")
    return dict(plan)


def _check_heads(hf: nn.Module, tp: int) -> None:
    config = hf.config
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    if heads % tp or kv % tp:
        raise ConfigError(f"parallel.tp = {tp} must divide both the attention heads ({heads}) and "
                          f"the key/value heads ({kv}) of {type(hf).__name__}: each rank computes "
                          f"whole heads. Choose a tp that divides both, or use parallel.tp = 1")


def _matched(base: nn.Module, plan: dict[str, str]) -> list[tuple[str, str]]:
    """(module name in the base model, style) for every module a plan key matches; `*` stands
    for one path component (a layer index)."""
    patterns = [(re.compile(re.escape(key).replace(r"\*", r"[^.]+")), style) for key, style in plan.items()]
    out = []
    for name, module in base.named_modules():
        style = next((s for p, s in patterns if p.fullmatch(name)), None)
        if style is None:
            continue
        if type(module) is not nn.Linear:
            raise ConfigError(f"the base_model_tp_plan of {type(base).__name__} makes {name} "
                              f"({type(module).__name__}) {style}: shardlm cuts only nn.Linear "
                              f"layers; use parallel.tp = 1")
        out.append((name, style))
    if not out:
        raise ConfigError(f"the base_model_tp_plan of {type(base).__name__} matches none of its "
                          f"modules: use parallel.tp = 1")
    return out


def _local_range(module: nn.Module, parent: nn.Module, features: int, tp: TPState) -> tuple[int, int]:
    """This rank's [lo, hi) of `features` (a column-parallel layer's outputs or a row-parallel
    one's inputs): whole heads inside an attention module (one with a head_dim), else an even
    cut of the features."""
    head_dim = getattr(parent, "head_dim", None)
    if not isinstance(head_dim, int):
        return even_range(features, tp.size, tp.rank)
    if features % head_dim:
        raise ConfigError(f"{type(module).__name__} of width {features} in {type(parent).__name__} "
                          f"is not a whole number of heads of {head_dim}: use parallel.tp = 1")
    lo, hi = even_range(features // head_dim, tp.size, tp.rank)
    return lo * head_dim, hi * head_dim


def _cut_linear(base: nn.Module, name: str, style: str, tp: TPState, full_name: str) -> None:
    """Replace the nn.Linear `name` by its column- or row-parallel version; record its Split."""
    parent_name, _, attr = name.rpartition(".")
    parent = base.get_submodule(parent_name)
    linear: nn.Linear = getattr(parent, attr)
    has_bias = linear.bias is not None
    whole = tuple(linear.weight.shape)  # (out, in)
    if style == "colwise":
        lo, hi = _local_range(linear, parent, linear.out_features, tp)
        layer = ColumnParallelLinear(linear.in_features, hi - lo, has_bias, tp, gather_input=False)
        tp.splits[f"{full_name}.weight"] = Split(whole, 0, ((lo, hi),))
        if has_bias:
            tp.splits[f"{full_name}.bias"] = Split((whole[0],), 0, ((lo, hi),))
    else:  # rowwise: the bias, replicated, is added once after the sum
        lo, hi = _local_range(linear, parent, linear.in_features, tp)
        layer = RowParallelLinear(hi - lo, linear.out_features, has_bias, tp)
        tp.splits[f"{full_name}.weight"] = Split(whole, 1, ((lo, hi),))
    setattr(parent, attr, layer)


def _set_local_heads(parent: nn.Module, tp: int) -> None:
    """Head counts a module keeps as attributes, made this rank's (transformers 5's Llama, Qwen2
    and Mistral attention keeps none: it infers heads from view(..., -1, head_dim), and
    num_key_value_groups, a ratio, is unchanged). The shared config is left whole."""
    for attr in ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads"):
        value = getattr(parent, attr, None)
        if isinstance(value, int):
            setattr(parent, attr, value // tp)


class _SharedInput:
    """Megatron's f once per input, however many column-parallel layers of one module read it.

    A forward pre-hook on each of a module's column-parallel layers: the first to see an input
    brings it into the parallel region, the others seeing the same tensor take that result, so
    the backward all-reduce runs once on their summed gradient. A layer given another tensor
    gets its own f, which is still right, only not fused. Forgotten when the module returns (a
    forward hook), so no activation outlives its forward."""

    def __init__(self, tp: TPState):
        self.tp = tp
        self.seen: torch.Tensor | None = None
        self.region: torch.Tensor | None = None

    def enter(self, layer: nn.Module, args: tuple) -> tuple:
        x = args[0]
        if x is not self.seen:
            self.seen, self.region = x, into_parallel_region(x, self.tp)
        return (self.region, *args[1:])

    def forget(self, *_) -> None:
        self.seen = self.region = None


def _share_inputs(base: nn.Module, colwise: list[str], tp: TPState) -> None:
    by_parent: dict[str, list[str]] = {}
    for name in colwise:
        parent, _, attr = name.rpartition(".")
        by_parent.setdefault(parent, []).append(attr)
    for parent_name, attrs in by_parent.items():
        parent, shared = base.get_submodule(parent_name), _SharedInput(tp)
        for attr in attrs:
            getattr(parent, attr).register_forward_pre_hook(shared.enter)
        parent.register_forward_hook(shared.forget)
