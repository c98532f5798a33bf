"""Corpus -> byte-level BPE -> cached token stream -> deterministic, resumable batches;
chat / prompt-completion / seq2seq rows, tables, and packed documents (packed.py).

Imports config, launch, hardware and comm (the layers below it); models read its packed.py."""
