"""Context parallelism's modes priced side by side (parallel.cp_mode: ring, ulysses, hybrid;
parallel/context/attention.py, parallel/context/ulysses.py): the bytes each sends per micro-batch, as the ledger
counts them, and their time on a link; `choose_cp_mode` is what cp_mode = 'auto' runs.

Pure functions; no torch. Notation: C = cp, U the all-to-all degree, R = C/U the ring's, t the
tensor-parallel degree, s·b = `tokens` the micro-batch's whole sequences, d the head width
(model.head_dim where a family sets it — Gemma, Qwen3 — else d_model / n_heads: flops.head_dim).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlm.config.layout_rules import cp_degrees
from shardlm.models import flops
from shardlm.planner.links import collective_parts
from shardlm.planner.traffic import cp_comm_bytes


def _heads(m, tp: int) -> tuple[int, int]:
    """(query, key/value) heads of one tensor-parallel rank (at least one key/value head)."""
    return m.n_heads // tp, max(1, (m.n_kv_heads or m.n_heads) // tp)


def attention_seconds(m, seq_len: int, micro_batch: int, tp: int, cp: int, rate: float,
                      recompute: str = "none") -> float:
    """One micro-batch's causal attention on a rank, forward (2·w·s FLOPs per local token for
    QKᵀ and AV together, w = n_heads · head_dim: half the dense 4·w·s) and backward (twice that),
    once more forward with recomputation: the compute the cp modes' exchanges hide behind."""
    tokens = micro_batch * seq_len
    forward = 2 * flops.attention_width(m) * seq_len * tokens * m.n_layers / (tp * cp) / rate
    return forward * (2 + (2 if recompute != "none" else 1))


def cp_a2a_bytes(m, tokens: int, cp: int, a2a: int, tp: int, e: int, recompute: str = "none",
                 layers: int | None = None) -> int:
    """Bytes a rank sends in Ulysses' all-to-alls per micro-batch (`all_to_all/cp`: the rows it
    sends to the other U-1 ranks): per block forward q, k, v (key/value heads replicated up to U)
    in one exchange and the output in another, over its tokens/C tokens: (U-1)/U of
    (2·h + 2·max(h_kv, U))·tokens/C·d·e; backward their gradients (the same bytes); recomputation
    runs the forward's again."""
    if a2a == 1:
        return 0
    layers = m.n_layers if layers is None else layers
    heads, kv = _heads(m, tp)
    kv = max(kv, a2a)
    width = (heads + 2 * kv) // a2a + heads // a2a  # head rows per destination: q, k, v + output
    passes = 3 if recompute != "none" else 2
    return layers * passes * (a2a - 1) * (tokens // cp) * width * flops.head_dim(m) * e


def cp_mode_bytes(m, tokens: int, cp: int, tp: int, e: int, recompute: str = "none",
                  layers: int | None = None, mode: str = "ring", ulysses: int = 0) -> dict[str, int]:
    """{'all_to_all': ..., 'send_recv': ...}: the ledger's bytes on the cp group per micro-batch
    for `mode` (ulysses: the all-to-all degree of 'hybrid'). The hybrid's ring is
    planner.traffic.cp_comm_bytes over R ranks with each rank's key/value heads divided by U —
    the heads the exchange left it (tp x U in place of tp)."""
    if cp == 1:
        return {"all_to_all": 0, "send_recv": 0}
    a2a, ring = cp_degrees(cp, mode, ulysses)
    return {"all_to_all": cp_a2a_bytes(m, tokens, cp, a2a, tp, e, recompute, layers),
            "send_recv": cp_comm_bytes(m, tokens, ring, tp * a2a, e, recompute, layers)}


@dataclass(frozen=True)
class CPModeTime:
    mode: str
    ulysses: int
    """The all-to-all degree (1 ring, cp ulysses)."""
    bytes: int
    seconds: float
    """Exposed communication per micro-batch."""


def cp_mode_seconds(m, tokens: int, cp: int, tp: int, e: int, recompute: str, mode: str, ulysses: int,
                    bandwidth: float, latency: float, attention_s: float = 0.0,
                    overlap: float = 0.0, hop_factor: float = 1.0) -> CPModeTime:
    """The exposed communication time of `mode` per micro-batch (alpha-beta, planner.links.
    collective_parts): the all-to-alls wait at once (attention needs the heads before it
    starts); the ring's key/value hops hide behind `overlap` x `attention_s` (this rank's
    attention compute, forward + backward), its fp32 gradient hops do not; each hop x the
    device's measured `hop_factor` (Calibration.factor('send_recv'); as timing._cp_ring)."""
    a2a, ring = cp_degrees(cp, mode, ulysses)
    parts = cp_mode_bytes(m, tokens, cp, tp, e, recompute, None, mode, ulysses)
    passes = 3 if recompute != "none" else 2
    seconds = 0.0
    if a2a > 1:  # collective_parts takes the whole tensor and moves (U-1)/U of it
        calls = 2 * passes * m.n_layers
        seconds += collective_parts("all_to_all", parts["all_to_all"] * a2a / (a2a - 1), a2a,
                                    bandwidth, latency, calls)[0]
    if ring > 1:
        kv = max(1, _heads(m, tp)[1] // a2a)
        block = 2 * tokens // ring * kv * flops.head_dim(m)  # k and v of one ring rank
        kv_hops, grad_hops = (ring - 1) * passes * m.n_layers, ring * m.n_layers
        hops = hop_factor * collective_parts("p2p", kv_hops * block * e, ring, bandwidth, latency, kv_hops)[0]
        grads = hop_factor * collective_parts("p2p", grad_hops * block * 4, ring, bandwidth, latency, grad_hops)[0]
        seconds += max(0.0, hops - overlap * attention_s) + grads
    return CPModeTime(mode, a2a, sum(parts.values()), seconds)


def cp_mode_options(m, cp: int, tp: int) -> list[tuple[str, int]]:
    """(mode, all-to-all degree) that parallel.cp = `cp` can run for model `m`: the ring always,
    Ulysses and each hybrid degree where the heads divide (config_rules._cp_mode_fits)."""
    heads, kv = _heads(m, tp)
    fits = lambda u: heads % u == 0 and (kv % u == 0 or u % kv == 0)  # noqa: E731
    options = [("ring", 1)]
    options += [("hybrid", u) for u in range(2, cp) if cp % u == 0 and fits(u)]
    return options + ([("ulysses", cp)] if fits(cp) else [])


def a2a_degree(m, cp: int, tp: int, mode: str, ulysses: int) -> int:
    """The all-to-all degree U `mode` runs (1: the ring); for 'auto', decided only when the run
    is built, the largest the heads allow (Ulysses' replicated key/value heads make it the one
    that saves the most: activations.cp_saved)."""
    if cp == 1:
        return 1
    if mode == "auto":
        return max(u for _, u in cp_mode_options(m, cp, tp))
    return cp_degrees(cp, mode, ulysses)[0]


def choose_cp_mode(m, tokens: int, cp: int, tp: int, e: int, recompute: str, bandwidth: float,
                   latency: float, attention_s: float = 0.0, overlap: float = 0.0,
                   hop_factor: float = 1.0) -> list[CPModeTime]:
    """Every mode cp can run, fastest first (ties: fewer bytes, then the ring's order above)."""
    times = [cp_mode_seconds(m, tokens, cp, tp, e, recompute, mode, u, bandwidth, latency,
                             attention_s, overlap, hop_factor) for mode, u in cp_mode_options(m, cp, tp)]
    return sorted(times, key=lambda t: (t.seconds, t.bytes))
