"""Export a trained run to a Hugging Face `transformers` directory (`shardlm export --format hf`).

The class is the one of model.family, or of the family our fields imply (hf_names.hf_family: a
GPT-2-style config, LayerNorm, learned positions, GELU, becomes a `GPT2LMHeadModel`, a LLaMA-style
one, RMSNorm, RoPE, SwiGLU, a `LlamaForCausalLM` with its RoPE scaling and head width, with
q/k/v-only biases a `Qwen2ForCausalLM`, with Gemma's (1 + w) norms a Gemma class, a LLaMA-style
mixture of experts a `MixtralForCausalLM`, ...); its config keys are its family file's
(config/families/<family>.py: Family.export). All reproduce our logits (the model code already
computes exactly what those classes compute: GELU tanh, rotate-half RoPE with HF's frequency
table, Mixtral's softmax router renormalised over the top k). Configs that no class can express
— mixed styles, or experts those classes cannot hold (sigmoid routers, shared experts, dense
blocks between the sparse ones, capacity dropping) — are a ConfigError naming each field.

The output directory holds `model.safetensors`, `config.json`, `generation_config.json` (written
by `save_pretrained`), our `tokenizer.json` and a `tokenizer_config.json`, so
`AutoModelForCausalLM.from_pretrained(out)` and `AutoTokenizer.from_pretrained(out)` both work.
A run of model.hf_path writes the checkpoint's own identity back instead (carried into the run by
hf_dir.carry_identity, checked against its sha256s): its tokenizer files, chat template and
generation_config.json byte for byte, and config.json's bos/eos/pad ids as the checkpoint's;
`--format peft` puts its tokenizer files beside the adapter.
A LoRA run exports its base (its adapters go to PEFT's format: `export_peft`, `--format peft`;
checkpoint/peft_adapter.py),
or with `--merge` the base with the adapters folded into the weights. A run of a transformers
module (models/hf_build.py: Falcon, GPT-J, T5, ...) is saved by the library's own class
(`export_module`).

Nothing is written through a link: the files are written into a fresh private directory inside
`out` (mkdtemp: created exclusively, mode 0700), then renamed into `out` — a rename replaces a
name, it never follows it — after checking that no destination is a link. `out` must be empty
or new unless `force`; `out` itself may not be a link.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from shardlm.checkpoint.weights import (TOKENIZER, WEIGHTS, load_config_json, load_for_inference,
                                       resolve_run_dir)
from shardlm.checkpoint.hf_names import heads_first, hf_family, hf_sources, moe_sources
from shardlm.checkpoint.hf_dir import read_identity, write_identity
from shardlm.checkpoint.weights import HF_CONFIG
from shardlm.checkpoint.peft_adapter import ADAPTER_DIR, merged_state_dict, peft_adapter, write_adapter
from shardlm.config.model import ModelConfig
from shardlm.config.families import family as registered_family
from shardlm.errors import ConfigError
from shardlm.data.tokenizer import EOT
from shardlm.models.flops import head_dim, resolved_d_ff


def _import_transformers():
    try:
        import transformers
    except ImportError:
        raise ConfigError('exporting to Hugging Face format needs transformers: '
                          'pip install -e ".[hf]"') from None
    return transformers


def rope_parameters(m: ModelConfig) -> dict:
    """model.rope_* as transformers' rope_parameters (the keys its ROPE_INIT_FUNCTIONS read):
    what hf_shapes.hf_shape reads back."""
    params: dict = {"rope_type": m.rope_type, "rope_theta": m.rope_theta}
    if m.rope_type != "default":
        params["factor"] = m.rope_factor
    if m.rope_fraction != 1.0:  # partial rotary (GPT-NeoX, Phi-3 family)
        params["partial_rotary_factor"] = m.rope_fraction
    original = {"original_max_position_embeddings": m.rope_original_max_seq_len or m.max_seq_len}
    if m.rope_type == "llama3":
        params.update(low_freq_factor=m.rope_low_freq_factor,
                      high_freq_factor=m.rope_high_freq_factor, **original)
    if m.rope_type == "yarn":
        params.update(beta_fast=m.rope_beta_fast, beta_slow=m.rope_beta_slow, **original)
        if not m.rope_truncate:  # transformers' default is True
            params["truncate"] = False
        if m.rope_attention_factor:
            params["attention_factor"] = m.rope_attention_factor
    return params


def hf_config(m: ModelConfig, eot: int | None):
    """The GPT2Config, LlamaConfig, Qwen2Config, MixtralConfig, ... describing exactly our model
    (hf_family chooses; the family's file says its keys, given LLaMA's)."""
    from shardlm.models.decoder import is_sliding

    tf = _import_transformers()
    tokens = {"bos_token_id": eot, "eos_token_id": eot, "vocab_size": m.vocab_size,
              "tie_word_embeddings": m.tie_embeddings}
    fam = registered_family(hf_family(m))
    llama_keys = dict(hidden_size=m.d_model, intermediate_size=resolved_d_ff(m),
                      num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads,
                      num_key_value_heads=m.n_kv_heads or m.n_heads, head_dim=head_dim(m),
                      max_position_embeddings=m.max_seq_len, rms_norm_eps=m.norm_eps,
                      rope_parameters=rope_parameters(m), sliding_window=m.sliding_window or None,
                      hidden_act="silu", **tokens)
    layer_types = ["sliding_attention" if is_sliding(m, i) else "full_attention" for i in range(m.n_layers)]
    return getattr(tf, fam.config_class)(**fam.export(m, llama_keys, layer_types))


def _model_class(tf, family: str):
    """The transformers class an export of `family` builds."""
    return getattr(tf, registered_family(family).model_class)


def hf_state_dict(sd: dict[str, torch.Tensor], m: ModelConfig,
                  stacked_experts: bool = True) -> dict[str, torch.Tensor]:
    """Our parameter names and layouts -> the HF class's, by the table model.hf_path loads with
    (hf_names.hf_sources): each of ours cut into its HF tensors along dimension 0, transposed
    for GPT-2's Conv1D. `sd` is `Decoder.state_dict()`. GPT-2 always has biases: where ours
    has none (model.bias = false) the HF bias is zero (Family.zero_biases). `stacked_experts`:
    the mixtures' classes hold their experts stacked (transformers >= 5), not one module per
    expert (transformers 4); see _moe_experts."""
    family = hf_family(m)
    sources, zero_biases = hf_sources(m, family), registered_family(family).zero_biases
    out: dict[str, torch.Tensor] = {}
    for ours, source in sources.items():
        tensor = heads_first(sd[ours], source.per_head) if source.per_head else sd[ours]
        for name, part in zip(source.names, tensor.split(list(source.rows))):
            out[name] = (part.t() if source.transposed else part).contiguous()
        bias = f"{ours.removesuffix('.weight')}.bias"
        if zero_biases and ours.startswith(("blocks.", "norm_f.")) and ours.endswith(".weight") \
                and bias not in sources:
            out[f"{source.names[0].removesuffix('.weight')}.bias"] = torch.zeros(sum(source.rows))
    out.update(_moe_experts(sd, m, family, stacked_experts))
    return out


def _moe_experts(sd: dict[str, torch.Tensor], m: ModelConfig, family: str,
                 stacked: bool) -> dict[str, torch.Tensor]:
    """A mixture's routers and experts (Mixtral, Qwen3-MoE, OLMoE; {} for a dense family).

    transformers >= 5 holds the experts stacked exactly as ours (`mlp.experts.gate_up_proj`
    (E, 2f, d), gate rows first, and `down_proj` (E, d, f)) and the router as `mlp.gate`; its
    save_pretrained writes them per expert, as the published checkpoints are (the names
    model.hf_path loads: hf_names.moe_sources). transformers 4 holds that per-expert layout in
    memory, so `stacked` = false writes the files' names."""
    sources, out = moe_sources(m, family), {}
    for i in ([] if not sources else range(m.n_layers)):
        b, h = f"blocks.{i}", f"model.layers.{i}"
        if f"{b}.mlp.router.weight" not in sources:  # a dense block (Qwen3-MoE's moe_every)
            continue
        if stacked:
            out.update({f"{h}.mlp.gate.weight": sd[f"{b}.mlp.router.weight"],
                        f"{h}.mlp.experts.gate_up_proj": sd[f"{b}.mlp.experts.gate_up"],
                        f"{h}.mlp.experts.down_proj": sd[f"{b}.mlp.experts.down"]})
            continue
        for ours in ("mlp.router.weight", "mlp.experts.gate_up", "mlp.experts.down"):
            source, tensor = sources[f"{b}.{ours}"], sd[f"{b}.{ours}"]
            flat = tensor.reshape(-1, *tensor.shape[2:]) if source.experts else tensor
            out.update({n: p.contiguous() for n, p in zip(source.names, flat.split(list(source.rows)))})
    return out


def _tokenizer_config(eot: int | None, max_len: int) -> dict:
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
              # Byte-level BPE decodes to the exact text; HF's clean-up would drop spaces.
              "clean_up_tokenization_spaces": False}
    if eot is not None:  # GPT-2's convention: <|endoftext|> both starts and ends a text
        config.update(bos_token=EOT, eos_token=EOT)
    return config


def _check_out(out: Path, force: bool) -> None:
    """`out` may be new, or an empty directory, or (force) a directory: never a link."""
    if out.is_symlink():
        raise ConfigError(f"--out {str(out)!r} is a symbolic link: not written through; name a "
                          f"real directory")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {str(out)!r} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ConfigError(f"--out {str(out)!r} is not empty: export into a new or empty "
                          f"directory, or pass --force (force=True) to replace files of the same "
                          f"names in it")


def _move_into(staging: Path, out: Path) -> None:
    """Rename every file of `staging` into `out`, after checking no destination is a link or a
    directory (a rename would replace a link, not follow it; refusing says what was there)."""
    names = sorted(p.name for p in staging.iterdir())
    planted = [n for n in names if (out / n).is_symlink() or (out / n).is_dir()]
    if planted:
        raise ConfigError(f"--out {str(out)!r} already holds {planted} as links or directories: "
                          f"not written through; remove them or export elsewhere")
    for name in names:
        os.replace(staging / name, out / name)

def _write_staged(out: Path, write) -> Path:
    """`write(staging)` into a fresh private directory inside `out`, then each file renamed
    into `out` (the module docstring: nothing is written through a link); returns `out`."""
    out.mkdir(parents=True, exist_ok=True)
    _check_out(out, force=True)  # not replaced by a link meanwhile
    staging = Path(tempfile.mkdtemp(prefix=".export-", dir=out))
    try:
        write(staging)
        _move_into(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _save_with_tokenizer(model, staging: Path, src: Path, tokenizer_config: dict,
                         identity: dict | None = None) -> None:
    """A transformers model's `save_pretrained`, the run's tokenizer.json and its config; a run
    of model.hf_path: the checkpoint's own tokenizer files, chat template and generation config
    instead, byte for byte (checkpoint/hf_dir.py carry_identity)."""
    model.save_pretrained(staging)
    shutil.copyfile(src / TOKENIZER, staging / TOKENIZER)
    (staging / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    if identity is not None:  # what the checkpoint had replaces ours (a checkpoint without a
        write_identity(src, staging, identity)  # tokenizer_config.json keeps the one above)


def _set_token_ids(config, identity: dict | None) -> None:
    """config.json's bos/eos/pad ids as the checkpoint's (an eos list stays a list); the model's
    generation config follows them where the checkpoint had no generation_config.json."""
    for key, value in (identity or {}).get("token_ids", {}).items():
        setattr(config, key, value)



def export_hf(run_dir: str | Path, out_dir: str | Path, force: bool = False,
              merge: bool = False) -> Path:
    """Write `run_dir`'s model and tokenizer as a transformers directory; returns `out_dir`.
    `force`: write into a non-empty `out_dir` (files of the same names are replaced).
    A LoRA run exports its frozen base (the model its PEFT adapter applies to), or with `merge`
    the base with the adapters folded in (checkpoint/peft_adapter.py merged_state_dict)."""
    tf = _import_transformers()
    src = resolve_run_dir(run_dir)
    out = Path(out_dir)
    if out.resolve() == src:
        raise ConfigError(f"--out {str(out_dir)!r} is the run directory itself; exporting there "
                          f"would overwrite its model.safetensors and config.json")
    _check_out(out, force)
    if merge and not load_config_json(src).lora.rank:
        raise ConfigError(f"--merge: {str(run_dir)!r} is not a LoRA run (lora.rank = 0): there "
                          f"are no adapters to merge; export it without --merge")
    if (src / HF_CONFIG).is_file():  # a transformers module: its own class saves it
        return export_module(src, out, force, merge)
    identity = read_identity(src)  # a run of model.hf_path: the checkpoint's tokens and template
    model, tokenizer, cfg = load_for_inference(src, torch.device("cpu"))
    m = cfg.model
    eot = tokenizer.token_to_id(EOT)
    config = hf_config(m, eot)
    _set_token_ids(config, identity)
    cls = _model_class(tf, hf_family(m))
    with torch.device("meta"):  # no memory and no random init: every tensor comes from `sd`
        hf_model = cls(config)
    stacked = any(n.endswith(".experts.gate_up_proj") for n, _ in hf_model.named_parameters())
    ours = model.state_dict()
    if merge:
        ours = merged_state_dict(ours, cfg.model, cfg.lora)
    sd = hf_state_dict(ours, m, stacked_experts=stacked)
    renamed = registered_family(hf_family(m)).in_memory_names
    sd = {renamed.get(name, name): tensor for name, tensor in sd.items()}
    del model
    missing, unexpected = hf_model.load_state_dict(sd, strict=False, assign=True)
    if missing or unexpected:
        raise ConfigError(f"internal error mapping to {cls.__name__}: missing {sorted(missing)}, "
                          f"unexpected {sorted(unexpected)}")
    if m.tie_embeddings:
        hf_model.tie_weights()
    leftover = [n for n, p in hf_model.named_parameters() if p.is_meta]
    if leftover:
        raise ConfigError(f"internal error mapping to {cls.__name__}: no values for {leftover}")
    return _write_staged(out, lambda staging: _save_with_tokenizer(
        hf_model, staging, src, _tokenizer_config(eot, m.max_seq_len), identity))


def export_peft(run_dir: str | Path, out_dir: str | Path, force: bool = False) -> Path:
    """Write a LoRA run's adapters as a PEFT adapter directory (adapter_config.json +
    adapter_model.safetensors; checkpoint/peft_adapter.py); returns `out_dir`. Their base is
    `export_hf` of the same run (or the run's model.hf_path, unchanged)."""
    from safetensors.torch import load_file

    src = resolve_run_dir(run_dir)
    out = Path(out_dir)
    if out.resolve() == src:
        raise ConfigError(f"--out {str(out_dir)!r} is the run directory itself; export the "
                          f"adapters elsewhere (the run already holds them in {ADAPTER_DIR}/)")
    _check_out(out, force)
    cfg = load_config_json(src)
    sd = load_file(str(src / WEIGHTS))
    peft_adapter(sd, cfg.model, cfg.lora)  # refused before anything is written
    identity = read_identity(src)

    def write(staging: Path) -> None:
        write_adapter(staging, sd, cfg.model, cfg.lora)
        if identity is not None:  # the tokenizer beside the adapter, as peft users save it
            write_identity(src, staging, identity, tokenizer_only=True)

    return _write_staged(out, write)


def export_module(run_dir: str | Path, out_dir: str | Path, force: bool = False,
                  merge: bool = False) -> Path:
    """A run of a transformers module (models/hf_build.py: a causal LM our decoder does not map,
    or an encoder-decoder) written by the library's own `save_pretrained`, with the run's
    tokenizer: every tensor is the trained one, as saved (a LoRA run: its frozen base, or with
    `merge` the adapters folded in, models.lora.remove_lora). The KV cache, off for training,
    is on again in its config.json for generation."""
    from shardlm.models.lora import remove_lora

    src, out = resolve_run_dir(run_dir), Path(out_dir)
    _check_out(out, force)
    model, tokenizer, cfg = load_for_inference(src, torch.device("cpu"))
    if cfg.lora.rank:
        remove_lora(model, merge)
    inner = model.model
    inner.config.use_cache = True
    identity = read_identity(src)
    _set_token_ids(inner.config, identity)
    if getattr(inner, "generation_config", None) is not None:
        _set_token_ids(inner.generation_config, identity)
    eos = getattr(inner.config, "eos_token_id", None)
    special = tokenizer.id_to_token(eos) if isinstance(eos, int) else None
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                        "model_max_length": cfg.model.max_seq_len}
    if special is not None:
        tokenizer_config["eos_token"] = special
    return _write_staged(out, lambda staging: _save_with_tokenizer(inner, staging, src, tokenizer_config,
                                                                   identity))
