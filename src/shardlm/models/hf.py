"""Adapters that plug a Hugging Face transformers model into our loop unmodified.

The loop calls `forward(idx) -> logits (B, T, vocab)` and computes the loss itself (trainer.
loss_of); a transformers model takes keyword arguments and returns a ModelOutput. An adapter
is the thinnest bridge: the wrapped model is a registered child (`self.model`), so the ZeRO
engine sees its modules unchanged — the units are found as for any model (the largest
nn.ModuleList's children, or `parallel.units` class names; parallel/data/zero/units.py), and tied weights
(GPT-2's and T5's embedding = output head) are the same Parameter in two places, which the
engine keeps tied.

    model = CausalLMAdapter(LlamaForCausalLM(LlamaConfig(vocab_size=cfg.model.vocab_size, ...)))
    run = build_run(cfg, model=model)

From the CLI, a model.hf_path our decoder does not map is built into these adapters by
models/hf_build.py (the transformers path: docs/finetuning.md).

Build the model on the meta device (`with torch.device("meta"): LlamaForCausalLM(config)`) and
the sharded build materialises it a unit at a time on each rank: every leaf module is
initialised by the model's own `_init_weights`, seeded from (train.seed, module name), so any
layout builds the same weights (models/init.py). Or build it on the CPU, identically on every
rank (seed torch first). Set `attn_implementation` explicitly, and dropout to 0 if runs are to
be compared: each rank draws its own masks.
transformers is an optional extra (`pip install shardlm[hf]`): nothing here imports it, the
adapters only call the model they are given.

Mixtures of experts (Mixtral, Qwen2-MoE, OLMoE, ...): transformers adds a model's load-balancing
loss (`router_aux_loss_coef` × `aux_loss`, Switch's loss over the forward's tokens) only to the
loss it computes itself from `labels`, and only with `output_router_logits`. Our loop computes
the loss from the logits, so CausalLMAdapter asks for the router logits while training and
attaches `coef × aux_loss` to the logits the way our own MoE layers attach theirs
(models.moe._AttachAuxLoss: identity forward, backward gives the term the language-model loss's
gradient scale). That scale is `MoEStats.grad_scale`, which the trainer already sets on any model
with a `moe_stats` before each step; the adapter's MoEStats has no layers of its own (transformers'
layers record nothing: `sums` stays None, so no per-expert telemetry is logged) and no biases.
Expert parallelism (parallel.ep) replaces the model's experts modules where their layout allows
(parallel/expert/dispatch.py: StackedExperts).
transformers computes the loss from one forward's router logits, i.e. per micro-batch, as our
layers do: a rank's micro-batch gets the term one process with gradient accumulation gives it.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from shardlm.models.init import parameter_seed
from shardlm.models.lora import adapter_initial_value, is_adapter, remove_lora
from shardlm.models.moe import MoEStats, _AttachAuxLoss


WRAPPED = "model."
"""The prefix an adapter puts on the wrapped model's parameter and module names (`self.model`):
`model.transformer.h.0.attn.q_proj.weight` is the library's `transformer.h.0.attn.q_proj.weight`."""


def _check_vocab(model: nn.Module, vocab_size: int | None) -> None:
    got = getattr(model.config, "vocab_size", None)
    if vocab_size is not None and got != vocab_size:
        raise ValueError(f"{type(model).__name__} has vocab_size {got}, the data {vocab_size}: "
                         "build it with the config's model.vocab_size")


class _PieceByPieceInit(nn.Module):
    """initial_value / init_buffers (models/init.py) for a transformers model built on meta."""

    model: nn.Module

    @torch.no_grad()
    def initial_value(self, name: str, seed: int) -> torch.Tensor:
        """Parameter `name`'s initial values, as the library initialises it: in a copy of the
        model still on the meta device, its leaf module is given CPU memory, then the model's
        own `_init_weights` runs on the leaf and on every module above it, leaf first (GPT-2
        re-scales c_proj from its parent block), under a seed of (seed, module name). On the
        other, meta, modules it computes nothing. A LoRA adapter (models/lora.py) starts as
        PEFT starts it, as on our Decoder."""
        if is_adapter(name):
            return adapter_initial_value(name, tuple(self.get_parameter(name).shape), seed)
        module_name, _, attr = name.rpartition(".")
        twin = copy.deepcopy(self)
        remove_lora(twin)  # a LoRA-wrapped layer's own weight: initialised as the nn.Linear it was
        leaf = twin.get_submodule(module_name).to_empty(device="cpu")
        for param in leaf.parameters(recurse=False):
            param.fill_(float("nan"))  # what _init_weights leaves alone shows up below
        parts = module_name.split(".")
        chain = [twin.get_submodule(".".join(parts[:i])) for i in range(len(parts), -1, -1)]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(parameter_seed(seed, module_name))
            for module in chain:
                twin.model._init_weights(module)
        value = getattr(leaf, attr).detach().float()
        if torch.isnan(value).any():
            raise TypeError(f"{type(self.model).__name__}._init_weights does not initialise "
                            f"{type(leaf).__name__} ({name}): build this model on the CPU instead")
        return value

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Buffers computed in a module's constructor (LLaMA's rotary inv_freq): the module
        rebuilt on the CPU from its config, its buffers copied in; a module without a config
        (GPT-J's sinusoid table) by the model's own `_init_weights`, which in transformers 5
        fills the buffers a meta-device build left empty."""
        for name, module in self.named_modules():
            own = dict(module.named_buffers(recurse=False))
            if not own:
                continue
            if hasattr(module, "config"):
                with torch.device("cpu"):
                    fresh = type(module)(module.config)
                for key, value in fresh.named_buffers(recurse=False):
                    own[key].copy_(value)
                continue
            unset = {key: _unset(b.dtype) for key, b in own.items()}
            for key, buffer in own.items():  # what _init_weights leaves alone shows up below
                if unset[key] is not None:
                    buffer.fill_(unset[key])
            self.model._init_weights(module)
            if any(u is None or (own[k] == u).any() or own[k].isnan().any() for k, u in unset.items()):
                raise TypeError(f"cannot rebuild the buffers of {name} ({type(module).__name__}) "
                                f"built on the meta device: build this model on the CPU instead")


def _unset(dtype: torch.dtype) -> float | int | None:
    """A value no initialised buffer of `dtype` holds: NaN, or an integer type's minimum (a
    position table never does); None for bool, where every value is meaningful."""
    if dtype.is_floating_point:
        return float("nan")
    return None if dtype == torch.bool else torch.iinfo(dtype).min


def router_aux_coef(config) -> float:
    """A transformers MoE config's load-balancing coefficient, or 0 when the model has no such
    loss (a config without `output_router_logits` / `router_aux_loss_coef`: a dense model)."""
    if not hasattr(config, "output_router_logits"):
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


def num_experts(config) -> int:
    """Routed experts per MoE layer in a transformers config (Mixtral: num_local_experts;
    Qwen2-MoE, OLMoE, ...: num_experts)."""
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


class CausalLMAdapter(_PieceByPieceInit):
    """Any `*ForCausalLM` (GPT2LMHeadModel, LlamaForCausalLM, MixtralForCausalLM, ...): logits
    of `input_ids`; for a mixture of experts with a `router_aux_loss_coef`, the model's
    load-balancing loss attached to them while training (the module docstring). Set the
    config's router_aux_loss_coef to 0 to train without it."""

    def __init__(self, model: nn.Module, vocab_size: int | None = None):
        super().__init__()
        _check_vocab(model, vocab_size)
        self.model = model
        # No KV cache in training: it would only allocate (and, under ZeRO-3, the cache object
        # is not a tensor output, so nothing is lost by turning it off).
        self.model.config.use_cache = False
        self.aux_coef = router_aux_coef(model.config)
        experts = num_experts(model.config)
        self.moe_stats = MoEStats([], experts) if experts else None
        """A mixture of experts: the balancing loss's grad_scale (set by the trainer) and, under
        expert parallelism, the all-to-all wait time (parallel/expert.StackedExperts). A plain
        attribute, not a submodule."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if not self.aux_coef or not torch.is_grad_enabled():  # no term; evaluation, generation
            return self.model(input_ids=idx, use_cache=False).logits
        out = self.model(input_ids=idx, use_cache=False, output_router_logits=True)
        logits, aux = out.logits, getattr(out, "aux_loss", None)
        if not isinstance(aux, torch.Tensor):  # never silently train without the term
            raise TypeError(f"{type(self.model).__name__} has router_aux_loss_coef {self.aux_coef} but "
                            f"returned no aux_loss with output_router_logits=True (got {aux!r})")
        if aux.requires_grad and logits.requires_grad:
            logits = _AttachAuxLoss.apply(logits, self.aux_coef * aux.float(), self.moe_stats.grad_scale)
        return logits


class Seq2SeqAdapter(_PieceByPieceInit):
    """An encoder-decoder (T5ForConditionalGeneration, BartForConditionalGeneration, ...) as
    `(source, source_mask, labels) -> logits (B, T, vocab)`, the batch of data.format = 'seq2seq'
    (data/seq2seq.py). Teacher forcing as transformers does it from `labels`: the decoder reads
    the labels shifted right behind the model's decoder_start_token_id, -100 replaced by its
    pad_token_id (T5's _shift_right, BART's shift_tokens_right), so the loop's cross-entropy of
    these logits against the labels (ignoring -100) is the library's own `.loss`.
    """

    def __init__(self, model: nn.Module, vocab_size: int | None = None):
        super().__init__()
        _check_vocab(model, vocab_size)
        self.model = model
        self.model.config.use_cache = False  # training; generation asks for the cache itself
        config = model.config
        # transformers >= 5 T5Config has no decoder_start_token_id unless config.json sets one;
        # T5's convention (and the library's own error message) is to start with the pad token.
        start = getattr(config, "decoder_start_token_id", None)
        self.start = start if start is not None else config.pad_token_id
        self.pad = config.pad_token_id if config.pad_token_id is not None else self.start
        if self.start is None:
            raise ValueError("the model config has neither decoder_start_token_id nor pad_token_id")

    def decoder_inputs(self, labels: torch.Tensor) -> torch.Tensor:
        """labels (B, T) shifted right behind the start token, -100 (no loss) as padding."""
        start = labels.new_full((labels.shape[0], 1), self.start)
        shifted = torch.cat([start, labels[:, :-1]], dim=1)  # (B, T)
        return shifted.masked_fill(shifted == -100, self.pad)

    def forward(self, source: torch.Tensor, source_mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=source, attention_mask=source_mask,
                          decoder_input_ids=self.decoder_inputs(labels), use_cache=False).logits
