"""Other systems' launchers running shardlm's training: ray.py (Ray Train's TorchTrainer).

The top of the layers, beside cli: a module here may import anything in shardlm (it runs the
same per-rank entry as `shardlm train`, cli/train.py) and nothing in shardlm imports it; the
outside library it drives is imported only here, and only when used (an optional extra)."""
