"""Models: the GPT-2 / LLaMA decoder family, named presets, parameter and FLOP counts.

Import from the defining module: decoder.py (Decoder, build_model, generate: torch), flops.py
(count_params, flops_per_token: no torch, read by config and the planner), hf.py (the
transformers adapters). Also here: fp8.py and precision.py (the compute dtype's
autocast and loss scaler), quant.py (QLoRA's base), placement.py (where a rank's piece of a
parameter sits in the whole). Imports config, launch, hardware, comm, data.
"""
