"""The peer loop: the plain PyTorch step a user would write (the anchor several benches time
shardlm against), started as shardlm's run starts: the same config, data slice and weights."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from shardlm.parallel.data.zero.optim import lr_at, set_lr


def reference_setup(overrides: dict, dp_rank: int, dp_size: int):
    """A torch reference side's start, as shardlm's run starts: (the validated config, shardlm's
    Loader over this data-parallel rank's slice of each global batch, the same model built
    whole from the same seed)."""
    from shardlm.config.load import load_config
    from shardlm.data.loader import Loader, build_dataset
    from shardlm.models.decoder import build_model

    cfg = load_config(overrides=overrides).validate()
    t = cfg.train
    torch.manual_seed(t.seed)
    dataset = build_dataset(cfg.data, cfg.model.vocab_size)
    loader = Loader(dataset.train, t.seq_len, t.micro_batch, grad_accum=t.grad_accum, seed=t.seed,
                    dp_rank=dp_rank, dp_size=dp_size)
    return cfg, loader, build_model(cfg.model, "cpu", seed=t.seed)


def adamw(groups, t) -> torch.optim.AdamW:
    """torch's fused AdamW at the run's settings (`t`: cfg.train)."""
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, fused=True)


def token_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every token, in fp32: (B, T, vocab) logits, (B, T) targets."""
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def mean_loss(loss, world: int) -> float:
    """A reference step's loss averaged over the ranks for the report, as shardlm's train_step does
    (one scalar all-reduce on both sides)."""
    import torch.distributed as dist

    total = loss.detach().reshape(1) / world
    dist.all_reduce(total)
    return float(total[0])


def peer_step(forward: Callable, optimizer, loader, t, step: int, world: int, clip: Callable,
              before_zero_grad: Callable | None = None) -> float:
    """One step as a torch user writes it (grad_accum 1): the scheduled learning rate, forward,
    loss, backward, `clip()`, optimizer step, `before_zero_grad()` (where given), zero_grad;
    the loss averaged over the `world` ranks."""
    set_lr(optimizer, lr_at(step, t))
    (x, y), = loader.micro_batches(step)
    loss = token_loss(forward(x), y)
    loss.backward()
    clip()
    optimizer.step()
    if before_zero_grad is not None:
        before_zero_grad()
    optimizer.zero_grad(set_to_none=True)
    return mean_loss(loss, world)
