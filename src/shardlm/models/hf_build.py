"""The transformers path: a model.hf_path (or model.hf_config) our decoder does not compute is
trained as the library's own module, wrapped by an adapter of models/hf.py — a causal LM
(Falcon, BLOOM, OPT, GPT-J, CodeGen, ...: CausalLMAdapter) or an encoder-decoder (T5, BART:
Seq2SeqAdapter). One route, two adapters:

    model = build_hf_model("ckpt/config.json", vocab_size=cfg.model.vocab_size)   # on meta
    run = build_run(cfg)          # train/build.py does this when hf_shapes.transformers_config says so

The sharded build materialises it a unit at a time (the library's `_init_weights`, or the
directory's tensors by name: checkpoint/hf_dir.module_initializer). What the route supports
is what composes with a module we did not write: ZeRO 0-3 and its offload tiers (the engine
needs only parameters), activation checkpointing (the largest nn.ModuleList's children), LoRA on
its nn.Linear layers, tensor parallelism by its config's base_model_tp_plan
(parallel/tensor/plan.py). Pipeline stages, ring attention, expert parallelism, FP8 layers and
document masks all replace or feed parts of our own Decoder: refused, before anything is
spawned (route_problems), with the fix.

transformers is imported inside the functions (the optional extra `shardlm[hf]`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Collection

import torch

from shardlm.config.model import ModelConfig
from shardlm.config.schema import Config
from shardlm.config.fields import compile_on, document_mask_on
from shardlm.errors import ConfigError
from shardlm.models.hf import CausalLMAdapter, Seq2SeqAdapter
from shardlm.config.hf_shapes import causal_lm_config, decoder_problems

SUPPORTED = "ZeRO 0-3, offload, recomputation, LoRA, tp by base_model_tp_plan"
UNSUPPORTED = "pp/cp/ep/fp8/document masks"


def _import_transformers():
    try:
        import transformers
    except ImportError:
        raise ConfigError('model.hf_path of a model our decoder does not map needs transformers: '
                          'pip install -e ".[hf]"') from None
    return transformers


def hf_model_class(config_file: str | Path) -> tuple[type, object]:
    """(the transformers class to build, its config) for a config.json: an encoder-decoder's
    `architectures[0]` (T5ForConditionalGeneration, ...); a decoder-only model's causal-LM
    class by its model_type (AutoModelForCausalLM's table: GPTJForCausalLM, FalconForCausalLM,
    ...). A class or model_type transformers does not have is a ConfigError naming it."""
    tf = _import_transformers()
    raw = json.loads(Path(config_file).read_text())
    if raw.get("is_encoder_decoder"):
        name = (raw.get("architectures") or [""])[0]
        cls = getattr(tf, name, None)
        if cls is None or not hasattr(cls, "config_class"):
            raise ConfigError(f"{config_file}: architectures[0] = {name!r} is not a transformers "
                              f"model class (transformers {tf.__version__})")
        return cls, _config_of(cls.config_class, raw, config_file)
    kind = str(raw.get("model_type", ""))
    if kind not in tf.CONFIG_MAPPING:
        raise ConfigError(f"{config_file}: model_type {kind!r} is not one transformers "
                          f"{tf.__version__} knows (code shipped with a checkpoint, trust_remote_code, "
                          f"is never run): train it through the Python API, build_run(cfg, model=...)")
    config = _config_of(tf.CONFIG_MAPPING[kind], raw, config_file)
    cls = tf.MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if cls is None:
        raise ConfigError(f"{config_file}: transformers has no causal language model for "
                          f"model_type {kind!r} (AutoModelForCausalLM does not map it)")
    return cls, config


def _config_of(config_class: type, raw: dict, config_file: str | Path) -> object:
    """transformers' config object for a config.json, or a ConfigError naming the file and what
    transformers found wrong (rope_parameters missing a key, say), not its traceback."""
    try:
        return config_class.from_dict(raw)
    except (KeyError, ValueError, TypeError) as e:
        raise ConfigError(f"{config_file}: transformers cannot read it as a "
                          f"{config_class.__name__}: {e}") from None


def build_hf_model(config_file: str | Path, vocab_size: int | None = None,
                   device: torch.device | str = "meta") -> CausalLMAdapter | Seq2SeqAdapter:
    """The model a config.json describes, with fresh weights on `device` (meta: the sharded
    build materialises it), in the adapter the loop calls: Seq2SeqAdapter for an
    encoder-decoder, CausalLMAdapter otherwise."""
    cls, config = hf_model_class(config_file)
    adapter = Seq2SeqAdapter if getattr(config, "is_encoder_decoder", False) else CausalLMAdapter
    with torch.device(device):
        return adapter(cls(config), vocab_size)


def route_line(model: ModelConfig) -> str:
    """What `shardlm train` says before spawning about the path a model.hf_path takes through
    transformers ('' for our decoder and for an encoder-decoder, whose data.format says it)."""
    config_file = causal_lm_config(model.hf_path)
    if not config_file:
        return ""
    cls, config = hf_model_class(config_file)
    differs = decoder_problems(model.hf_path)  # a mapped family with a feature ours lacks
    why = f" (our decoder does not compute its {'; '.join(differs)})" if differs else ""
    return (f"model: {model.hf_path} ({config.model_type}) through transformers' "
            f"{cls.__name__}{why}: mapped families get every axis; this path supports "
            f"{SUPPORTED}; not {UNSUPPORTED}")


def route_problems(cfg: Config) -> list[str]:
    """The settings a causal LM on the transformers path cannot honour, each with its fix."""
    if not causal_lm_config(cfg.model.hf_path):
        return []
    par = cfg.parallel
    problems = [f"parallel.{axis} = {value} ({what}); use parallel.{axis} = 1 with ZeRO "
                f"(parallel.zero_stage) or tensor parallelism by the model's base_model_tp_plan"
                for axis, value, what in (("pp", par.pp, "pipeline stages cut our Decoder's blocks"),
                                          ("cp", par.cp, "ring attention replaces our Decoder's"),
                                          ("ep", par.ep, "expert parallelism cuts our MoE layers"))
                if value > 1]
    if par.sequence_parallel:
        problems.append("parallel.sequence_parallel = true (the model's norms and residuals are "
                        "the library's modules); set it false")
    if cfg.precision.compute == "fp8":
        problems.append(f"precision.compute = 'fp8' (FP8 swaps our Decoder's linears); use bf16 "
                        f"or fp32")
    if document_mask_on(cfg.data):
        problems.append(f"data.document_mask = {cfg.data.document_mask!r} (on for data.format = "
                        f"{cfg.data.format!r}: per-document attention is our Decoder's); set "
                        f"data.document_mask = 'off'")
    if cfg.lora.rank and par.tp > 1:
        problems.append(f"lora.rank = {cfg.lora.rank} with parallel.tp = {par.tp} (LoRA is cut for "
                        f"tensor parallelism in our Decoder's layers, not by a base_model_tp_plan); "
                        f"use LoRA with ZeRO (parallel.tp = 1)")
    if cfg.lora.quantize != "none":
        problems.append(f"lora.quantize = {cfg.lora.quantize!r} (QLoRA quantises shardlm's Decoder "
                        f"linears); set lora.quantize = 'none' (plain LoRA works)")
    if compile_on(cfg.train):
        problems.append("train.compile = true (not verified with a transformers module yet); set "
                        "train.compile = false")
    return problems


def check_route(cfg: Config) -> None:
    """route_problems as one ConfigError naming the path and every offending setting."""
    problems = route_problems(cfg)
    if problems:
        raise ConfigError(f"model.hf_path = {cfg.model.hf_path!r} trains through transformers "
                          f"(its model_type does not map onto shardlm's decoder), which supports "
                          f"{SUPPORTED}, not: " + "; ".join(problems))



@torch.no_grad()
def generate_causal(model: CausalLMAdapter, idx: torch.Tensor, max_new_tokens: int,
                    end_id: int | None = None, temperature: float = 0.0, top_k: int | None = 50,
                    generator: torch.Generator | None = None, stop_ids: Collection[int] = (),
                    on_token: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
    """The prompt (B, T) continued by the library's own `generate` (its KV cache), as models.
    generate returns it: (B, T + up to max_new_tokens). temperature 0 is greedy, otherwise
    sampling from the top_k; stops at `end_id` and at any of `stop_ids` when given (the
    library's eos_token_id list); `on_token` gets each step's tokens (B, 1) as they are drawn.
    Sampling draws from torch's global generator, seeded from `generator`'s seed when one is
    given (every rank alike)."""
    sample = temperature > 0
    if sample and generator is not None:
        torch.manual_seed(generator.initial_seed())
    ends = sorted({*([] if end_id is None else [end_id]), *stop_ids})
    pad = ends[0] if ends else getattr(model.model.config, "pad_token_id", None)
    kwargs = dict(do_sample=sample, max_new_tokens=max_new_tokens, use_cache=True,
                  eos_token_id=ends or None, pad_token_id=pad if pad is not None else 0)
    if sample:
        kwargs.update(temperature=temperature, top_k=top_k or None)
    if on_token is not None:
        kwargs["streamer"] = _TokenStreamer(on_token)
    was_training = model.training
    model.eval()
    try:
        return model.model.generate(input_ids=idx, attention_mask=torch.ones_like(idx), **kwargs)
    finally:
        model.train(was_training)


class _TokenStreamer:
    """transformers' streamer protocol (`put` each step's tokens, `end`): the prompt, put first,
    is skipped; each new step's tokens go to `on_token` as (B, 1)."""

    def __init__(self, on_token: Callable[[torch.Tensor], None]):
        self.on_token, self.prompt_seen = on_token, False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.on_token(value.reshape(-1, 1))

    def end(self) -> None:
        pass
