"""One objective whatever the split: on chat data (loss on assistant tokens only) the loss is the
global batch's summed cross-entropy over its counted targets, divided by their number — the
same for one micro-batch of 4, 2 micro-batches of 2, 2 data-parallel ranks of 2 at ZeRO-3, a
2-stage pipeline of 4 micro-batches of 1, and 2 context-parallel ranks (issue 40; transformers'
2024 gradient-accumulation fix). A mean of per-micro-batch means (what the loop did before)
weighs a micro-batch with few assistant tokens as much as a full one: on these rows it moves
the initial model's loss 40 times the tolerance (test_the_logged_loss_is_the_global_mean), and
its gradient and so the parameters far more.

The reference is independent of the split under test: the whole global batch in ONE
micro-batch, one process (the parity tests' references split the batch as their ranks do).

Tolerance, stated: fp32. The split changes the order of the loss's sum over the 4 x 64
targets and of the gradient sums (per micro-batch, then added; per rank, then all-reduced),
and a cp rank's attention merges two halves: each reordered sum of n fp32 terms moves by at
most ~n·eps relative (eps = 1.2e-7; n = 256 here, so ~3e-5 worst case, ~√n·eps = 2e-6
typical). Three AdamW steps carry that into the parameters, where m/√v of a near-zero gradient
amplifies it: losses within 2e-5 relative, each parameter tensor within 5e-4 relative (norm).
Measured on an AMD EPYC (Zen 3): losses within 1e-7, parameters within 1e-7 (accumulation,
ranks), 6e-6 (pipeline), 4e-5 (cp); the per-micro-batch mean of before missed by 0.16-0.46.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_overrides
from parity import rel
from shardlm.config.load import load_config
from shardlm.data.packed import PackedTokens
from shardlm.data.sft import IGNORE
from shardlm.launch.spawn import run_ranks
from shardlm.parallel.data.evaluation import token_sums
from shardlm.train.build import build_run
from zero_cases import train_case, train_cases

STEPS = 3
LOSS_TOL = 2e-5
PARAM_TOL = 5e-4

CHATS = [  # assistant turns of very different lengths: packed rows carry uneven loss counts
    {"messages": [{"role": "user", "content": "What is two plus two?"},
                  {"role": "assistant", "content": "Four."}]},
    {"messages": [{"role": "system", "content": "You explain at length."},
                  {"role": "user", "content": "Why is the sky blue?"},
                  {"role": "assistant", "content": "Sunlight scatters off the molecules of the air, "
                   "and blue light, with its shorter wavelength, scatters far more than red, so "
                   "the sky we see away from the sun is mostly that scattered blue light."}]},
    {"messages": [{"role": "user", "content": "Say hi, then list three colours and three animals."},
                  {"role": "assistant", "content": "Hi."}]},
    {"messages": [{"role": "user", "content": "Count to ten."},
                  {"role": "assistant", "content": "One, two, three, four, five, six, seven, eight, nine, ten."},
                  {"role": "user", "content": "Backwards?"},
                  {"role": "assistant", "content": "Ten, nine, eight, seven, six, five, four, three, two, one."}]},
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("global_loss")
    src = tmp / "chat.jsonl"
    src.write_text("".join(json.dumps(c) + "\n" for _ in range(12) for c in CHATS))
    base = tiny_overrides(tmp, model__preset="llama-tiny", data__source=str(src), data__format="chat",
                          data__max_bytes=0, data__val_fraction=0.1, data__cache_dir=str(tmp / "cache"),
                          train__micro_batch=4, train__lr=3e-3, train__warmup_steps=1,
                          train__eval_batches=1)
    # The first global batch's rows: their counted targets must be uneven, or no split could differ.
    run = build_run(load_config(overrides={**base, "run.name": "counts"}).validate())
    (x, y), = run.train_loader.micro_batches(0)
    per_row = (y != IGNORE).sum(dim=1).tolist()
    with torch.no_grad():  # the initial model's [summed loss, correct, count] per half-batch
        logits = run.forward(PackedTokens(x.ids, x.positions))  # every position's logits
        halves = [token_sums(logits[rows], y[rows]) for rows in (slice(0, 2), slice(2, 4))]
        counted = (x.counted, y, logits, run.forward(x))  # the head on the counted positions only
    first = {"global": float(sum(h[0] for h in halves) / sum(h[2] for h in halves)),
             "mean of means": float(sum(h[0] / h[2] for h in halves) / 2)}
    whole = train_case(base, STEPS)  # the reference: the global batch in one micro-batch
    accumulated = train_case({**base, "train.micro_batch": 2, "train.grad_accum": 2}, STEPS)
    split = {**base, "train.micro_batch": 2}
    by_rank = run_ranks(train_cases, 2, tmp, [
        ({**split, "parallel.zero_stage": 3}, STEPS, -1),  # 2 ranks x 2
        ({**base, "train.micro_batch": 1, "train.grad_accum": 4, "parallel.pp": 2}, STEPS, -1),
        ({**base, "parallel.cp": 2}, STEPS, -1),
    ])
    ranks = by_rank[0]
    ranks[1]["params"].update(by_rank[1][1]["params"])  # the pipeline: each stage's own blocks
    return per_row, first, whole, {"micro_batch 2 x grad_accum 2": accumulated, "2 ranks x 2, ZeRO-3": ranks[0],
                            "pp 2, 4 micro-batches of 1": ranks[1], "cp 2": ranks[2]}, counted


def test_the_rows_carry_uneven_loss_counts(runs):
    per_row, _, _, _, _ = runs
    assert min(per_row) > 0 and max(per_row) >= 1.5 * min(per_row), per_row


@pytest.mark.parametrize("split", ["micro_batch 2 x grad_accum 2", "2 ranks x 2, ZeRO-3",
                                   "pp 2, 4 micro-batches of 1", "cp 2"])
def test_every_split_trains_the_whole_batch_objective(runs, split):
    _, _, whole, splits, _ = runs
    ours = splits[split]
    assert ours["losses"] == pytest.approx(whole["losses"], rel=LOSS_TOL), split
    worst = max((rel(ours["params"][n], v), n) for n, v in whole["params"].items())
    assert worst[0] <= PARAM_TOL, (split, worst)


def test_the_logged_loss_is_the_global_mean(runs):
    """Step 1's logged loss is the initial model's cross-entropy summed over the global batch's
    counted targets over their number (computed here from token_sums of its two halves), and
    the mean of the halves' means the loop used to train on differs from it far beyond the
    tolerance: the comparisons above can fail."""
    _, first, whole, _, _ = runs
    assert whole["losses"][0] == pytest.approx(first["global"], rel=LOSS_TOL)
    assert abs(first["mean of means"] - first["global"]) > 10 * LOSS_TOL * first["global"], first


def test_the_head_runs_on_the_counted_positions_only(runs):
    """Chat rows carry their loss mask into the Decoder (PackedTokens.counted): its head and the
    loss over the vocabulary run on the counted positions only, as (1, N, vocab) in row order,
    and equal those positions' logits of the whole forward. Tolerance: the head's products over
    the same d_model terms, cut into a matrix of other rows (BLAS may block it otherwise): fp32,
    2e-6 absolute on logits of magnitude ~1 (d_model 64 terms x 2^-24 each, with room). The cp
    split above (whose ranks keep the whole head) trains to the same losses, which checks the
    gradients through the cut."""
    counted, y, full, cut = runs[4]
    assert counted is not None and torch.equal(counted, y != IGNORE)
    assert cut.shape == (1, int(counted.sum()), full.shape[-1])
    assert (cut[0] - full[counted]).abs().max() <= 2e-6
