"""The composition matrix (bench/compose_matrix.py, run by bench/compose.py): every pair of its
24 features validated — each refusal must be one docs/architecture.md lists, with its rule,
under "Composition matrix" — and a fixed subset trained on gloo ranks against one process (the
bench's reference and tolerances: fp32, every step's loss and gradient norm within 1e-4
relative)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))  # spawned ranks import the bench's rank function by name
_spec = importlib.util.spec_from_file_location("compose", REPO / "bench" / "compose.py")
compose = importlib.util.module_from_spec(_spec)
sys.modules["compose"] = compose
_spec.loader.exec_module(compose)
import compose_matrix as matrix  # noqa: E402 (bench/ is on the path above)

EXCLUSIVE = {"fp16+fp8", "recompute_full+recompute_selective", "offload_cpu+offload_nvme"}


def _documented_refusals() -> dict[str, str]:
    """pair -> rule, from the refusal table of architecture.md's Composition matrix section."""
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text[text.index("## Composition matrix"):]
    end = section.find("\n## ", 3)
    section = section if end < 0 else section[:end]
    return dict(re.findall(r"^\| `([a-z0-9_]+\+[a-z0-9_]+)` \| `(_[a-z0-9_]+)` \| \S", section, re.M))


def test_every_pair_is_accepted_or_refused_as_documented():
    refused, exclusive = {}, set()
    for a, b in matrix.pairs():
        try:
            rules = matrix.validate_pair(a, b)
        except matrix.Exclusive:
            exclusive.add(matrix.pair_name(a, b))
            continue
        if rules:
            assert len(rules) == 1, (a.name, b.name, rules)  # one reason per pair: the table's
            refused[matrix.pair_name(a, b)] = next(iter(rules))
    assert len(matrix.FEATURES) == 24 and len(matrix.pairs()) == 276
    assert exclusive == EXCLUSIVE
    documented = _documented_refusals()
    assert refused == documented, (  # a new refusal, or one removed, updates the docs' table
        {p: r for p, r in refused.items() if documented.get(p) != r},
        {p: r for p, r in documented.items() if refused.get(p) != r})


def test_frontier_pairs_are_accepted_or_refused_as_documented():
    """The newer features (compose_matrix.FRONTIER) against every feature: each refusal one that
    architecture.md's frontier table lists with its rule (and only those), and the pairs issue
    42 part 4 lifted (compose_matrix.LIFTED) accepted."""
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text[text.index("### Issue 42's newer features"):]
    documented = {frozenset((a, b)): rule for a, b, rule in
                  re.findall(r"^\| ([a-z0-9_]+) × ([a-z0-9_]+) \| (_[a-z0-9_]+) \|", section, re.M)}
    refused = {}
    for a, b in matrix.pairs(frontier=True):
        try:
            rules = matrix.validate_pair(a, b)
        except matrix.Exclusive:
            continue
        if rules:
            assert len(rules) == 1, (a.name, b.name, rules)
            refused[frozenset((a.name, b.name))] = next(iter(rules))
    assert refused == documented and len(refused) == 5
    assert len(matrix.pairs(frontier=True)) == 24 * 8 + 28
    for name in matrix.LIFTED:
        assert matrix.validate_pair(*(matrix.BY_NAME[n] for n in name.split("+"))) == {}, name


def test_a_refusal_says_what_to_change():
    tp4 = matrix.Feature("tp4", {"parallel.tp": 4})  # > llama-tiny's 2 key/value heads
    rules = matrix.validate_pair(tp4, matrix.BY_NAME["qlora"])
    assert list(rules) == ["_lora_layout"]
    assert "parallel.tp = 4" in rules["_lora_layout"][0] and "lora.quantize = 'none'" in rules["_lora_layout"][0]
    assert matrix.validate_pair(matrix.BY_NAME["tp"], matrix.BY_NAME["lora"]) == {}


def test_a_mismatch_is_reported():
    ref = {"losses": [5.0, 4.0], "norms": [1.0, 0.9], "stepped": [True, True]}
    assert compose.compare(dict(ref), ref, 1e-4) == ""
    off = {**ref, "norms": [1.0, 0.9002]}
    assert "step 2 gradient norm" in compose.compare(off, ref, 1e-4)


def test_nvme_snapshot_keeps_the_state_of_its_save(tmp_path):
    """An asynchronous save with the optimizer on NVMe writes from a copy of the tier's files
    on their disk: the steps after it change the files, not the snapshot."""
    from shardlm.config.schema import TrainConfig
    from shardlm.parallel.data.zero.tiers.nvme import NvmeTier

    tier = NvmeTier(tmp_path, torch.float32, chunk_bytes=4096, buffers=3)
    target = torch.zeros(3000)
    tier.add(target, torch.linspace(-1, 1, 3000), decay=True)
    tier.build_optimizer(TrainConfig())
    tier.step([torch.full((3000,), 0.5)])
    live = tier.segment_state(0)
    views = [live[i].view(-1)[100:2100] for i in range(3)]  # as a checkpoint slice cuts them
    saved = [v.clone() for v in views]
    snapshot = tier.snapshot()
    assert all(snapshot.holds(v) for v in views) and not snapshot.holds(target)
    copies = [snapshot.view_of(v) for v in views]
    tier.step([torch.full((3000,), -0.25)])
    assert not torch.equal(views[0], saved[0])  # the step did change the live files
    for copy, before in zip(copies, saved):
        assert torch.equal(copy, before)
    tier.close()


SUBSET = ["offload_nvme+async_ckpt", "cp+chat_sft", "param_offload+lora", "tp+fp8", "zero3+periodic_ckpt"]
"""Four refusals this matrix removed: NVMe optimizer offload with an asynchronous save (read
back: exactly step 2's state), the loss-masked SFT loss under cp, LoRA's frozen base through
the nvme parameter store, fp8's tensor-parallel linears (emulated: 5e-2); and a periodic save
(checkpoint.every = 2) of ZeRO-3 shards read back as step 2's state. All on 2 ranks: one spawn
for the references, one for the pairs."""


@pytest.fixture(scope="module")
def subset_outcomes(tmp_path_factory):
    chosen = [tuple(matrix.BY_NAME[n] for n in pair.split("+")) for pair in SUBSET]
    assert all(matrix.validate_pair(a, b) == {} for a, b in chosen)
    outcomes = {}
    compose.run_batch(chosen, tmp_path_factory.mktemp("compose"), {},
                      lambda a, b, outcome: outcomes.__setitem__(matrix.pair_name(a, b), outcome))
    return outcomes


@pytest.mark.parametrize("pair", SUBSET)
def test_pair_matches_one_process(subset_outcomes, pair):
    status, detail = subset_outcomes[pair]
    assert status == "matched", detail


def test_a_pair_checked_elsewhere_is_reported_so(tmp_path):
    """Local SGD's reference is a simulation of its replicas, a fault-tolerant replica a world
    under the launcher: --run names the test that checks them instead of spawning."""
    pair = (matrix.BY_NAME["local_sgd"], matrix.BY_NAME["zero3"])
    status, detail = compose.run_pair(*pair, tmp_path, {})
    assert status == matrix.ELSEWHERE and "tests/test_local_sgd.py" in detail
