"""What a step pays beyond the calibrated pass, as the planner prices it from the probe's own
figures (issue 41 part 3: the planner on a second CPU kind, docs/planner.md "Validation"): the
in-situ factor never under 1, the optimizer's state read cold, the nvme tier's lone first read
and last write. Pure arithmetic on synthetic devices: nothing is timed."""

from dataclasses import replace

import pytest

from shardlm.config.schema import ZeroConfig
from shardlm.config.dims import ParallelDims
from shardlm.hardware.catalog import CALIBRATION, LINKS, Cluster, Device, MatmulCurve, Node
from shardlm.hardware.machine import local_disk, local_disk_lone
from shardlm.planner.workload import Dtypes, Strategy, Workload
from shardlm.planner.timing import estimate_time
from shardlm.planner.in_situ import in_situ_factor, pass_key, predicted_pass, step_pass_factor
from shardlm.planner.memory import nvme_first_chunk
from shardlm.planner.memory_bound import cold_adamw, optimizer_term
from shardlm.planner.shapes import preset_model
from shardlm.planner.workload import stage_params

ADAMW = ((2**18, 0.29e-9), (2**21, 0.22e-9), (2**24, 0.52e-9))
"""The AMD EPYC (Zen 4) probe's fused AdamW at two threads, seconds per parameter."""
DISK = {1: {"bytes_per_s": 1.30e9, "directory": "."}, 2: {"bytes_per_s": 1.49e9, "directory": "."},
        4: {"bytes_per_s": 1.485e9, "directory": "."}}
"""The same machine's disk: 1, 2 and 4 streams reading and writing at once."""


def _cluster(n: int, passes: tuple = (), lone: float = 0.0) -> Cluster:
    curve = MatmulCurve(((256, 64, 192, 1e11), (256, 64, 64, 1e11), (256, 256, 64, 1e11)), "test curve")
    cpu = Device("cpu (test)", "cpu", 8e9, {"fp32": 1e11}, 1e10, 1.0, "test", curves={"fp32": curve},
                 op_seconds=3e-6, fresh_bandwidth=2e9, bandwidth_curve=((2**20, 3e10), (2**28, 1.5e10)),
                 adamw_curve=ADAMW, passes=passes)
    link = replace(LINKS["eth-10"], bandwidth=1e9, latency=1e-4)
    node = Node(n, link, LINKS["eth-10"], 1, link, 16e9, 1e10, local_disk(DISK, n)[0], "test", lone)
    return Cluster(1, n, cpu, node, CALIBRATION["cpu"])


def test_a_pass_measured_under_its_parts_holds_the_step_at_its_parts():
    assert step_pass_factor(1.2, 1.0) == pytest.approx(1.2)
    assert step_pass_factor(106.5, 128.9) == 1.0  # the AMD EPYC's gpt-mini pass: x 0.83 measured
    m = preset_model("gpt-tiny")
    w, s = Workload(m, 64, 2), Strategy(ParallelDims(), 0, 2, 1, dtypes=Dtypes("fp32"))
    parts = predicted_pass(w, s, _cluster(1))
    key = pass_key(m, 2, 64, "fp32")
    under = _cluster(1, ((key, 0.8 * parts),))
    factor, how = in_situ_factor(w, s, under)
    assert factor == 1.0 and "held at its parts" in how
    # the step is then what its parts say, as with no pass measured at all
    assert estimate_time(w, s, under).step == pytest.approx(estimate_time(w, s, _cluster(1)).step, rel=1e-12)
    over = _cluster(1, ((key, 1.3 * parts),))
    assert in_situ_factor(w, s, over)[0] == pytest.approx(1.3) and "held" not in in_situ_factor(w, s, over)[1]


def test_the_optimizer_reads_its_state_cold():
    # 5.3 M parameters: 0.36 ns log-linear between 2 M and 16 M; the step pays the 16 M (DRAM) rate
    assert cold_adamw(ADAMW, 5.3e6) == pytest.approx(0.52e-9)
    assert cold_adamw(ADAMW, 2**18) == pytest.approx(0.52e-9)  # a small model's state is cold too
    slower_small = ((2**18, 2e-9), (2**24, 1e-9))  # a curve faster at its DRAM end keeps its own rate
    assert cold_adamw(slower_small, 2**18) == pytest.approx(2e-9)
    w = Workload(preset_model("gpt-mini"), 128, 2)
    s = Strategy(ParallelDims(), 0, 2, 1, dtypes=Dtypes("fp32"))
    psi = stage_params(w, s.layout)[0].dense
    term = optimizer_term(s, _cluster(1), psi, psi)
    norm = 4 * psi / _cluster(1).device.bandwidth_at(4 * psi)
    assert term.seconds == pytest.approx(0.52e-9 * psi + norm) and "state from DRAM" in term.formula


def test_lone_requests_run_at_the_streams_curve_of_half_as_many_streams():
    # one rank: one request in flight, half of one stream's two: half its rate
    assert local_disk_lone(DISK, 1) == pytest.approx(0.65e9)
    assert local_disk_lone(DISK, 2) == pytest.approx(1.30e9)  # two requests: one stream's worth
    assert local_disk_lone(DISK, 3) == pytest.approx((1.30e9 + 1.49e9) / 2)
    assert local_disk_lone(DISK, 4) == pytest.approx(1.49e9)
    assert local_disk_lone({}, 1) == 0.0  # never measured: the tier's bytes all at the streams' rate


def test_the_nvme_tiers_first_chunk_is_the_root_units_shard():
    w = Workload(preset_model("gpt-mini"), 128, 2)
    sp = stage_params(w, ParallelDims())[0]
    chunk = ZeroConfig().nvme_chunk_mb * 2**20
    assert nvme_first_chunk(sp, 1, chunk, 4) == sp.root_unit  # 2.2 M parameters: under a 64 MiB chunk
    assert nvme_first_chunk(sp, 2, chunk, 4) == -(-int(sp.root_unit) // 2)
    assert nvme_first_chunk(sp, 1, 2**20, 4) == 2**18  # a 1 MiB chunk of fp32: 256 K parameters
    assert nvme_first_chunk(replace(sp, root_unit=0), 1, chunk, 4) == sp.block_unit  # a middle stage


def test_the_nvme_tier_moves_its_first_chunk_at_the_lone_rate():
    w = Workload(preset_model("gpt-mini"), 128, 2)
    s = Strategy(ParallelDims(), 1, 2, 1, dtypes=Dtypes("fp32"), offload_optimizer="nvme")
    sp = stage_params(w, s.layout)[0]
    psi, first = sp.dense, float(sp.root_unit)
    streams = local_disk(DISK, 1)[0]
    plain = optimizer_term(s, _cluster(1), psi, psi, first).seconds  # no lone rate: all at the streams'
    lone = optimizer_term(s, _cluster(1, lone=local_disk_lone(DISK, 1)), psi, psi, first).seconds
    # read + write of master, m, v (24 B a parameter); the first chunk's 24 B at half the rate
    assert lone - plain == pytest.approx(24 * first / 0.65e9 - 24 * first / streams)
    assert lone - plain == pytest.approx(24 * first / 1.30e9)  # = the first chunk once more
    t = estimate_time(w, s, _cluster(1, lone=local_disk_lone(DISK, 1)))
    assert t.optimizer == pytest.approx(lone)


def test_stages_2_and_3_map_their_gradient_shards_afresh_each_step():
    w = Workload(preset_model("gpt-mini"), 128, 4)
    fresh = {}
    for stage in (1, 2, 3):
        s = Strategy(ParallelDims(dp_shard=2), stage, 2, 1, dtypes=Dtypes("fp32"))
        t = estimate_time(w, s, _cluster(2))
        fresh[stage] = next(x for x in t.work if x.name == "ZeRO flatten / gather copies").fresh_bytes
    psi = stage_params(w, ParallelDims(dp_shard=2))[0].dense
    # stage 1: gloo's all-gather output (4 B x psi); stage 2: + the flat gradient buffer (4 psi)
    # + this rank's gradient shard (4 psi / 2): bench_planner counted 31.8 MB more pages than stage 1
    assert fresh[1] == pytest.approx(4 * psi)
    assert fresh[2] - fresh[1] == pytest.approx(4 * psi + 4 * psi / 2)
    assert fresh[2] - fresh[1] == pytest.approx(31.9e6, rel=0.01)
    # stage 3: the shards too, beside the two gathers per micro-batch (x 2 for gloo's copy)
    assert fresh[3] == pytest.approx(4 * psi + 4 * psi / 2 + 2 * 4 * psi * 2)
    # a shard under the mmap threshold comes from the heap: no new pages (gpt-tiny on 2 ranks)
    tiny = Workload(preset_model("gpt-tiny"), 64, 4)
    s = Strategy(ParallelDims(dp_shard=2), 2, 2, 1, dtypes=Dtypes("fp32"))
    t = estimate_time(tiny, s, _cluster(2))
    psi_tiny = stage_params(tiny, s.layout)[0].dense
    assert next(x for x in t.work if x.name.startswith("ZeRO")).fresh_bytes == pytest.approx(2 * 4 * psi_tiny)
