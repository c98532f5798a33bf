"""LoRA (models/lora.py) on our decoder: the adapted model starts as the base model, only the
adapters train and hold optimizer state, ZeRO stages 0 and 3 on two ranks match one process,
and a checkpoint resumes.

Tolerance: fp32, 2 ranks, no accumulation against the one-process reference with the same
global batch (zero_cases.reference_case): each rank computes one micro-batch of the reference;
the sharded grad norm may differ in the last bit (tests/test_zero.py), held to 1e-6 relative.
"""

from __future__ import annotations

import pytest
import torch

from ckpt_cases import straight_and_resumed
from conftest import tiny_overrides
from lora_cases import lora_case, lora_cases
from parity import assert_matches
from shardlm.config.load import load_config
from shardlm.errors import ConfigError
from shardlm.models.decoder import build_model
from shardlm.models.lora import apply_lora, is_adapter
from shardlm.launch.spawn import run_ranks
from shardlm.train.build import build_run
from shardlm.train.step import train_step
from zero_cases import reference_case

STEPS = 4


def _base(tmp_path, preset="llama-tiny", **extra):
    return tiny_overrides(tmp_path, model__preset=preset, train__micro_batch=4, lora__rank=4,
                          train__lr=1e-2, **extra)


@pytest.mark.parametrize("preset", ["llama-tiny", "gpt-tiny"])
def test_zero_B_reproduces_the_base_model(preset):
    cfg = load_config(overrides={"model.preset": preset}).model
    base = build_model(cfg, "cpu", seed=3)
    adapted = build_model(cfg, "cpu", seed=3)
    state = apply_lora(adapted, 8, 16.0, 0.0, "", cfg.mlp, seed=3)
    assert state.trainable == sum(p.numel() for n, p in adapted.named_parameters() if is_adapter(n))
    assert any(p.abs().sum() > 0 for n, p in adapted.named_parameters() if "lora_A" in n)
    idx = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(adapted(idx), base(idx))


def test_built_run_starts_as_the_base(tmp_path):
    """Through build_run (meta device, the initializer): the same parameters and logits."""
    o = _base(tmp_path)
    lora = build_run(load_config(overrides={**o, "run.name": "a"}).validate())
    plain = build_run(load_config(overrides={**o, "lora.rank": 0, "run.name": "b"}).validate())
    names = dict(plain.model.named_parameters())
    for name, p in lora.model.named_parameters():
        assert is_adapter(name) or torch.equal(p, names[name]), name
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(lora.model(idx), plain.model(idx))


def test_only_adapters_train_and_hold_state(tmp_path):
    out = lora_case(_base(tmp_path), 6)
    changed = {n for n in out["params"] if not torch.equal(out["params"][n], out["before"][n])}
    assert changed and all(is_adapter(n) for n in changed)
    assert all("lora_B" in n or "lora_A" in n for n in out["requires_grad"])
    assert out["losses"][-1] < out["losses"][0]
    assert out["optim_elements"] == out["adapter_elements"] == out["trainable"]


def test_bad_targets_and_layouts_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="mlp.nothing"):
        build_run(load_config(overrides={**_base(tmp_path), "lora.targets": "attn.qkv,mlp.nothing"}).validate())
    with pytest.raises(ConfigError, match="lora.quantize"):  # tp > n_kv_heads: kv rows not cut from nf4
        load_config(overrides={**_base(tmp_path), "parallel.tp": 4, "lora.quantize": "nf4"}).validate()
    load_config(overrides={**_base(tmp_path), "parallel.tp": 2, "lora.quantize": "nf4"}).validate()  # QLoRA: cut
    load_config(overrides={**_base(tmp_path), "parallel.tp": 2}).validate()  # plain LoRA: cut by tp


RESUME_STAGES = (0, 3)


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    from worlds import several

    tmp = tmp_path_factory.mktemp("lora2")
    cases = [({**_base(tmp), "parallel.zero_stage": stage}, STEPS) for stage in (0, 3)]
    cases.append(({**_base(tmp, "gpt-tiny"), "parallel.zero_stage": 3}, STEPS))
    # and, in the same world (worlds.several), test_checkpoint_resumes's runs: one spawn, not three
    resumes = [(f"lora{stage}", {**_base(tmp), "parallel.zero_stage": stage}, 2) for stage in RESUME_STAGES]
    out, resumed = zip(*run_ranks(several, 2, tmp, [(lora_cases, (cases,)), (straight_and_resumed, (resumes,))]))
    refs = {preset: reference_case(_base(tmp, preset), 2, STEPS) for preset in ("llama-tiny", "gpt-tiny")}
    return out, refs, resumed[0]  # resumed[0]: rank 0's (straight, resumed) per stage


@pytest.mark.parametrize("case,preset", [(0, "llama-tiny"), (1, "llama-tiny"), (2, "gpt-tiny")])
def test_two_ranks_match_one_process(two_rank_runs, case, preset):
    out, refs, _ = two_rank_runs
    ref = refs[preset]
    for rank in (0, 1):
        got = out[rank][case]
        assert_matches(got["losses"], got["params"], ref, f"case {case} rank {rank}", tol=1e-6, lr=1e-2)
        base = {n for n in got["params"] if not is_adapter(n)}
        assert all(torch.equal(got["params"][n], got["before"][n]) for n in base)
    # the optimizer holds the adapters only: sharded at stage 3, whole at stage 0
    stage3 = out[0][1]["optim_elements"] + out[1][1]["optim_elements"]
    assert out[0][1]["adapter_elements"] <= stage3 < out[0][1]["adapter_elements"] + 64
    assert out[0][0]["optim_elements"] == out[0][0]["adapter_elements"]


@pytest.mark.parametrize("stage", RESUME_STAGES)
def test_checkpoint_resumes(two_rank_runs, stage):
    # two_rank_runs' world ran straight_and_resumed of _base at this stage: 4 steps saving at 2,
    # then a resume from step 2
    straight, resumed = two_rank_runs[2][RESUME_STAGES.index(stage)]
    assert resumed["start"] == 2
    assert resumed["losses"] == straight["losses"][2:]
    for name, value in straight["params"].items():
        assert torch.equal(resumed["params"][name], value), name


def test_from_a_transformers_checkpoint(tmp_path):
    """model.hf_path + LoRA: the checkpoint's weights load under their names (the first logits
    are transformers' own, B being zero), adapters come from the model's initializer, and only
    they change (the loss falling is test_only_adapters_train_and_hold_state's)."""
    from test_hf_path import make_hf_dir, overrides

    hf_dir, hf = make_hf_dir(tmp_path, "llama")
    run = build_run(load_config(overrides=overrides(tmp_path, hf_dir, lora__rank=4, train__steps=3,
                                                     train__lr=1e-2)).validate())
    x, y = run.train_loader.micro_batches(0)[0]
    with torch.no_grad():
        torch.testing.assert_close(run.model(x), hf(input_ids=x).logits, atol=1e-5, rtol=1e-5)
    before = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    for step in range(3):
        train_step(run, step)
    changed = {n for n, p in run.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(is_adapter(n) for n in changed)
