"""Rank-side functions for the checkpoint tests (importable by spawned ranks)."""

from __future__ import annotations

from pathlib import Path

import torch

from shardlm.checkpoint.sharded import CHECKPOINTS, step_dir_name
from shardlm.config.load import load_config
from shardlm.train.build import build_run
from shardlm.train.loop import train


def base_overrides(tmp_path, **extra) -> dict:
    """The checkpoint tests' run: llama-tiny, micro-batch 4, one evaluation batch."""
    from conftest import tiny_overrides

    return tiny_overrides(tmp_path, **{"model__preset": "llama-tiny", "train__micro_batch": 4,
                                       "train__eval_batches": 1, **extra})


def train_run(overrides: dict) -> dict:
    """A whole `train` (with its checkpoints); the losses of the steps it ran, where it
    started, and the final parameters as fp32."""
    run = build_run(load_config(overrides=overrides).validate())
    result = train(run)
    with run.strategy.full_parameters():
        params = {n: p.detach().float().cpu().clone() for n, p in run.model.named_parameters()}
    return {"losses": result.losses, "start": run.start_step, "params": params,
            "run_dir": str(run.run_dir), "stall": [s.stall_s for s in result.saves]}


def checkpoint_of(run_dir: str, step: int) -> str:
    return str(Path(run_dir) / CHECKPOINTS / step_dir_name(step))


def straight_and_resumed(rank: int, world_size: int, cases: list[tuple[str, dict, int]]) -> list:
    """Per case: 2n steps saving at n, then a second run resuming from that checkpoint."""
    torch.manual_seed(0)
    out = []
    for name, overrides, n in cases:
        base = {**overrides, "train.steps": 2 * n}
        straight = train_run({**base, "checkpoint.every": n, "run.name": f"{name}-straight"})
        resumed = train_run({**base, "run.name": f"{name}-resumed",
                             "checkpoint.resume": checkpoint_of(straight["run_dir"], n)})
        out.append((straight, resumed))
    return out


def train_ranks(rank: int, world_size: int, overrides: dict) -> dict:
    return train_run(overrides)


# -- synthetic checkpoints: the real writer and reader on a few small tensors, no model -----------

SHAPES = {"model/emb": (8, 6), "model/norm": (6,), "model/head": (5, 6),
          "optim/exp_avg/emb": (8, 6), "optim/exp_avg_sq/emb": (8, 6)}


def synthetic_state(step: int) -> dict[str, torch.Tensor]:
    """The tensors a synthetic checkpoint of `step` holds (distinct per step and tensor)."""
    gen = torch.Generator().manual_seed(step)
    return {name: torch.randn(shape, generator=gen) for name, shape in SHAPES.items()}


def synthetic_slices(values: dict[str, torch.Tensor], rank: int, world_size: int) -> list:
    """`rank`'s ZeRO-like contiguous share of every flattened tensor (views of `values`)."""
    from shardlm.checkpoint.sharded import StateSlice

    slices = []
    for name, t in values.items():
        flat = t.reshape(-1)
        share = -(-flat.numel() // world_size)
        lo, hi = min(rank * share, flat.numel()), min((rank + 1) * share, flat.numel())
        if lo < hi:
            slices.append(StateSlice(name, tuple(t.shape), lo, hi, flat[lo:hi]))
    return slices


def synthetic_save(root: Path, step: int, world_size: int = 2, keep: int = 3, session: str = "s",
                   values: dict[str, torch.Tensor] | None = None):
    """Save `step` as `world_size` ranks would (each its ZeRO-like contiguous share of every
    flattened tensor), synchronously; the rank writers are returned (rank 0 last)."""
    from shardlm.checkpoint.sharded import CheckpointWriter

    values = synthetic_state(step) if values is None else values
    writers = []
    for rank in reversed(range(world_size)):  # rank 0 last: it publishes once every note is there
        writer = CheckpointWriter(root, rank, world_size, keep, False, session, timeout_s=5.0)
        slices = synthetic_slices(values, rank, world_size)
        writer.save(step, slices, True, {"step": step, "marker": f"state of {step}"},
                    {"rng": f"rank {rank}"}, {"config": {"seed": step}, "layout": {"world_size": world_size}})
        writers.append(writer)
    return writers


def load_synthetic(ckpt: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(manifest, every tensor of SHAPES read whole) through the real reader."""
    from shardlm.checkpoint.sharded import read_manifest
    from shardlm.checkpoint.reader import CheckpointReader

    manifest = read_manifest(ckpt)
    reader = CheckpointReader(ckpt, manifest)
    out = {}
    for name, shape in SHAPES.items():
        numel = torch.Size(shape).numel()
        flat = torch.full((numel,), float("nan"))
        reader.read_range(name, shape, 0, numel, flat)
        out[name] = flat.view(shape)
    return manifest, out


def same_state(loaded: dict[str, torch.Tensor], step: int) -> bool:
    expected = synthetic_state(step)
    return all(torch.equal(loaded[n], expected[n]) for n in SHAPES)


def ranks_agree_on_resume(rank: int, world_size: int, run_dir: str) -> dict:
    """On each of 2 ranks, over `run_dir`'s synthetic checkpoints (steps 1-3 saved by 2 ranks;
    step 3's rank-00001 file corrupt, its size unchanged): what resume_source chooses — rank 1
    is made to see no usable checkpoint, which must not matter: rank 0 chooses — and what
    load_slices does with steps 3 and 2 in each reader mode (a rank's failure to read must be
    every rank's error; a load that succeeds must hold exactly what was saved)."""
    import contextlib
    from unittest import mock

    from shardlm.checkpoint.sharded import CheckpointError

    from shardlm.checkpoint.reader import load_slices
    from shardlm.launch.runtime import Runtime
    from shardlm.train.checkpointing import resume_source

    runtime = Runtime(rank, world_size, rank, world_size, torch.device("cpu"), "gloo")
    out = {}

    def unusable(*args, **kwargs):
        raise CheckpointError(f"rank {rank} sees no usable checkpoint")

    blind = mock.patch("shardlm.train.checkpointing.newest_usable", unusable)
    with blind if rank == 1 else contextlib.nullcontext():
        try:
            choice = resume_source(load_config(overrides={"checkpoint.resume": "auto"}),
                                   Path(run_dir), runtime)
            out["choice"] = str(choice)
        except CheckpointError as e:
            out["choice"] = f"error: {e}"
    for readers in ("all", "one"):
        for step in (3, 2):
            unset = {n: torch.full(shape, float("nan")) for n, shape in SHAPES.items()}
            slices = synthetic_slices(unset, rank, world_size)
            ckpt = Path(run_dir) / CHECKPOINTS / step_dir_name(step)
            try:
                load_slices(ckpt, slices, runtime, readers)
            except CheckpointError as e:
                out[f"{readers} {step}"] = f"error: {e}"
                continue
            expected = synthetic_state(step)
            exact = all(torch.equal(s.tensor, expected[s.name].reshape(-1)[s.start:s.end])
                        for s in slices)
            out[f"{readers} {step}"] = "loaded" if exact else "loaded wrong"
    return out
