"""Regional compilation: torch.compile each transformer block, not the whole model.

Every block of a decoder has the same code, so Dynamo traces the first block once and the others
reuse its graph (the parameters are graph inputs, not constants): compile time stays that of one
block however deep the model is (torchtitan's apply_compile does the same).

What is compiled is the block's `forward`, not the module's call: the module's forward hooks run
outside the compiled region, as in eager. That is where the strategies live — ZeRO-3's gather
and free of a unit's flat parameters (parallel/data/zero/params.py: a collective and a storage resize, which
Dynamo would not trace) and activation checkpointing's hooks (parallel/blocks/activation.py). The
compiled forward sees ordinary parameters; whether their storage was just refilled is invisible
to it. (`nn.Module.compile()` compiles `_call_impl`, hooks included, so it is not used.)
Selective checkpointing is the exception: its policy picks aten ops, so apply_ac puts the
checkpoint inside the forward compiled here, and the compiler keeps what the policy keeps.

A block with a mixture of experts compiles its attention, router and experts (their grouped
matmuls are one custom op: models/expert_matmul.py) and leaves the dispatch between them eager:
how many rows each expert receives is data, and under expert parallelism an all-to-all with
those splits moves them.

Our blocks are compiled with fullgraph=True: a graph break inside a block is an error at the
first step, never a silent split into smaller graphs (tests/test_compile.py holds the count at
zero). Any other model's repeated layers are compiled without it: their code is not ours.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from shardlm.models.decoder import Block
from shardlm.models.moe import MoE
from shardlm.parallel.data.zero.units import unit_modules

log = logging.getLogger("shardlm")


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far (Dynamo's frame compiles, forward, plus
    AOTAutograd's backward compiles): read before and after the first step, the difference is
    what compilation cost that step."""
    spent = torch._dynamo.utils.calculate_time_spent()
    return spent.get("entire_frame_compile", 0.0) + spent.get("entire_backward_compile", 0.0)


def apply_compile(model: nn.Module, enabled: bool) -> nn.Module:
    """Replace each block's forward by its compiled version, in place; returns the model.

    The blocks are ours (fullgraph) or, for any other model, the children of its largest
    nn.ModuleList (the ZeRO units): the same set activation checkpointing wraps."""
    if not enabled:
        return model
    blocks = [block for _, block in unit_modules(model)]
    if not blocks:
        raise ValueError(f"train.compile: no repeated blocks found in {type(model).__name__} to compile; "
                         f"set train.compile = false")
    for block in blocks:
        # An instance attribute shadows the class's forward; nn.Module.__call__ still runs the
        # hooks around it, eagerly.
        mlp = getattr(block, "mlp", None)
        if isinstance(block, Block) and isinstance(mlp, MoE):
            # A mixture of experts' dispatch has data-dependent shapes (how many rows each expert
            # gets, an expert-parallel all-to-all's splits): it stays eager between compiled parts
            # — the attention, the router and the experts' grouped matmuls (models/expert_matmul.py),
            # each one graph (fullgraph), the block's own hooks around them as for any block.
            for part in (block.attn, mlp.router, mlp.experts) + ((mlp.shared,) if mlp.shared is not None else ()):
                part.forward = torch.compile(part.forward, fullgraph=True)
            continue
        block.forward = torch.compile(block.forward, fullgraph=isinstance(block, Block))
    log.info("compile: torch.compile on each of %d blocks (regional; %s), hooks kept eager",
             len(blocks), "fullgraph" if isinstance(blocks[0], Block) else "graph breaks allowed")
    return model
