"""Rank-side helpers for the transformers parity tests (importable by spawned ranks): tiny
models built from configs (no weights are downloaded), identically on every rank."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from shardlm.models.hf import CausalLMAdapter, Seq2SeqAdapter
from zero_cases import train_case

VOCAB = 512  # tests/conftest.py: tiny_overrides uses gpt-tiny's vocabulary
ATTN = "sdpa"  # the same attention kernel in every process, whatever the library would pick


def hf_model(name: str, device: str = "cpu") -> torch.nn.Module:
    """The adapted model, built under a fixed seed (on the CPU) or on the meta device for the
    sharded build. Dropout is 0: each process would draw its own masks, and the comparison is
    between processes."""
    with torch.device(device):
        return _hf_model(name)


def _hf_model(name: str) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    if name == "gpt2":
        config = tf.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                               bos_token_id=0, eos_token_id=0, attn_implementation=ATTN)
        return CausalLMAdapter(tf.GPT2LMHeadModel(config), VOCAB)
    if name == "llama":
        config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
                                attn_implementation=ATTN)
        return CausalLMAdapter(tf.LlamaForCausalLM(config), VOCAB)
    if name == "t5":
        config = tf.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                             num_heads=4, dropout_rate=0.0, attn_implementation=ATTN)
        return Seq2SeqAdapter(tf.T5ForConditionalGeneration(config), VOCAB)
    raise ValueError(name)


def reverse_jsonl(path: Path, n: int = 240) -> Path:
    """A data.format = 'seq2seq' file: short strings of a-f and their reversals."""
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(n):
            word = "".join(rng.choice("abcdef") for _ in range(rng.randint(3, 6)))
            f.write(json.dumps({"source": word, "target": word[::-1]}) + "\n")
    return path


def hf_train_cases(rank: int, world_size: int, cases: list[tuple[str, dict, int]]) -> list[dict]:
    return [train_case(overrides, steps, model=hf_model(name)) for name, overrides, steps in cases]


def hf_built(rank: int, world_size: int, cases: list[tuple[str, dict]]) -> list[dict]:
    """Each model built on the meta device, parallelized (the sharded build); its full
    parameters and buffers."""
    from shardlm.config.load import load_config
    from shardlm.train.build import build_run

    out = []
    for name, overrides in cases:
        run = build_run(load_config(overrides=overrides).validate(), model=hf_model(name, "meta"))
        with run.strategy.full_parameters():
            out.append({n: t.detach().float().clone() for n, t in
                        [*run.model.named_parameters(), *run.model.named_buffers()]})
    return out


# A checkpoint directory as a downloaded instruct model has it (SmolLM2-Instruct's layout): a
# tokenizer with added special tokens, a ChatML chat_template.jinja, generation_config.json and
# bos / eos / pad ids that are not 0.
INSTRUCT_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
          " + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\\n' }}{% endif %}")
INSTRUCT_REPLY = "Hi"
"""What `instruct_dir`'s model answers greedily to anything, then <|im_end|>."""
INSTRUCT_VOCAB = 320
INSTRUCT_CHATS = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
                  for q, a in (("Hello there", "Hi"), ("What is two plus two?", "Four."),
                               ("Name a colour.", "Blue."), ("Say yes.", "Yes."))]


def chat_bpe(chats: list[dict], specials: list[str]):
    """A byte-level BPE of 300 ids trained on `chats`' texts (any text decodes back to itself),
    with `specials` as its special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    texts = [m["content"] for chat in chats for m in chat["messages"]] + ["system user assistant"]
    tok.train_from_iterator(texts * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def instruct_dir(root: Path) -> Path:
    """A tiny LlamaForCausalLM saved by transformers with its tokenizer (save_pretrained of a
    PreTrainedTokenizerFast: tokenizer.json, tokenizer_config.json with added_tokens_decoder,
    chat_template.jinja; special_tokens_map.json as older hub models ship it),
    generation_config.json with a list of eos ids, and bos 1 / eos 2 / pad 2. Its weights make
    it a bigram model whose greedy reply to the generation prompt is INSTRUCT_REPLY and then
    <|im_end|>: the blocks add nothing (o_proj and down_proj zero), so the next token depends on
    the last one only, through the embedding and the head."""
    import transformers as tf

    tok = chat_bpe(INSTRUCT_CHATS, INSTRUCT_SPECIALS)
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>",
                                      eos_token="<|im_end|>", pad_token="<|im_end|>",
                                      unk_token="<|endoftext|>", model_max_length=2048)
    fast.chat_template = CHATML
    root.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(root)
    config = json.loads((root / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="PreTrainedTokenizerFast", clean_up_tokenization_spaces=False,
                  added_tokens_decoder={str(i): {"content": t, "lstrip": False, "normalized": False,
                                                 "rstrip": False, "single_word": False, "special": True}
                                        for i, t in enumerate(INSTRUCT_SPECIALS)})
    (root / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")  # as the hub's
    if not (root / "special_tokens_map.json").exists():
        (root / "special_tokens_map.json").write_text(json.dumps(
            {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
             "unk_token": "<|endoftext|>"}, indent=2) + "\n")
    config = tf.LlamaConfig(vocab_size=INSTRUCT_VOCAB, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                            pad_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config)
    ids = [fast.convert_tokens_to_ids(t) for t in fast.tokenize("\n" + INSTRUCT_REPLY)]
    chain = ids + [2]  # "\n" (the generation prompt's last token) -> the reply -> <|im_end|>
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight
        head = model.lm_head.weight
        head.mul_(0.01)
        for current, following in zip(chain, chain[1:]):
            head[following] = 10 * embed[current] / embed[current].norm()
    model.generation_config = tf.GenerationConfig(bos_token_id=1, eos_token_id=[2, 0], pad_token_id=2,
                                                  max_new_tokens=64)
    model.save_pretrained(root)
    return root
