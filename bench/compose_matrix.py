"""The composition matrix's rows and rules (bench/compose.py runs them): the everyday FEATURES
and the newer FRONTIER, each a table of config overrides; how two combine into one config
(`feature_overrides`), whether the config accepts the pair (`validation`), how many ranks its
layout needs (`world_of`) and the one-process run it is compared with (`reference_overrides`).
Nothing here starts a process: tests/test_compose.py validates every pair from these.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from pathlib import Path
from typing import Any

from shardlm.config.load import load_config
from shardlm.config.rules import refusing_rules
from shardlm.errors import ConfigError

STEPS = 4

@dataclasses.dataclass(frozen=True)
class Feature:
    name: str
    keys: dict[str, Any]
    """The config overrides that turn the feature on ('{work}' is the pair's scratch folder)."""
    needs_dp: bool = False
    """Means something only over data-parallel ranks (ZeRO shards, ep groups, offloaded shards)."""
    soft: tuple[str, ...] = ()
    """Keys whose value yields to the other feature's (chat SFT's document_mask = 'off', so the
    two features are separate, becomes 'on' with doc_mask)."""
    elsewhere: str = ""
    """Where its pairs are checked when they cannot be here: replicas that train apart (local
    SGD: its reference is a simulation, not one process) or that are worlds of their own under a
    launcher (fault tolerance) do not run in one spawned world."""
    checked_with: tuple[str, ...] = ()
    """The features `elsewhere`'s tests pair it with: --run reports those pairs as checked there,
    the others as accepted and not run."""


FEATURES = [
    Feature("zero3", {"parallel.zero_stage": 3}, needs_dp=True),
    Feature("hybrid", {"parallel.zero_stage": 3, "parallel.dp_replicate": 2, "parallel.dp_shard": 2}),
    Feature("tp", {"parallel.tp": 2}),
    Feature("tp_sp", {"parallel.tp": 2, "parallel.sequence_parallel": True}),
    Feature("cp", {"parallel.cp": 2}),
    Feature("pp", {"parallel.pp": 2}),
    Feature("moe", {"model.experts": 4, "model.top_k": 2}),
    Feature("ep", {"model.experts": 4, "model.top_k": 2, "parallel.ep": 2}, needs_dp=True),
    Feature("fp16", {"precision.compute": "fp16"}),
    Feature("fp8", {"precision.compute": "fp8", "precision.fp8_emulate": True}),
    Feature("compile", {"train.compile": True}),
    Feature("recompute_full", {"activation.checkpoint": "full"}),
    Feature("recompute_selective", {"activation.checkpoint": "selective"}),
    Feature("act_offload", {"activation.offload": "cpu"}),
    Feature("offload_cpu", {"parallel.zero_stage": 1, "zero.offload_optimizer": "cpu"}, needs_dp=True),
    Feature("offload_nvme", {"parallel.zero_stage": 1, "zero.offload_optimizer": "nvme",
                             "zero.nvme_path": "{work}/nvme"}, needs_dp=True),
    # 'nvme': on a CPU-only machine the 'cpu' parameter tier is the device's memory and moves nothing
    Feature("param_offload", {"parallel.zero_stage": 3, "zero.offload_params": "nvme",
                              "zero.nvme_path": "{work}/nvme"}, needs_dp=True),
    Feature("lora", {"lora.rank": 4}),
    Feature("qlora", {"lora.rank": 4, "lora.quantize": "nf4"}),
    Feature("chat_sft", {"data.format": "chat", "data.source": "{work}/chat.jsonl", "data.max_bytes": 0,
                         "data.val_fraction": 0.2, "data.document_mask": "off"},
            soft=("data.document_mask",)),
    Feature("doc_mask", {"data.document_mask": "on"}),
    Feature("auto", {"parallel.strategy": "auto"}),
    Feature("async_ckpt", {"checkpoint.async": True}, needs_dp=True),
    Feature("periodic_ckpt", {"checkpoint.every": 2}),
]
FRONTIER = [
    Feature("fp8_ag", {"parallel.zero_stage": 3, "precision.compute": "fp8", "precision.fp8_emulate": True,
                       "precision.fp8_all_gather": True}, needs_dp=True),
    Feature("async_tp", {"parallel.tp": 2, "parallel.sequence_parallel": True, "parallel.async_tp": True}),
    # a V of 4 stages needs 4 blocks (llama-tiny has 2)
    Feature("zbv", {"parallel.pp": 2, "parallel.pp_virtual": 2, "parallel.pp_schedule": "zbv", "model.n_layers": 4}),
    Feature("dualpipev", {"parallel.pp": 2, "parallel.pp_virtual": 2, "parallel.pp_schedule": "dualpipev",
                          "train.grad_accum": 4, "model.n_layers": 4}),
    Feature("muon", {"train.optimizer": "muon"}),
    Feature("ulysses", {"parallel.cp": 2, "parallel.cp_mode": "ulysses"}),
    Feature("local_sgd", {"parallel.dp_replicate": 2, "train.local_sgd.every": 2},
            elsewhere="tests/test_local_sgd.py (against the simulation of its replicas)",
            checked_with=("zero3", "tp", "cp", "pp", "moe", "ep", "lora", "offload_cpu", "offload_nvme")),
    Feature("ft", {"parallel.dp_replicate": 2, "parallel.fault_tolerant": True, "parallel.zero_stage": 1},
            elsewhere="tests/test_fault_tolerant.py (replica worlds under the launcher)",
            checked_with=("zero3", "hybrid", "tp", "cp", "pp", "moe", "ep", "muon", "lora", "chat_sft",
                          "periodic_ckpt")),
]
"""Issue 42's newer features, outside the everyday matrix: --pairs names them, --frontier
validates each against every feature (FEATURES and these)."""
ELSEWHERE = "elsewhere"
"""--run's outcome for an accepted pair with a feature checked `elsewhere` (its test's name)."""
BY_NAME = {f.name: f for f in FEATURES + FRONTIER}
LIFTED = ("fp8_ag+tp", "fp8_ag+tp_sp", "fp8_ag+lora", "fp8_ag+compile", "async_tp+compile",
          "tp+muon", "tp_sp+muon", "pp+muon", "ep+muon", "cp+muon", "hybrid+muon", "offload_cpu+muon",
          "async_tp+muon", "zbv+muon", "lora+muon", "qlora+muon")
"""Pairs issue 42 accepted (refused before), each run against one process here."""

BASE = {"model.preset": "llama-tiny", "precision.compute": "fp32", "run.device": "cpu",
        "train.seq_len": 32, "train.micro_batch": 2, "train.grad_accum": 2, "train.steps": STEPS,
        "train.warmup_steps": 1, "train.eval_every": 0, "train.eval_batches": 1,
        "train.sample_tokens": 0, "data.max_bytes": 300_000, "run.progress": "off",
        "checkpoint.resume": "never"}
EXECUTION = ("parallel.", "activation.", "zero.", "train.compile", "checkpoint.async", "checkpoint.every",
             "precision.fp8_all_gather")
"""Keys that choose how a model trains, not what it computes: the reference leaves them out."""
LARGEST = ("parallel.zero_stage",)
"""Keys two features may both set: the pair takes the larger value."""


class Exclusive(ValueError):
    """Two features set one key to different values (full or selective recomputation, fp16 or
    fp8): one choice, not a pair to compose."""


def feature_overrides(features: tuple[Feature, ...], work: str | Path = "{work}") -> dict[str, Any]:
    """The base config with every feature on; Exclusive if two set one key differently."""
    keys, soft, first = dict(BASE), {k for f in features for k in f.soft}, {}
    for feature in sorted(features, key=lambda f: bool(f.soft), reverse=True):  # soft keys first
        for key, value in feature.keys.items():
            value = value.replace("{work}", str(work)) if isinstance(value, str) else value
            if key in first and first[key][1] != value:
                if key in LARGEST:
                    value = max(keys[key], value)
                elif key in soft and key in feature.soft:
                    continue
                elif key not in soft:
                    raise Exclusive(f"{first[key][0]} and {feature.name} set {key} to different values")
            keys[key], first[key] = value, (feature.name, value)
    return keys


def pairs(frontier: bool = False) -> list[tuple[Feature, Feature]]:
    """Every pair of FEATURES; with `frontier`, every pair with a FRONTIER feature in it instead."""
    if not frontier:
        return list(itertools.combinations(FEATURES, 2))
    return [(a, b) for a, b in itertools.combinations(FEATURES + FRONTIER, 2) if a in FRONTIER or b in FRONTIER]


def pair_name(a: Feature, b: Feature) -> str:
    return f"{a.name}+{b.name}"


def validate_pair(a: Feature, b: Feature) -> dict[str, list[str]]:
    """{} if Config.validate() accepts the pair, else the refusing rules and their messages.
    Validation reads no files but the nvme and chat paths' syntax: '{work}' stays a placeholder."""
    cfg = load_config(overrides=feature_overrides((a, b)))
    try:
        cfg.validate()
    except ConfigError as e:
        rules = refusing_rules(cfg)
        return rules or {"(field check)": [str(e)]}
    return {}


def model_axes(overrides: dict[str, Any]) -> int:
    """tp x cp x pp: the ranks one model replica spans."""
    return math.prod(int(overrides.get(f"parallel.{axis}", 1)) for axis in ("tp", "cp", "pp"))


def checked_elsewhere(features: tuple[Feature, ...]) -> str:
    """Why --run does not train these features here ('' where it does): the test that checks
    them (Feature.elsewhere, where its checked_with holds the others), else 'not run'."""
    for f in features:
        if f.elsewhere:
            others = [g.name for g in features if g is not f]
            if all(o in f.checked_with for o in others):
                return f.elsewhere
            return f"not run: {f.name} runs under its launcher or against a simulation, no test pairs it with {'+'.join(others)}"
    return ""


def _elsewhere(features: tuple[Feature, ...]) -> tuple[str, str]:
    why = checked_elsewhere(features)
    return ("accepted", why) if why.startswith("not run") else (ELSEWHERE, why)


def validation(a: Feature, b: Feature) -> tuple[str, str]:
    """('accepted', ''), ('refused', the rules' names) or ('exclusive', why)."""
    try:
        rules = validate_pair(a, b)
    except Exclusive as e:
        return "exclusive", str(e)
    return ("refused", " ".join(sorted(rules))) if rules else ("accepted", "")


def world_of(overrides: dict[str, Any], features: tuple[Feature, ...]) -> int:
    """Ranks the pair's layout needs: the model axes times the data-parallel ranks."""
    axes = model_axes(overrides)
    replicate = int(overrides.get("parallel.dp_replicate", 1))
    shard = int(overrides.get("parallel.dp_shard", -1))
    if shard > 0:
        dp = replicate * shard
    else:
        dp = 2 * replicate if axes == 1 or any(f.needs_dp for f in features) else replicate
    return axes * dp


def reference_overrides(overrides: dict[str, Any], world: int) -> dict[str, Any]:
    """One process: the execution keys out, the data-parallel ranks' micro-batches accumulated."""
    ref = {k: v for k, v in overrides.items() if not k.startswith(EXECUTION)}
    ref["train.grad_accum"] = int(overrides["train.grad_accum"]) * (world // model_axes(overrides))
    ref["parallel.dp_shard"] = 1
    if int(overrides.get("parallel.tp", 1)) > 1 and overrides.get("lora.quantize", "none") != "none":
        ref["lora.quantize_layout"] = "columns"  # the tp run's packing: the same rounding of the base
    return ref


def precision_of(overrides: dict[str, Any]) -> str:
    return {"fp16": "fp16", "bf16": "bf16", "fp8": "fp8"}.get(overrides["precision.compute"], "fp32")
