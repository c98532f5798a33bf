"""Models: the GPT-2 / LLaMA decoder family, named presets, parameter and FLOP counts."""

from shardlm.models.decoder import Decoder, build_model, generate
from shardlm.models.flops import count_params, flops_per_token

__all__ = ["Decoder", "build_model", "count_params", "flops_per_token", "generate"]
