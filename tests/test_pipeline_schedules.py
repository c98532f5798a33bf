"""Pipeline schedules as data (shardlm/parallel/pipeline/tables.py): every named schedule's table is
valid and its simulated bubble sits next to its published formula; a user's table is checked
before the run with an error naming the rank and slot that breaks a rule; and ZB-V, DualPipeV
and a table from a CSV train on real gloo ranks as one process does (fp32)."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_overrides
from parity import assert_matches
from shardlm.errors import ConfigError
from shardlm.parallel.pipeline.tables import (NAMED, Op, Table, check_table, posted_orders, read_table, send_plan,
                                              untagged_order_problem)
from shardlm.parallel.pipeline.schedules import bubble_formula
from shardlm.parallel.pipeline.schedules import build_table, table_for
from shardlm.launch.spawn import run_ranks
from pp_cases import cases_and_save, train_and_sample

STEPS, MICRO = 2, 4


def _grid():
    for name in NAMED:
        v = 2 if name in ("interleaved", "zbv", "dualpipev") else 1
        for p in (2, 3, 4, 8):
            for m in (1, 2, 3, 4, 6, 8, 16):
                if (name == "interleaved" and m % p) or (name == "dualpipev" and m < 2 * p):
                    continue
                yield name, p, v, m


def test_every_named_table_runs_and_meets_its_formula():
    """Each table passes the checker (each op once, F before B before W, neighbours' messages
    in order, no deadlock). GPipe, 1F1B and interleaved simulate to exactly their formulas; zb's
    formula is its table's; ZB-V and DualPipeV leave exactly the P-1 unit warm-up per rank
    (for M >= 2P-1), (P-1)/(6M+P-1): within DualPipeV's published bound (its F&B not
    overlapped here) and tending to ZB-V's published 0 as M grows. Memory: ZB-V holds at most
    2P chunk-micro-batches (1F1B's P stages' worth), DualPipeV 2P + 1 (the README's PP + 1)."""
    for name, p, v, m in _grid():
        timeline = check_table(table_for(name, p, v, m), p, p * v, m)
        formula = bubble_formula(name, p, v, m)
        if name in ("gpipe", "1f1b", "interleaved", "zb"):
            assert timeline.idle == pytest.approx(formula), (name, p, m)
        elif m >= 2 * p - 1:
            assert timeline.idle == pytest.approx((p - 1) / (6 * m + p - 1)), (name, p, m)
            assert formula == 0 if name == "zbv" else timeline.idle <= formula, (name, p, m)
        if name == "zbv":
            assert max(timeline.peak_in_flight) <= 2 * p, (p, m)
        if name == "dualpipev":
            assert max(timeline.peak_in_flight) <= 2 * p + 1, (p, m)
    assert build_table("zbv", 2, 2, 4).placement == "v" and build_table("interleaved", 2, 2, 4).placement == "loop"


def test_a_table_round_trips_through_csv(tmp_path):
    table = build_table("dualpipev", 3, 2, 6)
    path = tmp_path / "dualpipev.csv"
    path.write_text(table.to_csv())
    read = read_table(path)
    assert read.rows == table.rows and (read.stages, read.micro, read.placement) == (6, 6, "v")
    assert table_for(f"file:{path}", 3, 2, 6).rows == table.rows


def _rows(text: str) -> Table:
    """A table from 'rank 0 ops | rank 1 ops', ops space-separated ('.' an idle slot)."""
    rows = tuple(tuple(None if c == "." else Op(c[1], int(c[0]), int(c[2])) for c in row.split())
                 for row in text.split("|"))
    ops = [op for row in rows for op in row if op]
    return Table("t", rows, max(o.stage for o in ops) + 1, max(o.micro for o in ops) + 1)


GOOD = "0F0 0F1 0B0 0B1 | 1F0 1B0 1F1 1B1"


@pytest.mark.parametrize("text, message", [
    ("0F0 0F1 0B0 | 1F0 1B0 1F1 1B1",
     r"stage 0 micro-batch 1 has \['F'\]; it needs F and B \(or F, I and W\) on rank 0"),
    ("0F0 0F1 0B0 0B1 0B1 | 1F0 1B0 1F1 1B1", r"rank 0 slot 4 repeats 0B1 \(already at rank 0 slot 3\)"),
    ("0F0 0B0 0F1 0B1 | 1F0 1W0 1I0 1F1 1B1", r"rank 1 runs 1F0 then 1I0 then 1W0 out of order"),
    ("0F0 0B0 0F1 0B1 | 1F1 1F0 1B0 1B1", r"deadlocks: rank 0 slot 1 \(0B0\), rank 1 slot 0 \(1F1\)"),
    ("0B0 0F0 0F1 0B1 | 1F0 1B0 1F1 1B1", r"rank 0 runs 0F0 then 0B0 out of order"),
    ("0F0 0F1 1B0 0B1 | 1F0 0B0 1F1 1B1", r"stage 1 runs on rank 0 \(slot 2\) and on rank 1 \(slot 0, 1F0\)"),
    ("0F0 3F0 3B0 0B0 | 1F0 2F0 1B0 2B0", r"rank 1 slot 2 \(1B0\) needs stage 2's gradient of micro-batch 0, "
                                          r"which this rank computes later \(slot 3\)"),
    ("0F0 3F0 3B0 0B0 | 2F0 1F0 1B0 2B0", r"rank 1 slot 0 \(2F0\) needs stage 1's activations of micro-batch 0, "
                                          r"which this rank computes later \(slot 1\)"),
])
def test_broken_tables_name_the_rank_and_slot(text, message):
    check_table(_rows(GOOD))
    with pytest.raises(ConfigError, match=message):
        check_table(_rows(text))


def test_every_table_posts_its_messages_in_the_order_they_are_taken():
    """NCCL ignores tags: a pair's activations and gradients must go in the order the receiver
    takes them. The loop schedules make them in that order; ZB-V and DualPipeV do not (their two
    streams interleave differently at the two ends: untagged_order_problem names where), so the
    executor posts by send_plan, which holds a message back until every message its receiver
    takes first from that rank is out. For every named table, every ordered pair's posted
    sequence is the receiver's, and the simulation (one channel per pair, matched by place
    alone) runs without deadlock."""
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 1), ("zbv", 2), ("dualpipev", 2)):
        for p in (2, 3, 4):
            for m in (2 * p, 12):
                table = table_for(name, p, v, m)
                orders = posted_orders(table)
                assert orders and all(posted == taken for posted, taken in orders.values()), (name, p, m)
                mixed = untagged_order_problem(table)
                assert (mixed is None) == (name not in ("zbv", "dualpipev") or (name, p) == ("dualpipev", 2)), \
                    (name, p, m, mixed)
    assert untagged_order_problem(build_table("zbv", 2, 2, 4)) == (
        "rank 0's message 2 to rank 1 is 0F2 but rank 1 takes 3B0 as its message 2 from rank 0 "
        "(<stage>F<micro-batch>: activations, B: gradients)")
    plan = send_plan(build_table("zbv", 2, 2, 4))
    # 0F2 is made at slot 2 and held until 3B0 (made by 3I0, slot 4) is posted before it
    assert plan[0][2] == [] and plan[0][4] == [(1, "3B0"), (1, "0F2")]


def test_deadlock_names_every_stuck_rank():
    # rank 0 waits for micro-batch 0's gradient before sending micro-batch 1's activations;
    # rank 1 waits for those before running micro-batch 0's backward
    with pytest.raises(ConfigError, match=r"deadlocks: rank 0 slot 1 \(0B0\), rank 1 slot 1 \(1F1\)"):
        check_table(_rows("0F0 0B0 0F1 0B1 | 1F0 1F1 1B0 1B1"))


def test_config_checks_the_table_before_any_process(tmp_path):
    from shardlm.config.load import load_config

    base = {**tiny_overrides(tmp_path, train__grad_accum=2), "model.n_layers": 4, "parallel.pp": 2}
    with pytest.raises(ConfigError, match="set parallel.pp_virtual = 2"):
        load_config(overrides={**base, "parallel.pp_schedule": "zbv"}).validate()
    with pytest.raises(ConfigError, match=r"needs at least 2·pp = 4 micro-batches"):
        load_config(overrides={**base, "parallel.pp_schedule": "dualpipev", "parallel.pp_virtual": 2}).validate()
    with pytest.raises(ConfigError, match="cannot read it"):
        load_config(overrides={**base, "parallel.pp_schedule": f"file:{tmp_path}/none.csv"}).validate()
    bad = tmp_path / "bad.csv"  # micro-batch 1 taken first: posted so (send_plan), it runs
    bad.write_text("0F0,0F1,0B0,0B1\n1F1,1B1,1F0,1B0\n")
    load_config(overrides={**base, "parallel.pp_schedule": f"file:{bad}"}).validate()
    bad.write_text("0F0,0B0,0F1,0B1\n1F1,1F0,1B0,1B1\n")  # 0F1 waits on 0B0, 1B0 on 1F1, 1F1 on 0F1
    with pytest.raises(ConfigError, match=r"file:.*deadlocks: rank 0 slot 1 \(0B0\), rank 1 slot 0 \(1F1\)"):
        load_config(overrides={**base, "parallel.pp_schedule": f"file:{bad}"}).validate()
    with pytest.raises(ConfigError, match=r"has 2 micro-batches \(train.grad_accum\); the run has 4"):
        load_config(overrides={**base, "train.grad_accum": 4, "parallel.pp_schedule": f"file:{bad}"}).validate()
    with pytest.raises(ConfigError, match="must be one of gpipe"):
        load_config(overrides={**base, "parallel.pp_schedule": "zbh2"}).validate()


# fp32, against one process with the same global batch: each micro-batch's forward and backward
# compute what one process computes; the weight gradients are summed over micro-batches in
# another order (W after other micro-batches' I, chunk by chunk), and the tied embedding's two
# shares inside one backward on rank 0 (a V holds both ends): 1e-5 relative (tests/parity.py).
@pytest.fixture(scope="module")
def v_runs(tmp_path_factory):
    """Each case on 2 ranks (one spawn, which also writes ZB-V's checkpoints) and in one process."""
    import os

    tmp = tmp_path_factory.mktemp("ppv")
    gpt = {**tiny_overrides(tmp, train__grad_accum=MICRO, train__micro_batch=2), "model.n_layers": 4}
    llama = {**tiny_overrides(tmp, model__preset="llama-tiny", train__grad_accum=MICRO, train__micro_batch=2),
             "model.n_layers": 4}
    table = tmp / "mine.csv"  # a user's table: ZB-V's with rank 1's weight gradients all at the end
    zbv = build_table("zbv", 2, 2, MICRO)
    late = [op for op in zbv.rows[1] if op.kind != "W"] + [op for op in zbv.rows[1] if op.kind == "W"]
    table.write_text(Table("mine", (zbv.rows[0], tuple(late)), 4, MICRO).to_csv())
    v = {"parallel.pp": 2, "parallel.pp_virtual": 2}
    cases = [({**gpt, **v, "parallel.pp_schedule": "zbv"}, STEPS),
             ({**llama, **v, "parallel.pp_schedule": "dualpipev", "parallel.zero_stage": 1}, STEPS),
             ({**gpt, **v, "parallel.pp_schedule": f"file:{table}"}, STEPS)]
    save = {**cases[0][0], "train.steps": 2, "checkpoint.every": 1, "run.name": "zbv-saved"}
    out = run_ranks(cases_and_save, 2, tmp, cases, save)
    saved = os.environ.get("LOCAL_WORLD_SIZE")  # one rank's threads, as zero_cases.reference_case
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    try:
        refs = [train_and_sample(gpt, STEPS), train_and_sample(llama, STEPS)]
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE") if saved is None else os.environ.__setitem__("LOCAL_WORLD_SIZE", saved)
    return out, [refs[0], refs[1], refs[0]], gpt


@pytest.mark.parametrize("case, what", [(0, "pp=2 ZB-V gpt (tied head, both ends on rank 0)"),
                                        (1, "pp=2 DualPipeV llama, ZeRO-1"),
                                        (2, "pp=2 a CSV table (ZB-V, rank 1's W last)")])
def test_v_schedules_match_one_process(v_runs, case, what):
    out, refs, _ = v_runs
    ranks = [out[r][case] for r in range(2)]
    assert ranks[0]["losses"] == ranks[1]["losses"]  # every stage logs the head's loss
    whole = {**ranks[0]["params"], **ranks[1]["params"]}
    assert_matches(ranks[0]["losses"], whole, refs[case], what)
    assert not set(ranks[0]["params"]) & set(ranks[1]["params"])  # each parameter on one rank


def _assert_posted_as_taken(ranks: list[dict]) -> int:
    """Every ordered pair's messages, as the executor posted them on real ranks (Stage.posted,
    the last step), go in the order the receiver posted its receives: what NCCL, which ignores
    tags, needs. Returns how many messages were checked."""
    checked = 0
    for a, sender in enumerate(ranks):
        for b, receiver in enumerate(ranks):
            sent = [label for kind, peer, label in sender["posted"] if kind == "send" and peer == b]
            taken = [label for kind, peer, label in receiver["posted"] if kind == "recv" and peer == a]
            assert sent == taken, (a, b, sent, taken)
            checked += len(sent)
    return checked


def test_v_schedules_post_sends_in_the_order_receives_are_posted(v_runs):
    """ZB-V's and DualPipeV's own order of making messages differs from the receiver's at
    pp = 2 for ZB-V (untagged_order_problem): gloo would match them by tag, NCCL would pair
    the wrong ones. On the ranks of v_runs each pair's sends went in the receiver's order."""
    out, _, _ = v_runs
    assert untagged_order_problem(build_table("zbv", 2, 2, MICRO)) is not None  # the check bites
    for case in (0, 1, 2):
        # per step, each of MICRO micro-batches: activations down and gradients back, both ways
        assert _assert_posted_as_taken([out[r][case] for r in range(2)]) == 4 * MICRO


def test_generation_through_the_v_equals_one_process(v_runs):
    """Sampling after training through the V's stages (rank 0, 1, the turn on rank 1, back to
    rank 0, which samples) gives the one-process sample, token for token (fp32, the same seeded
    sampler), for ZB-V and DualPipeV."""
    out, refs, _ = v_runs
    # The parameters agree to 1e-5, not bit for bit: the same text because the seeded sampler's
    # argmax(p / q), q ~ Exp(1) (torch.multinomial), leads by >= 1.6e-2 (gpt) and 1.5e-2 (llama)
    # relative at every step, the top-50 cut by >= 1.6e-4 and 4.9e-5 (/T), measured on the
    # references: smaller changes of the logits cannot change the text.
    for case in (0, 1):
        assert out[0][case]["sample"] == out[1][case]["sample"] == refs[case]["sample"]


def test_zbv_checkpoint_loads_in_one_process(v_runs):
    """ZB-V pp=2 saved after step 1 (each rank its stages: 0 and 3, 1 and 2); one process
    resumes it: its step 2 has ZB-V's step-2 loss, and its evaluation after step 2 ZB-V's
    (evaluated through the V: Schedule.forward_only)."""
    from ckpt_cases import checkpoint_of
    from pp_cases import train_run

    out, _, gpt = v_runs
    saved = out[0][3]
    one = train_run({**gpt, "train.steps": 2, "run.name": "one",
                     "checkpoint.resume": checkpoint_of(saved["run_dir"], 1)})
    assert one["start"] == 1 and len(saved["losses"]) == 2
    torch.testing.assert_close(torch.tensor(one["losses"]), torch.tensor(saved["losses"][1:]), rtol=1e-5, atol=0)
    assert out[1][3]["val_loss"] == saved["val_loss"] == pytest.approx(one["val_loss"], rel=1e-5)


def test_planner_bubble_and_memory_of_the_v_schedules(tmp_path):
    """The planner's bubble for ZB-V and DualPipeV is their simulated table's (what the runtime
    executes), and its activations in flight are the table's peak chunks over two chunks a rank:
    ZB-V P micro-batches of a rank's blocks (1F1B's first stage), DualPipeV P + 1/2. A user's
    table is planned the same way (1F1B's, written to a CSV: 1F1B's bubble and memory)."""
    from shardlm.config.dims import ParallelDims
    from shardlm.planner.pipeline import pp_bubble, pp_in_flight
    from shardlm.planner.workload import Strategy

    for p, m in [(2, 4), (4, 8), (4, 16)]:
        for name in ("zbv", "dualpipev"):
            s = Strategy(ParallelDims(1, 1, pp=p), 1, 1, m, pp_schedule=name, pp_virtual=2)
            assert pp_bubble(s) == pytest.approx((p - 1) / (6 * m + p - 1))
            assert [pp_in_flight(s, r) for r in range(p)] == [p + (name == "dualpipev") / 2] * p
    path = tmp_path / "1f1b.csv"
    path.write_text(build_table("1f1b", 4, 1, 8).to_csv())
    s = Strategy(ParallelDims(1, 1, pp=4), 1, 1, 8, pp_schedule=f"file:{path}")
    assert pp_bubble(s) == pytest.approx(3 / 11) and [pp_in_flight(s, r) for r in range(4)] == [4, 3, 2, 1]



def test_dualpipev_on_4_ranks_matches_one_process(tmp_path):
    """pp = 4: 8 stages in a V, so ranks 1 and 2 receive from both neighbours (chunk 0 from the
    rank before, chunk 1 from the rank after) and rank 3 turns the V; DualPipeV's whole pattern
    (M = 2P = 8 micro-batches of one sequence). Losses and parameters after 2 steps within 1e-5
    of one process, and the same sample."""
    import os

    gpt = {**tiny_overrides(tmp_path, train__grad_accum=8, train__micro_batch=1), "model.n_layers": 8}
    piped = {**gpt, "parallel.pp": 4, "parallel.pp_virtual": 2, "parallel.pp_schedule": "dualpipev"}
    out = run_ranks(cases_and_save, 4, tmp_path, [(piped, 2)], None, timeout=600)
    saved = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    try:
        ref = train_and_sample(gpt, 2)
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE") if saved is None else os.environ.__setitem__("LOCAL_WORLD_SIZE", saved)
    whole = {name: value for rank in out for name, value in rank[0]["params"].items()}
    # The sample from parameters within 1e-5 of the reference's (not bitwise): the same text
    # because the seeded sampler's choice, argmax(p / q) with q ~ Exp(1) (torch.multinomial),
    # leads by >= 1.9e-4 relative at every one of the 20 steps, and the top-50 cut's 50th logit
    # the 51st by >= 4.3e-5 (/T), measured on the reference: smaller changes of the logits
    # cannot change the text (the parameters agree to 1e-5 relative, asserted below).
    assert all(rank[0]["losses"] == out[0][0]["losses"] and rank[0]["sample"] == ref["sample"] for rank in out)
    assert_matches(out[0][0]["losses"], whole, ref, "pp=4 DualPipeV")
    # DualPipeV at pp = 4 makes messages out of its receivers' order (untagged_order_problem):
    # posted in their order all the same (6 pairs' activations and gradients, 8 micro-batches)
    assert untagged_order_problem(build_table("dualpipev", 4, 2, 8)) is not None
    assert _assert_posted_as_taken([rank[0] for rank in out]) == 2 * 6 * 8
