"""data.format = chat with model.hf_path's own chat template: found as transformers finds it,
rendered by transformers' apply_chat_template, loss on the assistant turns only (the template's
{% generation %} markers, else spans found by rendering prefixes), recorded in the run; ours only
where the directory has none; a template that cannot be split is a clear error."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from shardlm.config.schema import DataConfig
from shardlm.data.loader import build_dataset
from shardlm.data.loader import _windows
from shardlm.data.sft import (DEFAULT_RECORD, IGNORE, check_chat_template, find_chat_template,
                              template_for)
from shardlm.errors import ConfigError
from test_sft_data import CHATS as SFT_CHATS

transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer  # noqa: E402

SEQ = 96
VOCAB = 384
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>",
            "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
EOS = 0  # config.json's eos_token_id: <|endoftext|> separates the packed examples

CHATS = SFT_CHATS[:3]  # a system turn, two turns, one turn

# Qwen2 / ChatML as published (without its default system message).
CHATML = ("{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
          " + '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\\n' }}{%- endif %}")
# The same with the assistant's output marked, as TRL's assistant-only-loss templates do.
CHATML_MARKED = ("{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
                 "{%- if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + "
                 "'<|im_end|>' }}{% endgeneration %}{{ '\\n' }}{%- else %}{{ message['content'] + "
                 "'<|im_end|>\\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}"
                 "{{ '<|im_start|>assistant\\n' }}{%- endif %}")
# Meta-Llama-3-8B-Instruct's tokenizer_config.json chat_template, verbatim.
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim"
          " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
          "{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant"
          "<|end_header_id|>\\n\\n' }}{% endif %}")
# Qwen3-style: earlier assistant turns lose their reasoning once a later turn follows, so a
# turn's rendering changes with what comes after it (prefixes not stable).
DROPS_REASONING = ("{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
                   "{%- if message['role'] == 'assistant' and not loop.last %}"
                   "{{ message['content'].split('</think>')[-1] }}{%- else %}{{ message['content'] }}"
                   "{%- endif %}{{ '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}"
                   "{{ '<|im_start|>assistant\\n' }}{%- endif %}")
END = {"chatml": "<|im_end|>", "chatml_marked": "<|im_end|>", "llama3": "<|eot_id|>"}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """A byte-level BPE (any text decodes back to itself) with the templates' special tokens."""
    from hf_cases import chat_bpe

    return chat_bpe(CHATS, SPECIALS)


def _tokenizer_dir(root: Path, tok: Tokenizer, template: str | list | None = None,
                   jinja: str | None = None) -> Path:
    """A transformers tokenizer directory (AutoTokenizer loads it) with a config.json's eos."""
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
              "eos_token": {"content": "<|endoftext|>", "__type": "AddedToken"}}
    if template is not None:
        config["chat_template"] = template
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (root / "chat_template.jinja").write_text(jinja)
    if not (root / "config.json").exists():  # (a saved model's own config.json has its eos)
        (root / "config.json").write_text(json.dumps({"eos_token_id": EOS}))
    return root


def _build(tmp_path: Path, directory: Path, tok: Tokenizer, chats: list = CHATS, repeat: int = 2):
    tmp_path.mkdir(parents=True, exist_ok=True)
    src = tmp_path / "chat.jsonl"
    src.write_text("".join(json.dumps(c) + "\n" for _ in range(repeat) for c in chats))
    cfg = DataConfig(source=str(src), format="chat", cache_dir=str(tmp_path / "cache"), val_fraction=0.0)
    return build_dataset(cfg, VOCAB, (tok, EOS), SEQ, chat_template=template_for("chat", str(directory)))


def _rows(ds) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = np.asarray(ds.train)
    return _windows(tokens, np.arange(len(tokens) // (SEQ + 1)), SEQ, np.asarray(ds.train_mask))


def test_template_is_found_where_transformers_finds_it(tmp_path, tokenizer):
    plain = _tokenizer_dir(tmp_path / "plain", tokenizer)
    assert find_chat_template(plain) is None and template_for("chat", str(plain)) is None
    one = find_chat_template(_tokenizer_dir(tmp_path / "one", tokenizer, CHATML))
    assert one.text == CHATML and one.source.endswith("tokenizer_config.json chat_template")
    assert one.special_tokens == {"bos_token": "<|begin_of_text|>", "eos_token": "<|endoftext|>"}
    named = find_chat_template(_tokenizer_dir(tmp_path / "named", tokenizer, [
        {"name": "tool_use", "template": LLAMA3}, {"name": "default", "template": CHATML_MARKED}]))
    assert named.text == CHATML_MARKED and named.name == "default" and named.generation_markers
    jinja = find_chat_template(_tokenizer_dir(tmp_path / "jinja", tokenizer, CHATML, jinja=LLAMA3))
    assert jinja.text == LLAMA3 and jinja.source.endswith("chat_template.jinja")  # the file wins
    assert template_for("prompt_completion", str(tmp_path / "jinja")) is None
    for directory in ("one", "named", "jinja"):  # the template transformers itself loads
        loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / directory).chat_template
        assert (loaded["default"] if isinstance(loaded, dict) else loaded) == \
            find_chat_template(tmp_path / directory).text
    _tokenizer_dir(tmp_path / "nodefault", tokenizer, [{"name": "tool_use", "template": LLAMA3}])
    with pytest.raises(ConfigError, match="named chat templates tool_use but none named 'default'"):
        find_chat_template(tmp_path / "nodefault")


@pytest.mark.parametrize("name", ["chatml", "chatml_marked", "llama3"])
def test_loss_only_on_the_assistant_turns_as_the_template_renders_them(tmp_path, tokenizer, name):
    template = {"chatml": CHATML, "chatml_marked": CHATML_MARKED, "llama3": LLAMA3}[name]
    directory = _tokenizer_dir(tmp_path / name, tokenizer, template)
    ds = _build(tmp_path, directory, tokenizer)
    _, y = _rows(ds)
    kept = tokenizer.decode(y[y != IGNORE].tolist(), skip_special_tokens=False)
    assistant = [m["content"] for chat in CHATS for m in chat["messages"] if m["role"] == "assistant"]
    assert kept == "".join(a + END[name] for a in assistant) * 2  # each turn and its end, nothing else
    # The inputs are transformers' own rendering of each conversation, examples joined in order.
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    rendered = "".join(hf.apply_chat_template(c["messages"], tokenize=False) for c in CHATS) * 2
    packed = [int(t) for t in np.asarray(ds.train) if t != EOS]  # less the rows' padding
    assert tokenizer.decode(packed, skip_special_tokens=False) == rendered
    record = ds.meta["chat_template"]
    assert record == {"source": str(directory / "tokenizer_config.json") + " chat_template",
                      "name": "default", "sha256": find_chat_template(directory).sha256,
                      "assistant": "generation markers" if name == "chatml_marked" else "prefixes"}


def test_markers_and_prefixes_agree_token_for_token(tmp_path, tokenizer):
    """ChatML with and without {% generation %}: the same ids and the same loss bits."""
    marked = _build(tmp_path / "a", _tokenizer_dir(tmp_path / "marked", tokenizer, CHATML_MARKED), tokenizer)
    plain = _build(tmp_path / "b", _tokenizer_dir(tmp_path / "plain", tokenizer, CHATML), tokenizer)
    assert np.array_equal(marked.train, plain.train) and np.array_equal(marked.train_mask, plain.train_mask)


def test_a_directory_without_a_template_uses_ours(tmp_path, tokenizer):
    ds = _build(tmp_path, _tokenizer_dir(tmp_path / "plain", tokenizer), tokenizer)
    assert ds.meta["chat_template"] == DEFAULT_RECORD
    _, y = _rows(ds)
    kept = tokenizer.decode(y[y != IGNORE].tolist(), skip_special_tokens=False)
    assistant = [m["content"] for chat in CHATS for m in chat["messages"] if m["role"] == "assistant"]
    assert kept == "".join(a + "<|endoftext|>" for a in assistant) * 2  # DEFAULT_TEMPLATE's <end>


def test_a_template_that_cannot_be_split_is_a_clear_error(tmp_path, tokenizer):
    directory = _tokenizer_dir(tmp_path / "qwen3ish", tokenizer, DROPS_REASONING)
    two_turns = {"messages": [{"role": "user", "content": "Hi?"},
                              {"role": "assistant", "content": "<think>greet</think>Hello."},
                              {"role": "user", "content": "Bye?"},
                              {"role": "assistant", "content": "<think>part</think>Bye."}]}
    src = tmp_path / "chat.jsonl"
    src.write_text(json.dumps(CHATS[2]) + "\n" + json.dumps(two_turns) + "\n")
    cfg = DataConfig(source=str(src), format="chat", cache_dir=str(tmp_path / "cache"))
    # before anything starts: the first conversation (one assistant turn) splits fine ...
    assert check_chat_template(cfg, str(directory), tokenizer).text == DROPS_REASONING
    with pytest.raises(ConfigError, match=r"data.source example 2 \(in file order\): the chat template "
                       r".* cannot be split into turns: rendered, messages\[:2\] renders differently "
                       r"once the later messages follow .* \{% generation %\}"):
        _build(tmp_path, directory, tokenizer, [CHATS[2], two_turns], repeat=1)  # ... the second not
    src.write_text(json.dumps(two_turns) + "\n")
    with pytest.raises(ConfigError, match="data.source's first conversation: .* cannot be split"):
        check_chat_template(cfg, str(directory), tokenizer)
    assistant_first = {"messages": [{"role": "assistant", "content": "Hello."}]}
    src.write_text(json.dumps(assistant_first) + "\n")
    with pytest.raises(ConfigError, match="this conversation starts with one: put its prompt"):
        check_chat_template(cfg, str(_tokenizer_dir(tmp_path / "chatml", tokenizer, CHATML)), tokenizer)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, tokenizer) -> Path:
    """A tiny random Llama saved by transformers, with the tokenizer and Llama 3's template."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, bos_token_id=3, eos_token_id=EOS, hidden_size=32,
                                      intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, max_position_embeddings=256)
    directory = tmp_path_factory.mktemp("hf") / "llama"
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return _tokenizer_dir(directory, tokenizer, LLAMA3)


def test_cli_refuses_a_template_that_cannot_be_split_before_spawning(tmp_path, llama_dir, capsys):
    from shardlm.cli.main import main

    directory = shutil.copytree(llama_dir, tmp_path / "qwen3ish")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": DROPS_REASONING}))
    two_turns = {"messages": [{"role": "user", "content": "Hi?"},
                              {"role": "assistant", "content": "<think>greet</think>Hello."},
                              {"role": "user", "content": "Bye?"},
                              {"role": "assistant", "content": "<think>part</think>Bye."}]}
    (tmp_path / "chat.jsonl").write_text(json.dumps(two_turns) + "\n")
    code = main(["train", "--nproc", "2", "--model.hf_path", str(directory), "--data.format=chat",
                 f"--data.source={tmp_path / 'chat.jsonl'}", f"--run.dir={tmp_path / 'runs'}",
                 "--precision.compute=fp32", "--run.device=cpu"])
    assert code == 2
    assert "data.source's first conversation: the chat template" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()  # nothing started


def test_cli_trains_with_the_checkpoints_template_and_records_it(tmp_path, llama_dir):
    """`shardlm train --model.hf_path DIR --data.format=chat` on a tiny Llama whose directory has
    Llama 3's template: the run trains and says, in its log and first JSONL record, which one."""
    directory = shutil.copytree(llama_dir, tmp_path / "llama")
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for _ in range(30) for c in CHATS))
    result = subprocess.run(
        [sys.executable, "-m", "shardlm", "train", "--model.hf_path", "llama", "--data.format=chat",
         "--data.source=chat.jsonl", "--train.steps=2", "--train.seq_len=64", "--train.micro_batch=2",
         "--train.eval_every=0", "--train.sample_tokens=0", "--precision.compute=fp32",
         "--run.progress=off", f"--data.cache_dir={tmp_path / 'cache'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    sha = find_chat_template(directory).sha256
    assert (f"data: chats rendered with the chat template llama/tokenizer_config.json "
            f"chat_template ('default', sha256 {sha[:16]}; assistant turns by prefixes)") in result.stderr, \
        result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "runs" / "latest" / "metrics.jsonl").open()]
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["chat_template"]["sha256"] == sha and "chat_template" not in records[1]
