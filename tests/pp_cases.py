"""Rank-side functions for the pipeline tests (importable by spawned ranks)."""

from __future__ import annotations

from shardlm.config.load import load_config
from shardlm.train.build import build_run
from shardlm.train.step import sample_text, train_step


def sample_case(rank: int, world_size: int, overrides: dict, steps: int) -> str:
    """Train `steps` steps, then sample 20 tokens (every rank takes part)."""
    run = build_run(load_config(overrides=overrides).validate())
    for step in range(steps):
        train_step(run, step)
    return sample_text(run, "def ", 20)


def train_and_sample(overrides: dict, steps: int) -> dict:
    """Train `steps` steps: the losses and full fp32 parameters (as zero_cases.train_case), then
    sample 20 tokens from the same run (every rank takes part); with pp, the last step's
    messages as the executor posted them (Stage.posted)."""
    run = build_run(load_config(overrides=overrides).validate())
    losses = [train_step(run, step).loss for step in range(steps)]
    posted = list(run.schedule.stage.posted) if run.schedule is not None else []  # the last step's
    with run.strategy.full_parameters():
        params = {n: p.detach().float().cpu().clone() for n, p in run.model.named_parameters()}
    return {"losses": losses, "params": params, "sample": sample_text(run, "def ", 20), "posted": posted}


def cases_and_save(rank: int, world_size: int, cases: list[tuple[dict, int]], save: dict | None) -> list:
    """In one spawn: train_and_sample of each case, then ckpt_cases.train_run of `save` (a run
    writing checkpoints), if given."""
    import torch

    torch.manual_seed(0)
    return [*(train_and_sample(overrides, steps) for overrides, steps in cases),
            *([train_run(save)] if save else [])]


def train_run(overrides: dict) -> dict:
    """A whole `train` (its checkpoints, its evaluation at the last step): the losses, where it
    started, the run directory and the last evaluation's loss."""
    from shardlm.train.loop import train

    run = build_run(load_config(overrides=overrides).validate())
    result = train(run)
    return {"losses": result.losses, "start": run.start_step, "run_dir": str(run.run_dir),
            "val_loss": result.val_loss}


def pp_world(rank: int, world_size: int, sample: tuple[dict, int], train: list, runs: list) -> dict:
    """Several independent checks in one spawned world (one set of processes, not one per
    check): sample_case of `sample` first (as the first thing its process does, as when it had
    a world of its own), then zero_cases.train_cases of `train`, then a whole
    ckpt_cases.train_run (checkpoints and metrics written) of each overrides dict in `runs`."""
    import ckpt_cases
    from zero_cases import train_cases

    return {"sample": sample_case(rank, world_size, *sample), "train": train_cases(rank, world_size, train),
            "runs": [ckpt_cases.train_run(overrides) for overrides in runs]}
