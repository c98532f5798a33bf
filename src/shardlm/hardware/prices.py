"""Prices and energy defaults of the hardware catalog: on-demand list prices per device-hour,
the datacenter overhead (PUE) and the grid's carbon intensity (planner/cost.py prices a training
budget with them). Split out of catalog.py, which re-exports these names. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from shardlm.errors import ConfigError


@dataclass(frozen=True)
class Price:
    """One public cloud's on-demand list price for one device, per device-hour (USD)."""

    cloud: str
    instance: str
    usd_per_device_hour: float
    """The instance's hourly price divided by its devices (host CPU, RAM, disk and network
    included, as the instance is sold)."""
    as_of: str
    source: str

    def describe(self) -> str:
        return (f"${self.usd_per_device_hour:.2f}/device-hour: {self.cloud} {self.instance}, "
                f"on-demand list price as of {self.as_of} ({self.source})")


_AWS = "AWS EC2 On-Demand pricing page, aws.amazon.com/ec2/pricing/on-demand/, us-east-1, Linux"
_GCP = "Google Cloud Compute Engine GPU pricing page, cloud.google.com/compute/gpus-pricing, us-central1"
_AZURE = ("Azure Linux Virtual Machines pricing page, azure.microsoft.com/pricing/details/"
          "virtual-machines/linux/, East US")

PRICES: dict[str, tuple[Price, ...]] = {
    # Figures recalled, not fetched (no web access when written): each as it stood on the
    # provider's page around early 2024, rounded to the cent. List prices move (AWS announced
    # cuts of up to ~45% to P4 and P5 on-demand prices in June 2025, not applied here); check the
    # page, or pass --price-per-hour. Reserved, spot and committed-use prices are far lower.
    # Only whole-instance prices (GCP's GPU-only prices, which leave the VM out, are not listed).
    "V100-16GB": (
        Price("aws", "p3.16xlarge (8 x V100-16GB, $24.48/h)", 3.06, "early 2024", _AWS),
        Price("azure", "NC6s_v3 (1 x V100-16GB PCIe, $3.06/h)", 3.06, "early 2024", _AZURE),
    ),
    "V100-32GB": (
        Price("aws", "p3dn.24xlarge (8 x V100-32GB, $31.21/h)", 3.90, "early 2024", _AWS),
    ),
    "A100-40GB": (
        Price("aws", "p4d.24xlarge (8 x A100-40GB, $32.77/h)", 4.10, "early 2024", _AWS),
        Price("gcp", "a2-highgpu-1g (1 x A100-40GB with its VM, about $3.67/h; approximate)",
              3.67, "early 2024", _GCP),
        Price("azure", "ND96asr_v4 (8 x A100-40GB, $27.20/h)", 3.40, "early 2024", _AZURE),
    ),
    "A100-80GB": (
        Price("aws", "p4de.24xlarge (8 x A100-80GB, $40.97/h)", 5.12, "early 2024", _AWS),
        Price("gcp", "a2-ultragpu-1g (1 x A100-80GB with its VM, about $5.07/h; approximate)",
              5.07, "early 2024", _GCP),
        Price("azure", "ND96amsr_A100_v4 (8 x A100-80GB, $32.77/h)", 4.10, "early 2024", _AZURE),
    ),
    "H100-80GB": (
        Price("aws", "p5.48xlarge (8 x H100-80GB, $98.32/h)", 12.29, "early 2024", _AWS),
        Price("gcp", "a3-highgpu-8g (8 x H100-80GB, about $88.25/h; approximate)", 11.03,
              "early 2024", _GCP),
        Price("azure", "ND96isr_H100_v5 (8 x H100-80GB, $98.32/h)", 12.29, "early 2024", _AZURE),
    ),
}
"""Device name -> its list prices. Devices absent (H200, MI250X, TPU v4, a CPU) have no price
here: pass --price-per-hour."""


def find_price(device, cloud: str | None = None) -> Price | None:
    """The catalog's price for `device` (a catalog.Device, found by its name): the named
    cloud's, or the lowest list price of those
    known. None: no price in the catalog (ConfigError: the named cloud has none)."""
    prices = PRICES.get(device.name, ())
    if cloud is None:
        return min(prices, key=lambda p: p.usd_per_device_hour, default=None)
    match = [p for p in prices if p.cloud == cloud.lower()]
    if not match:
        known = ", ".join(p.cloud for p in prices) or "none"
        raise ConfigError(f"no {cloud!r} price for {device.name} in the catalog (known: {known}); "
                          f"pass --price-per-hour USD")
    return match[0]


PUE_DEFAULT = 1.2
"""Datacenter overhead (power usage effectiveness), an assumption between the hyperscalers' and
the industry's: Google reports a fleet-wide trailing-twelve-month PUE of 1.10 (2023
Environmental Report), the Uptime Institute's Global Data Center Survey 2023 an industry
average of 1.58. Override with --pue. (Here, not in planner/cost.py, so the
command line reads the defaults without importing the planner.)"""

GRID_DEFAULT = 480.0
"""gCO2 per kWh: the world average carbon intensity of electricity in 2023, 480 g/kWh (Ember,
Global Electricity Review 2024). Regions differ tenfold (hydro/nuclear grids under 50, coal-heavy
ones over 700); override with --grid-gco2-per-kwh."""
