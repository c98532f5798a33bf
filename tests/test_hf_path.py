"""model.hf_path: a local transformers directory (config.json, safetensors, tokenizer.json) loads
into our decoder through the trainer's own build, with transformers' logits and loss."""

import json

import pytest
import torch

from shardlm.config.load import load_config
from shardlm.errors import ConfigError
from shardlm.launch.spawn import run_ranks
from shardlm.train.build import build_run
from shardlm.train.step import train_step

transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402

VOCAB = 512
SPECIAL = ["<unk>", "</s>"]
WORDS = [f"w{i}" for i in range(VOCAB - len(SPECIAL))]


def _config(family: str):
    common = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=1)
    if family == "gpt2":
        return transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common)
    llama = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, **common)
    if family == "mistral":
        return transformers.MistralConfig(sliding_window=16, **llama)  # the 32-token rows overrun it
    if family == "qwen2":  # biases on q/k/v only (model.qkv_bias), a tied head as Qwen2-0.5B's
        return transformers.Qwen2Config(tie_word_embeddings=True, **llama)
    return transformers.LlamaConfig(rope_theta=500000.0, **llama)


def _model_class(family: str):
    return {"gpt2": transformers.GPT2LMHeadModel, "llama": transformers.LlamaForCausalLM,
            "mistral": transformers.MistralForCausalLM, "qwen2": transformers.Qwen2ForCausalLM}[family]


def make_hf_dir(root, family: str, shard: bool = False):
    """A tiny random transformers model saved with a WordLevel tokenizer of exactly VOCAB tokens."""
    torch.manual_seed(0)
    model = _model_class(family)(_config(family)).eval()
    with torch.no_grad():  # norms start at 1 and biases at 0: perturb so every tensor matters
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    out = root / family
    model.save_pretrained(out, **({"max_shard_size": "40KB"} if shard else {}))
    vocab = {token: i for i, token in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(out / "tokenizer.json"))
    return out, model


def overrides(tmp_path, hf_dir, **extra):
    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():
        gen = torch.Generator().manual_seed(3)
        corpus.write_text(" ".join(WORDS[i] for i in torch.randint(len(WORDS), (6000,), generator=gen)))
    values = {"model.hf_path": str(hf_dir), "data.source": str(corpus),
              "data.cache_dir": str(tmp_path / "cache"), "data.val_fraction": 0.05, "run.dir": str(tmp_path / "runs"),
              "precision.compute": "fp32", "train.seq_len": 32, "train.micro_batch": 2,
              "train.steps": 1, "train.warmup_steps": 0, "train.eval_every": 0,
              "train.eval_batches": 1, "train.sample_tokens": 0, "run.progress": "off"}
    values.update({k.replace("__", "."): v for k, v in extra.items()})
    return values


@pytest.mark.parametrize("family", ["gpt2", "llama", "mistral", "qwen2"])
def test_loaded_model_has_transformers_logits_and_loss(tmp_path, family):
    hf_dir, hf = make_hf_dir(tmp_path, family, shard=family == "llama")
    run = build_run(load_config(overrides=overrides(tmp_path, hf_dir)).validate())
    assert run.dataset.tokenizer.to_str() == Tokenizer.from_file(str(hf_dir / "tokenizer.json")).to_str()
    assert run.dataset.eot_id == 1  # config.json's eos_token_id separates the documents
    x, y = run.train_loader.micro_batches(0)[0]
    window = torch.cat([x, y[:, -1:]], dim=1)  # ours predicts y from x: HF's labels shift inside
    with torch.no_grad():
        ours = run.model(x)
        theirs = hf(input_ids=window, labels=window)
    torch.testing.assert_close(ours, theirs.logits[:, :-1], atol=1e-5, rtol=1e-5)
    loss = train_step(run, 0)[0]
    assert loss == pytest.approx(theirs.loss.item(), abs=1e-5)
    if family == "mistral":  # the sliding window is a mask on every block, the context whole
        assert (run.cfg.model.sliding_window, run.cfg.model.max_seq_len) == (16, 128)
    if family == "qwen2":
        assert run.cfg.model.qkv_bias and not run.cfg.model.bias
        assert run.model.blocks[0].attn.qkv.bias is not None and run.model.blocks[0].attn.proj.bias is None


def loaded_parameters(rank: int, world_size: int, values: dict) -> dict:
    run = build_run(load_config(overrides=values).validate())
    with run.strategy.full_parameters():
        return {n: p.detach().float().cpu().clone() for n, p in run.model.named_parameters()}


def test_zero3_on_two_ranks_loads_the_same_weights(tmp_path):
    hf_dir, _ = make_hf_dir(tmp_path, "llama", shard=True)
    one = loaded_parameters(0, 1, overrides(tmp_path, hf_dir))
    values = overrides(tmp_path, hf_dir, parallel__zero_stage=3, run__dir=str(tmp_path / "runs2"))
    ranks = run_ranks(loaded_parameters, 2, tmp_path, values)
    for params in ranks:
        assert params.keys() == one.keys()
        for name in one:
            torch.testing.assert_close(params[name], one[name], atol=0, rtol=0)


def test_missing_files_tensors_and_conflicts_are_named(tmp_path):
    hf_dir, _ = make_hf_dir(tmp_path, "gpt2")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="no config.json"):
        load_config(overrides={"model.hf_path": str(empty)})
    with pytest.raises(ConfigError, match=r"model.n_layers = '3' \(config.json: 2\)"):
        load_config(overrides={"model.hf_path": str(hf_dir), "model.n_layers": "3"})
    with pytest.raises(ConfigError, match="drop model.preset"):
        load_config(overrides={"model.hf_path": str(hf_dir), "model.preset": "gpt-tiny"})

    (hf_dir / "tokenizer.json").rename(tmp_path / "tokenizer.json")
    with pytest.raises(ConfigError, match=r"has no tokenizer.json"):
        build_run(load_config(overrides=overrides(tmp_path, hf_dir)).validate())
    (tmp_path / "tokenizer.json").rename(hf_dir / "tokenizer.json")

    from safetensors.torch import load_file, save_file
    weights = load_file(hf_dir / "model.safetensors")
    del weights["transformer.h.1.mlp.c_fc.weight"]
    save_file(weights, hf_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"has no tensor 'transformer.h.1.mlp.c_fc.weight'"):
        build_run(load_config(overrides=overrides(tmp_path, hf_dir, run__dir=str(tmp_path / "r2"))).validate())
    (hf_dir / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="neither model.safetensors nor"):
        build_run(load_config(overrides=overrides(tmp_path, hf_dir, run__dir=str(tmp_path / "r3"))).validate())


@pytest.mark.parametrize("config, message", [
    # an unmapped model_type trains through transformers (tests/test_hf_generic.py): its sizes first
    ({"model_type": "bert"}, r"config.json has none of hidden_size.*\(model_type 'bert'\)"),
])
def test_unsupported_architectures_are_refused(tmp_path, config, message):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message):
        load_config(overrides={"model.hf_path": str(tmp_path)})


def test_a_tensor_parallel_rank_reads_only_its_rows(tmp_path):
    """Issue 27: with tp a rank reads its own rows (column-parallel) or columns (row-parallel) of
    each safetensors tensor, not the whole: the piece equals the whole's cut, and the reader
    copied out exactly the piece's elements (q, k and v ranges from three HF tensors included)."""
    from shardlm.checkpoint.hf_names import hf_initializer
    from shardlm.models.decoder import build_model
    from shardlm.models.placement import Split

    hf_dir, _ = make_hf_dir(tmp_path, "llama")
    cfg = load_config(overrides=overrides(tmp_path, hf_dir))
    init = hf_initializer(hf_dir, build_model(cfg.model, "meta"), cfg.model)
    qkv, proj = init("blocks.0.attn.qkv.weight"), init("blocks.0.attn.proj.weight")
    q, kv = 64, 32  # 4 heads, 2 kv heads of 16
    cuts = [("blocks.0.attn.qkv.weight", Split(tuple(qkv.shape), 0, ((0, 32), (q, q + 16), (q + kv, q + kv + 16)))),
            ("blocks.0.attn.proj.weight", Split(tuple(proj.shape), 1, ((32, 64),))),
            ("blocks.1.mlp.gate_up.weight", Split((320, 64), 0, ((80, 160), (240, 320))))]
    for name, split in cuts:
        before = init.reader.elements_read
        piece = init.piece(name, split)
        assert torch.equal(piece, split.take(init(name))), name
        assert init.reader.elements_read - before == piece.numel(), name
