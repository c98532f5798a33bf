"""Checkpoints. weights.py: a finished run's weights (model.safetensors + config + tokenizer),
what `generate` and `export` read. sharded.py: resumable sharded checkpoints of the whole
training state, written by every rank; reader.py reads them at any layout. manifest.py: what makes one
trustworthy before it is read (the manifest's own digest, confined file names, slices that tile
every tensor, `latest`, and the choice of the newest usable checkpoint). hf_names.py: our names <->
transformers'; peft_adapter.py: LoRA adapters in PEFT's format, and merged into the weights.
export.py: a run as a transformers directory. hf_dir.py: reading a transformers directory, and
its identity (tokenizer files, chat template, generation config, special-token ids) carried into
a run's hf_identity/ and written back, byte for byte, by every export. Imports every layer up to models."""
