"""LoRA adapters out of shardlm: the PEFT format (`adapter_config.json` +
`adapter_model.safetensors`, what `peft.PeftModel.from_pretrained` loads onto the transformers
model `export.export_hf` writes), written at the end of a LoRA run (run_dir/adapter/, by
save_weights) and by `shardlm export --format peft` (export.export_peft); and merging into the
base weights (`shardlm export --merge`).

Our adapters sit on our fused layers; PEFT's sit on the transformers class's modules. A LoRA on
our fused `attn.qkv` (A (r, d), B (q + 2kv, r)) is, exactly, three PEFT LoRAs on q_proj, k_proj
and v_proj sharing the same A, each with its rows of B: [B_q; B_k; B_v] A x is B_q A x, B_k A x
and B_v A x side by side. SwiGLU's `mlp.gate_up` splits into gate_proj and up_proj the same way.
GPT-2's c_attn is fused in transformers too, and PEFT's LoRA on a Conv1D keeps nn.Linear's
layouts for A and B (only the merge transposes: fan_in_fan_out = true), so GPT-2's adapters are
ours unchanged. The row split is `checkpoint/hf_names.py`'s table, the one that loads HF weights.

A transformers module trained as it is (models/hf_build.py: model.hf_path of a model_type our
decoder does not map) carries its adapters on the library's own nn.Linear layers already: each
keeps its name, less the adapter's `model.` (models.hf.WRAPPED), and its A and B unchanged.

What is exact: with the adapters' dropout off (inference), the PEFT model's outputs are ours.
Training the exported adapters further in PEFT is not the same optimisation problem: the copies
of A on q/k/v (gate/up) become independent parameters there.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from shardlm.checkpoint.hf_names import heads_first, hf_family, hf_sources
from shardlm.config.model import LoRAConfig, ModelConfig
from shardlm.config.families import family as registered_family
from shardlm.errors import ConfigError
from shardlm.launch.files import atomic_write
from shardlm.models.hf import WRAPPED

log = logging.getLogger("shardlm")

ADAPTER_CONFIG, ADAPTER_WEIGHTS, ADAPTER_DIR = "adapter_config.json", "adapter_model.safetensors", "adapter"
PEFT_PREFIX = "base_model.model."
"""PeftModelForCausalLM's prefix on the wrapped transformers model's module names, as
`PeftModel.save_pretrained` writes them (the adapter's name, `default`, left out)."""


def lora_modules(sd: dict[str, torch.Tensor]) -> list[str]:
    """The names of our layers that carry adapters, in the state dict's order."""
    return [n[: -len(".lora_A.weight")] for n in sd if n.endswith(".lora_A.weight")]


def _hf_targets(model: ModelConfig, modules: list[str]) -> tuple[dict[str, list[tuple[str, int]]], bool]:
    """Our adapted layer -> [(HF module name, rows of our output it holds)], and whether the
    HF modules include Conv1D (GPT-2: fan_in_fan_out). A layer with no HF module of its own (a
    mixture's router) is a ConfigError naming it."""
    family = hf_family(model)
    sources = hf_sources(model, family)
    out, transposed = {}, set()
    for module in modules:
        source = sources.get(f"{module}.weight")
        if source is None or module in ("tok_emb", "pos_emb"):
            raise ConfigError(f"the LoRA adapters on {module!r} have no counterpart in the "
                              f"transformers {family} model's modules: PEFT cannot hold them "
                              f"(lora.targets chose it); export --merge folds them in instead")
        out[module] = [(n[: -len(".weight")], rows) for n, rows in zip(source.names, source.rows)]
        transposed.add(source.transposed)
    return out, True in transposed  # peft sets each module's own (Linear: false) anyway


def _target_modules(hf_names: list[str], n_layers: int) -> list[str]:
    """PEFT's target_modules: per-layer suffixes ('self_attn.q_proj', 'attn.c_proj': the parent
    keeps GPT-2's two c_proj apart) where every layer carries that module, otherwise the full
    module names (PEFT matches a target by the whole name or a dotted suffix)."""
    layers: dict[str, set[int]] = {}
    others: list[str] = []
    for name in hf_names:
        parts = name.split(".")
        if len(parts) > 3 and parts[2].isdigit():  # model.layers.{i}.… / transformer.h.{i}.…
            layers.setdefault(".".join(parts[3:]), set()).add(int(parts[2]))
        else:
            others.append(name)
    suffixes = {s for s, found in layers.items() if found == set(range(n_layers))}
    whole = [n for n in hf_names if n not in others and ".".join(n.split(".")[3:]) not in suffixes]
    return sorted(suffixes) + sorted(whole) + sorted(others)


def peft_adapter(sd: dict[str, torch.Tensor], model: ModelConfig, lora: LoRAConfig,
                 base_model: str | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json's contents, adapter_model.safetensors' tensors) for the adapters in
    `sd` (our parameter names, as model.safetensors holds them) of a run of `model` with `lora`."""
    modules = lora_modules(sd)
    if not modules:
        raise ConfigError("this run has no LoRA adapters (lora.rank = 0): nothing to write in the "
                          "PEFT format; export the model itself with --format hf")
    sources, family = {}, ""  # our decoder's name table; a transformers module's layers are its own
    if all(m.startswith(WRAPPED) for m in modules):  # transformers' own modules, by their names
        targets = {m: [(m.removeprefix(WRAPPED), sd[f"{m}.lora_B.weight"].shape[0])] for m in modules}
        fan_in_fan_out = False  # nn.Linear only (models/lora.py adapts nothing else)
    else:
        targets, fan_in_fan_out = _hf_targets(model, modules)
        family = hf_family(model)
        sources = hf_sources(model, family)
    tensors: dict[str, torch.Tensor] = {}
    for module, parts in targets.items():
        a, b = sd[f"{module}.lora_A.weight"], sd[f"{module}.lora_B.weight"]
        source = sources.get(f"{module}.weight")
        heads = source.per_head if source else 0  # GPT-NeoX's per-head q/k/v rows
        b = heads_first(b, heads) if heads else b
        for (hf_name, _), b_rows in zip(parts, b.split([rows for _, rows in parts])):
            tensors[f"{PEFT_PREFIX}{hf_name}.lora_A.weight"] = a.detach().cpu().contiguous().clone()
            tensors[f"{PEFT_PREFIX}{hf_name}.lora_B.weight"] = b_rows.detach().cpu().contiguous().clone()
    hf_names = [n for parts in targets.values() for n, _ in parts]
    # A mixture's dense MLP (Qwen3-MoE's dense blocks): PEFT under transformers 5 reads a target
    # module named gate_proj / up_proj / down_proj of a mixture as transformers 4's per-expert
    # linears and moves it onto the stacked experts (peft.utils.transformers_weight_conversion),
    # so these are named as parameters instead: PEFT's ParamWrapper adds s·B A to the weight,
    # the same LoRA on the same module.
    mixture = bool(family) and registered_family(family).experts is not None
    by_weight = sorted(n for n in hf_names if mixture and ".mlp." in n)
    hf_names = [n for n in hf_names if n not in by_weight]
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout, "bias": "none", "fan_in_fan_out": fan_in_fan_out,
        "target_modules": _target_modules(hf_names, model.n_layers),
        "target_parameters": [f"{n}.weight" for n in by_weight] or None,
        "base_model_name_or_path": base_model, "inference_mode": True, "init_lora_weights": True,
        "use_rslora": False, "use_dora": False, "modules_to_save": None,
        "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
        "alpha_pattern": {}, "revision": None,
    }
    return config, tensors


def _base_model_name(model: ModelConfig) -> str | None:
    return str(Path(model.hf_path).resolve()) if model.hf_path else None


def write_adapter(directory: Path, sd: dict[str, torch.Tensor], model: ModelConfig, lora: LoRAConfig,
                  base_model: str | None = None) -> Path:
    """adapter_config.json + adapter_model.safetensors in `directory` (created), each written
    whole then renamed into place. `base_model`: default the run's model.hf_path, if any."""
    config, tensors = peft_adapter(sd, model, lora, base_model or _base_model_name(model))
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f"{ADAPTER_WEIGHTS}.{os.getpid()}.part"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, directory / ADAPTER_WEIGHTS)
    atomic_write(directory / ADAPTER_CONFIG, json.dumps(config, indent=2) + "\n")
    return directory


def save_run_adapter(run_dir: Path, tensors: dict[str, torch.Tensor], model: ModelConfig,
                     lora: LoRAConfig) -> Path | None:
    """At the end of a LoRA run: run_dir/adapter/ in the PEFT format, beside model.safetensors
    (with model.hf_path's tokenizer files, checkpoint/hf_dir.py write_identity). A model no
    transformers class expresses gets none (logged), never a failed run."""
    from shardlm.checkpoint.hf_dir import read_identity, write_identity

    try:
        directory = write_adapter(run_dir / ADAPTER_DIR, tensors, model, lora)
        identity = read_identity(run_dir)
        if identity is not None:  # model.hf_path's tokenizer beside its adapter
            write_identity(run_dir, directory, identity, tokenizer_only=True)
        return directory
    except ConfigError as e:
        log.warning("no PEFT adapter written: %s", e)
        return None


def merged_state_dict(sd: dict[str, torch.Tensor], model: ModelConfig, lora: LoRAConfig) -> dict[str, torch.Tensor]:
    """`sd` with every adapter folded into its layer's weight, W + (alpha / r) · B A (in fp32,
    then W's dtype), and the adapters dropped: the plain model computing what base + adapters do."""
    modules = lora_modules(sd)
    if not modules:
        raise ConfigError("--merge: this run has no LoRA adapters (lora.rank = 0); export it "
                          "without --merge")
    if "head" in modules and model.tie_embeddings:
        raise ConfigError("--merge: the adapters on the head would untie it from the embedding "
                          "(model.tie_embeddings = true); export with --format peft instead")
    scaling = lora.alpha / lora.rank
    out = {n: t for n, t in sd.items() if ".lora_A." not in n and ".lora_B." not in n}
    for module in modules:
        w = sd[f"{module}.weight"]
        a, b = sd[f"{module}.lora_A.weight"].float(), sd[f"{module}.lora_B.weight"].float()
        out[f"{module}.weight"] = (w.float() + scaling * (b @ a)).to(w.dtype)
    return out
