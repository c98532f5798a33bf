"""Pipeline parallelism on real gloo ranks against one process with the same global batch,
every precision pinned to fp32; and the layer split's arithmetic."""

from __future__ import annotations

import itertools

import pytest
import torch

from conftest import tiny_overrides
from parity import assert_matches as _matches
from shardlm.config.dims import split_layers
from shardlm.errors import ConfigError
from shardlm.launch.spawn import run_ranks
from zero_cases import reference_case, train_cases

STEPS, MICRO = 3, 4
ZERO3_STEPS = 2


def stages_whole(results: list[dict]) -> dict[str, torch.Tensor]:
    """The whole model from every stage's parameters (names are the whole model's)."""
    whole: dict[str, torch.Tensor] = {}
    for result in results:
        whole.update(result["params"])
    return whole


# fp32. A pipeline runs each micro-batch's forward and backward as one process does, on the same
# values; only the gradients' accumulation order over micro-batches can differ (1F1B and GPipe
# both accumulate in micro-batch order on each stage except GPipe's reversed backward), and the
# tied embedding's two shares are summed across stages instead of inside one backward: 1e-5
# (the key bias apart: tests/parity.py).
def _checkpoint_base(tmp, n: int) -> dict:
    return tiny_overrides(tmp, train__grad_accum=MICRO, train__micro_batch=2, train__steps=2 * n)


def _ledger_overrides(tmp) -> dict:
    return {**tiny_overrides(tmp, train__grad_accum=MICRO, train__micro_batch=2, train__steps=2),
            "parallel.pp": 2, "run.name": "ledger"}


def _sample_base(tmp) -> dict:
    return tiny_overrides(tmp, model__n_layers=4, train__grad_accum=2)


def _sample_piped(base: dict) -> dict:
    return {**base, "parallel.pp": 2, "parallel.pp_schedule": "interleaved", "parallel.pp_virtual": 2}


@pytest.fixture(scope="module")
def pp_runs(two_rank_world):
    return two_rank_world["parity"]


@pytest.fixture(scope="module")
def two_rank_world(tmp_path_factory):
    """Every 2-rank check of this file that needs no other run first, in one spawned world
    (pp_cases.pp_world): the interleaved sample, the parity cases (pp_runs), the run the
    checkpoint-layout test resumes from and the ledger test's run. One set of rank processes
    instead of four."""
    from pp_cases import pp_world

    tmp = tmp_path_factory.mktemp("pp")
    gpt = tiny_overrides(tmp, train__grad_accum=MICRO, train__micro_batch=2)
    llama = tiny_overrides(tmp, model__preset="llama-tiny", train__grad_accum=MICRO, train__micro_batch=2)
    uneven = {**gpt, "model.n_layers": 5}
    deep = {**llama, "model.n_layers": 4}
    cases = [({**gpt, "parallel.pp": 2, "parallel.pp_schedule": "1f1b"}, STEPS, -1),
             ({**gpt, "parallel.pp": 2, "parallel.pp_schedule": "gpipe"}, STEPS, -1),
             ({**llama, "parallel.pp": 2, "parallel.zero_stage": 1}, STEPS, -1),
             ({**uneven, "parallel.pp": 2, "parallel.pp_layers": "1,4"}, STEPS, -1),
             ({**deep, "parallel.pp": 2, "parallel.pp_schedule": "interleaved", "parallel.pp_virtual": 2,
               "parallel.zero_stage": 2}, STEPS, -1),
             ({**gpt, "parallel.pp": 2, "parallel.pp_schedule": "zb"}, STEPS, -1),
             ({**deep, "parallel.pp": 2, "parallel.pp_schedule": "zb", "parallel.zero_stage": 1,
               "activation.checkpoint": "full"}, STEPS, -1)]
    saved = {**_checkpoint_base(tmp, 2), "parallel.pp": 2, "parallel.zero_stage": 1, "checkpoint.every": 2,
             "run.name": "pp2"}
    out = run_ranks(pp_world, 2, tmp, (_sample_piped(_sample_base(tmp)), 2), cases,
                    [saved, _ledger_overrides(tmp)])
    refs = [reference_case(gpt, 1, STEPS), None, reference_case(llama, 1, STEPS),
            reference_case(uneven, 1, STEPS), reference_case(deep, 1, STEPS), None,
            reference_case({**deep, "activation.checkpoint": "full"}, 1, STEPS)]
    refs[1] = refs[5] = refs[0]
    return {"parity": ([r["train"] for r in out], refs), "sample": [r["sample"] for r in out],
            "pp2_saved": out[0]["runs"][0], "ledger": out[0]["runs"][1]}


@pytest.mark.parametrize("case, what", [(0, "pp=2 1f1b gpt (tied head)"), (1, "pp=2 gpipe gpt"),
                                        (2, "pp=2 1f1b llama, ZeRO-1"), (3, "pp=2, 5 layers as 1 + 4"),
                                        (4, "pp=2 interleaved, 2 chunks per rank, ZeRO-2"),
                                        (5, "pp=2 zero bubble gpt"),
                                        (6, "pp=2 zero bubble llama, ZeRO-1, full recompute")])
def test_pp_matches_one_process(pp_runs, case, what):
    out, refs = pp_runs
    ranks = [out[r][case] for r in range(2)]
    for got in ranks:  # every stage logs the same loss (the last stage's, summed)
        assert got["losses"] == ranks[0]["losses"]
    _matches(ranks[0]["losses"], stages_whole(ranks), refs[case], what)


@pytest.fixture(scope="module")
def four_rank_runs(tmp_path_factory):
    """One spawn of 4 ranks for the 4-rank cases (process start-up paid once): pp 2 × dp 2 at
    ZeRO-1, pp 2 × tp 2 with sequence parallelism, and pp 2 × dp 2 at ZeRO-3 (GPT's tied head,
    interleaved: two chunks per rank; 2 steps)."""
    tmp = tmp_path_factory.mktemp("pp4")
    base = tiny_overrides(tmp, model__preset="llama-tiny", train__grad_accum=MICRO, train__micro_batch=2)
    gpt = tiny_overrides(tmp, model__n_layers=4, train__grad_accum=MICRO, train__micro_batch=2, train__seq_len=32)
    out = run_ranks(train_cases, 4, tmp,
                    [({**base, "parallel.pp": 2, "parallel.zero_stage": 1}, STEPS, -1),
                     ({**base, "parallel.pp": 2, "parallel.tp": 2, "parallel.sequence_parallel": True,
                       "train.grad_accum": 2 * MICRO}, STEPS, -1),
                     ({**gpt, "parallel.pp": 2, "parallel.zero_stage": 3, "parallel.pp_schedule": "interleaved",
                       "parallel.pp_virtual": 2}, ZERO3_STEPS, -1)], timeout=300)
    return out, base, gpt


def test_pp_with_data_and_tensor_parallelism_on_4_ranks(four_rank_runs):
    """pp 2 × dp 2 at ZeRO-1 (each stage's states sharded over its two data-parallel ranks), and
    pp 2 × tp 2 with sequence parallelism, each against one process with the same global batch."""
    from tp_cases import whole_params

    out, base, _ = four_rank_runs
    two = reference_case(base, 2, STEPS)
    for dp in range(2):  # ranks (stage, dp) = 2·stage + dp
        _matches(out[dp][0]["losses"], stages_whole([out[dp][0], out[2 + dp][0]]), two, f"pp2 x dp2, dp {dp}")
    # ranks (stage, tp) = 2·stage + t: each stage's pieces put together, then the stages
    whole = {**whole_params([out[0][1], out[1][1]]), **whole_params([out[2][1], out[3][1]])}
    _matches(out[0][1]["losses"], whole, two, "pp2 x tp2 SP")


def test_pp2_dp2_zero3_matches_one_process_and_gathers_once_per_step(four_rank_runs):
    """ZeRO-3 under pp (issue 28): each stage's units sharded over its two data-parallel ranks,
    gathered at their first forward of a step and held to its last backward (parallel/data/zero/params.py
    hold_for_step), reduce-scattered after it; the tied head's copy on the last stage has its
    gradient summed over the two ends first. Every stage's parameters match one process (1e-5,
    tests/parity.py), and per step each rank's shard group carries exactly one all-gather and
    one reduce-scatter of its stage's padded parameters (the ledger; gathered for each
    micro-batch's forward and backward instead, it read 9.6 times that: 2·M gathers and the
    root's again, measured with hold_for_step off)."""
    from shardlm.parallel.data.zero.partition import comm_bytes_per_step

    out, _, gpt = four_rank_runs
    ref = reference_case(gpt, 2, ZERO3_STEPS)
    for dp in range(2):  # ranks (stage, dp) = 2·stage + dp
        first, last = out[dp][2], out[2 + dp][2]
        assert first["losses"] == last["losses"]  # every stage logs the head's loss
        _matches(first["losses"], stages_whole([first, last]), ref, f"pp2 x dp2 ZeRO-3, dp {dp}")
    for rank in range(4):
        got = out[rank][2]
        assert got["padded"] > 0
        for step in range(ZERO3_STEPS):
            assert got["comm_by_op"][step]["dp_shard"] == 2 * got["padded"] * 4, (rank, step)
        assert got["comm_by_op"][-1]["dp_shard"] == comm_bytes_per_step(got["padded"], 3, 4, 4, pipeline=True)


def test_3d_pp2_tp2_dp2_on_8_ranks(tmp_path):
    """pipeline × tensor × data parallelism at once (8 ranks, ZeRO-1, sequence parallel):
    against one process with the same global batch."""
    from tp_cases import whole_params

    base = tiny_overrides(tmp_path, model__preset="llama-tiny", train__grad_accum=2, train__micro_batch=2)
    out = run_ranks(train_cases, 8, tmp_path,
                    [({**base, "parallel.pp": 2, "parallel.tp": 2, "parallel.sequence_parallel": True,
                       "parallel.zero_stage": 1}, 2, -1)], timeout=600)
    ref = reference_case(base, 2, 2)
    for dp in range(2):  # rank = stage·4 + dp·2 + t
        whole = {**whole_params([out[2 * dp][0], out[2 * dp + 1][0]]),
                 **whole_params([out[4 + 2 * dp][0], out[5 + 2 * dp][0]])}
        _matches(out[2 * dp][0]["losses"], whole, ref, f"pp2 x tp2 x dp2, dp {dp}")


def test_checkpoints_load_across_pipeline_layouts(two_rank_world, tmp_path):
    """pp 2 → 1 process → pp 2: the same loss curve continues."""
    from ckpt_cases import checkpoint_of, train_ranks, train_run

    n = 2
    base = _checkpoint_base(tmp_path, n)
    saved = two_rank_world["pp2_saved"]  # the world's train_run at pp 2, ZeRO-1, saving every n steps
    one = train_run({**base, "run.name": "one", "checkpoint.every": n,
                     "checkpoint.resume": checkpoint_of(saved["run_dir"], n)})
    assert one["start"] == n
    torch.testing.assert_close(torch.tensor(one["losses"]), torch.tensor(saved["losses"][n:]), rtol=1e-5, atol=0)
    back = run_ranks(train_ranks, 2, tmp_path, {**base, "parallel.pp": 2, "run.name": "back",
                                                "train.steps": 3 * n,
                                                "checkpoint.resume": checkpoint_of(one["run_dir"], 2 * n)})[0]
    alone = train_run({**base, "run.name": "alone", "train.steps": 3 * n,
                       "checkpoint.resume": checkpoint_of(one["run_dir"], 2 * n)})
    assert back["start"] == alone["start"] == 2 * n
    torch.testing.assert_close(torch.tensor(back["losses"]), torch.tensor(alone["losses"]), rtol=1e-5, atol=0)


def test_ledger_and_bubble(two_rank_world):
    """Per step, each stage sends one activation (first stage) or one gradient (last stage) of
    micro_batch × seq × d_model per micro-batch, and the tied embedding's gradient is summed
    across the two ends; the JSONL carries the measured bubble next to (P-1)/(M+P-1)."""
    import json
    from pathlib import Path

    result = two_rank_world["ledger"]  # the world's train_run of _ledger_overrides (2 steps, pp 2)
    lines = [json.loads(x) for x in (Path(result["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    last = lines[-1]
    act = 2 * 64 * 64 * 4  # micro-batch 2 × seq 64 × d_model 64, fp32
    assert last["comm_bytes_by_op"] == {"send/pp": MICRO * act, "all_reduce/pp_ends": 2 * 512 * 64 * 4}
    assert last["pp_bubble_formula"] == pytest.approx(1 / (MICRO + 1))
    assert len(last["pp_bubble_by_stage"]) == 2 and all(0 <= b < 1 for b in last["pp_bubble_by_stage"])
    assert len(last["pp_peak_rss_bytes_by_stage"]) == 2 and min(last["pp_peak_rss_bytes_by_stage"]) > 2**20


@pytest.mark.parametrize("n_layers, pp", [(126, 16), (5, 2), (7, 7), (48, 5)])
def test_split_sums_to_the_layers_and_is_balanced(n_layers, pp):
    """The split always sums to the model's layers (the planner's old split put 127 on 16
    stages of a 126-layer model, 21 on the last), each stage >= 1, and no other split of the
    same layers makes the most loaded stage lighter (checked exhaustively where small)."""
    for first, last in [(0.0, 0.0), (0.0, 2.5), (1.0, 6.0)]:
        split = split_layers(n_layers, pp, first, last)
        assert sum(split) == n_layers and min(split) >= 1 and len(split) == pp
        cost = lambda s: max(c + e for c, e in zip(s, [first] + [0] * (pp - 2) + [last]))  # noqa: E731
        if n_layers <= 12:
            best = min(cost(s) for s in itertools.product(range(1, n_layers + 1), repeat=pp)
                       if sum(s) == n_layers)
            assert cost(split) == best
        else:
            assert cost(split) <= (n_layers + first + last) / pp + 1
    assert split_layers(126, 16) == [7, 7] + [8] * 14


def test_split_property_over_many_shapes():
    for n_layers, pp in itertools.product(range(1, 40), range(1, 12)):
        if pp > n_layers:
            with pytest.raises(ConfigError):
                split_layers(n_layers, pp)
            continue
        split = split_layers(n_layers, pp, 0.5, 3.0)
        assert sum(split) == n_layers and min(split) >= 1 and len(split) == pp


def test_pipeline_config_errors(tmp_path):
    from shardlm.config.load import load_config

    base = tiny_overrides(tmp_path)
    load_config(overrides={**base, "parallel.pp": 2, "parallel.zero_stage": 3}).validate()  # issue 28
    with pytest.raises(ConfigError, match="summing to the model's 2 layers"):
        load_config(overrides={**base, "parallel.pp": 2, "parallel.pp_layers": "2,1"}).validate()
    with pytest.raises(ConfigError, match="exceed the model.s 2 layers"):
        load_config(overrides={**base, "parallel.pp": 3}).validate()


def test_generation_through_the_stages_equals_one_process(two_rank_world, tmp_path):
    """Sampling across pipeline stages (interleaved: 2 chunks per rank) gives the one-process
    sample, token for token (fp32; the same seeded sampler on the last stage)."""
    from pp_cases import sample_case

    base = _sample_base(tmp_path)
    piped = two_rank_world["sample"]  # the world's sample_case of _sample_piped(base), 2 steps
    alone = run_ranks(sample_case, 1, tmp_path, base, 2)[0]
    # Not the same parameters bit for bit (pp sums gradients in another order): the same text
    # because the seeded sampler's choice, argmax(p / q) with q ~ Exp(1) (torch.multinomial),
    # leads by >= 1.8e-2 relative at every step, the top-50 cut by >= 1.0e-4 (/T) (measured on
    # the one-process run): smaller changes of the logits cannot change the text.
    assert piped[0] == piped[1] == alone
