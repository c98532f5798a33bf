"""Saving and loading trained weights: safetensors for tensors, JSON for metadata — nothing is
ever unpickled.

A run directory holds `model.safetensors`, `config.json` and `tokenizer.json` (and a LoRA run its
adapters in the PEFT format, `adapter/`: peft_adapter.py); the run's parent
directory holds a `latest` link to the newest finished run. (Sharded, resumable checkpoints with
optimizer state extend this format; they live here too.)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from shardlm.config.schema import Config
from shardlm.config.load import config_from_dict
from shardlm.errors import ConfigError
from shardlm.launch.files import atomic_write
from shardlm.models.moe import bias_tensors, take_bias_tensors

WEIGHTS, CONFIG, TOKENIZER, LATEST = "model.safetensors", "config.json", "tokenizer.json", "latest"
HF_CONFIG = "transformers_config.json"
"""A run of a transformers module (an encoder-decoder or a causal LM, models/hf_build.py): the
model's own config, so the run directory rebuilds it without the model.hf_config / hf_path it
started from."""


def point_latest(run_dir: Path) -> None:
    """Move `<parent>/latest` to this run, atomically (a new link renamed over the old one)."""
    link = run_dir.parent / LATEST
    tmp = run_dir.parent / f".{LATEST}.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(run_dir.name)
    os.replace(tmp, link)


def save_weights(run_dir: Path, model: nn.Module | dict[str, torch.Tensor], cfg: Config, tokenizer,
                 hf_config=None) -> Path:
    """The model's weights (or the given whole tensors by name: a tensor-parallel run's, put
    together by parallel.tensor.pieces.whole_parameters), its config and tokenizer, in `run_dir`. A
    mixture of experts balanced by bias also saves its routers' biases (models.moe.bias_tensors).
    A transformers module's config (`hf_config`, else the adapted model's) goes to HF_CONFIG."""
    from shardlm.checkpoint.sharded import write_safetensors

    run_dir.mkdir(parents=True, exist_ok=True)
    # named_parameters() lists a tied parameter once (the embedding, not the head). Written
    # piece by piece straight from the parameters (views of one flat buffer under ZeRO, on the
    # GPU or not): no whole copy of the model in host memory (a clone and the library's
    # in-memory file were two: +1.5 GiB on rank 0 for gpt2-774m, measured).
    tensors = model if isinstance(model, dict) else dict(model.named_parameters())
    tensors = {**tensors, **bias_tensors(getattr(model, "moe_stats", None))}  # MoE routing state
    write_safetensors(run_dir / WEIGHTS, tensors)
    atomic_write(run_dir / CONFIG, json.dumps(cfg.to_dict(), indent=2))
    tokenizer.save(str(run_dir / TOKENIZER))
    hf_config = hf_config or getattr(getattr(model, "model", None), "config", None)
    if hasattr(hf_config, "to_json_string"):  # a transformers module (models/hf_build.py)
        atomic_write(run_dir / HF_CONFIG, hf_config.to_json_string())
    if cfg.lora.rank:  # the adapters also in the PEFT format, in run_dir/adapter/
        from shardlm.checkpoint.peft_adapter import save_run_adapter

        save_run_adapter(run_dir, tensors, cfg.model, cfg.lora)
    point_latest(run_dir)
    return run_dir / WEIGHTS


def resolve_run_dir(path: str | Path) -> Path:
    """A run directory, its `latest` link, or its parent (then `latest` inside it)."""
    p = Path(path)
    if (p / LATEST).exists() and not (p / WEIGHTS).exists():
        target = (p / LATEST).resolve()
        if target.parent != p.resolve():  # `latest` names a run beside it, nothing elsewhere
            raise ConfigError(f"{p / LATEST} points to {str(target)!r}, outside {str(p)!r}: not "
                              f"followed; name the run directory itself")
        p = target
    if not (p / WEIGHTS).is_file():
        raise ConfigError(f"no trained weights at {str(path)!r}: expected a run directory holding "
                          f"{WEIGHTS} (e.g. runs/latest after `shardlm train`)")
    return p.resolve()


_RUN_FIX = "the run directory is damaged: train again, or copy the file back from a backup"


def load_config_json(run_dir: Path) -> Config:
    """A run's resolved config.json; one that cannot be read or parsed is a ConfigError naming
    the file and the line (launch/cache_files.read_named_json), not a traceback."""
    from shardlm.launch.cache_files import read_named_json

    saved = read_named_json(run_dir / CONFIG, "the run's config", _RUN_FIX)
    if not isinstance(saved, dict):
        raise ConfigError(f"{str(run_dir / CONFIG)!r} is missing or not a JSON object; {_RUN_FIX}")
    return config_from_dict(saved)


def _read_weights(run_dir: Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    """WEIGHTS's tensors; a file safetensors cannot read (cut short, overwritten) is a
    ConfigError naming it, not the library's bare error."""
    try:
        return load_file(str(run_dir / WEIGHTS), device=device)
    except Exception as e:  # safetensors raises its own SafetensorError (and OSError)
        raise ConfigError(f"{str(run_dir / WEIGHTS)!r} cannot be read as safetensors ({e}); "
                          f"{_RUN_FIX}") from None


def _run_tokenizer(run_dir: Path):
    from shardlm.data.tokenizer import read_tokenizer_file

    return read_tokenizer_file(run_dir / TOKENIZER, "the run's tokenizer")


def _load_transformers(run_dir: Path, cfg: Config, device: torch.device) -> nn.Module:
    """A transformers module's run from its HF_CONFIG (models/hf_build.build_hf_model: the
    adapter its kind needs; a LoRA run's adapters under their names), its parameters from
    WEIGHTS (materialize keeps tied ones tied; buffers such as BART's final_logits_bias are
    rebuilt from the config, as training built them), in eval mode."""
    from shardlm.models.hf_build import build_hf_model
    from shardlm.models.init import materialize

    saved = _read_weights(run_dir)

    def value(name: str) -> torch.Tensor:
        if name not in saved:
            raise ConfigError(f"{run_dir / WEIGHTS} has no tensor {name!r}, which "
                              f"{run_dir / HF_CONFIG} describes: the run directory is incomplete")
        return saved[name]

    model = build_hf_model(run_dir / HF_CONFIG, cfg.model.vocab_size, "meta")
    if cfg.lora.rank:
        from shardlm.models.lora import apply_lora

        lora = cfg.lora
        apply_lora(model, lora.rank, lora.alpha, lora.dropout, lora.targets, "")
    return materialize(model, device, 0, value).eval()


def load_for_inference(path: str | Path, device: torch.device):
    """(model, tokenizer, config) of a saved run, model in eval mode on `device`."""
    from shardlm.models.decoder import build_model

    run_dir = resolve_run_dir(path)
    cfg = load_config_json(run_dir)
    tokenizer = _run_tokenizer(run_dir)  # the small files first: a damaged one named before the weights load
    if (run_dir / HF_CONFIG).is_file():  # a transformers module: the library's own class
        return _load_transformers(run_dir, cfg, device), tokenizer, cfg
    model = build_model(cfg.model, device, seed=0)
    if cfg.lora.rank:  # the adapters under their own names (models/lora.py), then loaded below
        from shardlm.models.lora import apply_lora

        lora = cfg.lora
        apply_lora(model, lora.rank, lora.alpha, lora.dropout, lora.targets, cfg.model.mlp)
    quantized = cfg.lora.quantize != "none"
    if quantized:  # QLoRA: the base's packed bytes load as saved, then become plain weights
        from shardlm.models.lora import DEFAULT_TARGETS
        from shardlm.models.quant import by_columns, quantizable, quantize_base

        dense = DEFAULT_TARGETS[cfg.model.mlp].split(",")
        quantize_base(model, cfg.lora.quantize, quantizable(model, dense),
                      columns=by_columns(cfg.lora.quantize_layout, cfg.parallel.tp))
    state = take_bias_tensors(getattr(model, "moe_stats", None), _read_weights(run_dir, str(device)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - dict(model.named_parameters()).keys()
    if unexpected or set(missing) - tied:
        raise ConfigError(f"{run_dir / WEIGHTS} does not match its config.json: missing "
                          f"{sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")
    if quantized:  # the dequantised base: what the adapters were trained against
        from shardlm.models.quant import dequantize_base

        dequantize_base(model)
    model.eval()
    return model, tokenizer, cfg
