"""Activation checkpointing: trade recomputation in backward for activation memory.

"full" keeps only each block's input and recomputes the whole block in backward (Chen et al.
2016). "selective" (Korthikanti et al. 2022) keeps the outputs of the expensive ops, matmuls and
attention, and recomputes only the cheap element-wise ones (norms, activations, RoPE, residual
adds), so backward does no extra matmul FLOPs.

Each block gets torch's composable, non-reentrant `checkpoint` (forward pre/post hooks), not the
`checkpoint_wrapper` module: the wrapper inserts `_checkpoint_wrapped_module.` into every name the
parent's `named_parameters()` yields (only its `state_dict` hooks strip it), while the hooks leave
the module tree, parameter names and state_dict keys exactly as they were.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from shardlm.zero.units import unit_modules

logger = logging.getLogger("shardlm")

AC_MODES = ("none", "full", "selective")

_aten = torch.ops.aten
# Ops whose outputs "selective" keeps. `linear` decomposes to mm/addmm before dispatch, so it is
# listed only for backends that keep it whole. Attention ops vary by device; missing ones skipped.
_SAVE_OP_NAMES = (
    "mm", "addmm", "bmm", "linear",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)
SAVE_OPS = frozenset(getattr(_aten, name).default for name in _SAVE_OP_NAMES if hasattr(_aten, name))


def _save_matmuls_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Keep matmul and attention outputs; recompute everything else in backward."""
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_save_matmuls_policy)


def apply_ac(model: nn.Module, mode: str) -> nn.Module:
    """Checkpoint every layer in place ("none" | "full" | "selective"): the blocks of our
    models, the children of the largest nn.ModuleList of any other.

    Returns the same model object; with "none" nothing is touched.
    """
    if mode not in AC_MODES:
        raise ValueError(f"activation checkpoint mode {mode!r}; choose one of {', '.join(AC_MODES)}")
    if mode == "none":
        return model
    kwargs = {"context_fn": _selective_context} if mode == "selective" else {}
    blocks = [m for _, m in unit_modules(model)]  # our blocks, or any model's repeated layers
    for block in blocks:
        checkpoint(block, use_reentrant=False, **kwargs)
    logger.info("activation checkpointing: %s on %d blocks%s", mode, len(blocks),
                " (saving matmul and attention outputs)" if mode == "selective" else "")
    return model
