"""Measured rates as the planner reads them: a device's matmul curve (MatmulCurve, fitted on
the model's own shapes), the interpolation of the memory probe's curves, and their one-line
descriptions. No torch; hardware/probe.py measures, hardware/catalog.py holds the devices.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class MatmulCurve:
    """Measured matmul FLOP/s of one device at one precision (and, on a CPU, thread count): the
    calibration the time model reads instead of a fitted efficiency (docs/planner.md section 4).

    A shape that was measured runs at its measured rate. Any other runs at the rate of the fit
    1/rate = a + b/I over the measured points, I = m·k·n / (m·k + k·n + m·n) (the product's
    FLOPs per element it reads and writes, halved: its arithmetic intensity): a roofline's
    knee, rate = r_max · I / (I + I_half), fitted by least squares on 1/rate, which is linear in
    1/I (weighted by relative error). The fit is clamped to the measured rates' range: nothing
    is extrapolated beyond what this device was seen to do."""

    points: tuple[tuple[int, int, int, float], ...]
    """(m, k, n, FLOP/s) of each measured (m x k) @ (k x n) product."""
    source: str
    """Which calibration: what measured the points, where, at how many threads."""

    @cached_property
    def _fit(self) -> tuple[float, float, float, float]:
        """(a, b, lowest rate, highest rate) of 1/rate = a + b/I, least squares in relative
        error (each point weighted 1/y²): a slow outlier, timed beside other work, would
        otherwise dominate a fit on 1/rate."""
        xs = [1 / intensity(m, k, n) for m, k, n, _ in self.points]
        ys = [1 / r for *_, r in self.points]
        ws = [1 / y**2 for y in ys]
        total = sum(ws)
        mx, my = sum(w * x for w, x in zip(ws, xs)) / total, sum(w * y for w, y in zip(ws, ys)) / total
        var = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
        b = max(0.0, sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys)) / var) if var > 0 else 0.0
        rates = [r for *_, r in self.points]
        return my - b * mx, b, min(rates), max(rates)

    def describe_fit(self) -> str:
        """The fit in words: r_max and I_half of rate = r_max · I / (I + I_half), the clamp."""
        a, b, low, high = self._fit
        knee = (f"r_max {1 / a / 1e9:,.1f} GFLOP/s, I_half {b / a:,.0f}" if a > 0
                else f"no knee (1/rate = {a:.3g} + {b:.3g}/I)")
        return (f"rate = r_max·I/(I + I_half), I = mkn/(mk + kn + mn): {knee}; clamped to the "
                f"measured {low / 1e9:,.1f}-{high / 1e9:,.1f} GFLOP/s")

    def rate(self, m: int, k: int, n: int) -> float:
        """FLOP/s of an (m x k) @ (k x n) product on this device."""
        for pm, pk, pn, r in self.points:
            if (pm, pk, pn) == (m, k, n):
                return r
        a, b, low, high = self._fit
        inverse = a + b / intensity(m, k, n)
        return high if inverse <= 1 / high else min(high, max(low, 1 / inverse))

    def scaled(self, factor: float) -> MatmulCurve:
        """Every rate x `factor` (ranks time-sharing the cores: cpu_share)."""
        if factor == 1:
            return self
        return MatmulCurve(tuple((m, k, n, r * factor) for m, k, n, r in self.points),
                           f"{self.source}, x {factor:.2g} (ranks share the cores)")


def describe_memory_rates(rates: dict) -> str:
    """hardware.probe.memory_probe's rates in one line (the calibration line of `estimate`,
    `shardlm calibrate`)."""
    elementwise = rates.get("elementwise", [])
    adamw = rates.get("adamw", [])
    parts = [f"memory probe ({rates.get('threads', '?')} thread(s)"
             + (f", load average {rates['load_average']:.1f} when measured" if "load_average" in rates else "") + "):"]
    if elementwise:
        parts.append("element-wise " + ", ".join(f"{bw / 1e9:,.1f} GB/s at {n / 2**20:g} MiB" for n, bw in elementwise))
    if "fresh_bandwidth" in rates:
        parts.append(f"fresh pages {rates['fresh_bandwidth'] / 1e9:,.2f} GB/s")
    if adamw:
        parts.append("fused AdamW " + ", ".join(f"{sec * 1e9:.2f} ns/param at {n / 2**20:g} M" for n, sec in adamw))
    if "op_seconds" in rates:
        parts.append(f"{rates['op_seconds'] * 1e6:.1f} us per dispatched op")
    return parts[0] + " " + "; ".join(parts[1:])


def interpolate(points, x: float) -> float:
    """y at `x` on measured (x, y) points: linear in log x between the neighbours, clamped to
    the ends (nothing extrapolated beyond what was measured)."""
    import math

    pts = sorted(points)
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            f = math.log(x / x0) / math.log(x1 / x0)
            return y0 + f * (y1 - y0)
    return pts[-1][1]


def intensity(m: int, k: int, n: int) -> float:
    """Arithmetic intensity of an (m x k) @ (k x n) product, up to a constant: multiply-adds
    per element of its two inputs and its output."""
    return m * k * n / (m * k + k * n + m * n)


def measured_curve(points: list[dict], where: str) -> MatmulCurve:
    """hardware.probe's curve entries as a MatmulCurve, its source naming which calibration
    (`shardlm calibrate`'s shapes of a model, or only the probe's generic ones) and `where`:
    the precision, threads and device they were measured at."""
    own = sum(1 for p in points if p.get("origin", "calibrate") == "calibrate")
    loaded = sum(1 for p in points if p.get("loaded"))
    what = (f"calibrated: {own} model shape(s) timed by `shardlm calibrate` + {len(points) - own} probe "
            f"shape(s)" if own else f"probe: {len(points)} generic shape(s) (`shardlm calibrate --model "
            f"...` adds the model's own)")
    return MatmulCurve(tuple((p["m"], p["k"], p["n"], p["flops_per_s"]) for p in points),
                       f"{what}, {where}" + (f", {loaded} timed under load" if loaded else ""))
