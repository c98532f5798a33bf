"""The planner's model-parallel axes beyond data parallelism: context parallelism (activations,
ZeRO over dp_shard x cp, the ring) and pipelines (stage memory per schedule, p2p bytes, runnable
plans), against the runtime's own formulas and orders."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shardlm.config.schema import ParallelConfig
from shardlm.config.load import load_config
from shardlm.config.dims import ParallelDims
from shardlm.errors import ConfigError
from shardlm.hardware.catalog import parse_cluster
from shardlm.planner.memory import estimate_memory
from shardlm.planner.search import EVERYTHING, RUNTIME, plan_for_run, search
from shardlm.planner.shapes import preset_model
from shardlm.planner.explain import describe_strategy
from shardlm.planner.timing import estimate_time
from shardlm.planner.workload import Dtypes, Strategy, Workload, stage_params


LONG = Workload(preset_model("llama-1b"), 32768, 8)
"""A sequence whose activations dominate: llama-1b (V = 128k) at 32k tokens."""
A100 = parse_cluster("8xA100-80GB")


def _cp_strategy(lay: ParallelDims, stage: int = 3, recompute: str = "none", micro: int = 1,
                 w: Workload = LONG) -> Strategy:
    return Strategy(lay, stage, micro, w.global_batch // (micro * lay.dp_size), recompute,
                    dtypes=Dtypes("bf16"))


def _part(memory, name: str) -> float:
    return next(p.bytes for p in memory.items[3].parts if p.name == name)


def test_context_parallel_halves_the_activations_of_a_long_sequence():
    one = estimate_memory(LONG, _cp_strategy(ParallelDims(1, 8)), A100)
    two = estimate_memory(LONG, _cp_strategy(ParallelDims(1, 4, cp=2)), A100)
    # every rank runs every layer, the loss included, on its half of the tokens
    assert _part(two, "saved by blocks") == pytest.approx(_part(one, "saved by blocks") / 2, rel=1e-12)
    assert _part(two, "backward peak") == pytest.approx(_part(one, "backward peak") / 2, rel=1e-12)
    # ... plus the ring's key/value blocks and fp32 gradients in flight: small
    ring = _part(two, "cp ring buffers")
    assert 0 < ring < 0.02 * two.activations
    assert two.activations == pytest.approx(one.activations / 2, rel=0.02)
    assert "cp ring buffers" not in [p.name for p in one.items[3].parts]
    # tp x cp: both divide
    four = estimate_memory(LONG, _cp_strategy(ParallelDims(1, 2, cp=2, tp=2)), A100)
    assert _part(four, "saved by blocks") < _part(two, "saved by blocks") / 1.9


@pytest.mark.parametrize("preset,kv", [("gpt-tiny", 0), ("llama-tiny", 2)])
def test_cp_saved_is_what_the_ring_and_ulysses_keep_beyond_one_process(preset, kv):
    """The bytes a forward saves for backward (distinct storages packed by saved_tensors_hooks,
    weights excluded) with every block's attention run by the ring's op, by Ulysses' all-to-all
    path and by the hybrid's (all-to-all, then the ring), minus the one-process model's: exactly
    activations.cp_saved per token and layer. One process: a group of one rank runs the same
    ops (its exchanges are copies), so the all-to-all degree is 1 here; learned positions (the
    projection's input copied under cp) and RoPE with GQA (the packed buffer)."""
    import torch

    from shardlm.comm.collectives import Comm, CommLedger
    from shardlm.models.decoder import build_model
    from shardlm.parallel.context.attention import CPState, RingAttention, UlyssesAttention
    from shardlm.planner.activations import ActivationDtypes, cp_saved

    cfg = replace(preset_model(preset), n_layers=1, n_heads=4, n_kv_heads=kv)
    b, s = 2, 32
    idx = torch.randint(0, cfg.vocab_size, (b, s), generator=torch.Generator().manual_seed(0))

    def saved(mode: str) -> int:
        model = build_model(cfg)
        if mode != "one":
            cp = CPState(Comm(None, "cp", CommLedger()))
            for block in model.blocks:
                scale = block.attn.core.scale
                block.attn.core = (RingAttention(cp, scale) if mode == "ring" else
                                   UlyssesAttention(cp, cp.comm, CPState(cp.comm) if mode == "hybrid" else None, scale))
            model.context = cp
        storages: dict[int, int] = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(idx).sum().backward()
        return sum(n for ptr, n in storages.items() if ptr not in weights)

    one, dt = saved("one"), ActivationDtypes(4, 4, norms_in_fp32=False)
    for mode in ("ring", "ulysses", "hybrid"):
        per_token, _ = cp_saved(cfg, dt, a2a=1, all_to_all=mode != "ring")
        assert saved(mode) - one == per_token * cfg.n_layers * b * s, mode  # whole storages: exact
    # the planner charges it where nothing is recomputed, per local token
    w, two_gpus = Workload(cfg, s, 2 * b), parse_cluster("2xA100-80GB")
    plain = estimate_memory(w, Strategy(ParallelDims(1, 2), 0, b, 1, dtypes=Dtypes("fp32")), two_gpus)
    for mode, u in (("ring", 1), ("ulysses", 2)):
        two = estimate_memory(w, Strategy(ParallelDims(1, 1, cp=2), 0, b, 2, dtypes=Dtypes("fp32"),
                                          cp_mode=mode), two_gpus)
        per_token, _ = cp_saved(cfg, dt, a2a=u)
        assert _part(two, "saved by blocks") == pytest.approx(
            _part(plain, "saved by blocks") / 2 + per_token * cfg.n_layers * b * s / 2, rel=1e-12)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_shards_model_states_over_dp_shard_times_cp(stage):
    w = replace(LONG, seq_len=4096)
    four = estimate_memory(w, _cp_strategy(ParallelDims(1, 4, cp=1, tp=2), stage, w=w), A100)
    two_by_two = estimate_memory(w, _cp_strategy(ParallelDims(1, 2, cp=2, tp=2), stage, w=w), A100)
    for category in ("parameters", "gradients", "optimizer states"):
        assert two_by_two.category(category) == pytest.approx(four.category(category), rel=1e-12)
    # and the engine's collectives run over those 4 ranks, moving the same bytes
    comms = lambda lay: {c.name: c for c in  # noqa: E731
                         estimate_time(w, _cp_strategy(lay, stage, w=w), A100).comms}
    t4, t22 = comms(ParallelDims(1, 4, tp=2)), comms(ParallelDims(1, 2, cp=2, tp=2))
    assert t22["reduce-scatter gradients"].group.startswith("4 ranks")
    assert t22["reduce-scatter gradients"].bytes == pytest.approx(t4["reduce-scatter gradients"].bytes)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_context_parallel_ring_is_cp_comm_bytes_and_compute_is_split(recompute):
    from shardlm.planner.traffic import cp_comm_bytes, tp_comm_bytes

    m, seq = LONG.model, LONG.seq_len
    s = _cp_strategy(ParallelDims(1, 2, cp=2, tp=2), 3, recompute)  # micro 1 x accum 4
    t = estimate_time(LONG, s, A100)
    comms = {c.name: c for c in t.comms}
    ring = comms["context-parallel ring"]
    assert ring.bytes == s.grad_accum * cp_comm_bytes(m, seq, 2, 2, 2, recompute, m.n_layers)
    assert ring.group.startswith("2 ranks, intra-node")
    assert 0 < ring.exposed <= ring.seconds
    # tensor-parallel collectives move this rank's half of the tokens
    tp_bytes = s.grad_accum * tp_comm_bytes(m, seq // 2, 2, True, 2, recompute, m.n_layers)
    assert comms["tensor-parallel all-reduces"].bytes == pytest.approx(tp_bytes)
    # the same global batch on 8 data-parallel ranks: the same compute per step, split differently
    dp = estimate_time(LONG, _cp_strategy(ParallelDims(1, 8), 3, recompute), A100)
    tp_only = estimate_time(LONG, _cp_strategy(ParallelDims(1, 4, tp=2), 3, recompute), A100)
    assert t.compute == pytest.approx(dp.compute, rel=1e-9) == pytest.approx(tp_only.compute, rel=1e-9)
    assert "context-parallel ring" not in [c.name for c in dp.comms]


def test_a_measured_hop_factor_prices_every_ring_hop():
    """A device whose ring hop was measured at 2x the link model's one step (Calibration.
    factor('send_recv'), from hardware/gloo_probe.py): the ring moves the same bytes in twice the
    time, and cp_mode = 'auto' compares the modes with the hop priced so."""
    from shardlm.planner.cp_modes import choose_cp_mode

    slow = replace(A100, measured=replace(A100.calibration, collective_factors=(("send_recv", 2.0),)))
    s = _cp_strategy(ParallelDims(1, 2, cp=2, tp=2), 3)
    ring = lambda cluster: next(c for c in estimate_time(LONG, s, cluster).comms  # noqa: E731
                                if c.name == "context-parallel ring")
    base, doubled = ring(A100), ring(slow)
    assert doubled.bytes == base.bytes
    assert doubled.seconds == pytest.approx(2 * base.seconds, rel=1e-12)
    assert doubled.latency == pytest.approx(2 * base.latency, rel=1e-12)
    m = LONG.model
    once, twice = (choose_cp_mode(m, 4096, 2, 1, 2, "none", 100e9, 5e-6, hop_factor=f) for f in (1.0, 2.0))
    assert {t.mode: t.seconds for t in twice}["ring"] == pytest.approx(2 * {t.mode: t.seconds for t in once}["ring"])


def test_context_parallel_validation_names_every_factor():
    w = replace(LONG, seq_len=1000)
    with pytest.raises(ConfigError) as info:
        estimate_memory(w, _cp_strategy(ParallelDims(1, 2, cp=3), w=replace(w, global_batch=2)), A100)
    text = str(info.value)
    assert "dp_replicate (1) x dp_shard (2) x cp (3) x tp (1) x pp (1) = 6, but" in text
    assert "seq 1000 must divide by 6" in text


# ---------------------------------------------------------------------------------------------
# Pipeline parallelism: the runtime's bytes, the schedules' memory, what train runs

TINY = replace(preset_model("gpt-tiny"), n_layers=4)
"""tests/test_pipeline.py's model (vocab 512, d_model 64, a tied head), 4 blocks."""


def test_pp_comm_bytes_are_the_ledgers():
    """Per step: M activations forward from every chunk but the model's last, M gradients back
    from every chunk but its first, b·s/cp(/t with SP)·h·e each; the tied embedding's gradient
    all-reduced by the two ends (2x its tensor). The ledger's numbers on 2-4 gloo ranks
    (micro-batch 2 x seq 64, M = 4, fp32), as tests/test_pipeline.py's ledger test and a
    manual run of each layout measured them."""
    from shardlm.planner.traffic import pp_comm_bytes

    act, tied = 2 * 64 * 64 * 4, 2 * 512 * 64 * 4
    llama = replace(preset_model("llama-tiny"), n_layers=4)  # untied
    assert pp_comm_bytes(TINY, 128, 4, 0, 2, 1, 1, False, 4, True) == 4 * act + tied
    assert pp_comm_bytes(TINY, 128, 4, 1, 2, 1, 1, False, 4, True) == 4 * act + tied
    # pp 4: the middle stages send both ways, no tied copy
    assert [pp_comm_bytes(TINY, 128, 4, r, 4, 1, 1, False, 4, True) for r in range(4)] == \
        [4 * act + tied, 8 * act, 8 * act, 4 * act + tied]
    # pp 2 x tp 2 with sequence parallelism: hidden states of half the tokens, half the vocabulary
    assert pp_comm_bytes(TINY, 128, 4, 0, 2, 2, 1, True, 4, True) == 4 * act // 2 + tied // 2
    assert pp_comm_bytes(TINY, 128, 4, 0, 2, 2, 1, False, 4, True) == 4 * act + tied // 2
    # interleaved, 2 chunks per rank: 3 of the 4 chunks send forward, 3 back
    assert pp_comm_bytes(TINY, 128, 4, 0, 2, 1, 1, False, 4, True, virtual=2) == 12 * act + tied
    # pp 2 x cp 2, llama (untied): this rank's half of the sequence
    assert pp_comm_bytes(llama, 128, 4, 1, 2, 1, 2, False, 4, False) == 4 * act // 2
    assert pp_comm_bytes(TINY, 128, 4, 0, 1, 1, 1, False, 4, True) == 0


def test_pipeline_timing_counts_the_ledgers_bytes_and_exposes_the_reduction():
    """The step's p2p volume is pp_comm_bytes of the stage shown; the data-parallel reduction
    after the pipeline's last backward (finish_backward) has no backward to hide in."""
    from shardlm.planner.traffic import pp_comm_bytes

    w = Workload(preset_model("gpt2-350m"), 1024, 32)
    s = Strategy(ParallelDims(1, 4, pp=2), 2, 1, 8, dtypes=Dtypes("bf16"))
    t = estimate_time(w, s, A100)
    comms = {c.name: c for c in t.comms}
    index = 0 if t.stage == "first stage" else 1
    assert comms["pipeline send/recv"].bytes == pp_comm_bytes(w.model, 1024, 8, index, 2, 1, 1, True, 2, False)
    assert comms["tied embedding all-reduce"].bytes == 2 * w.model.vocab_size * w.model.d_model * 2
    reduce = comms["reduce-scatter gradients"]
    assert reduce.exposed == pytest.approx(reduce.seconds)
    flat = estimate_time(w, Strategy(ParallelDims(1, 8), 2, 1, 4, dtypes=Dtypes("bf16")), A100)
    flat_reduce = next(c for c in flat.comms if c.name == "reduce-scatter gradients")
    assert flat_reduce.exposed < flat_reduce.seconds  # without a pipeline, it hides in backward


@pytest.mark.parametrize("model", ["gpt2-350m", "llama-1b"])
def test_gpipe_holds_every_micro_batch_and_1f1b_peaks_on_the_first_stage(model):
    from shardlm.planner.memory import stage_memories
    from shardlm.planner.pipeline import pp_in_flight

    w = Workload(preset_model(model), 1024, 32)
    one_f = Strategy(ParallelDims(1, 2, pp=4), 1, 1, 16, dtypes=Dtypes("bf16"))  # M = 16 > P = 4
    gpipe = replace(one_f, pp_schedule="gpipe")
    assert [pp_in_flight(one_f, r) for r in range(4)] == [4, 3, 2, 1]
    assert [pp_in_flight(gpipe, r) for r in range(4)] == [16] * 4
    assert pp_in_flight(replace(one_f, grad_accum=2), 0) == 2  # never more than M
    ones, gpipes = stage_memories(w, one_f, A100), stage_memories(w, gpipe, A100)
    for a, b in zip(ones, gpipes):
        assert b.activations > a.activations and b.peak > a.peak
    # 1F1B: of the stages with the same blocks, the earliest holds the most; the first is the peak
    stages = stage_params(w, one_f.layout)
    same = [m.activations for m, sp in zip(ones, stages) if sp.layers == stages[0].layers]
    assert len(same) > 1 and same == sorted(same, reverse=True)
    assert estimate_memory(w, one_f, A100).stage == "first stage" == max(ones, key=lambda m: m.peak).stage
    # GPipe's last stage also keeps what the loss saved for every micro-batch
    assert any(p.name == "saved for the loss" for p in gpipes[-1].items[3].parts)
    assert not any(p.name == "saved for the loss" for p in ones[-1].items[3].parts)


def test_interleaved_and_zero_bubble_follow_the_runtimes_orders():
    """The planner's interleaved activation peak replays OneFOneB.order with V chunks; its
    zero-bubble idle share is the runtime's list schedule's (3M + 2(P-1) units long)."""
    from types import SimpleNamespace

    from shardlm.parallel.pipeline.schedules import _list_schedule
    from shardlm.parallel.pipeline.executor import OneFOneB
    from shardlm.planner.pipeline import interleaved_peak, pp_bubble

    for p, v, m in [(2, 2, 4), (4, 2, 8), (4, 3, 4), (3, 2, 6)]:
        split = [(i * 7) % 3 + 1 for i in range(p * v)]
        for r in range(p):
            order = OneFOneB(SimpleNamespace(index=r, count=p, chunks=[range(0)] * v)).order(m)
            held = peak = 0
            for kind, chunk, _ in order:
                held += split[chunk * p + r] if kind == "F" else -split[chunk * p + r]
                peak = max(peak, held)
            assert interleaved_peak(split, p, v, r, m) == peak
    for p, m in [(2, 4), (2, 8), (4, 4), (4, 16), (8, 8)]:
        s = Strategy(ParallelDims(1, 1, pp=p), 1, 1, m, pp_schedule="zb")
        assert pp_bubble(s) == pytest.approx(1 - 3 * m / _list_schedule(p, m)[1])
        assert pp_bubble(replace(s, pp_schedule="1f1b")) == pytest.approx((p - 1) / (m + p - 1))


def test_runtime_plans_run_pipelines_at_every_zero_stage():
    w = Workload(preset_model("llama-7b"), 4096, 64)
    cluster = parse_cluster("4xA100-40GB")
    runtime = search(w, cluster, Dtypes("bf16"), RUNTIME)
    piped = [p for p in runtime.plans if p.strategy.layout.pp > 1]
    assert piped and all(p.runtime_supported for p in piped)
    assert any(p.strategy.zero_stage == 3 for p in piped)  # issue 28: ZeRO-3 on a pipeline runs
    best = piped[0]
    o = best.overrides()
    assert o["parallel.pp"] == best.strategy.layout.pp and o["parallel.pp_schedule"] == "1f1b"
    assert f"pp {best.strategy.layout.pp} 1f1b" in describe_strategy(best.strategy)
    cfg = best.apply(load_config(overrides={"model.preset": "llama-7b", "train.seq_len": "4096"}))
    assert cfg.parallel.pp == best.strategy.layout.pp and cfg.parallel.zero_stage == best.strategy.zero_stage
    flat = next(p for p in runtime.plans if p.strategy.layout.pp == 1)
    assert flat.apply(cfg).parallel.pp == 1  # the layout is whole


def test_config_strategy_and_auto_keep_the_runs_pipeline():
    from shardlm.planner.search import config_strategy

    cfg = load_config(overrides={"model.preset": "gpt-mini", "parallel.pp": "2", "parallel.pp_schedule": "gpipe",
                                 "parallel.pp_layers": "1,3", "train.grad_accum": "4",
                                 "precision.compute": "fp32"}).validate()
    w, s = config_strategy(cfg, parse_cluster("4xA100-80GB"))
    assert (s.layout.pp, s.layout.dp_shard, s.pp_schedule, s.pp_layers) == (2, 2, "gpipe", "1,3")
    assert [sp.layers for sp in stage_params(w, s.layout, [1, 3])] == [1, 3]
    assert w.global_batch == cfg.train.micro_batch * 4 * 2
    plans = plan_for_run(cfg.model, 4, "4xA100-80GB", (cfg.train.micro_batch, 4, cfg.train.seq_len),
                         parallel=cfg.parallel)
    assert plans and all(p.strategy.layout.pp == 2 and p.strategy.zero_stage < 3 for p in plans)
    assert all((p.strategy.pp_schedule, p.strategy.pp_layers) == ("gpipe", "1,3") for p in plans)
    resolved = plans[0].apply(cfg)
    assert (resolved.parallel.pp, resolved.parallel.pp_schedule, resolved.parallel.pp_layers) == (2, "gpipe", "1,3")


def test_auto_with_dualpipev_splits_the_batch_into_what_the_schedule_takes():
    """parallel.strategy = 'auto' keeps a run's DualPipeV, which needs >= 2·pp micro-batches a
    step: the search skips the splits it cannot take (it raised "this plan cannot run" on the
    first of them before, so an auto run with DualPipeV stopped while resolving)."""
    cfg = load_config(overrides={"model.preset": "llama-tiny", "model.n_layers": "4", "parallel.pp": "2",
                                 "parallel.pp_virtual": "2", "parallel.pp_schedule": "dualpipev",
                                 "train.micro_batch": "2", "train.grad_accum": "4", "train.seq_len": "32",
                                 "precision.compute": "fp32"}).validate()
    plans = plan_for_run(cfg.model, 2, "2xA100-80GB", (2, 4, cfg.train.seq_len), parallel=cfg.parallel)
    assert plans and all(p.strategy.pp_schedule == "dualpipev" for p in plans)
    assert all(p.strategy.grad_accum >= 4 for p in plans if p.strategy.layout.pp == 2)


def test_search_tries_context_parallelism_only_where_activations_matter():
    from dataclasses import replace as with_
    from shardlm.planner.candidates import AUTO, rank_layouts as _layouts

    long = list(_layouts(LONG, A100, EVERYTHING, Dtypes("bf16")))
    assert {lay.cp for lay in long} == {1, 2, 4, 8}
    assert all(lay.cp * lay.tp <= 8 for lay in long)  # the ring stays inside a node
    assert {lay.cp for lay in _layouts(LONG, A100, with_(EVERYTHING, cp=False), Dtypes("bf16"))} == {1}
    assert {lay.cp for lay in _layouts(LONG, A100, AUTO, Dtypes("bf16"))} == {1}
    short = Workload(preset_model("gpt2-350m"), 1024, 64)  # activations a small share: no cp
    assert {lay.cp for lay in _layouts(short, A100, EVERYTHING, Dtypes("bf16"))} == {1}
    result = search(LONG, A100, Dtypes("bf16"), RUNTIME)
    best = result.plans[0]
    assert best.strategy.layout.cp > 1 and best.runtime_supported
    overrides = best.overrides()
    assert overrides["parallel.cp"] == best.strategy.layout.cp
    assert "cp " in describe_strategy(best.strategy)
    cfg = best.apply(load_config(overrides={"model.preset": "llama-1b", "train.seq_len": "32768"}))
    assert cfg.parallel.cp == best.strategy.layout.cp and cfg.parallel.tp == best.strategy.layout.tp
    no_cp = next(p for p in result.plans if p.strategy.layout.cp == 1)
    assert "cp" not in no_cp.overrides() and no_cp.apply(cfg).parallel.cp == 1  # the layout is whole


def test_search_prices_cp_modes_and_overlapped_tp_and_its_commands_carry_them():
    """`plan` tries each tp layout with and without async TP (it wins where the overlap pays:
    a large model on GPUs) and prices a cp layout at the mode the runtime's 'auto' resolves to;
    a run's own cp_mode and async_tp are kept (plan_for_run)."""
    result = search(LONG, A100, Dtypes("bf16"), RUNTIME)
    tp_plans = [p for p in result.plans if p.strategy.layout.tp > 1 and p.strategy.sequence_parallel]
    assert {p.strategy.async_tp for p in tp_plans} == {False, True}
    fast = next(p for p in tp_plans if p.strategy.async_tp)
    blocking = estimate_time(LONG, replace(fast.strategy, async_tp=False), A100)
    assert fast.timing.tokens_per_s >= blocking.tokens_per_s  # the two are priced apart, the better kept first
    assert fast.overrides()["parallel.async_tp"] is True and " async" in describe_strategy(fast.strategy)
    cfg = fast.apply(load_config(overrides={"model.preset": "llama-1b", "train.seq_len": "32768"}))
    assert cfg.parallel.async_tp and cfg.parallel.sequence_parallel
    cp_plan = next(p for p in result.plans if p.strategy.layout.cp > 1)
    assert cp_plan.strategy.cp_mode == "auto" and cp_plan.overrides()["parallel.cp_mode"] == "auto"
    assert cp_plan.apply(cfg).parallel.cp_mode == "auto"
    assert fast.apply(cp_plan.apply(cfg)).parallel.async_tp  # each plan sets its own whole layout
    kept = plan_for_run(preset_model("gpt2-350m"), 8, "8xA100-80GB", (2, 1, 1024),
                        parallel=ParallelConfig(cp=2, cp_mode="ulysses"))
    assert kept and {p.strategy.cp_mode for p in kept} == {"ulysses"}
    # `auto` keeps a run's async_tp as it is: it never turns on what the run's config may refuse
    blocking = plan_for_run(preset_model("gpt2-350m"), 8, "8xA100-80GB", (2, 1, 1024),
                            parallel=ParallelConfig(tp=2, sequence_parallel=True))
    assert blocking and not any(p.strategy.async_tp for p in blocking)


def test_auto_keeps_the_runs_own_tp_and_cp():
    model = preset_model("gpt2-350m")
    plans = plan_for_run(model, 8, "8xA100-80GB", (2, 1, 1024), parallel=ParallelConfig(cp=2))
    assert plans and all(p.strategy.layout.cp == 2 and p.strategy.layout.tp == 1 for p in plans)
    for p in plans:  # the configured global batch: 2 x 1 x (8 / cp) sequences
        assert p.strategy.micro_batch * p.strategy.grad_accum * p.strategy.layout.dp_size == 2 * 4
    both = plan_for_run(model, 8, "8xA100-80GB", (2, 1, 1024), parallel=ParallelConfig(tp=2, cp=2))
    assert both and all((p.strategy.layout.tp, p.strategy.layout.cp) == (2, 2) for p in both)
    with pytest.raises(ConfigError, match="does not divide the 8 ranks"):
        plan_for_run(model, 8, "8xA100-80GB", (2, 1, 1024), parallel=ParallelConfig(cp=3))


# ---------------------------------------------------------------------------------------------
# The cluster syntax


def test_moe_parameters_follow_the_model_and_expert_parallelism():
    """A mixture of experts' parameters come from models.flops (Mixtral 8x7B: the published
    46.7B total); ep = 8 leaves each rank 1/8 of every block's routed experts and the dense
    part whole, and the states of the experts are sharded over dp_shard / ep ranks only."""
    from shardlm.models.flops import count_params

    w = Workload(preset_model("mixtral-8x7b"), 4096, 64)
    assert sum(sp.dense + sp.experts for sp in stage_params(w, ParallelDims(1, 16))) == count_params(w.model)
    one, ep8 = stage_params(w, ParallelDims(1, 16))[0], stage_params(w, ParallelDims(1, 16, ep=8))[0]
    assert ep8.dense == one.dense and ep8.experts == pytest.approx(one.experts / 8)
    s = Strategy(ParallelDims(1, 16, ep=8), 3, 1, 4, "full", dtypes=Dtypes("bf16"))
    memory = estimate_memory(w, s, parse_cluster("2x8xH100-80GB"))
    params = next(i for i in memory.items if i.name == "parameters").bytes
    assert params == pytest.approx(2 * (ep8.dense / 16 + ep8.experts / 2))


def test_plans_with_experts_run_ep_with_tp_and_cp():
    """The runtime's expert parallelism lives inside dp_shard x cp, each expert on one rank of
    the ep x tp grid: the search tries ep beside tp (ep x tp dividing the experts) and every
    plan it yields runs (parallel.ep printed); a MoE block under tp is priced as the ledger
    counts it (traffic.moe_tp_calls: 12 collectives per block, not a dense block's 4) and its
    exchange over the grid's ep x tp ranks, each with 1/tp of the tokens."""
    from shardlm.planner.timing import estimate_time

    result = search(Workload(preset_model("moe-tiny"), 64, 16), parse_cluster("4xcpu"), Dtypes("fp32"), RUNTIME)
    ep = [p for p in result.plans if p.strategy.layout.ep > 1]
    assert any(p.strategy.layout.tp > 1 for p in ep)
    assert all(p.runtime_supported for p in result.plans)
    assert all(p.overrides()["parallel.ep"] == p.strategy.layout.ep for p in ep)
    assert all(4 % (p.strategy.layout.ep * p.strategy.layout.tp) == 0 for p in ep)  # moe-tiny: 4 experts
    cluster = parse_cluster("4xcpu")

    def exchange(lay):
        w = Workload(preset_model("moe-mini"), 128, 2 * lay.dp_replicate * lay.dp_shard)
        timing = estimate_time(w, Strategy(lay, 0, 2, 1, "none", dtypes=Dtypes("fp32")), cluster)
        return next(c for c in timing.comms if c.name == "expert all-to-all")
    # 4 dispatches and combines per MoE block (4 blocks), 2 x 128 tokens: ep alone sends half
    # of each rank's 256 tokens' 2 choices; ep 2 x tp 2 three quarters of 128
    a2a = 16 * 256 * 2 * 256 * 4
    assert exchange(ParallelDims(2, 2, ep=2)).bytes == a2a / 2 + 4 * 4 * 8
    assert exchange(ParallelDims(1, 2, tp=2, ep=2)).bytes == a2a * 3 / 8 + 4 * 2 * 8 * 3
    assert exchange(ParallelDims(2, 1, tp=2)).bytes == a2a / 4 + 4 * 4 * 8
