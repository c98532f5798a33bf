"""The predicted half of a study: the planner (shardlm.planner) at the real sizes on the named
cluster, and at the measured sizes on this CPU (the column that checks the planner against the
measurement). Pure arithmetic apart from this CPU's cached probe.
"""

from __future__ import annotations

from dataclasses import replace

from shardlm.config.model import ModelConfig
from shardlm.config.load import load_config
from shardlm.config.dims import ParallelDims
from shardlm.errors import ConfigError
from shardlm.hardware.catalog import Cluster, parse_cluster
from shardlm.planner.workload import Strategy, Workload
from shardlm.planner.memory import estimate_memory
from shardlm.planner.timing import estimate_time
from shardlm.planner.search import default_dtypes, predict_local
from shardlm.planner.shapes import preset_model
from shardlm.studies.points import MMAP_THRESHOLD, MiB, Point, largest_fitting
from shardlm.studies.specs import StrategySpec

ENCODER_DECODERS = {  # name: (encoder layers, decoder layers, d_model, heads, d_ff, vocab, parameters, tied)
    "mt5-base": (12, 12, 768, 12, 2048, 250112, 580e6, False),
    "mt5-large": (24, 24, 1024, 16, 2816, 250112, 1.2e9, False),
    "mt5-xl": (24, 24, 2048, 32, 5120, 250112, 3.7e9, False),
    "t5-11b": (24, 24, 1024, 128, 65536, 32128, 11e9, True),
    "mt5-xxl": (24, 24, 4096, 64, 10240, 250112, 13e9, False),
}
ENCODER_DECODER_NOTE = """T5 / mT5 shapes (Raffel et al. 2020 table 14; Xue et al. 2021 table 1: mT5 580M-13B, gated
GELU MLPs, untied 250k-token head). The planner has no encoder-decoder: each is planned as a
stack of encoder + decoder blocks of that width with the real parameter count (model states
exact; activations and FLOPs approximate: cross-attention's matmuls and keys/values are not
counted, encoder and decoder each see `seq` tokens). This study measures the decoder family
only: the encoder-decoder family is predicted, not measured (the trainer's seq2seq path,
model.hf_config with data.format = 'seq2seq', is not wired into the study yet)."""
"""ENCODER_DECODERS: T5 and mT5 shapes, and how the planner takes them."""

MOE_EXPERTS = 8


def model_of(name: str, seq: int) -> tuple[ModelConfig, float | None]:
    """(shape, Ψ when given exactly) of a preset or an ENCODER_DECODERS name."""
    if name in ENCODER_DECODERS:
        enc, dec, h, a, f, v, params, tied = ENCODER_DECODERS[name]
        model = ModelConfig(preset=f"{name} (as {enc}+{dec} blocks)", vocab_size=v, n_layers=enc + dec,
                            n_heads=a, n_kv_heads=a, d_model=h, d_ff=f, max_seq_len=seq, norm="rmsnorm",
                            position="rope", mlp="swiglu", bias=False, tie_embeddings=tied)
        return model, params
    return preset_model(name), None


def sized(cluster: Cluster, devices: int) -> Cluster:
    """The same device, node and links with `devices` devices (whole nodes beyond one)."""
    return parse_cluster(f"{devices}x{cluster.device.name}")


def predict(model: ModelConfig, params: float | None, seq: int, cluster: Cluster, strat: StrategySpec,
            micro: int, global_batch: int | None = None, degrees: dict | None = None,
            precision: str = "auto") -> dict:
    """One configuration on `cluster`: memory, fit, time, communication. `global_batch`
    (sequences) sets grad_accum for layouts with fewer data ranks; `degrees` the tp/pp/ep degrees
    at this scale (default: the strategy's own)."""
    deg = {"tp": strat.tp, "pp": strat.pp, "ep": strat.ep, **{k: v for k, v in (degrees or {}).items()
                                                            if getattr(strat, k) > 1}}
    if strat.moe:
        model = replace(model, experts=MOE_EXPERTS, top_k=2)
    world = cluster.world_size
    dims = ParallelDims.resolve(world, tp=deg["tp"], pp=deg["pp"], ep=deg["ep"])
    accum = max(1, (global_batch or micro * dims.dp_size) // (micro * dims.dp_size))
    workload = Workload(model, seq, micro * accum * dims.dp_size, params)
    strategy = Strategy(dims, strat.stage, micro, accum, "none", strat.offload_optimizer,
                        strat.offload_params, default_dtypes(cluster, precision))
    memory = estimate_memory(workload, strategy, cluster)
    timing = estimate_time(workload, strategy, cluster)
    return {"devices": world, "tp": deg["tp"], "pp": deg["pp"], "ep": deg["ep"], "stage": strat.stage,
            "micro_batch": micro, "grad_accum": accum, "seq": seq, "global_batch": workload.global_batch,
            "precision": strategy.dtypes.compute, "fits": memory.fits, "peak_bytes": memory.peak,
            "capacity_bytes": memory.capacity, "host_bytes_per_node": memory.host_per_node,
            "state_bytes": sum(memory.category(c) for c in ("parameters", "gradients", "optimizer states")),
            "tokens_per_s": timing.tokens_per_s, "mfu": timing.mfu, "hfu": timing.hfu,
            "step_s": timing.step, "comm_bytes": sum(c.bytes for c in timing.comms),
            "comm_exposed_s": timing.exposed_comm,
            "comm_share": timing.exposed_comm / timing.step if timing.step else 0.0}


def predicted_max_batch(model: ModelConfig, params: float | None, seq: int, cluster: Cluster,
                        strat: StrategySpec, limit: int, precision: str = "auto") -> tuple[int, dict | None]:
    """The largest micro-batch the planner fits on `cluster` (same search as the measured one),
    and its prediction (None when batch 1 does not fit)."""
    try:
        best, _ = largest_fitting(lambda b: predict(model, params, seq, cluster, strat, b,
                                                    precision=precision)["fits"], limit)
    except ConfigError:
        return 0, None
    return best, (predict(model, params, seq, cluster, strat, best, precision=precision) if best else None)


def predict_here(point: Point) -> dict:
    """The planner for a measured point, on this CPU with its ranks (docs/planner.md section 7:
    the cached probe): predicted peak process memory, model-state bytes, tokens/s."""
    settings = {k: v for k, v in point.overrides if not k.startswith("run.")}
    cfg = load_config(overrides=settings).validate()
    p = predict_local(cfg, point.ranks, MMAP_THRESHOLD)  # the allocator its run has
    return {"peak_rss_bytes": p.peak_process_bytes, "model_state_bytes": sum(p.model_state_bytes.values()),
            "tokens_per_s": p.tokens_per_s, "mfu": p.timing.mfu,
            "comm_bytes": sum(c.bytes for c in p.timing.comms)}


def predicted_here_max_batch(make_point, cap_mib: float, limit: int) -> int:
    """The largest micro-batch whose predicted peak on this CPU is under the cap."""
    return largest_fitting(lambda b: predict_here(make_point(b))["peak_rss_bytes"] <= cap_mib * MiB, limit)[0]


def rank_counts(cluster: Cluster, default: tuple[int, ...]) -> tuple[int, ...]:
    """Device counts to sweep: the spec's when they fit the cluster's node size, else one node,
    two, four ... up to the cluster."""
    if default and cluster.world_size in default:
        return default
    counts, n = [], cluster.node.per_node
    while n < cluster.world_size:
        counts.append(n)
        n *= 2
    return tuple(counts + [cluster.world_size])
