"""The compute side of the time model (timing.py adds communication, the bubble and the
optimizer): model FLOPs per token (PaLM appendix B; recomputation as hardware FLOPs), and the
rate a rank's matmuls run at — the calibrated matmul curve of this machine (hardware/catalog.py
MatmulCurve, hardware/probe.py) timed on the model's own shapes, or a catalog device's peak and
efficiency; FP8 blocks at the fp8 peak. Pure functions."""

from __future__ import annotations

import functools
from dataclasses import replace

from shardlm.config.model import ModelConfig
from shardlm.hardware.catalog import Cluster, MatmulCurve
from shardlm.hardware.gpu_calibration import device_curves
from shardlm.models import flops
from shardlm.planner.workload import Strategy, Workload, matmul_shapes, shape_of


def matmul_rate(w: Workload, s: Strategy, peak: dict[str, float]) -> float:
    """The device's peak FLOP/s for this run's kernels. Under fp8 (Dtypes.fp8) on a device the
    catalog gives an fp8 peak, the blocks' linears (6 x their weights per token: all of the
    matmul parameters but the head's) run at it and the rest (the head, attention) at the
    carrier dtype's: the harmonic mix by FLOP share. Without an fp8 peak (the CPU emulation:
    the rounding emulated, the matmuls in bf16) every FLOP runs at the carrier's."""
    carrier = peak[s.dtypes.compute]
    if not (s.dtypes.fp8 and "fp8" in peak):
        return carrier
    m = w.model
    share = 6 * (flops.matmul_params(m) - m.d_model * m.vocab_size) / flops.kernel_flops_per_token(m, w.seq_len)
    return 1.0 / (share / peak["fp8"] + (1.0 - share) / carrier)


def model_flops_per_token(w: Workload, recompute: str = "none", count: str = "model") -> float:
    """models.flops.flops_per_token (PaLM appendix B: 6N + 12·L·h·s; count='model', for MFU)
    or what the kernels execute (count='kernel': causal flash attention, 6N + 7·L·h·s; for
    time; 'kernel-forward': its forward share); a mixture of experts counts its active
    parameters (the router, top_k routed experts and the shared ones: models.flops)."""
    value = _flops_per_token(w.model_key, w.seq_len, recompute, count)
    if w.params:
        value *= w.params / shape_of(replace(w, params=None)).total
    return value


@functools.lru_cache(maxsize=256)
def _flops_per_token(model_fields: tuple, seq_len: int, recompute: str, count: str) -> float:
    # Memoised by the model's fields (Workload.model_key): a search asks thousands of times.
    m = ModelConfig(**dict(model_fields))
    return {"model": lambda: flops.flops_per_token(m, seq_len, recompute),
            "kernel": lambda: flops.kernel_flops_per_token(m, seq_len, recompute),
            "kernel-forward": lambda: flops.kernel_forward_flops_per_token(m, seq_len)}[count]()


def compute_rate(w: Workload, s: Strategy, cluster: Cluster) -> tuple[float, str]:
    """(FLOP/s the step's compute runs at on one rank, which calibration says so).

    With a measured curve for the compute dtype (this CPU: Device.curves), the rate of the
    model's own matmuls at this run's shapes: each forward product (workload.matmul_shapes, a
    rank's tokens b·s/cp, its tensor-parallel shard) and its two backward products (dX: m x n x
    k, dW: k x m x n), their FLOPs over their summed measured-curve seconds; attention and the
    element-wise work run at that rate too; a catalog GPU has one where `shardlm calibrate
    --device cuda` timed a GPU of its kind on this machine (hardware/gpu_calibration.py).
    Without one (the catalog's GPUs otherwise): the device's
    efficiency x h/(h + half_width) of matmul_rate's peak, small matrices filling less of the
    chip (docs/planner.md section 4)."""
    dev, m = cluster.device, w.model
    peak = matmul_rate(w, s, dev.peak)  # fp8 blocks at the device's fp8 peak where it has one
    curve = device_curves(dev).get(s.dtypes.compute)  # a GPU's: `shardlm calibrate --device cuda`
    if curve is None:
        width = cluster.calibration.half_width
        return (peak * dev.efficiency * m.d_model / (m.d_model + width),
                f"catalog: efficiency {dev.efficiency:g} x h/(h + {width:g}) of the "
                f"{'fp8' if s.dtypes.fp8 and 'fp8' in dev.peak else s.dtypes.compute} peak")
    return curve_rate(curve, m, max(1, s.micro_batch * w.seq_len // s.layout.cp), s.layout.tp), curve.source


def curve_rate(curve: MatmulCurve, m, tokens: int, tp: int = 1) -> float:
    """FLOP/s of one rank's forward and backward matmuls for a micro-batch of `tokens` tokens
    on `curve`: their FLOPs over their summed seconds (each product at its own rate)."""
    flops_total = seconds = 0.0
    for _, rows, k, n, count in matmul_shapes(m, tokens, tp):
        product = 2 * rows * k * n * count
        for shape in ((rows, k, n), (rows, n, k), (k, rows, n)):  # forward, dX, dW
            flops_total += product
            seconds += product / curve.rate(*shape)
    return flops_total / seconds
