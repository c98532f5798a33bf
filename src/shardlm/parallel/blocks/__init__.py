"""What is done to every block whatever the axes: activation checkpointing and activation
offload (activation.py), and regional compilation (compile.py: torch.compile per block).
No collectives of their own: they wrap blocks whose axes' collectives are elsewhere."""
