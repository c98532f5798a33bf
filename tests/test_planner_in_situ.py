"""The in-situ factor (planner/in_situ.py, train/calibration.py): a whole-model pass timed in
one process, over the planner's parts for that pass, scales every layout's compute and
memory-bound work of that model, and nothing else. The pass is timed for real on gpt-tiny (its
value is not asserted: no test depends on this machine's speed); the factor's arithmetic is
checked on a synthetic device."""

from dataclasses import replace

import pytest

from conftest import private_cache
from shardlm.config.dims import ParallelDims
from shardlm.hardware import probe
from shardlm.hardware.catalog import CALIBRATION, LINKS, Cluster, Device, MatmulCurve, Node, intensity
from shardlm.planner.workload import Dtypes, Strategy, Workload
from shardlm.planner.timing import estimate_time
from shardlm.planner.in_situ import in_situ_factor, pass_key, predicted_pass
from shardlm.planner.shapes import preset_model

POINTS = tuple((m, k, n, 8e10 * intensity(m, k, n) / (intensity(m, k, n) + 40.0))
               for m, k, n in ((16, 64, 64), (128, 128, 512), (1024, 1024, 1024)))


def _cluster(n: int, passes: tuple = ()) -> Cluster:
    """n ranks of a synthetic CPU with every memory-bound rate set (no probe)."""
    cpu = Device("cpu (test)", "cpu", 8e9, {"fp32": 2e11}, 1e10, 1.0, "test",
                 curves={"fp32": MatmulCurve(POINTS, "calibrated: synthetic")}, op_seconds=3e-6,
                 fresh_bandwidth=3e9, bandwidth_curve=((2**20, 2e10), (2**28, 1e10)),
                 adamw_curve=((2**18, 1e-9),), passes=passes)
    link = replace(LINKS["eth-10"], bandwidth=1e9, latency=1e-4)
    node = Node(n, link, LINKS["eth-10"], 1, link, 16e9, 1e10, 2e9, "test")
    return Cluster(1, n, cpu, node, CALIBRATION["cpu"])


def test_a_measured_pass_scales_compute_and_memory_bound_work_only():
    m = preset_model("gpt-tiny")
    w = Workload(m, 64, 4)
    layouts = [Strategy(ParallelDims(), 0, 2, 1, dtypes=Dtypes("fp32")),
               Strategy(ParallelDims(dp_shard=2), 3, 2, 1, dtypes=Dtypes("fp32")),
               Strategy(ParallelDims(tp=2), 0, 2, 2, dtypes=Dtypes("fp32"), sequence_parallel=False),
               Strategy(ParallelDims(pp=2), 1, 2, 4, dtypes=Dtypes("fp32"))]
    for s in layouts:
        n = s.layout.world_size
        plain = estimate_time(replace(w, global_batch=s.micro_batch * s.grad_accum * s.layout.dp_size), s,
                              _cluster(n))
        w_s = replace(w, global_batch=s.micro_batch * s.grad_accum * s.layout.dp_size)
        predicted = predicted_pass(w_s, s, _cluster(n))
        measured = 1.5 * predicted  # this machine's pass ran 1.5x its parts
        scaled = estimate_time(w_s, s, _cluster(n, ((pass_key(m, 2, 64, "fp32"), measured),)))
        assert in_situ_factor(w_s, s, _cluster(n, ((pass_key(m, 2, 64, "fp32"), measured),)))[0] == \
            pytest.approx(1.5, rel=1e-12)
        assert scaled.compute == pytest.approx(1.5 * plain.compute, rel=1e-9)
        per_op = ("element-wise traffic", "fresh memory (page faults)", "per-op dispatch")
        for before, after in zip(plain.work, scaled.work):
            factor = 1.5 if before.name in per_op or before.name == "tensor-parallel copies" else 1.0
            assert after.seconds == pytest.approx(factor * before.seconds, rel=1e-9), before.name
        assert scaled.optimizer == plain.optimizer
        assert [c.seconds for c in scaled.comms] == [c.seconds for c in plain.comms]  # timed as they run
        assert "in situ x 1.50" in scaled.calibration and "in situ" not in plain.calibration
        assert ("no pass of this model measured (`shardlm calibrate --model gpt-tiny --seq 64 --micro-batch 2 "
                "--precision fp32") in plain.calibration


def test_a_pass_of_another_shape_batch_or_dtype_is_not_used():
    m = preset_model("gpt-tiny")
    w, s = Workload(m, 64, 2), Strategy(ParallelDims(), 0, 2, 1, dtypes=Dtypes("fp32"))
    for key in (pass_key(replace(m, n_layers=m.n_layers + 1), 2, 64, "fp32"), pass_key(m, 1, 64, "fp32"),
                pass_key(m, 2, 32, "fp32"), pass_key(m, 2, 64, "bf16")):
        factor, how = in_situ_factor(w, s, _cluster(1, ((key, 1.0),)))
        assert factor == 1.0 and how.startswith("no pass of this model measured")
    # the name is not the shape: a preset renamed keeps its key
    assert pass_key(replace(m, preset="renamed"), 2, 64, "fp32") == pass_key(m, 2, 64, "fp32")


def test_the_pass_is_timed_cached_and_read_by_local_cpu(monkeypatch, tmp_path):
    from shardlm.hardware.catalog import local_cpu
    from shardlm.train.calibration import measured_pass

    private_cache(monkeypatch, tmp_path)
    m = preset_model("gpt-tiny")
    first = measured_pass(m, 1, 32, "fp32", threads=1, repeats=2)  # a real pass, timed here
    assert first["seconds"] > 0 and {"load_average", "loaded", "measured_at"} <= set(first)
    monkeypatch.setattr("shardlm.train.calibration.time_model_pass", lambda *a, **k: pytest.fail("re-timed"))
    assert measured_pass(m, 1, 32, "fp32", threads=1) == first  # cached
    assert probe.cached_passes(1) == {pass_key(m, 1, 32, "fp32"): first["seconds"]}
    measured = {"cpu": "test cpu", "cores": 2, "threads": 1, "peak": {"fp32": 6e10}, "memory_bandwidth": 1e10,
                "gloo_in_step_bandwidth": 1e9, "gloo_in_step_latency": 1e-4, "baseline_rss": 2e8, "gloo_in_step_all_gather_factor": 1.0,
                "gloo_in_step_reduce_scatter_factor": 1.0, "gloo_in_step_send_recv_factor": 1.0, "curve": {}, "passes": probe.cached_passes(1)}
    monkeypatch.setattr(probe, "measure_cpu", lambda n: measured)
    assert dict(local_cpu(2).device.passes) == {pass_key(m, 1, 32, "fp32"): first["seconds"]}
    # 4 ranks on 2 cores: each runs at half a core, its pass twice as long
    assert dict(local_cpu(4).device.passes) == {pass_key(m, 1, 32, "fp32"): 2 * first["seconds"]}


def test_collectives_timed_in_a_step_fit_the_ring_model_local_cpu_reads(monkeypatch):
    """gloo_probe.gloo_probe: the all-reduces timed among matmuls fit latency and bandwidth; the
    all-gathers, reduce-scatters and ring hops give factors over that model (a hop: one step of
    all its bytes); local_cpu uses them, for more ranks than cores that many ranks' fit, not
    stretched again (it was measured with the cores contended)."""
    from shardlm.hardware.catalog import local_cpu

    alpha, beta = 1e-3, 1e9  # per ring step; bytes/s
    from shardlm.hardware import gloo_probe

    sizes = gloo_probe.IN_STEP_SIZES

    def ring(steps, moved):  # 2 ranks
        return steps * alpha + moved / beta

    in_step = {"all_reduce": [[n, ring(2, n)] for n in sizes],
               "all_gather": [[n, 1.5 * ring(1, n / 2)] for n in sizes],
               "reduce_scatter": [[n, 2.0 * ring(1, n / 2)] for n in sizes],
               "send_recv": [[n, 1.7 * ring(1, n)] for n in sizes]}
    rank = {"latency": 2e-4, "all_reduce": 0.02, "rss": 2e8,
            "bytes": 8.0 * 2**20, "in_step": in_step}
    monkeypatch.setattr("shardlm.launch.spawn.run_ranks", lambda fn, n, tmp: [rank, rank])
    got = gloo_probe.gloo_probe()
    assert got["gloo_in_step_latency"] == pytest.approx(alpha, rel=1e-9)
    assert got["gloo_in_step_bandwidth"] == pytest.approx(beta, rel=1e-9)
    assert got["gloo_in_step_all_gather_factor"] == pytest.approx(1.5, rel=1e-9)
    assert got["gloo_in_step_reduce_scatter_factor"] == pytest.approx(2.0, rel=1e-9)
    assert got["gloo_in_step_send_recv_factor"] == pytest.approx(1.7, rel=1e-9)
    measured = {"cpu": "test cpu", "cores": 2, "threads": 1, "peak": {"fp32": 6e10}, "memory_bandwidth": 1e10,
                "baseline_rss": 2e8, "curve": {}, **got}
    monkeypatch.setattr(probe, "measure_cpu", lambda n: measured)
    two = local_cpu(2)
    assert two.node.intra.latency == got["gloo_in_step_latency"]
    assert two.node.intra.bandwidth == pytest.approx(beta, rel=1e-9)
    assert two.calibration.factor("reduce_scatter") == pytest.approx(2.0, rel=1e-9)
    assert two.calibration.factor("send_recv") == pytest.approx(1.7, rel=1e-9)
    # more ranks than cores: that many ranks' own fit (probe.oversubscribed_in_step, the
    # time-sharing measured in it), not stretched again
    crowded = {**measured, "gloo_in_step_latency": 5e-3, "gloo_in_step_bandwidth": 8e8, "in_step_ranks": 4}
    monkeypatch.setattr(probe, "measure_cpu", lambda n: crowded if n == 4 else measured)
    four = local_cpu(4)
    assert (four.node.intra.latency, four.node.intra.bandwidth) == (5e-3, 8e8)
    assert "between 4 local gloo ranks among matmuls" in four.node.intra.source


def test_sequence_parallel_charges_one_all_reduce_per_replicated_gradient():
    """Under sequence parallelism each norm weight and bias (and row bias) a tp rank applies to its
    slice of the sequence is all-reduced in backward, one call each (parallel/tensor/norms.py):
    the calls, not only their bytes, are in the step."""
    from shardlm.planner.traffic import sp_replicated_grads

    m = preset_model("gpt-tiny")  # LayerNorm with bias, biased linears: 6 tensors a block + 2
    elements, tensors = sp_replicated_grads(m, m.n_layers, embedding=True, head=True)
    assert tensors == 6 * m.n_layers + 2 + (1 if m.position == "learned" else 0)
    s = Strategy(ParallelDims(tp=2), 0, 2, 1, dtypes=Dtypes("fp32"), sequence_parallel=True)
    t = estimate_time(Workload(m, 64, 2), s, _cluster(2))
    tp = next(c for c in t.comms if c.name == "tensor-parallel all-reduces")
    term = next(x for x in tp.terms if "sequence-sharded" in x.name)
    assert term.name.startswith(f"{tensors} all-reduces")
    assert term.seconds > tensors * 2 * 1e-4  # at least each all-reduce's two ring steps' latency


def test_a_context_parallel_rank_reads_the_pass_of_its_share_of_the_sequence():
    m = preset_model("gpt-tiny")
    w = Workload(m, 64, 2)
    s = Strategy(ParallelDims(cp=2), 0, 2, 1, dtypes=Dtypes("fp32"))
    half = predicted_pass(replace(w, seq_len=32), s, _cluster(2))
    whole_key, half_key = pass_key(m, 2, 64, "fp32"), pass_key(m, 2, 32, "fp32")
    factor, how = in_situ_factor(w, s, _cluster(2, ((whole_key, 1.0), (half_key, 2 * half))))
    assert factor == pytest.approx(2.0, rel=1e-12) and "(2 x 32 tokens" in how
    # only the whole sequence's pass measured: that one, and the line says which
    factor, how = in_situ_factor(w, s, _cluster(2, ((whole_key, 1.0),)))
    assert "(2 x 64 tokens" in how


def test_calibrate_does_not_time_a_pass_that_would_not_fit(monkeypatch, capsys, tmp_path):
    from shardlm.cli.main import main

    private_cache(monkeypatch, tmp_path)
    monkeypatch.setattr(probe, "_time_product", lambda *a: {"best_s": 1e-3, "median_s": 1e-3})
    monkeypatch.setattr(probe, "cpu_peak_flops", lambda precision, threads=None: 1e11)
    monkeypatch.setattr(probe, "memory_probe", lambda threads, again=False: {"threads": threads})
    measured = {"cpu": "test cpu", "cores": 2, "threads": 2, "peak": {"fp32": 6e10}, "memory_bandwidth": 1e10,
                "gloo_in_step_bandwidth": 1e9, "gloo_in_step_latency": 1e-4, "baseline_rss": 2e8, "gloo_in_step_all_gather_factor": 1.0,
                "gloo_in_step_reduce_scatter_factor": 1.0, "gloo_in_step_send_recv_factor": 1.0, "curve": {}}
    monkeypatch.setattr(probe, "measure_cpu", lambda n: measured)
    monkeypatch.setattr("shardlm.hardware.catalog.available_memory", lambda: 2e8)  # 0.2 GB: less than a worker's baseline
    monkeypatch.setattr("shardlm.train.calibration.time_model_pass", lambda *a, **k: pytest.fail("timed"))
    assert main(["calibrate", "--model", "gpt-tiny", "--seq", "64"]) == 0
    out = capsys.readouterr().out
    assert "the model's pass is not timed: one process needs ~" in out and "has 0.2 GB available" in out


def test_a_recomputing_run_reads_the_pass_that_recomputes():
    m = preset_model("gpt-tiny")
    w = Workload(m, 64, 2)
    s = Strategy(ParallelDims(), 0, 2, 1, "full", dtypes=Dtypes("fp32"))
    full = predicted_pass(w, s, _cluster(1))
    assert full > predicted_pass(w, replace(s, recompute="none"), _cluster(1))  # the forward again
    plain_key, full_key = pass_key(m, 2, 64, "fp32"), pass_key(m, 2, 64, "fp32", "full")
    assert plain_key != full_key
    factor, how = in_situ_factor(w, s, _cluster(1, ((plain_key, 1.0), (full_key, 3 * full))))
    assert factor == pytest.approx(3.0, rel=1e-12) and "full recompute" in how
    factor, how = in_situ_factor(w, s, _cluster(1, ((plain_key, 1.0),)))  # none measured with it
    assert "full recompute" not in how and factor == pytest.approx(
        1.0 / predicted_pass(w, replace(s, recompute="none"), _cluster(1)), rel=1e-12)


def test_the_end_of_run_line_names_the_calibrate_command_when_no_pass_was_timed():
    """A run's prediction carries the `shardlm calibrate` command its missing pass needs
    (in_situ.calibrate_command, the metrics record's "calibrate_command"), and the end line
    names it; with the pass measured there is none to name."""
    import torch

    from shardlm.planner.in_situ import calibrate_command
    from shardlm.train.telemetry import prediction_summary

    m = preset_model("gpt-tiny")
    s = Strategy(ParallelDims(dp_shard=2), 0, 2, 1, "full", dtypes=Dtypes("fp32"))
    w = Workload(m, 64, 4)
    command = calibrate_command(w, s, _cluster(2))
    assert command == "shardlm calibrate --model gpt-tiny --seq 64 --micro-batch 2 --precision fp32 --recompute full --ranks 2"
    t = estimate_time(w, s, _cluster(2))
    assert f"`{command}` times one" in t.calibration
    predicted = {"hardware": "2 x cpu", "step_time_s": t.step, "peak_bytes_per_rank": 2**30}
    line = prediction_summary({**predicted, "calibrate_command": command}, [0.1, 0.1], torch.device("cpu"))
    assert line.endswith(f"(this model's pass was never timed here: `{command}` times it, and later "
                         "predictions use it)")
    measured = _cluster(2, ((pass_key(m, 2, 64, "fp32", "full"), 0.1),))
    assert calibrate_command(w, s, measured) == ""
    assert "never timed" not in prediction_summary({**predicted, "calibrate_command": None}, [0.1, 0.1],
                                                   torch.device("cpu"))


class _FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_in_step_times_a_collective_over_the_matmuls_round_and_reduce_scatters_as_the_runtime(monkeypatch):
    """gloo_probe._in_step reports what a collective adds to a round of matmuls (the round
    with it less the round without), not the collective's own span, which with more ranks than
    cores includes the other ranks' matmuls; its reduce-scatter is the runtime's on gloo (an
    all-reduce in place, then this rank's chunk: comm/collectives.py). A fake clock: each
    matmul takes 1 ms, an all-reduce 4 ms, of which 3 ms are another rank's matmuls it waited
    for (so the round with it is 4 + 4 - 3 = 5 ms)."""
    import torch

    from shardlm.hardware import gloo_probe

    clock = _FakeClock()
    monkeypatch.setattr(gloo_probe.time, "perf_counter", clock)

    class Operand:
        def __matmul__(self, other):
            clock.now += 1e-3

    class Work:
        def wait(self):
            pass

    class Dist:
        calls: list[str] = []
        world = 2

        def get_world_size(self):
            return self.world

        def get_rank(self):
            return 1

        def all_reduce(self, tensor):
            self.calls.append("all_reduce")
            tensor.mul_(2)
            clock.now += 4e-3 - 3e-3  # its own time less the matmuls it overlapped

        def all_gather_single(self, out, inp):
            self.calls.append("all_gather")
            clock.now += 2e-3

        isend, irecv = "isend", "irecv"

        def P2POp(self, op, tensor, peer):
            return op, peer

        def batch_isend_irecv(self, ops):
            self.calls.append(ops)
            clock.now += 1.5e-3
            return [Work() for _ in ops]

    monkeypatch.setattr(gloo_probe.torch, "randn", lambda *shape: Operand())
    dist = Dist()
    got = gloo_probe._in_step(dist, rounds=6)
    for op, added in (("all_reduce", 1e-3), ("all_gather", 2e-3), ("reduce_scatter", 1e-3), ("send_recv", 1.5e-3)):
        assert [n for n, _ in got[op]] == [float(n) for n in gloo_probe.IN_STEP_SIZES]
        assert all(t == pytest.approx(added, abs=1e-12) for _, t in got[op]), (op, got[op])
    assert "reduce_scatter" not in dist.calls  # gloo's own (a clone of the input) is never timed
    _, scatter = gloo_probe._single_tensor_collectives(dist)
    whole, shard = torch.arange(8.0), torch.empty(4)
    scatter(shard, whole)
    assert torch.equal(shard, 2 * torch.arange(4.0, 8.0))  # rank 1's chunk of the sum
    dist.world = 4  # a ring hop as Comm.shift: to the next rank, from the previous, posted together
    gloo_probe._shift(dist, torch.zeros(2), torch.zeros(2))
    assert dist.calls[-1] == [("isend", 2), ("irecv", 0)]
