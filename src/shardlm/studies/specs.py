"""The studies as data: which model, strategies, batches and steps each one measures on this
machine, and which model, sequence and cluster it predicts at full size. `--quick` picks the
QUICK variant (seconds per point, used in tests); the full variant is what docs/studies/ shows.

A strategy is named once here with both of its faces: the `shardlm train` settings that run it
here and the planner degrees that predict it on a cluster.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StrategySpec:
    label: str
    settings: dict
    """`shardlm train` overrides (measured, on this machine's ranks)."""
    stage: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    offload_optimizer: str = "none"
    offload_params: str = "none"
    moe: bool = False
    """Runs the mixture-of-experts variant of the model (experts = 4 here, 8 predicted)."""
    note: str = ""


def _stage(stage: int, label: str, **extra) -> StrategySpec:
    return StrategySpec(label, {"parallel.zero_stage": stage, **extra}, stage)


STRATEGIES = {
    "ddp": _stage(0, "DDP (ZeRO-0)"),
    "zero1": _stage(1, "ZeRO-1"),
    "zero2": _stage(2, "ZeRO-2"),
    "zero3": _stage(3, "ZeRO-3"),
    "zero3-keep": StrategySpec("ZeRO-3, no reshard", {"parallel.zero_stage": 3,
                                                      "parallel.reshard_after_forward": False}, 3,
                               note="parameters stay gathered from forward to backward (FSDP "
                                    "SHARD_GRAD_OP-like); the planner assumes reshard"),
    "fsdp": StrategySpec("FSDP-style reshard", {"parallel.zero_stage": 3,
                                                "parallel.reshard_after_forward": True}, 3,
                         note="ZeRO-3 freeing each unit's gathered parameters after its forward "
                              "and gathering them again for backward (FSDP FULL_SHARD)"),
    "tp": StrategySpec("tensor parallel", {"parallel.zero_stage": 1, "parallel.tp": 2}, 1, tp=2,
                       note="Megatron-LM column/row linears; ZeRO-1 over the data ranks left"),
    "pp": StrategySpec("pipeline parallel", {"parallel.zero_stage": 1, "parallel.pp": 2}, 1, pp=2,
                       note="1F1B over the global batch's micro-batches; ZeRO-1 over the data ranks left"),
    "ep": StrategySpec("expert parallel", {"parallel.zero_stage": 1, "parallel.ep": 2}, 1, ep=2,
                       moe=True, note="the mixture-of-experts variant of the model (top-2)"),
    "zero3-cpu": StrategySpec("ZeRO-3 + CPU offload", {"parallel.zero_stage": 3,
                                                       "zero.offload_optimizer": "cpu",
                                                       "zero.offload_params": "cpu"}, 3,
                              offload_optimizer="cpu", offload_params="cpu"),
    "zero3-nvme": StrategySpec("ZeRO-3 + NVMe offload", {"parallel.zero_stage": 3,
                                                         "zero.offload_optimizer": "nvme",
                                                         "zero.offload_params": "nvme",
                                                         "zero.nvme_chunk_mb": 4}, 3,
                               offload_optimizer="nvme", offload_params="nvme",
                               note="4 MiB chunks: the streaming buffers stay small beside a small model"),
}


@dataclass(frozen=True)
class Measured:
    """The half run here: a small model at sizes this machine trains in seconds to minutes."""

    model: dict
    """model.* keys, train.seq_len, data.max_bytes."""
    steps: int
    micro_batch: int = 4
    ranks: tuple[int, ...] = (2,)


@dataclass(frozen=True)
class Predicted:
    """The half predicted by the planner at the real size."""

    model: str
    """A preset (`shardlm presets`) or a name in studies.predict.ENCODER_DECODERS."""
    seq: int
    cluster: str
    micro_batch: int = 4
    precision: str = "auto"


@dataclass(frozen=True)
class Study:
    name: str
    title: str
    question: str
    strategies: tuple[str, ...]
    measured: Measured
    predicted: Predicted
    cap_mib: float = 0.0
    """max-batch, offload-rescue: the per-rank memory cap the measured search holds the rank-0
    process's peak RSS to (MiB)."""
    max_batch: int = 64
    """The largest micro-batch the measured search tries."""
    epoch_tokens: float = 0.0
    """Tokens in one epoch, for time per epoch (measured: this many tokens here)."""
    predicted_epoch_tokens: float = 0.0
    sizes: tuple[str, ...] = ()
    """zero-sweep: the measured model presets; scaling: unused."""
    predicted_sizes: tuple[str, ...] = ()
    encoder_decoder_sizes: tuple[str, ...] = ()
    predicted_ranks: tuple[int, ...] = ()
    degrees: dict = field(default_factory=dict)
    """strategies: tp / pp / ep degrees at cluster scale (measured: 2 each)."""


_TINY = {"model.preset": "gpt-tiny", "train.seq_len": 32, "data.max_bytes": 400_000}
_MINI = {"model.preset": "gpt-mini", "train.seq_len": 32, "data.max_bytes": 2_000_000}
_MINI_LONG = {"model.preset": "gpt-mini", "train.seq_len": 128, "data.max_bytes": 4_000_000}
_SMALL = {"model.preset": "gpt-mini", "model.d_model": 512, "model.n_heads": 8, "train.seq_len": 128,
          "data.max_bytes": 4_000_000}
"""17M parameters (gpt-mini at width 512): model states large enough beside the activations for
the ZeRO stages to differ by many sequences, a step short enough on two cores."""

_MAX_BATCH = dict(name="max-batch", title="Largest micro-batch under a memory cap: DDP vs ZeRO stages",
                  question="How large a micro-batch does each ZeRO stage fit under a per-rank memory "
                           "cap, and how long is an epoch at it?",
                  strategies=("ddp", "zero1", "zero2", "zero3"))
_OFFLOAD = dict(name="offload-rescue", title="Offload rescue: a model that does not fit at batch 1",
                question="A model that neither DDP nor ZeRO-3 holds at batch 1 under the cap: does "
                         "ZeRO-3 with CPU or NVMe offload train it, and at what batch?",
                strategies=("ddp", "zero3", "zero3-cpu", "zero3-nvme"))
_SWEEP = dict(name="zero-sweep", title="ZeRO stages x model sizes x ranks",
              question="Memory per rank, tokens/s, communication and MFU of each ZeRO stage, "
                       "for a decoder family and a T5-shaped encoder-decoder family.",
              strategies=("ddp", "zero1", "zero2", "zero3"))
_STRATEGIES = dict(name="strategies", title="Strategies on one model and batch",
                   question="DDP, ZeRO-1/2/3, FSDP-style reshard, tensor, pipeline and expert "
                            "parallelism on the same model and global batch: memory, speed, "
                            "communication.",
                   strategies=("ddp", "zero1", "zero2", "zero3-keep", "fsdp", "tp", "pp", "ep"))
_SCALING = dict(name="scaling", title="Weak and strong scaling",
                question="Throughput and MFU against the number of ranks, with the global batch "
                         "growing with the ranks (weak) or fixed (strong), and the share of the "
                         "step spent communicating.",
                strategies=("zero2",))

FULL = {
    "max-batch": Study(**_MAX_BATCH, measured=Measured(_SMALL, steps=2), cap_mib=660,
                       max_batch=16, epoch_tokens=1e7, predicted_epoch_tokens=1e9,
                       predicted=Predicted("gpt2-350m", 1024, "8xV100-16GB")),
    "offload-rescue": Study(**_OFFLOAD, measured=Measured(_SMALL, steps=2), cap_mib=500,
                            max_batch=16, predicted=Predicted("gpt2-1.5b", 1024, "1xV100-16GB"),
                            epoch_tokens=1e7, predicted_epoch_tokens=1e9),
    "zero-sweep": Study(**_SWEEP, measured=Measured(_MINI, steps=3, ranks=(1, 2)),
                        sizes=("gpt-tiny", "gpt-mini"),
                        predicted=Predicted("", 512, "4x8xV100-32GB", micro_batch=4),
                        predicted_sizes=("gpt2-350m", "gpt2-774m", "gpt2-1.5b", "gpt2-2.7b", "llama-7b"),
                        encoder_decoder_sizes=("mt5-base", "mt5-large", "mt5-xl", "t5-11b", "mt5-xxl"),
                        predicted_ranks=(8, 16, 32)),
    "strategies": Study(**_STRATEGIES, measured=Measured(_MINI_LONG, steps=3, micro_batch=4),
                        predicted=Predicted("gpt2-2.7b", 1024, "8xA100-80GB", micro_batch=4),
                        degrees={"tp": 8, "pp": 4, "ep": 8}),
    "scaling": Study(**_SCALING, measured=Measured(_MINI_LONG, steps=3, micro_batch=4),
                     predicted=Predicted("gpt2-1.5b", 1024, "8xA100-80GB", micro_batch=4),
                     predicted_ranks=(8, 16, 32, 64, 128, 256, 512, 1024)),
}

QUICK = {
    # The two ends of the ladder only: each probe is a 2-rank launch (the full study has all four).
    "max-batch": Study(**{**_MAX_BATCH, "strategies": ("ddp", "zero3")}, measured=Measured(_MINI, steps=2),
                       cap_mib=425, max_batch=2,
                       epoch_tokens=1e6, predicted_epoch_tokens=1e9,
                       predicted=Predicted("gpt2-350m", 1024, "8xV100-16GB")),
    "offload-rescue": Study(**_OFFLOAD, measured=Measured(_MINI, steps=2), cap_mib=390, max_batch=2,
                            predicted=Predicted("gpt2-1.5b", 1024, "1xV100-16GB"),
                            epoch_tokens=1e6, predicted_epoch_tokens=1e9),
    "zero-sweep": Study(**_SWEEP, measured=Measured(_TINY, steps=2), sizes=("gpt-tiny",),
                        predicted=Predicted("", 512, "2x8xV100-32GB", micro_batch=4),
                        predicted_sizes=("gpt2-350m", "gpt2-1.5b"),
                        encoder_decoder_sizes=("mt5-base", "mt5-xl"), predicted_ranks=(8, 16)),
    "strategies": Study(**_STRATEGIES, measured=Measured(_TINY, steps=2, micro_batch=4),
                        predicted=Predicted("gpt2-2.7b", 1024, "8xA100-80GB", micro_batch=4),
                        degrees={"tp": 8, "pp": 4, "ep": 8}),
    "scaling": Study(**_SCALING, measured=Measured(_TINY, steps=2, micro_batch=4),
                     predicted=Predicted("gpt2-1.5b", 1024, "8xA100-80GB", micro_batch=4),
                     predicted_ranks=(8, 64, 1024)),
}

NAMES = tuple(FULL)
