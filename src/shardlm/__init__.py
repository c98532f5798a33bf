"""shardlm: train language models efficiently on one device or many."""

__version__ = "0.1.0"
