"""bench_finetune.py's other side: an instruct checkpoint as a download has it (SmolLM2-135M-
Instruct's shape, random weights, a BPE trained on the chats, ChatML tokens and template), chats
from the standard library (a function's docstring as the answer), and the plain transformers +
peft loop a user would write instead of shardlm, fed the very batches shardlm trains on
(same_batches), its documents kept apart by a 4-D mask and per-document positions.
"""

from __future__ import annotations

import ast
import json
import sys
import sysconfig
from pathlib import Path

SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
                    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
          " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""The linears peft adapts: the same as shardlm's defaults (which fuse q/k/v and gate/up)."""


def chat_jsonl(path: Path, n: int) -> Path:
    """Up to `n` chats from the standard library's documented functions (file order,
    deterministic; ~2,700 there are); written once."""
    if path.exists():
        return path
    chats = []
    for file in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(file.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            doc = ast.get_docstring(node) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
            if doc and len(doc) > 40:
                question = f"What does `{node.name}` in the `{file.stem}` module do?"
                chats.append({"messages": [{"role": "system", "content": "You answer questions about Python."},
                                           {"role": "user", "content": question},
                                           {"role": "assistant", "content": doc}]})
        if len(chats) >= n:
            break
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(c) + "\n" for c in chats[:n]))
    return path


def instruct_checkpoint(directory: Path, chats: Path, shape: dict = SMOLLM2_135M, tokenizer_vocab: int = 8192) -> Path:
    """The checkpoint directory (built once; reused when its config.json is there)."""
    if (directory / "config.json").exists():
        return directory
    import torch
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [m["content"] for line in chats.open() for m in json.loads(line)["messages"]]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=tokenizer_vocab, special_tokens=SPECIALS,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                      pad_token="<|im_end|>", unk_token="<|endoftext|>", model_max_length=8192)
    fast.chat_template = CHATML
    directory.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(directory)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=2))
    model.generation_config = tf.GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model.save_pretrained(directory)
    return directory


def same_batches(cfg):
    """shardlm's train Loader for `cfg` (one rank), built as build_run builds it."""
    from shardlm.config.fields import document_mask_on
    from shardlm.data.loader import build_dataset
    from shardlm.data.loader import Loader
    from shardlm.data.sft import template_for
    from shardlm.data.tokenizer import hf_tokenizer

    t = cfg.train
    given = hf_tokenizer(cfg.model.hf_path, cfg.model.vocab_size)
    dataset = build_dataset(cfg.data, cfg.model.vocab_size, given, t.seq_len, (t.micro_batch * t.grad_accum, t.micro_batch),
                            template_for(cfg.data.format, cfg.model.hf_path))
    return Loader(dataset.train, seq_len=t.seq_len, micro_batch=t.micro_batch, grad_accum=t.grad_accum, seed=t.seed,
                  mask=dataset.train_mask, document_end=dataset.eot_id if document_mask_on(cfg.data) else None)


def plain_model(directory: str, dtype: str, rank: int, alpha: float, quantize: str):
    """from_pretrained + peft's LoRA, as a user writes it (QLoRA: bitsandbytes' 4-bit nf4)."""
    import torch
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    extra = {}
    if quantize == "nf4":
        extra["quantization_config"] = tf.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                             bnb_4bit_use_double_quant=True,
                                                             bnb_4bit_compute_dtype=dtype)
    model = tf.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation="sdpa", **extra)
    return get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=TARGETS))


def _document_mask(positions):
    """(B, 1, T, T) bool: key j visible from query i when both are in one document and j <= i."""
    import torch

    documents = (positions == 0).cumsum(-1)
    same = documents[:, :, None] == documents[:, None, :]
    causal = torch.ones(positions.shape[1], positions.shape[1], dtype=torch.bool).tril()
    return (same & causal)[:, None]


def loop_step(model, optimizer, batches, document_mask: bool) -> float:
    """One optimizer step over `batches` (shardlm's micro-batches): the summed cross-entropy of
    the counted targets over their number in the whole step (as shardlm normalises)."""
    import torch
    import torch.nn.functional as F

    counted = sum(int((y != -100).sum()) for _, y in batches)
    total = 0.0
    for x, y in batches:
        ids = x.ids if hasattr(x, "ids") else x
        kwargs = {}
        if document_mask and hasattr(x, "positions"):
            kwargs = {"attention_mask": _document_mask(x.positions), "position_ids": x.positions}
        logits = model(input_ids=ids, **kwargs).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum") / counted
        loss.backward()
        total += float(loss)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


if __name__ == "__main__":  # build the checkpoint and chats: python bench/finetune_loop.py DIR [N]
    root = Path(sys.argv[1])
    data = chat_jsonl(root / "chats.jsonl", int(sys.argv[2]) if len(sys.argv) > 2 else 2000)
    print(instruct_checkpoint(root / "smollm2-135m-shape", data))
