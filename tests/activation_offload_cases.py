"""Rank-side function for the activation offload tests (importable by spawned ranks)."""

from __future__ import annotations

import torch

import shardlm.parallel.blocks.activation as activation
from zero_cases import train_case


def offload_cases(rank: int, world_size: int, cases: list[dict], steps: int) -> list[dict]:
    """Each case trained `steps` steps with FORCE_HOST_COPY on (real host copies on this CPU
    device); with offload, also what the hooks packed, and whether a parameter was among it."""
    activation.FORCE_HOST_COPY = True
    torch.manual_seed(0)
    out = []
    packed_params: list[int] = []
    original = activation.ActivationOffload._pack

    def spy(self, t):  # a packed parameter would come back as a record, not the tensor itself
        packed = original(self, t)
        if not isinstance(packed, torch.Tensor):
            block = self.blocks[packed.record.block]
            own = {p.untyped_storage().data_ptr() for p in block.parameters()}
            packed_params.append(int(t.untyped_storage().data_ptr() in own))
        return packed

    activation.ActivationOffload._pack = spy
    try:
        for overrides in cases:
            packed_params.clear()
            result = train_case(overrides, steps)
            result["packed_params"] = sum(packed_params)
            result["packed"] = len(packed_params)
            out.append(result)
    finally:
        activation.ActivationOffload._pack = original
    return out
