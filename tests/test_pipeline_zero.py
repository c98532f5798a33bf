"""ZeRO-3 under pipeline parallelism: pp 2 x dp 2 on 4 gloo ranks against one process with the
same global batch, fp32. Each stage's units are sharded over its two data-parallel ranks,
gathered at their first forward of a step and held until the step's last backward (zero/params.py
hold_for_step), their gradients reduce-scattered after it."""

from __future__ import annotations

from conftest import tiny_overrides
from parity import assert_matches
from shardlm.spawn import run_ranks
from shardlm.zero.partition import comm_bytes_per_step
from zero_cases import reference_case, train_cases

STEPS, MICRO = 2, 4


def test_pp2_dp2_zero3_matches_one_process_and_gathers_once_per_step(tmp_path):
    """GPT (tied head: the embedding's copy on the last stage, its gradient summed over the two
    ends before the reduce-scatter), interleaved: two chunks per rank. Every stage's parameters
    match one process (1e-5, tests/parity.py), and per step each rank's shard group carries
    exactly one all-gather and one reduce-scatter of its stage's padded parameters (the ledger):
    gathered for each micro-batch's forward and backward instead, the ledger read 9.6 times that
    (2·M gathers, and the root's again; measured with hold_for_step off)."""
    base = tiny_overrides(tmp_path, model__n_layers=4, train__grad_accum=MICRO, train__micro_batch=2,
                          train__seq_len=32)
    piped = {**base, "parallel.pp": 2, "parallel.zero_stage": 3, "parallel.pp_schedule": "interleaved",
             "parallel.pp_virtual": 2}
    out = run_ranks(train_cases, 4, tmp_path, [(piped, STEPS, -1)], timeout=300)
    ref = reference_case(base, 2, STEPS)
    for dp in range(2):  # ranks (stage, dp) = 2·stage + dp
        first, last = out[dp][0], out[2 + dp][0]
        assert first["losses"] == last["losses"]  # every stage logs the head's loss
        assert_matches(first["losses"], {**first["params"], **last["params"]}, ref, f"pp2 x dp2 ZeRO-3, dp {dp}")
    for rank in range(4):
        got = out[rank][0]
        assert got["padded"] > 0
        for step in range(STEPS):
            assert got["comm_by_op"][step]["dp_shard"] == 2 * got["padded"] * 4, (rank, step)
        assert got["comm_by_op"][-1]["dp_shard"] == comm_bytes_per_step(got["padded"], 3, 4, 4, pipeline=True)
