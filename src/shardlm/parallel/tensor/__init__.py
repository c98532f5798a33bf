"""Tensor parallelism (Megatron-LM) and sequence parallelism: each block's weight matrices cut by
rows or columns over the tp group (decoder.py apply_tp for our Decoder, plan.py for a transformers
model's base_model_tp_plan), the layers that replace the model's own (layers.py, norms.py), and
the whole tensors put back together from pieces (pieces.py).

Collectives: over the tp group only, as torch custom ops in ops.py (all-reduce, the sequence's
all-gather and reduce-scatter), called from regions.py (Megatron's f / g and their sequence-
parallel forms), layers.py and norms.py; async_tp.py cuts them into pieces that overlap the
matmuls they feed."""
