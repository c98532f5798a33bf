"""Time-to-train, cost, energy and CO2 of a token budget: pure arithmetic on a predicted speed.

    time (s)        = tokens / predicted tokens/s
    device-hours    = time / 3600 x devices
    cost (USD)      = device-hours x price per device-hour
    energy (kWh)    = devices x board power (W) x UTILISATION x time (h) x PUE / 1000
    CO2 (kg)        = energy (kWh) x grid intensity (gCO2/kWh) / 1000

Prices and board powers come from hardware/catalog.py (PRICES, Device.power), each overridable;
the defaults (PUE_DEFAULT, GRID_DEFAULT: hardware/catalog.py) and UTILISATION below say their
sources and assumptions. docs/planner.md, "Cost and energy".
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlm.errors import ConfigError
from shardlm.hardware.catalog import GRID_DEFAULT, PUE_DEFAULT, Cluster, find_price

UTILISATION = 1.0
"""Devices draw their full board power (TDP) for the whole run: an upper bound — training
usually draws less. Only the accelerators are counted: host CPUs, memory, NICs and switches are
not (the PUE covers cooling and power delivery, not the servers' other parts)."""


@dataclass(frozen=True)
class CostBasis:
    """What a plan's time is priced with."""

    tokens: float
    """The training budget, in tokens."""
    price: float | None
    """USD per device-hour; None: unknown (cost is not computed)."""
    price_source: str
    power: float | None
    """Board power per device, W; None: unknown (energy and CO2 are not computed)."""
    pue: float = PUE_DEFAULT
    grid: float = GRID_DEFAULT
    """gCO2 per kWh."""

    def describe(self) -> list[str]:
        """Two lines: the price, and the energy and CO2 assumptions."""
        price = self.price_source if self.price is not None else "unknown (pass --price-per-hour USD)"
        power = (f"{self.power:.0f} W per device at full load (board power, an upper bound)"
                 if self.power is not None else "board power unknown")
        return [f"price: {price}",
                f"energy: {power} x PUE {self.pue:g}; CO2 at {self.grid:g} gCO2/kWh"]


@dataclass(frozen=True)
class Cost:
    seconds: float
    device_hours: float
    usd: float | None
    kwh: float | None
    co2_kg: float | None


def cost_basis(cluster: Cluster, tokens: float, price_per_hour: float | None = None,
               cloud: str | None = None, pue: float = PUE_DEFAULT,
               grid: float = GRID_DEFAULT) -> CostBasis:
    """The basis for `cluster`: `price_per_hour` if given, else the catalog's list price (the
    named cloud's, or the lowest), else unknown."""
    if not tokens > 0:
        raise ConfigError(f"--tokens {tokens:g} must be > 0")
    if price_per_hour is not None and price_per_hour < 0:
        raise ConfigError(f"--price-per-hour {price_per_hour:g} must be >= 0")
    if not pue >= 1:
        raise ConfigError(f"--pue {pue:g} must be >= 1 (1: no overhead)")
    if grid < 0:
        raise ConfigError(f"--grid-gco2-per-kwh {grid:g} must be >= 0")
    if price_per_hour is not None:
        price, source = price_per_hour, f"${price_per_hour:.2f}/device-hour (given)"
    else:
        listed = find_price(cluster.device, cloud)
        price = listed.usd_per_device_hour if listed else None
        source = listed.describe() if listed else ""
    return CostBasis(tokens, price, source, cluster.device.power, pue, grid)


def training_cost(tokens_per_s: float, devices: int, basis: CostBasis) -> Cost:
    """The formulas of the module docstring."""
    seconds = basis.tokens / tokens_per_s
    hours = seconds / 3600
    device_hours = hours * devices
    usd = device_hours * basis.price if basis.price is not None else None
    kwh = (devices * basis.power * UTILISATION * hours * basis.pue / 1000
           if basis.power is not None else None)
    co2 = kwh * basis.grid / 1000 if kwh is not None else None
    return Cost(seconds, device_hours, usd, kwh, co2)


RANK_BY = ("speed", "cost")


def rank(items: list, costs: list[Cost], by: str = "speed") -> list:
    """`items` (plans, possibly of different clusters and prices) reordered by their `costs`:
    'speed' = shortest time to train first, 'cost' = cheapest first (unknown cost last, ties by
    time). Stable: equal keys keep their order. On one cluster every plan uses the same devices
    at the same price, so cost is proportional to time and both orders agree."""
    if by not in RANK_BY:
        raise ConfigError(f"--rank-by {by!r}: choose one of {', '.join(RANK_BY)}")
    order = sorted(range(len(items)), key=(
        (lambda i: costs[i].seconds) if by == "speed" else
        (lambda i: (costs[i].usd is None, costs[i].usd or 0.0, costs[i].seconds))))
    return [items[i] for i in order]


DASH = "–"


def tokens(n: float) -> str:
    """'1e10', '2.5e9', '300,000'."""
    if n < 1e6:
        return f"{n:,.0f}"
    mantissa, exponent = f"{n:.3g}".split("e") if "e" in f"{n:.3g}" else (f"{n / 10**6:.3g}", "6")
    return f"{mantissa}e{int(exponent)}"


def duration(seconds: float) -> str:
    """'42 min', '5.3 h', '12.4 d', '2.1 y'."""
    if seconds < 3600:
        return f"{seconds / 60:.3g} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.3g} h"
    if seconds < 730 * 86400:
        return f"{seconds / 86400:.3g} d"
    return f"{seconds / (365 * 86400):.3g} y"


def money(usd: float | None) -> str:
    return DASH if usd is None else f"${usd:,.0f}" if usd >= 100 else f"${usd:,.2f}"


def number(value: float | None, digits: int = 3) -> str:
    return DASH if value is None else f"{value:,.0f}" if value >= 10**digits else f"{value:.{digits}g}"


def cost_json(cost: Cost) -> dict:
    return {"time_to_train_s": cost.seconds, "device_hours": cost.device_hours, "cost_usd": cost.usd,
            "energy_kwh": cost.kwh, "co2_kg": cost.co2_kg}


def basis_json(basis: CostBasis) -> dict:
    return {"tokens": basis.tokens, "usd_per_device_hour": basis.price, "price_source": basis.price_source,
            "device_power_w": basis.power, "utilisation": UTILISATION, "pue": basis.pue,
            "grid_gco2_per_kwh": basis.grid}
