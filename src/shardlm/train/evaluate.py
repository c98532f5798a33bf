"""`shardlm eval --checkpoint DIR`: a saved run's validation figures, in one process.

The run's weights (model.safetensors, as `shardlm generate` loads them) scored on the held-out
split its config describes — or another one: `--data.*` overrides (e.g. `--data.val_source=
test.parquet`) and `--train.eval_batches` / `--train.micro_batch` change what is scored, with the
run's own tokenizer. The figures are the training loop's (parallel/data/evaluation.py): the same
windows give the same val_loss, val_perplexity and val_token_accuracy as the run's last log line.
"""

from __future__ import annotations

from pathlib import Path

import torch

from shardlm.config.load import config_from_dict, flatten, typed_overrides
from shardlm.errors import ConfigError

EDITABLE = ("data.", "train.eval_batches", "train.micro_batch")
"""What an evaluation may change: anything else (the model, the sequence length) is the run's."""


def evaluate_checkpoint(path: str | Path, overrides: dict[str, str]) -> dict:
    """{'checkpoint', 'val_loss', 'val_perplexity', 'val_token_accuracy', 'val_targets',
    'val_rows'} of the run at `path` on its (or the overridden) validation split."""
    from shardlm.checkpoint.weights import load_for_inference
    from shardlm.config.fields import document_mask_on
    from shardlm.data.loader import build_dataset, eval_batches
    from shardlm.data.sft import template_for
    from shardlm.data.tokenizer import eot_id, hf_tokenizer
    from shardlm.launch.runtime import pick_device
    from shardlm.models.attention import choose_backend
    from shardlm.parallel.data.evaluation import metrics_of, token_sums

    fixed = sorted(k for k in overrides if not k.startswith(EDITABLE))
    if fixed:
        raise ConfigError(f"shardlm eval: {', '.join(fixed)} belong to the trained run; an "
                          f"evaluation may set data.* , train.eval_batches and train.micro_batch")
    device = pick_device("auto")
    model, tokenizer, saved = load_for_inference(path, device)
    cfg = config_from_dict({**flatten(saved.to_dict()), **typed_overrides(overrides)}).validate()
    if cfg.data.format == "seq2seq":
        raise ConfigError("shardlm eval scores decoder-only runs; a seq2seq run's validation loss "
                          "is in its metrics.jsonl")
    # The run's tokenizer and document separator: its checkpoint's eos, else our <|endoftext|>.
    given = (hf_tokenizer(cfg.model.hf_path, cfg.model.vocab_size) if cfg.model.hf_path
             else (tokenizer, eot_id(tokenizer)))
    t = cfg.train
    dataset = build_dataset(cfg.data, cfg.model.vocab_size, given, t.seq_len,  # chats as the run rendered them
                            chat_template=template_for(cfg.data.format, cfg.model.hf_path))
    documents = document_mask_on(cfg.data)  # the batches and attention the run trained with
    if hasattr(model, "attention_backend"):  # our Decoder (a transformers model runs its own)
        model.attention_backend = choose_backend(cfg.model.attention, device.type, documents, False)
    batches = eval_batches(dataset.val, t.seq_len, t.micro_batch, t.eval_batches, dataset.val_mask,
                           document_end=dataset.eot_id if documents else None)
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    rows = 0
    with torch.no_grad():
        for x, y in batches:
            sums += token_sums(model(x.to(device)), y.to(device))
            rows += len(y)
    return {"checkpoint": str(path), **metrics_of(sums.tolist()), "val_targets": int(sums[2]),
            "val_rows": rows}
