"""Time-to-train, cost, energy and CO2 for a token budget (planner/cost.py, issue 17 item 2)."""

from __future__ import annotations

import json
import math

import pytest

from shardlm.cli.main import main
from shardlm.errors import ConfigError
from shardlm.hardware.catalog import DEVICES, PRICES, find_price, parse_cluster
from shardlm.planner.cost import (DASH, GRID_DEFAULT, PUE_DEFAULT, CostBasis, cost_basis,
                                  duration, money, rank, tokens, training_cost)


def test_hand_computed_example():
    # 1e10 tokens at 25,000 tokens/s on 8 devices at $4.10/device-hour, 400 W, PUE 1.2, 480 g/kWh:
    # 400,000 s = 111.11 h; 888.89 device-hours; $3,644.44; 8 x 0.4 kW x 111.11 h x 1.2 =
    # 426.67 kWh; x 0.48 kg/kWh = 204.8 kg CO2.
    basis = CostBasis(1e10, 4.10, "test", 400.0, 1.2, 480.0)
    c = training_cost(25_000, 8, basis)
    assert c.seconds == pytest.approx(400_000)
    assert c.device_hours == pytest.approx(888.888_9, rel=1e-6)
    assert c.usd == pytest.approx(3_644.444, rel=1e-6)
    assert c.kwh == pytest.approx(426.666_7, rel=1e-6)
    assert c.co2_kg == pytest.approx(204.8, rel=1e-6)


def test_unknown_price_and_power_give_none():
    c = training_cost(1_000, 2, CostBasis(1e6, None, "", None))
    assert c.seconds == 1_000 and c.device_hours == pytest.approx(2 / 3.6)
    assert c.usd is None and c.kwh is None and c.co2_kg is None
    assert money(None) == DASH == "–"


def test_basis_takes_the_catalog_the_cloud_or_the_override():
    cluster = parse_cluster("8xA100-40GB")
    cheapest = cost_basis(cluster, 1e10)
    assert cheapest.price == min(p.usd_per_device_hour for p in PRICES["A100-40GB"])
    assert cost_basis(cluster, 1e10, cloud="aws").price == pytest.approx(32.77 / 8, abs=0.01)
    assert cost_basis(cluster, 1e10, price_per_hour=1.5).price == 1.5
    assert cheapest.power == 400 and cheapest.pue == PUE_DEFAULT and cheapest.grid == GRID_DEFAULT
    assert cost_basis(parse_cluster("8xH200-141GB"), 1e10).price is None
    with pytest.raises(ConfigError, match="no 'gcp' price for V100-32GB"):
        cost_basis(parse_cluster("8xV100-32GB"), 1e10, cloud="gcp")
    for bad in (dict(tokens=0), dict(tokens=1, price_per_hour=-1), dict(tokens=1, pue=0.9),
                dict(tokens=1, grid=-1)):
        with pytest.raises(ConfigError):
            cost_basis(cluster, **bad)


def test_catalog_prices_and_powers_are_dated_and_sourced():
    for name, prices in PRICES.items():
        assert name in DEVICES
        for p in prices:
            assert p.usd_per_device_hour > 0 and p.as_of and "pricing" in p.source
    for name in ("V100-16GB", "A100-40GB", "A100-80GB", "H100-80GB"):
        assert {p.cloud for p in PRICES[name]} >= {"aws", "azure"}
        assert DEVICES[name].power
    assert find_price(DEVICES["TPU-v4"]) is None and DEVICES["TPU-v4"].power is None


def test_rank_by_cost_differs_from_speed_across_prices():
    # Two plans on different clusters: a fast expensive one (H100 at $12.29) and a slower cheap
    # one (A100 at $4.10). Speed ranks the H100 first, cost the A100; an unpriced plan goes last.
    fast = training_cost(60_000, 8, CostBasis(1e10, 12.29, "", 700))
    slow = training_cost(27_000, 8, CostBasis(1e10, 4.10, "", 400))
    unpriced = training_cost(90_000, 8, CostBasis(1e10, None, "", None))
    assert slow.seconds > fast.seconds and slow.usd < fast.usd
    plans = ["h100", "a100", "unpriced"]
    costs = [fast, slow, unpriced]
    assert rank(plans, costs, "speed") == ["unpriced", "h100", "a100"]
    assert rank(plans, costs, "cost") == ["a100", "h100", "unpriced"]
    with pytest.raises(ConfigError):
        rank(plans, costs, "energy")


def test_on_one_cluster_cost_order_is_speed_order():
    basis = CostBasis(1e9, 3.0, "", 300)
    speeds = [5_000.0, 9_000.0, 7_000.0]
    costs = [training_cost(s, 4, basis) for s in speeds]
    assert rank(speeds, costs, "cost") == rank(speeds, costs, "speed") == [9_000.0, 7_000.0, 5_000.0]


def test_formatting():
    assert duration(1800) == "30 min" and duration(5 * 3600) == "5 h" and duration(3 * 86400) == "3 d"
    assert tokens(1e10) == "1e10" and tokens(2.5e9) == "2.5e9" and tokens(300_000) == "300,000"
    assert money(3644.44) == "$3,644" and money(12.345) == "$12.35"


def run_cli(args, capsys):
    code = main(args)
    return code, capsys.readouterr().out


def test_plan_shows_time_and_cost_columns(capsys):
    code, out = run_cli(["plan", "--model", "gpt2-124m", "--gpus", "8xA100-80GB", "--tokens", "1e10",
                         "--cloud", "aws", "--top", "3"], capsys)
    assert code == 0
    header = next(line for line in out.splitlines() if "tokens/s" in line and "strategy" in line)
    for column in ("to train", "cost", "kWh", "kg CO2"):
        assert column in header
    assert "p4de.24xlarge" in out and "as of early 2024" in out and "PUE 1.2" in out
    row = out.splitlines()[out.splitlines().index(header) + 1]
    assert "$" in row


def test_plan_json_carries_the_figures(capsys):
    code, out = run_cli(["plan", "--model", "gpt2-124m", "--gpus", "8xA100-80GB", "--tokens", "1e10",
                         "--price-per-hour", "2", "--pue", "1.1", "--grid-gco2-per-kwh", "100",
                         "--rank-by", "cost", "--top", "3", "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["rank_by"] == "cost" and data["cost_basis"]["usd_per_device_hour"] == 2
    for plan in data["plans"]:
        c = plan["cost"]
        assert c["time_to_train_s"] == pytest.approx(1e10 / plan["tokens_per_s"])
        assert c["cost_usd"] == pytest.approx(c["time_to_train_s"] / 3600 * 8 * 2)
        assert c["energy_kwh"] == pytest.approx(8 * 0.4 * c["time_to_train_s"] / 3600 * 1.1)
        assert c["co2_kg"] == pytest.approx(c["energy_kwh"] * 0.1)
    usd = [p["cost"]["cost_usd"] for p in data["plans"]]
    assert usd == sorted(usd)


def test_estimate_prints_the_figures_and_unknown_price_is_a_dash(capsys):
    code, out = run_cli(["estimate", "--model", "gpt2-124m", "--gpus", "8xV100-16GB", "--zero-stage", "1",
                         "--micro-batch", "4", "--seq", "1024", "--tokens", "1e9"], capsys)
    assert code == 0
    assert "to train 1e9 tokens:" in out and "device-hours" in out and "$3.06/device-hour" in out
    code, out = run_cli(["estimate", "--model", "gpt2-124m", "--gpus", "8xH200-141GB", "--micro-batch", "4",
                         "--seq", "1024", "--tokens", "1e9"], capsys)
    line = next(line for line in out.splitlines() if line.startswith("to train"))
    assert "cost –" in line and "price: unknown (pass --price-per-hour USD)" in out
    assert "kWh" in line and "energy –" not in line  # the H200's board power is known


def test_cost_options_need_tokens(capsys):
    assert main(["plan", "--model", "gpt2-124m", "--gpus", "8xA100-80GB", "--rank-by", "cost"]) == 2
    assert "need(s) --tokens N" in capsys.readouterr().err


def test_cpu_cluster_price_unknown_prints_a_dash(capsys, monkeypatch):
    # A CPU cluster without --price-per-hour: no price, no board power. The probe is replaced by
    # a fixed measurement (no timing here).
    import shardlm.hardware.probe as probe

    monkeypatch.setattr(probe, "measure_cpu", lambda n: {
        "cpu": "test", "cores": 2, "threads": 1, "peak": {"fp32": 5e10}, "memory_bandwidth": 1e10,
        "gloo_in_step_bandwidth": 1e9, "gloo_in_step_latency": 1e-4, "baseline_rss": 2e8,
        "gloo_in_step_all_gather_factor": 1.0, "gloo_in_step_reduce_scatter_factor": 1.0,
        "gloo_in_step_send_recv_factor": 1.0})
    code, out = run_cli(["plan", "--model", "gpt-tiny", "--gpus", "2xcpu", "--tokens", "1e7", "--top", "2"],
                        capsys)
    assert code == 0
    rows = [line for line in out.splitlines() if line.strip().startswith("1 ") and "tokens" not in line]
    assert rows and rows[0].count(DASH) == 3  # cost, kWh, CO2
    code, out = run_cli(["plan", "--model", "gpt-tiny", "--gpus", "2xcpu", "--tokens", "1e7", "--top", "1",
                         "--price-per-hour", "0.05", "--json"], capsys)
    c = json.loads(out)["plans"][0]["cost"]
    assert c["cost_usd"] == pytest.approx(c["device_hours"] * 0.05) and c["energy_kwh"] is None
    assert math.isfinite(c["time_to_train_s"])


def test_plan_compares_several_clusters_by_speed_or_cost(capsys):
    """One workload on three clusters: the ranking follows the best plan of each, by tokens/s,
    or by the priced cost when --rank-by cost (the same price per device-hour for the same
    number of devices: cost order = speed order)."""
    clusters = "8xA100-80GB,8xH100-80GB,8xV100-32GB"
    base = ["plan", "--model", "gpt2-350m", "--gpus", clusters, "--top", "1", "--json"]
    assert main(base) == 0
    out = json.loads(capsys.readouterr().out)
    best = {c["cluster"]: c["plans"][0]["tokens_per_s"] for c in out["clusters"]}
    assert len(best) == 3 and out["ranking"] == sorted(best, key=lambda c: -best[c])
    assert out["ranking"][0].startswith("8 x H100")
    # Price every cluster the same per device-hour: cost order = speed order.
    assert main(base + ["--tokens", "1e9", "--price-per-hour", "1", "--rank-by", "cost"]) == 0
    assert json.loads(capsys.readouterr().out)["ranking"] == out["ranking"]
    assert main(["plan", "--model", "gpt2-350m", "--gpus", clusters, "--top", "1"]) == 0
    text = capsys.readouterr().out
    assert "3 clusters, the best plan of each, fastest first" in text
    assert main(["estimate", "--model", "gpt2-350m", "--gpus", clusters]) == 2
    assert "compared by `shardlm plan`" in capsys.readouterr().err
