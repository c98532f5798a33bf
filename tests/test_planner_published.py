"""Published training runs, each with its exact configuration and source, against the planner's
prediction for it (pure arithmetic, no processes; docs/planner.md, "Published runs").

One model for every row: no constant is set per row. A row the planner cannot hold within
TOLERANCE stays in the table as a known miss, with the reason; the test asserts the pass
fraction and that every miss is listed (and that nothing listed as a miss has started to pass
unnoticed).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from shardlm.config.model import ModelConfig
from shardlm.config.dims import ParallelDims
from shardlm.hardware.catalog import parse_cluster
from shardlm.planner.workload import Strategy, Workload
from shardlm.planner.timing import estimate_time
from shardlm.planner.workload import Dtypes

TOLERANCE = 0.20
PASS_FRACTION = 0.9
"""The issue's target: 27 of 29 rows within TOLERANCE today (the two misses and why are
KNOWN_MISSES)."""

MEGATRON = "Narayanan et al. 2021, Efficient Large-Scale Language Model Training on GPU Clusters"
TITAN = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"


def gpt3_shape(layers: int, hidden: int, heads: int) -> ModelConfig:
    """Megatron-LM's GPT models of the paper: GPT-2 blocks, vocabulary 51,200, sequence 2048."""
    return ModelConfig(preset=f"gpt {layers}x{hidden}", vocab_size=51200, n_layers=layers, n_heads=heads,
                       d_model=hidden, max_seq_len=2048)


LLAMA31_8B = ModelConfig(preset="llama-3.1-8b", vocab_size=128256, n_layers=32, n_heads=32, n_kv_heads=8,
                         d_model=4096, d_ff=14336, max_seq_len=8192, mlp="swiglu", norm="rmsnorm",
                         position="rope", bias=False, tie_embeddings=False)


@dataclass(frozen=True)
class Row:
    name: str
    source: str
    model: ModelConfig
    cluster: str
    tp: int
    pp: int
    zero: int
    micro_batch: int
    global_batch: int
    recompute: str
    compute: str
    published: float
    metric: str
    """'megatron_tflops': model FLOP/s per GPU by Megatron's formula (recomputation counted,
    eq. 3 of the paper: 96·B·s·l·h²·(1 + s/6h + V/16lh) per step); 'tokens_per_gpu'."""
    offload: tuple[tuple[str, str], ...] = ()
    """Strategy fields beyond the table's columns (offload tiers)."""
    reduce: str = "auto"
    """The gradient reduction dtype (torchtitan's FSDP default: mixed_precision_reduce fp32)."""


# Table 2: ZeRO-3 without model parallelism against PTD-P (t 8 x p 12 for 175B, t 8 x p 35 for
# 530B, micro-batch 1), for 175B (96 x 12288, 96 heads) and 530B (105 x 20480, 128 heads).
# The planner's GPU overlap (0.5) was chosen with the 175B ZeRO-3 rows in view; the 530B ones
# were not looked at until after: they are the out-of-sample check.
ZERO3 = [Row(f"megatron-zero3-{size}-{n}", f"{MEGATRON}, Table 2 (ZeRO-3 without model parallelism)",
             shape, f"{n}xA100-80GB", 1, 1, 3, mb, batch, "full", "fp16", tf, "megatron_tflops")
         for size, shape, n, mb, batch, tf in (
             ("175b", gpt3_shape(96, 12288, 96), 384, 4, 1536, 144),
             ("175b", gpt3_shape(96, 12288, 96), 768, 2, 1536, 88),
             ("175b", gpt3_shape(96, 12288, 96), 1536, 1, 1536, 44),
             ("530b", gpt3_shape(105, 20480, 128), 640, 4, 2560, 138),
             ("530b", gpt3_shape(105, 20480, 128), 1120, 2, 2240, 98),
             ("530b", gpt3_shape(105, 20480, 128), 2240, 1, 2240, 48))]

PTDP = [Row(f"megatron-ptdp-{size}-{n}", f"{MEGATRON}, Table 2 (PTD-P)", shape, f"{n}xA100-80GB", 8, pp, 0, 1,
            batch, "full", "fp16", tf, "megatron_tflops")
        for size, shape, pp, n, batch, tf in (
            ("175b", gpt3_shape(96, 12288, 96), 12, 384, 1536, 153),
            ("175b", gpt3_shape(96, 12288, 96), 12, 768, 1536, 149),
            ("175b", gpt3_shape(96, 12288, 96), 12, 1536, 1536, 141),
            ("530b", gpt3_shape(105, 20480, 128), 35, 560, 2240, 171),
            ("530b", gpt3_shape(105, 20480, 128), 35, 1120, 2240, 167),
            ("530b", gpt3_shape(105, 20480, 128), 35, 2240, 2240, 159))]

# Table 1 (weak scaling): size, heads, hidden, layers, tp, pp, GPUs, batch, TFLOP/s per GPU.
# Micro-batch 1 and the plain 1F1B schedule: the table gives neither (an assumption). Every
# Megatron row sends pipeline tensors with scatter/gather (section 4.1; on unless
# --no-scatter-gather-tensors-in-pipeline: Megatron-LM's arguments.py): predict() sets
# Strategy.pp_scatter_gather for them.
WEAK_SCALING = [Row(f"megatron-weak-{size}b", f"{MEGATRON}, Table 1", gpt3_shape(layers, h, heads),
                    f"{gpus}xA100-80GB", tp, pp, 0, 1, batch, "full", "fp16", tf, "megatron_tflops")
                for size, heads, h, layers, tp, pp, gpus, batch, tf in (
                    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
                    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
                    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
                    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
                    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
                    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163))]

# llama3_8b.toml at the benchmark's commit (9dec370 / 6b03ffa): seq 8192, selective AC 'op',
# no compile, no Float8; FSDP's mixed precision bf16 parameters, fp32 reduction (its default).
TORCHTITAN = [Row(f"torchtitan-llama3.1-8b-fsdp-{n}", f"{TITAN}, Table {table} (FSDP, no compile, no Float8)",
                  LLAMA31_8B, f"{n}xH100-80GB", 1, 1, 3, 2, 2 * n, "selective", "bf16", tps, "tokens_per_gpu",
                  reduce="fp32")
              for n, table, tps in ((8, 1, 5762), (128, 3, 5605))]

# Our own runtime on one GPU, measured: docs/gpu.md "Measured: NVIDIA H200 (2026-11-26)",
# bench/gpu_check.py's configurations: llama-1b (16 x 2048, GQA 32/8, SwiGLU 8192) with
# vocabulary 32,000 and a tied head, seq 2048, micro-batch 4, bf16, eager.
GPU_CHECK = "docs/gpu.md, Measured: NVIDIA H200 (bench/gpu_check.py)"
LLAMA_1B = ModelConfig(preset="llama-1b (gpu_check)", vocab_size=32000, n_layers=16, n_heads=32, n_kv_heads=8,
                       d_model=2048, d_ff=8192, max_seq_len=2048, mlp="swiglu", norm="rmsnorm", position="rope",
                       bias=False, tie_embeddings=True)
OWN_H200 = [Row(f"shardlm-h200-llama1b-{name}", f"{GPU_CHECK}, {run}", LLAMA_1B, "1xH200-141GB", 1, 1, zero, 4, 4,
                recompute, "bf16", tps, "tokens_per_gpu", offload)
            for name, run, zero, recompute, offload, tps in (
                ("plain", "run 3", 0, "none", (), 57754),
                ("recompute-full", "run 1", 0, "full", (), 46708),
                ("recompute-selective", "run 1", 0, "selective", (), 45652),
                ("activation-offload", "run 3", 0, "none", (("activation_offload", "cpu"),), 12943),
                ("zero3-cpu-optimizer", "run 1", 3, "none", (("offload_optimizer", "cpu"),), 17188))]

ROWS = ZERO3 + PTDP + WEAK_SCALING + TORCHTITAN + OWN_H200

KNOWN_MISSES = {
    "torchtitan-llama3.1-8b-fsdp-8": "+34%: the Grand Teton H100s run at a 500 W power limit with "
                                     "HBM2e (peak below the SXM datasheet's 989 TF, unpublished), and "
                                     "torchtitan's 'selective' (op) recomputes every second matmul, "
                                     "which our 'selective' does not",
    "shardlm-h200-llama1b-zero3-cpu-optimizer": "+69%: the host AdamW over 1.04B parameters took "
                                                "~0.33 s (~113 GB/s of its 36 B/parameter traffic) "
                                                "where the planner charges 0.06 s at the catalog's "
                                                "DGX H200 host (614 GB/s) plus 0.08 s of PCIe; the "
                                                "machine measured had 16 host cores, a slice of a "
                                                "node the catalog does not describe",
}


def megatron_flops_per_step(m: ModelConfig, batch: int, seq: int) -> float:
    l, h, v = m.n_layers, m.d_model, m.vocab_size
    return 96 * batch * seq * l * h * h * (1 + seq / (6 * h) + v / (16 * l * h))


def predict(row: Row) -> float:
    cluster = parse_cluster(row.cluster)
    n = cluster.world_size
    dp = n // (row.tp * row.pp)
    dims = ParallelDims.resolve(n, 1, dp, 1, row.tp, row.pp, 1)
    accum = row.global_batch // (row.micro_batch * dp)
    assert accum * row.micro_batch * dp == row.global_batch, row.name
    strategy = Strategy(dims, row.zero, row.micro_batch, accum, row.recompute, dtypes=Dtypes(row.compute, row.reduce),
                        sequence_parallel=False, pp_scatter_gather=row.source.startswith(MEGATRON),
                        **dict(row.offload))
    timing = estimate_time(Workload(row.model, row.model.max_seq_len, row.global_batch), strategy, cluster)
    if row.metric == "megatron_tflops":
        return megatron_flops_per_step(row.model, row.global_batch, row.model.max_seq_len) / timing.step / n / 1e12
    return timing.tokens_per_s / n


@pytest.fixture(scope="module")
def predictions() -> dict[str, float]:
    return {row.name: predict(row) for row in ROWS}


def test_published_rows_within_tolerance_or_listed(predictions):
    errors = {row.name: predictions[row.name] / row.published - 1 for row in ROWS}
    misses = {name for name, err in errors.items() if abs(err) > TOLERANCE}
    table = "\n".join(f"{name}: {predictions[name]:.1f} vs {row.published:g} ({errors[name]:+.0%})"
                      for name, row in ((r.name, r) for r in ROWS))
    assert misses <= set(KNOWN_MISSES), f"unlisted misses {misses - set(KNOWN_MISSES)}:\n{table}"
    assert set(KNOWN_MISSES) <= misses, f"listed misses now pass {set(KNOWN_MISSES) - misses}: update\n{table}"
    assert 1 - len(misses) / len(ROWS) >= PASS_FRACTION, table


def test_zero3_rows_fall_as_megatron_measured(predictions):
    """Megatron-LM's ZeRO-3 rows (a fixed global batch over 2x and 4x the GPUs: each GPU's compute
    halves, its gathers do not) all within tolerance, and falling with the GPU count."""
    for row in ZERO3:
        assert predictions[row.name] == pytest.approx(row.published, rel=TOLERANCE), row.name
    for size in ("175b", "530b"):
        falling = [predictions[row.name] for row in ZERO3 if f"-{size}-" in row.name]
        assert falling[0] > 1.4 * falling[1] > 1.4 * 1.4 * falling[2], size


# ---------------------------------------------------------------------------------------------
# Family shapes: a published run stated exactly (--params N --family ...)


def test_llama_405b_is_expressible_exactly():
    """Llama 3.1 405B (Meta's model card / config.json): 126 layers, h 16384, 128 heads with 8
    key/value heads, SwiGLU width 53,248, vocabulary 128,256, untied head; parameters counted
    here by hand: embeddings and head 2·V·h, per block attention h·(h + 2·kv·d) + h·h, the MLP
    3·h·f, two RMSNorms, and the final norm."""
    from shardlm.models.flops import count_params
    from shardlm.planner.shapes import model_from_params

    m = model_from_params(405e9, 126, 16384, 128, 128256, 8192, "llama", kv_heads=8, ffn=53248)
    assert (m.n_layers, m.d_model, m.n_heads, m.n_kv_heads, m.d_ff, m.vocab_size) == (
        126, 16384, 128, 8, 53248, 128256)
    assert (m.mlp, m.norm, m.position, m.bias, m.tie_embeddings) == ("swiglu", "rmsnorm", "rope", False, False)
    h, kv_width, f, v = 16384, 8 * 128, 53248, 128256
    block = h * (h + 2 * kv_width) + h * h + 3 * h * f + 2 * h
    assert count_params(m) == 2 * v * h + 126 * block + h == 405_853_388_800


def test_params_names_its_family_and_fits_the_count(capsys):
    from shardlm.cli.main import main
    from shardlm.models.flops import count_params
    from shardlm.planner.shapes import model_from_params

    for family, kv in (("gpt2", None), ("llama", 8), ("moe", 8)):
        m = model_from_params(70e9, family=family, kv_heads=kv)
        assert count_params(m) == pytest.approx(70e9, rel=0.03), family
        assert 90 <= m.d_model / m.n_layers <= 160, family  # h ~ 128 x L in every family
    assert model_from_params(1.3e9).n_layers == 24 and model_from_params(1.3e9).d_model == 2048  # GPT-3 XL
    assert model_from_params(47e9, family="moe").experts == 8
    main(["estimate", "--params", "7e9", "--gpus", "8xA100-80GB", "--zero-stage", "3"])
    assert "(GPT-2-family shape)" in capsys.readouterr().out
    main(["estimate", "--params", "8e9", "--family", "llama", "--kv-heads", "8", "--gpus", "8xA100-80GB",
          "--zero-stage", "3"])
    out = capsys.readouterr().out
    assert "(LLaMA-family shape)" in out and "32/8 kv heads" in out and "swiglu/rmsnorm/rope" in out
    assert main(["estimate", "--model", "llama-7b", "--family", "llama", "--gpus", "8xA100-80GB"]) == 2
    assert "--family go(es) with --params" in capsys.readouterr().err
    assert main(["estimate", "--params", "7e9", "--kv-heads", "8", "--gpus", "8xA100-80GB"]) == 2
    assert "--family llama" in capsys.readouterr().err


def test_megatron_scatter_gather_sends_a_tp_share_and_gathers_it():
    """Megatron-LM's scatter/gather (Strategy.pp_scatter_gather): 1/t of each boundary tensor
    crosses the nodes, then an all-gather over the tp group rebuilds it; without it (our
    runtime) every tp rank sends the whole tensor."""
    row = next(r for r in WEAK_SCALING if r.name == "megatron-weak-1008.0b")
    cluster = parse_cluster(row.cluster)
    n = cluster.world_size
    dims = ParallelDims.resolve(n, 1, n // (row.tp * row.pp), 1, row.tp, row.pp, 1)
    w = Workload(row.model, 2048, row.global_batch)

    def sends(scatter: bool):
        s = Strategy(dims, 0, 1, row.global_batch // dims.dp_size, "full", dtypes=Dtypes("fp16"),
                     sequence_parallel=False, pp_scatter_gather=scatter)
        return next(c for c in estimate_time(w, s, cluster).comms if c.name == "pipeline send/recv")

    whole, split = sends(False), sends(True)
    assert split.bytes == pytest.approx(whole.bytes / row.tp)
    assert len(split.terms) == 2 and "all-gathers over the tp group" in split.terms[1].name
    assert split.terms[0].seconds < whole.seconds / row.tp * 1.01  # 1/t over the same link
    assert 0 < split.terms[1].seconds < split.terms[0].seconds  # NVLink all-gather: cheaper
