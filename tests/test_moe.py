"""Mixture of experts: the layer's routing, capacity and balancing in one process, and expert
parallelism on real gloo ranks against one process with the same global batch (fp32 pinned)."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import tiny_overrides
from parity import assert_matches
from shardlm.config.load import load_config
from shardlm.errors import ConfigError
from shardlm.models.decoder import build_model
from shardlm.models.moe import MoEStats, update_biases
from shardlm.parallel.expert.dispatch import moe_record
from shardlm.launch.spawn import run_ranks
from zero_cases import reference_case, train_cases

STEPS = 3


def _model(**model):
    cfg = load_config(overrides={"model.preset": "moe-tiny", **{f"model.{k}": v for k, v in model.items()}})
    return build_model(cfg.model, "cpu", seed=0)


def _step(model, idx):
    model.moe_stats.reset()
    logits = model(idx)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx.roll(-1, 1).flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_capacity_without_overflow_is_dropless():
    """capacity_factor = experts / top_k makes every expert's capacity all the tokens: the
    same bits as dropless; a tight capacity drops choices and changes the result."""
    idx = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    dropless = _step(_model(capacity_factor=0.0), idx)
    roomy = _model(capacity_factor=2.0)
    assert _step(roomy, idx)[0] == dropless[0]
    for name, grad in dropless[1].items():
        assert torch.equal(roomy.get_parameter(name).grad, grad), name
    assert roomy.moe_stats.sums[:, 4].sum() == 0  # nothing dropped
    tight = _model(capacity_factor=0.5)
    loss, _ = _step(tight, idx)
    assert loss != dropless[0] and tight.moe_stats.sums[:, 4].sum() > 0


def test_a_router_forced_to_one_expert_gives_the_expected_imbalance_and_drops():
    """Every token to expert 0 (top-1, a bias the choice is made on): imbalance max/mean = E,
    and with capacity factor 1 expert 0 keeps ceil(N / E) of the N choices."""
    model = _model(top_k=1, capacity_factor=1.0)
    for block in model.blocks:
        block.mlp.router.bias = torch.tensor([100.0, 0.0, 0.0, 0.0])
    idx = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
    _step(model, idx)
    n, e = idx.numel(), 4
    record = moe_record(model.moe_stats, model.moe_stats.sums, {})
    assert record["moe_tokens_per_expert"] == [[n, 0, 0, 0]] * 2
    assert record["moe_imbalance"] == pytest.approx(e)
    assert record["moe_dropped_fraction"] == pytest.approx((n - math.ceil(n / e)) / n)


def test_bias_balancing_moves_toward_the_mean_load():
    stats = MoEStats([0, 1], 4, biases={0: torch.zeros(4), 1: torch.zeros(4)})
    update_biases(stats, torch.tensor([[10.0, 0.0, 5.0, 5.0], [1.0, 1.0, 1.0, 1.0]]), 0.01)
    assert stats.biases[0].tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.0])
    assert stats.biases[1].tolist() == [0.0] * 4


def test_the_balancing_loss_reaches_the_router():
    """The Switch loss is attached to the layer output: with only it (and no language-model
    gradient), the router still gets a gradient; with coefficients 0 it gets none from it."""
    idx = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(2))
    for coef, expect in ((1.0, True), (0.0, False)):
        model = _model(aux_loss_coef=coef, z_loss_coef=0.0)
        model.moe_stats.reset()
        (model(idx) * 0).sum().backward()
        grad = model.blocks[0].mlp.router.weight.grad
        assert (grad is not None and bool(grad.abs().sum() > 0)) == expect


@pytest.mark.parametrize("overrides, message", [
    ({"parallel.ep": 2, "model.preset": "gpt-tiny"}, "must divide model.experts = 0"),
    ({"parallel.ep": 3}, "must divide model.experts = 4"),
    ({"parallel.ep": 2, "parallel.tp": 4}, "parallel.tp × parallel.ep = 4 × 2 must divide model.experts = 4"),
    ({"parallel.ep": 2, "parallel.tp": 2, "parallel.ep_rebalance_every": 1}, "ep_rebalance_every = 1 with parallel.tp"),
    ({"parallel.ep": 4, "parallel.cp": 2, "parallel.dp_shard": 1}, "must divide parallel.dp_shard × parallel.cp = 1 × 2"),
    ({"model.top_k": 5}, "exceeds model.experts"),
    ({"model.router": "argmax"}, "choose one of softmax, sigmoid"),
])
def test_bad_moe_configs_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides={"model.preset": "moe-tiny", **overrides}).validate()


def test_the_grouped_expert_matmul_is_the_per_expert_loop_bit_for_bit():
    """models/expert_matmul.py's op (what a compiled graph holds) against F.linear per expert,
    with and without a bias and with an expert that gets no rows: outputs and every gradient."""
    import torch.nn.functional as F

    from shardlm.models.expert_matmul import expert_linear

    g = torch.Generator().manual_seed(3)
    x = torch.randn(60, 32, generator=g, requires_grad=True)
    w = torch.randn(4, 48, 32, generator=g, requires_grad=True)
    b = torch.randn(4, 48, generator=g, requires_grad=True)
    counts = torch.tensor([20, 0, 31, 9])
    for bias in (None, b):
        inputs = (x, w) if bias is None else (x, w, b)
        loop = torch.cat([F.linear(xe, w[e], None if bias is None else bias[e])
                          for e, xe in enumerate(x.split(counts.tolist()))])
        grad = torch.randn(loop.shape, generator=g)
        grouped = expert_linear(x, w, bias, counts)
        assert torch.equal(grouped, loop)
        for ours, torchs in zip(torch.autograd.grad(grouped, inputs, grad), torch.autograd.grad(loop, inputs, grad)):
            assert torch.equal(ours, torchs)


def test_a_compiled_moe_block_is_one_graph_per_part_and_equals_eager():
    """apply_compile on a MoE model: a MoE block's attention, router and experts are compiled
    (fullgraph: a graph break is an error), its dispatch stays eager; a dense block compiles
    whole. The MoE layer's router and experts captured by Dynamo (aot_eager: the graph, without
    inductor's fused kernels) give eager's output and gradients bit for bit (fp32)."""
    from shardlm.parallel.blocks.compile import apply_compile

    model = _model(moe_every=2)
    dense, moe_block = model.blocks
    apply_compile(model, True)
    assert "forward" in vars(dense) and "forward" not in vars(moe_block)
    assert all("forward" in vars(m) for m in (moe_block.attn, moe_block.mlp.router, moe_block.mlp.experts))
    eager = _model(moe_every=2).blocks[1].mlp
    layer = _model(moe_every=2).blocks[1].mlp
    for part in (layer.router, layer.experts):
        part.forward = torch.compile(part.forward, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(4))
    outs = []
    for moe in (eager, layer):
        moe.stats.reset()
        out = moe(x)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        outs.append((out, {n: p.grad for n, p in moe.named_parameters()}))
    assert torch.equal(outs[0][0], outs[1][0])
    for name, grad in outs[0][1].items():
        assert torch.equal(outs[1][1][name], grad), name


def _parity_base(tmp) -> dict:
    return tiny_overrides(tmp, model__preset="moe-tiny", train__micro_batch=4, train__seq_len=32)


def _ledger_overrides(tmp) -> dict:
    return tiny_overrides(tmp, model__preset="moe-tiny", train__micro_batch=4, train__seq_len=32, parallel__ep=2)


def _checkpoint_base(tmp, n: int) -> dict:
    return tiny_overrides(tmp, model__preset="moe-tiny", train__micro_batch=4, train__seq_len=32,
                          train__steps=2 * n, model__balance="bias", model__bias_update_rate=0.05)


def _rebalance_base(tmp) -> dict:
    return tiny_overrides(tmp, model__preset="moe-tiny", train__micro_batch=4, train__seq_len=32,
                          model__top_k=1, model__experts=8)


def _rebalanced(base: dict) -> dict:
    return {**base, "parallel.ep": 2, "parallel.ep_rebalance_every": 1, "parallel.zero_stage": 1}


@pytest.fixture(scope="module")
def two_rank_world(tmp_path_factory):
    """Every 2-rank check of this file that needs no other run first, in one spawned world
    (worlds.several): the parity cases (moe_runs), the all-to-all ledger's step, the ep-2 run
    the checkpoint test resumes from, and the re-placement run. One set of processes, not four."""
    from ckpt_cases import train_ranks
    from moe_cases import ledger_case, rebalance_case
    from worlds import several

    tmp = tmp_path_factory.mktemp("moe")
    saved = {**_checkpoint_base(tmp, 2), "parallel.ep": 2, "checkpoint.every": 2, "run.name": "ep2"}
    calls = [(train_cases, (_parity_cases(tmp), )), (ledger_case, (_ledger_overrides(tmp),)),
             (train_ranks, (saved,)), (rebalance_case, (_rebalanced(_rebalance_base(tmp)), 4))]
    return run_ranks(several, 2, tmp, calls, timeout=300)


def _parity_cases(tmp) -> list:
    base = _parity_base(tmp)
    varied = {**base, "model.balance": "bias", "model.router": "sigmoid", "model.shared_experts": 1,
              "model.capacity_factor": 1.25, "model.bias_update_rate": 0.01}
    two = {**base, "train.grad_accum": 2}
    sharp = {"model.aux_loss_coef": 0.1, "model.z_loss_coef": 0.01}  # the balancing terms weigh more
    cases = [({**base, "parallel.ep": 2}, STEPS, -1),
             ({**varied, "parallel.ep": 2, "parallel.zero_stage": 2}, STEPS, -1),
             ({**base, "parallel.zero_stage": 3}, STEPS, -1),
             ({**base, "parallel.tp": 2}, STEPS, -1),
             ({**base, "parallel.tp": 2, "parallel.sequence_parallel": True, "model.shared_experts": 1}, STEPS, -1),
             ({**two, "parallel.pp": 2}, STEPS, -1),
             ({**base, "parallel.cp": 2, "parallel.ep": 2, **sharp}, STEPS, -1)]
    return cases


# fp32. The experts' rows and matmuls are the same under expert parallelism, grouped
# differently (an expert's rows from both ranks in one matmul, where one process runs each
# micro-batch's apart): 1e-5 relative on the losses and every parameter.
@pytest.fixture(scope="module")
def moe_runs(two_rank_world, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe-ref")
    base = _parity_base(tmp)
    varied = {**base, "model.balance": "bias", "model.router": "sigmoid", "model.shared_experts": 1,
              "model.capacity_factor": 1.25, "model.bias_update_rate": 0.01}
    two = {**base, "train.grad_accum": 2}
    sharp = {"model.aux_loss_coef": 0.1, "model.z_loss_coef": 0.01}  # the balancing terms weigh more
    out = [r[0] for r in two_rank_world]
    refs = [reference_case(base, 2, STEPS), reference_case(varied, 2, STEPS), None,
            reference_case(base, 1, STEPS), reference_case({**base, "model.shared_experts": 1}, 1, STEPS),
            reference_case(two, 1, STEPS), reference_case({**base, **sharp}, 1, STEPS)]
    refs[2] = refs[0]
    return out, refs


@pytest.mark.parametrize("case, what", [
    (0, "ep=2, ZeRO-0, aux loss"), (1, "ep=2, ZeRO-2, sigmoid router, bias balancing, shared expert, capacity 1.25"),
    (2, "dp=2 ZeRO-3 (experts sharded as any unit)"), (3, "tp=2: experts spread over the tp ranks"),
    (4, "tp=2 + sequence parallel, shared expert cut by tp"), (5, "pp=2"),
    (6, "cp=2 ranks as the ep=2 group: Switch's f, P and the z-loss over the whole sequence")])
def test_moe_matches_one_process(moe_runs, case, what):
    from tp_cases import whole_params

    out, refs = moe_runs
    ranks = [out[r][case] for r in range(2)]
    whole = whole_params(ranks) if case in (0, 1, 3, 4, 6) else (
        {**ranks[0]["params"], **ranks[1]["params"]} if case == 5 else ranks[0]["params"])
    assert_matches(ranks[0]["losses"], whole, refs[case], what)


def test_ep2_with_zero3_replicas_pipelines_and_tp_on_4_ranks(tmp_path):
    """ep=2 inside a shard group of 4 at ZeRO-3 (the experts sharded over the 2 ranks holding
    the same ones, the dense part over all 4), ep=2 × dp_replicate=2 at ZeRO-1, pp=2 × ep=2
    (each stage's experts over its 2 data-parallel ranks), and tp=2 × ep=2 with sequence
    parallelism at ZeRO-0 (each MoE block's 4 experts one per rank of the ep × tp grid)."""
    from tp_cases import whole_params

    base = tiny_overrides(tmp_path, model__preset="moe-tiny", train__micro_batch=2, train__seq_len=32)
    piped = {**base, "train.grad_accum": 2}
    out = run_ranks(train_cases, 4, tmp_path,
                    [({**base, "parallel.ep": 2, "parallel.zero_stage": 3}, STEPS, -1),
                     ({**base, "parallel.ep": 2, "parallel.dp_replicate": 2, "parallel.zero_stage": 1}, STEPS, -1),
                     ({**piped, "parallel.ep": 2, "parallel.pp": 2, "parallel.zero_stage": 1}, STEPS, -1),
                     ({**base, "parallel.ep": 2, "parallel.tp": 2, "parallel.sequence_parallel": True}, STEPS, -1)],
                    timeout=400)
    assert_matches(out[0][3]["losses"], whole_params([out[r][3] for r in range(4)]), reference_case(base, 2, STEPS),
                   "tp=2 (sequence parallel) x ep=2, ZeRO-0")
    ref = reference_case(base, 4, STEPS)
    for case, what in ((0, "ep=2 in dp_shard=4, ZeRO-3"), (1, "ep=2 x dp_replicate=2, ZeRO-1")):
        assert_matches(out[0][case]["losses"], whole_params([out[r][case] for r in range(4)]), ref, what)
    # ranks (stage, shard) = 2·stage + shard: each stage's experts from its two ranks, then the stages
    whole = {**whole_params([out[0][2], out[1][2]]), **whole_params([out[2][2], out[3][2]])}
    assert_matches(out[0][2]["losses"], whole, reference_case(piped, 2, STEPS), "pp=2 x ep=2, ZeRO-1")


def test_all_to_all_ledger_counts_the_tokens_routed(two_rank_world):
    """Each rank's all-to-all bytes = (rows it sends to the other rank's experts + rows it
    returns to the other rank) × d_model × 4 B, twice (backward sends the gradients the same
    way), from the routing every rank recorded; plus E int64 split counts per MoE call."""
    out = [r[1] for r in two_rank_world]  # moe_cases.ledger_case of _ledger_overrides
    e = out[0]["experts"]
    mine = [range(0, e // 2), range(e // 2, e)]
    for rank in range(2):
        other = 1 - rank
        rows = 0
        for call, counts in enumerate(out[rank]["routed"][rank]):
            sent = sum(counts[i] for i in mine[other])
            returned = sum(out[rank]["routed"][other][call][i] for i in mine[rank])
            rows += sent + returned
        assert out[rank]["bytes"]["all_to_all/ep"] == 2 * rows * out[0]["d_model"] * 4
        assert out[rank]["bytes"]["all_to_all_splits/ep"] == len(out[rank]["routed"][rank]) * (e // 2) * 8


def test_checkpoints_load_across_expert_layouts(two_rank_world, tmp_path):
    """ep=2 → 1 process: the same loss curve continues (the bias balancing's state included)."""
    from ckpt_cases import checkpoint_of, train_run

    n = 2
    base = _checkpoint_base(tmp_path, n)
    saved = two_rank_world[0][2]  # the world's train_run at ep 2, saving every n steps (rank 0)
    one = train_run({**base, "run.name": "one", "train.grad_accum": 2,
                     "checkpoint.resume": checkpoint_of(saved["run_dir"], n)})
    assert one["start"] == n
    torch.testing.assert_close(torch.tensor(one["losses"]), torch.tensor(saved["losses"][n:]), rtol=1e-5, atol=0)


def test_balanced_placement_lowers_the_busiest_rank():
    from shardlm.parallel.expert.balance import balanced_placement, rank_loads

    loads = [10.0, 9.0, 1.0, 1.0]
    placement = balanced_placement(loads, 2)
    assert placement == [[0, 3], [1, 2]] and max(rank_loads(loads, placement)) == 11
    assert max(rank_loads(loads, [[0, 1], [2, 3]])) == 19
    assert sorted(e for p in balanced_placement([3.0] * 8, 4) for e in p) == list(range(8))


def test_re_placing_experts_by_load_changes_nothing_but_where_they_run(two_rank_world, tmp_path):
    """ep = 2 with parallel.ep_rebalance_every = 1 (top-1 routing: uneven loads): experts move
    between the ranks with their Adam states, and the run still equals one process."""
    from tp_cases import whole_params

    base = _rebalance_base(tmp_path)
    out = [r[3] for r in two_rank_world]  # moe_cases.rebalance_case of _rebalanced(base), 4 steps
    assert sum(out[0]["moved"]) > 0, out[0]["moved"]
    assert any(len(s.ranges) > 1 or s.ranges[0][0] % 4 for s in out[0]["splits"].values())  # moved
    assert_matches(out[0]["losses"], whole_params(out), reference_case(base, 2, 4), "ep=2, re-placed by load")


def test_bias_balanced_weights_route_at_inference_as_in_training(tmp_path):
    """The routers' balancing biases are run state the routing depends on: saved with the final
    weights and restored by load_for_inference (else generation would route differently)."""
    from shardlm.checkpoint.weights import load_for_inference
    from shardlm.train.build import build_run
    from shardlm.train.loop import train

    over = tiny_overrides(tmp_path, model__preset="moe-tiny", train__micro_batch=4, train__seq_len=32,
                          train__steps=3, model__balance="bias", model__bias_update_rate=0.05)
    run = build_run(load_config(overrides=over).validate())
    train(run)
    trained = {i: b.clone() for i, b in run.model.moe_stats.biases.items()}
    assert any(b.abs().sum() > 0 for b in trained.values())
    model, _, _ = load_for_inference(run.run_dir, torch.device("cpu"))
    for i, b in trained.items():
        assert torch.equal(model.moe_stats.biases[i], b)
