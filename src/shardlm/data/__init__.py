"""Corpus -> byte-level BPE -> cached token stream -> deterministic, resumable batches;
chat / prompt-completion / seq2seq rows, tables, and packed documents (packed.py).

Imports config, launch, hardware and comm (the layers below it); models read its packed.py."""

from shardlm.data.corpus import corpus_files, fingerprint, iter_documents
from shardlm.data.loader import (Dataset, Loader, build_dataset, eval_batches,
                                 load_dataset)
from shardlm.data.tokenizer import EOT, load_tokenizer, train_tokenizer

__all__ = ["EOT", "Dataset", "Loader", "build_dataset", "corpus_files",
           "eval_batches", "fingerprint", "iter_documents", "load_dataset", "load_tokenizer",
           "train_tokenizer"]
