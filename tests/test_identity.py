"""A checkpoint's identity survives a run: model.hf_path's tokenizer files, chat template,
generation config and special token ids are carried into the run directory (byte for byte,
hashed) and written back by `shardlm export --format hf` (plain and `--merge` of a LoRA run)
and beside `--format peft`, through the CLI."""

from __future__ import annotations

import json

import pytest

from hf_cases import INSTRUCT_CHATS, instruct_dir

transformers = pytest.importorskip("transformers")

from shardlm.checkpoint.hf_dir import IDENTITY_DIR, IDENTITY_RECORD, HFDirError, read_identity  # noqa: E402
from shardlm.cli.main import main  # noqa: E402

IDENTITY = ["chat_template.jinja", "generation_config.json", "special_tokens_map.json",
            "tokenizer.json", "tokenizer_config.json"]
CHAT = INSTRUCT_CHATS[1]["messages"]


@pytest.fixture(scope="module")
def instruct(tmp_path_factory):
    return instruct_dir(tmp_path_factory.mktemp("hf") / "instruct")


def _train(tmp_path, directory, name: str, *extra: str):
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for _ in range(8) for c in INSTRUCT_CHATS))
    code = main(["train", "--model.hf_path", str(directory), "--data.format=chat",
                 f"--data.source={tmp_path / 'chat.jsonl'}", "--train.steps=2", "--train.seq_len=32",
                 "--train.micro_batch=2", "--train.eval_every=0", "--train.sample_tokens=0",
                 "--precision.compute=fp32", "--run.progress=off", "--run.device=cpu",
                 f"--run.dir={tmp_path / 'runs'}", f"--run.name={name}",
                 f"--data.cache_dir={tmp_path / 'cache'}", *extra])
    assert code == 0
    return tmp_path / "runs" / name


def _export(run, out, *extra: str):
    assert main(["export", "--checkpoint", str(run), "--out", str(out), *extra]) == 0
    return out


def _same_identity(directory, exported):
    """Every identity file byte for byte, the template's rendering and the token ids."""
    for name in IDENTITY:
        assert (exported / name).read_bytes() == (directory / name).read_bytes(), name
    ours, theirs = (transformers.AutoTokenizer.from_pretrained(d) for d in (exported, directory))
    assert ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == \
        theirs.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert (ours.eos_token_id, ours.pad_token_id, ours.bos_token_id) == (2, 2, 1)
    config = json.loads((exported / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)
    generation = transformers.GenerationConfig.from_pretrained(exported)
    assert (generation.eos_token_id, generation.pad_token_id) == ([2, 0], 2)


def test_full_run_carries_and_exports_the_checkpoints_identity(tmp_path, instruct):
    run = _train(tmp_path, instruct, "full")
    record = json.loads((run / IDENTITY_DIR / IDENTITY_RECORD).read_text())
    assert sorted(record["files"]) == IDENTITY
    assert record["token_ids"] == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    _same_identity(instruct, _export(run, tmp_path / "hf", "--format", "hf"))
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")  # loads whole
    assert model.config.eos_token_id == 2
    # A changed carried file is refused, not exported silently.
    (run / IDENTITY_DIR / "chat_template.jinja").write_text("{{ messages }}")
    with pytest.raises(HFDirError, match="chat_template.jinja is missing or changed"):
        read_identity(run)


def test_lora_run_merged_and_peft_exports_carry_the_identity(tmp_path, instruct):
    run = _train(tmp_path, instruct, "lora", "--lora.rank=4")
    _same_identity(instruct, _export(run, tmp_path / "merged", "--format", "hf", "--merge"))
    peft = _export(run, tmp_path / "peft", "--format", "peft")
    for adapter in (peft, run / "adapter"):  # the export and the run's own adapter/
        assert (adapter / "adapter_config.json").is_file()
        assert not (adapter / "generation_config.json").exists()
        for name in (n for n in IDENTITY if n != "generation_config.json"):
            assert (adapter / name).read_bytes() == (instruct / name).read_bytes(), (adapter, name)


def test_our_bpe_run_exports_as_before(tmp_path):
    """Without model.hf_path nothing is carried and the export writes our tokenizer files."""
    code = main(["train", "--model.preset=gpt-tiny", "--train.steps=1", "--train.seq_len=32",
                 "--train.micro_batch=2", "--train.eval_every=0", "--train.sample_tokens=0",
                 "--data.max_bytes=200000", "--precision.compute=fp32", "--run.progress=off",
                 "--run.device=cpu", f"--run.dir={tmp_path / 'runs'}", "--run.name=bpe"])
    assert code == 0
    run = tmp_path / "runs" / "bpe"
    assert not (run / IDENTITY_DIR).exists() and read_identity(run) is None
    out = _export(run, tmp_path / "hf", "--format", "hf")
    assert (out / "tokenizer.json").read_bytes() == (run / "tokenizer.json").read_bytes()
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == "<|endoftext|>"
    assert not (out / "chat_template.jinja").exists()


def test_finetune_defaults_unless_set_with_a_note_and_a_warning(instruct, caplog):
    """model.hf_path: lr 2e-5 (full) / 2e-4 (LoRA, QLoRA) and 3% warm-up unless the user sets
    them; the start-up note says which; a full fine-tune above 1e-4 is warned about. Our own
    presets keep the pre-training defaults. The label says our decoder computes it."""
    import logging

    import torch

    from shardlm.config.load import load_config
    from shardlm.errors import ConfigError
    from shardlm.train.resolve import decide

    def config(**values):
        return load_config(overrides={"model.hf_path": str(instruct), "precision.compute": "fp32",
                                      "train.steps": 200, **values}).validate()

    full, lora, qlora = config(), config(**{"lora.rank": 8}), config(**{"lora.rank": 8, "lora.quantize": "nf4"})
    assert (full.train.lr, lora.train.lr, qlora.train.lr) == (2e-5, 2e-4, 2e-4)
    assert (full.train.warmup_fraction, full.train.warmup_steps) == (0.03, 6)
    assert full.model.preset == "instruct (transformers checkpoint, shardlm's decoder)"
    mine = config(**{"train.lr": 5e-5, "train.warmup_steps": 7})
    assert (mine.train.lr, mine.train.warmup_steps, mine.train.warmup_fraction) == (5e-5, 7, 0.0)
    assert config(**{"train.warmup_fraction": 0.1}).train.warmup_steps == 20
    scratch = load_config(overrides={"model.preset": "gpt-tiny", "train.seq_len": 32}).validate()
    assert (scratch.train.lr, scratch.train.warmup_steps, scratch.train.warmup_fraction) == (1e-3, 30, 0.0)
    with pytest.raises(ConfigError, match="both set the warm-up"):
        config(**{"train.warmup_fraction": 0.1, "train.warmup_steps": 3})
    with caplog.at_level(logging.INFO, logger="shardlm"):
        decide(full, 1, torch.device("cpu"))
        decide(lora, 1, torch.device("cpu"))
        decide(config(**{"train.lr": 1e-3}), 1, torch.device("cpu"))
    notes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("fine-tuning settings")]
    assert notes[0].startswith(f"fine-tuning settings: a full fine-tune of {instruct}: train.lr = 2e-05 "
                               f"(the default for a full fine-tune), warm-up 6 steps = "
                               f"train.warmup_fraction 0.03 (the default) of 200")
    assert "train.lr = 0.0002 (the default for LoRA)" in notes[1]
    assert "train.lr = 0.001, warm-up 6 steps" in notes[2]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("train.lr = 0.001 on a full fine-tune of the pretrained")
