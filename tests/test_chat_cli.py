"""`shardlm chat`: a transformers directory (before training) and a run of it (after), through
the checkpoint's own ChatML template; the greedy reply streams and stops at <|im_end|> (the
model of hf_cases.instruct_dir answers INSTRUCT_REPLY, then <|im_end|>, then would go on);
the REPL keeps the history; the transformers path's generate stops at the same ids; `shardlm
eval --base` scores a run beside its untrained checkpoint."""

from __future__ import annotations

import builtins
import json

import pytest
import torch

from hf_cases import INSTRUCT_CHATS, INSTRUCT_REPLY, hf_model, instruct_dir

transformers = pytest.importorskip("transformers")

from shardlm.cli import chat as chat_cli  # noqa: E402
from shardlm.cli.main import main  # noqa: E402

GREEDY = ["--temperature", "0", "--tokens", "12"]


@pytest.fixture(scope="module")
def instruct(tmp_path_factory):
    return instruct_dir(tmp_path_factory.mktemp("hf") / "instruct")


def test_the_bigram_model_would_go_on_past_the_end_of_turn(instruct):
    """The premise: without stop ids the greedy continuation does not end at <|im_end|>."""
    chat = chat_cli.load_chat_model(instruct, torch.device("cpu"))
    assert chat.stop_ids == {0, 2}  # the template's eos <|im_end|>, generation_config's [2, 0]
    from shardlm.models.decoder import generate

    prompt = chat.prompt_ids([{"role": "user", "content": "Hello there"}])
    out = generate(chat.model, torch.tensor([prompt]), 6, temperature=0)[0, len(prompt):].tolist()
    reply = chat.tokenizer.encode(INSTRUCT_REPLY, add_special_tokens=False).ids
    assert out[:len(reply) + 1] == reply + [2] and len(out) == 6


def test_chat_on_a_transformers_directory_stops_at_the_end_of_turn(instruct, capsys):
    assert main(["chat", "--checkpoint", str(instruct), "--prompt", "Hello there", *GREEDY]) == 0
    assert capsys.readouterr().out == INSTRUCT_REPLY + "\n"
    # The prompt is transformers' own rendering of the conversation, with the generation prompt.
    chat = chat_cli.load_chat_model(instruct, torch.device("cpu"))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    hf = transformers.AutoTokenizer.from_pretrained(instruct)
    assert chat.prompt_ids(messages) == hf.apply_chat_template(messages, add_generation_prompt=True,
                                                               tokenize=True, return_dict=True)["input_ids"]


def test_chat_on_a_run_and_its_repl_keeps_the_history(tmp_path, instruct, capsys, monkeypatch):
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for _ in range(8) for c in INSTRUCT_CHATS))
    assert main(["train", "--model.hf_path", str(instruct), "--data.format=chat",
                 f"--data.source={tmp_path / 'chat.jsonl'}", "--train.steps=2", "--train.seq_len=32",
                 "--train.micro_batch=2", "--train.eval_every=0", "--train.sample_tokens=0",
                 "--precision.compute=fp32", "--run.progress=off", "--run.device=cpu",
                 f"--run.dir={tmp_path / 'runs'}", f"--data.cache_dir={tmp_path / 'cache'}"]) == 0
    capsys.readouterr()
    run = tmp_path / "runs" / "latest"
    assert main(["chat", "--checkpoint", str(run), "--prompt", "Hello there", *GREEDY]) == 0
    assert capsys.readouterr().out == INSTRUCT_REPLY + "\n"
    seen = []
    prompt_ids = chat_cli.ChatModel.prompt_ids
    monkeypatch.setattr(chat_cli.ChatModel, "prompt_ids",
                        lambda self, messages: seen.append([dict(m) for m in messages]) or prompt_ids(self, messages))
    lines = iter(["Hello there", "And again?", "/exit"])
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(lines))
    assert main(["chat", "--checkpoint", str(run), "--system", "Be brief.", *GREEDY]) == 0
    assert capsys.readouterr().out == (INSTRUCT_REPLY + "\n") * 2
    assert seen[1] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"},
                       {"role": "assistant", "content": INSTRUCT_REPLY}, {"role": "user", "content": "And again?"}]
    # eval --base: the run and its untrained checkpoint on the run's split, side by side; the
    # base's line is what eval of the transformers directory itself gives on the same data.
    split = ["--data.val_fraction=0.25"]
    assert main(["eval", "--checkpoint", str(run), "--base", *split]) == 0
    trained, base = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert base["checkpoint"] == str(instruct) and trained["val_targets"] == base["val_targets"] > 0
    assert trained["val_loss"] != base["val_loss"]
    assert main(["eval", "--checkpoint", str(instruct), "--data.format=chat", "--train.seq_len=32",
                 f"--data.source={tmp_path / 'chat.jsonl'}", f"--data.cache_dir={tmp_path / 'cache'}",
                 "--train.micro_batch=2", *split]) == 0
    assert json.loads(capsys.readouterr().out) == base


def test_the_transformers_paths_generate_stops_and_streams():
    from shardlm.models.hf_build import generate_causal

    model = hf_model("llama").eval()
    prompt = torch.tensor([[5, 6, 7, 8]])
    free = generate_causal(model, prompt, 6, end_id=None, temperature=0)[0, 4:].tolist()
    streamed = []
    stopped = generate_causal(model, prompt, 6, temperature=0, stop_ids={free[2]},
                              on_token=lambda t: streamed.append(int(t[0, 0])))[0, 4:].tolist()
    first = free.index(free[2])  # the stop id's first appearance ends it
    assert stopped == free[:first + 1] and streamed == stopped
