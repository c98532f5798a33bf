"""The planner's commands and its fit / plan decisions: what fits a device and what does not, the
held memory and the worst phase, `plan`'s ranking and its runtime-only search, predict_local's
mapping of a run's config, and that the commands import no torch (split from test_planner.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from shardlm.cli.main import main
from shardlm.config.load import load_config
from shardlm.errors import ConfigError
from shardlm.hardware.catalog import (CALIBRATION, LINKS, Cluster, Device, Node,
                                      parse_cluster)
from shardlm.planner.memory import estimate_memory
from shardlm.planner.search import EVERYTHING, RUNTIME, plan_for_run, predict_local, search
from shardlm.planner.shapes import model_from_params, preset_model
from shardlm.config.dims import ParallelDims
from shardlm.planner.workload import Dtypes, Strategy, Workload, shape_of


# ---------------------------------------------------------------------------------------------
# Fits or not


def run_cli(args: list[str], capsys) -> tuple[int, str]:
    code = main(args)
    return code, capsys.readouterr().out


def test_gpt2_xl_plain_data_parallel_does_not_fit_a_v100(capsys):
    code, out = run_cli(["estimate", "--model", "gpt2-1.5b", "--gpus", "8xV100-16GB",
                         "--zero-stage", "0", "--micro-batch", "4", "--seq", "1024", "--json"], capsys)
    report = json.loads(out)
    assert code == 1 and report["memory"]["fits"] is False
    # 16Ψ of model states alone (24.9 GB) exceed the 16 GB card.
    held = sum(i["bytes"] for i in report["memory"]["items"][:3])
    assert held == pytest.approx(16 * 1_557_611_200)
    assert report["suggestions"]
    assert all(s["peak_bytes"] <= s["capacity_bytes"] for s in report["suggestions"])


def test_gpt2_xl_zero3_with_selective_recompute_fits(capsys):
    code, out = run_cli(["estimate", "--model", "gpt2-1.5b", "--gpus", "8xV100-16GB",
                         "--zero-stage", "3", "--micro-batch", "4", "--seq", "1024",
                         "--recompute", "selective"], capsys)
    assert code == 0 and "fits: peak" in out
    for category in ("parameters", "gradients", "optimizer states", "activations", "buffers",
                     "fragmentation allowance"):
        assert category in out
    assert "K=12 B x Ψ_r / N=8" in out


def test_peak_is_held_memory_plus_the_worst_phase():
    cluster = parse_cluster("8xA100-80GB")
    w = Workload(preset_model("gpt2-1.5b"), 1024, 32)
    memory = estimate_memory(w, Strategy(ParallelDims(1, 8), 3, 4, 1, dtypes=Dtypes("bf16")), cluster)
    parts = memory.items[:4] + memory.items[4].parts  # states, activations, each buffer
    held = sum(i.bytes for i in parts if not i.phases)
    phases = {p: sum(i.phases.get(p, 0) for i in parts) for p in ("loss", "blocks", "embedding", "root")}
    assert memory.train_peak == pytest.approx(held + 1.1 * max(phases.values()))
    # ... which is less than adding every row: transients of different phases never coexist.
    rows = sum(i.bytes for i in memory.items)
    assert memory.train_peak < rows


def test_gradient_accumulation_keeps_whole_gradients_even_at_stage_3():
    # The engine reduces on the last micro-step only: param.grad of every parameter lives
    # across the micro-steps, unsharded (parallel/data/zero/engine.py); the planner must say so.
    cluster = parse_cluster("8xA100-80GB")
    w = Workload(preset_model("llama-7b"), 1024, 16)
    one = estimate_memory(w, Strategy(ParallelDims(1, 8), 3, 2, 1, dtypes=Dtypes("bf16")), cluster)
    two = estimate_memory(replace(w, global_batch=32),
                          Strategy(ParallelDims(1, 8), 3, 2, 2, dtypes=Dtypes("bf16")), cluster)
    accumulated = next(i for i in two.items[4].parts if i.name == "accumulated gradients")
    assert accumulated.bytes == pytest.approx(2 * 6_738_415_616) and not accumulated.phases
    assert two.peak > one.peak + 10e9


def test_setup_holds_shards_plus_one_unit_at_stage_3():
    # The sharded build: a 70B model at stage 3 on 512 H100s never holds its whole fp32 copy
    # (280 GB) on a rank, only its shards and one block.
    cluster = parse_cluster("64x8xH100-80GB")
    w = Workload(model_from_params(70e9), 2048, 512, params=70e9)
    memory = estimate_memory(w, Strategy(ParallelDims(1, 512), 3, 1, 1, "full", dtypes=Dtypes("bf16")), cluster)
    states = sum(i.bytes for i in memory.items[:3])
    assert states < memory.setup_peak < states + 2e9 + 20 * 70e9 / 80  # ~80 blocks: one of them
    assert memory.setup_peak < memory.capacity


def test_estimate_degree_error_is_clear(capsys):
    assert main(["estimate", "--model", "gpt2-124m", "--gpus", "8xA100-80GB", "--tp", "3"]) == 2
    assert "world size 8 is not divisible by dp_replicate (1) × cp (1) × tp (3) × pp (1) = 3" in capsys.readouterr().err


def test_plan_ranks_what_fits_and_explains(capsys):
    code, out = run_cli(["plan", "--model", "llama-7b", "--gpus", "2x8xA100-80GB", "--json"], capsys)
    result = json.loads(out)
    assert code == 0
    speeds = [p["tokens_per_s"] for p in result["plans"]]
    assert speeds == sorted(speeds, reverse=True) and len(speeds) > 1
    assert all(p["peak_bytes"] <= p["capacity_bytes"] for p in result["plans"])
    assert result["explanation"][0].startswith("Best:")
    assert any("slower" in line or "within 1%" in line for line in result["explanation"])


def test_plan_runtime_only_and_plan_for_run():
    model = preset_model("gpt2-1.5b")
    plans = plan_for_run(model, 8, "8xV100-16GB", (4, 1, 1024))
    assert plans and all(p.runtime_supported for p in plans)
    best = plans[0]
    o = best.overrides()
    assert o["train.micro_batch"] * o["train.grad_accum"] * o["parallel.dp_shard"] * \
        o["parallel.dp_replicate"] == 4 * 8  # the global batch is kept
    assert o["precision.compute"] == "fp16"  # V100: no bf16
    everything = search(Workload(model, 1024, 32), parse_cluster("8xV100-16GB"), Dtypes("fp16"), EVERYTHING)
    assert len(everything.plans) >= len(search(Workload(model, 1024, 32), parse_cluster("8xV100-16GB"),
                                               Dtypes("fp16"), RUNTIME).plans)
    with pytest.raises(ConfigError, match="has 8 devices, the run 4 ranks"):
        plan_for_run(model, 4, "8xV100-16GB", 2**20)


def test_offload_appears_only_when_needed():
    model = preset_model("llama-13b")
    cluster = parse_cluster("1xA100-80GB")
    result = search(Workload(model, 2048, 8), cluster, Dtypes("bf16"), RUNTIME)
    assert result.plans, "13B on one 80 GB GPU fits only by offloading its optimizer states"
    assert all(p.strategy.offload_optimizer != "none" for p in result.plans)


# ---------------------------------------------------------------------------------------------
# The commands: fast, JSON, no torch


def test_commands_do_not_import_torch():
    # (Their speed follows from this — pure arithmetic — and is not timed here: a loaded machine
    # would make a timed test fail for nothing.)
    code = (
        "import json, sys\n"
        "from shardlm.cli.main import main\n"
        "main(['estimate', '--model', 'gpt2-1.5b', '--gpus', '8xV100-16GB', '--zero-stage', '3',"
        " '--micro-batch', '4', '--seq', '1024', '--json'])\n"
        "main(['plan', '--model', 'llama-7b', '--gpus', '2x8xA100-80GB', '--json'])\n"
        "print(json.dumps({'torch': 'torch' in sys.modules}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    last = json.loads(out.strip().splitlines()[-1])
    assert last["torch"] is False


def test_predict_local_maps_the_config(monkeypatch):
    # A stand-in for this CPU (the real one is measured by spawning ranks): what matters here
    # is that a Config becomes the strategy the runtime would build.
    cpu = Device("cpu (test)", "cpu", 8e9, {"fp32": 1e11, "bf16": 5e10}, 1e10, 0.65, "test")
    node = Node(2, LINKS["eth-10"], LINKS["eth-10"], 1, LINKS["eth-10"], 16e9, 1e10, 2e9, "test")
    monkeypatch.setattr("shardlm.planner.search.local_cpu",
                        lambda n, mmap_threshold=None: Cluster(1, n, cpu, replace(node, per_node=n), CALIBRATION["cpu"]))
    cfg = load_config(overrides={"model.preset": "gpt-mini", "parallel.zero_stage": "2",
                                 "train.micro_batch": "4", "train.seq_len": "128"})
    pred = predict_local(cfg, 2)
    psi = shape_of(Workload(cfg.model, 128, 8)).total
    assert pred.model_state_bytes["params"] == pytest.approx(4 * psi)  # auto -> fp32 here
    assert pred.model_state_bytes["grads"] == pytest.approx(4 * psi / 2)
    assert pred.model_state_bytes["optimizer"] == pytest.approx(8 * psi / 2)
    assert pred.peak_process_bytes > sum(pred.model_state_bytes.values()) + pred.activation_bytes
    assert pred.step_time_s > 0 and pred.tokens_per_s == pytest.approx(8 * 128 / pred.step_time_s)
