"""Encoder-decoder seq2seq (T5, BART from tiny configs, CPU, fp32) and generation with a KV cache.

- data.format = 'seq2seq': the first loss of our loop equals transformers' own
  `model(input_ids, attention_mask, labels).loss` on the same batch, from scratch
  (model.hf_config) and from a save_pretrained directory (model.hf_path);
- both families train on reversing short strings (the loss falls over 20 steps), save a run that
  `shardlm generate` reads back and generates from; on a trivial mapping (a -> x, ...) 30 steps
  suffice for greedy generation to give the right targets;
- data rows: the source padded and masked, the target + end token, data.columns renaming;
- our Decoder's KV-cache generation equals no-cache generation token for token (greedy), and
  its cached logits equal full recomputation within 1e-5;
- ZeRO-3 on 2 gloo ranks with tiny T5 matches one process (the same global batch).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import tiny_overrides
from hf_cases import reverse_jsonl as _reverse_jsonl

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "hf"
FAMILIES = ("t5", "bart")
CLASSES = {"t5": "T5ForConditionalGeneration", "bart": "BartForConditionalGeneration"}


def _overrides(tmp_path: Path, family: str, **extra) -> dict:
    out = tiny_overrides(tmp_path, **{"data.format": "seq2seq", "train.seq_len": 8,
                                      "data.source_len": 8, "train.micro_batch": 8,
                                      "train.lr": 3e-3, "data.val_fraction": 0.1,
                                      "data.source": str(_reverse_jsonl(tmp_path / "rev.jsonl"))})
    del out["model.preset"]
    out["model.hf_config"] = str(CONFIGS / f"{family}-tiny.json")
    out.update({k.replace("__", "."): v for k, v in extra.items()})
    return out


def _run(overrides: dict):
    from shardlm.config.load import load_config
    from shardlm.train.build import build_run

    return build_run(load_config(overrides=overrides).validate())


def _library_loss(model, x) -> torch.Tensor:
    """transformers' own loss: its shift of the labels, its cross-entropy."""
    source, mask, labels = x
    return model(input_ids=source, attention_mask=mask, labels=labels).loss


def _saved_checkpoint(tmp_path: Path, family: str) -> Path:
    """A transformers model built from the tiny config, save_pretrained to a directory with a
    tokenizer.json (a BPE of ≤ vocab_size tokens trained on the data) beside it."""
    import transformers as tf

    from shardlm.data.tokenizer import save_tokenizer, train_tokenizer

    raw = json.loads((CONFIGS / f"{family}-tiny.json").read_text())
    cls = getattr(tf, CLASSES[family])
    torch.manual_seed(7)
    model = cls(cls.config_class.from_dict(raw))
    out = tmp_path / f"{family}-saved"
    model.save_pretrained(out)
    texts = [r[k] for r in map(json.loads, _reverse_jsonl(tmp_path / "rev.jsonl").open())
             for k in ("source", "target")]
    save_tokenizer(train_tokenizer(iter(texts), raw["vocab_size"]), out / "tokenizer.json")
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_first_loss_is_the_librarys(tmp_path, family):
    from shardlm.train.step import loss_of

    run = _run(_overrides(tmp_path, family))
    assert type(run.model.model).__name__ == CLASSES[family]
    x, y = run.train_loader.micro_batches(0)[0]
    source, mask, labels = x
    assert source.shape == (8, 8) and labels.shape == (8, 8) and torch.equal(labels, y)
    assert (labels == -100).any() and (mask == 0).any()  # padding on both sides, masked
    with torch.no_grad():
        ours = loss_of(run, x, y)
    assert float(ours) == pytest.approx(float(_library_loss(run.model.model, x)), rel=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_loads_a_save_pretrained_directory(tmp_path, family):
    """model.hf_path of an encoder-decoder: its weights (renamed under the adapter, tied ones by
    whichever name was saved) and its tokenizer; the first loss is the saved model's own."""
    import transformers as tf

    from shardlm.train.step import loss_of

    saved = _saved_checkpoint(tmp_path, family)
    overrides = _overrides(tmp_path, family)
    del overrides["model.hf_config"]
    run = _run({**overrides, "model.hf_path": str(saved)})
    reference = getattr(tf, CLASSES[family]).from_pretrained(saved).eval()
    x, y = run.train_loader.micro_batches(0)[0]
    with torch.no_grad():
        assert float(loss_of(run, x, y)) == pytest.approx(float(_library_loss(reference, x)), rel=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("start", ["scratch", "saved"])
def test_trains_and_generates(tmp_path, family, start):
    from shardlm.checkpoint.weights import load_for_inference
    from shardlm.cli.main import main
    from shardlm.data.tokenizer import eot_id
    from shardlm.models.seq2seq import generate_seq2seq
    from shardlm.train.loop import train

    overrides = _overrides(tmp_path, family, train__steps=20, train__warmup_steps=2)
    if start == "saved":
        del overrides["model.hf_config"]
        overrides["model.hf_path"] = str(_saved_checkpoint(tmp_path, family))
    result = train(_run(overrides))
    first, last = sum(result.losses[:3]) / 3, sum(result.losses[-3:]) / 3
    assert last < 0.8 * first, result.losses
    # The saved run rebuilt (its transformers_config.json) generates: 6 tokens when nothing
    # stops it; at most 6, ending with the end token, when the end token stops it.
    model, tokenizer, _ = load_for_inference(result.run_dir, torch.device("cpu"))
    source = torch.tensor([tokenizer.encode("abcd").ids])
    free = generate_seq2seq(model, source, torch.ones_like(source), 6, end_id=None)
    assert free.shape == (1, 6)
    end = model.model.config.eos_token_id if start == "saved" else eot_id(tokenizer)
    stopped = generate_seq2seq(model, source, torch.ones_like(source), 6, end_id=end)
    assert 1 <= stopped.shape[1] <= 6 and (stopped.shape[1] == 6 or stopped[0, -1] == end)
    assert main(["generate", "--checkpoint", str(result.run_dir), "--prompt", "abcd",
                 "--tokens", "6", "--temperature", "0"]) == 0
    assert main(["generate", "--checkpoint", str(result.run_dir), "--prompt", "abcd",
                 "--tokens", "6", "--temperature", "0", "--beams", "2"]) == 0
    assert main(["generate", "--checkpoint", str(result.run_dir), "--prompt", "abcd",
                 "--tokens", "6", "--temperature", "1.0", "--seed", "3"]) == 0


def test_mfu_counts_encoder_and_decoder(tmp_path):
    """Per target token: encoder linears over S source tokens, decoder linears over T (the
    cross-attention's k/v over S), the head over T, attention PaLM-style; S != T changes it."""
    from shardlm.models.init import materialize
    from shardlm.models.seq2seq import build_seq2seq, seq2seq_flops_per_token

    model = materialize(build_seq2seq(CONFIGS / "t5-tiny.json", 512, "meta"), "cpu", 0)
    d, ff, L, V, width = 64, 128, 2, 512, 64  # t5-tiny: d_kv 16 x 4 heads = 64
    enc = L * (4 * d * width + 2 * d * ff)
    dec = L * (8 * d * width + 2 * d * ff)
    cross_kv = L * 2 * d * width
    S, T = 12, 4
    expected = (6 * (enc * S + (dec - cross_kv) * T + cross_kv * S + V * d * T)
                + 12 * width * L * (S * S + T * T + T * S)) / T
    assert seq2seq_flops_per_token(model, S, T) == pytest.approx(expected)
    assert seq2seq_flops_per_token(model, S, T) > seq2seq_flops_per_token(model, T, T)


@pytest.mark.parametrize("preset", ["gpt-tiny", "llama-tiny"])
def test_kv_cache_generation_equals_recomputation(preset):
    """Learned positions and RoPE: greedy tokens identical with and without the cache, also past
    max_seq_len (the window slides: recomputed); the cache's logits (a prefill, a chunk of 3,
    then one token at a time) equal one forward over the whole sequence within 1e-5."""
    from shardlm.config.load import load_config
    from shardlm.models.decoder import build_model, generate
    from shardlm.models.kv_cache import KVCache

    cfg = load_config(overrides={"model.preset": preset, "model.max_seq_len": 32}).model
    model = build_model(cfg, "cpu", seed=1).eval()
    prompt = torch.randint(0, cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))
    cached = generate(model, prompt, 40, temperature=0, use_cache=True)  # 45 > max_seq_len
    # Tokens from two computations (the cache's attention, a recomputation): equal because each
    # step's argmax leads by far more than the paths' logits differ (<= 1e-5, asserted below):
    # the smallest lead over these 40 steps is 1.7e-2 (gpt-tiny), 4.4e-4 (llama-tiny), measured.
    assert torch.equal(cached, generate(model, prompt, 40, temperature=0, use_cache=False))
    with torch.no_grad():
        full = model(cached[:, :24])  # (2, 24, vocab)
        cache = KVCache(cfg.n_layers)
        parts = [model(cached[:, :5], cache=cache), model(cached[:, 5:8], cache=cache)]
        parts += [model(cached[:, t:t + 1], cache=cache) for t in range(8, 24)]
    assert cache.length == 24
    assert torch.allclose(torch.cat(parts, dim=1), full, atol=1e-5, rtol=0)


def test_seq2seq_refuses_what_it_cannot_do(tmp_path):
    from shardlm.config.load import load_config
    from shardlm.errors import ConfigError

    base = _overrides(tmp_path, "t5")
    for key, value, message in (("parallel.tp", 2, "parallel.tp = 2"),
                                ("parallel.pp", 2, "pipeline stages"),
                                ("lora.rank", 4, "LoRA applies to our decoder")):
        with pytest.raises(ConfigError, match=message):
            load_config(overrides={**base, key: value}).validate()
    with pytest.raises(ConfigError, match="goes with an encoder-decoder"):  # our decoder
        _run({**tiny_overrides(tmp_path), "data.format": "seq2seq", "data.source": base["data.source"]})
    text = {k: v for k, v in base.items() if k != "data.format"}
    with pytest.raises(ConfigError, match="trains on data.format = 'seq2seq'"):
        load_config(overrides=text).validate()


def test_zero3_two_ranks_match_one_process(tmp_path):
    """T5 at ZeRO-3 (T5Block units) on 2 gloo ranks = one process with the same global batch:
    losses and parameters within 1e-6 relative (the clip coefficient's ulp, tests/test_hf_models)."""
    from shardlm.launch.spawn import run_ranks
    from zero_cases import reference_case, train_cases

    overrides = {**_overrides(tmp_path, "t5"), "train.micro_batch": 4, "parallel.units": "T5Block"}
    ranks = run_ranks(train_cases, 2, tmp_path, [({**overrides, "parallel.zero_stage": 3}, 3, -1)],
                      timeout=600)
    ref = reference_case(overrides, 2, 3)
    got = ranks[0][0]
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-6)
    for name, value in ref["params"].items():
        assert torch.equal(ranks[1][0]["params"][name], got["params"][name]), name
        rel = float((got["params"][name] - value).norm() / value.norm().clamp_min(1e-12))
        assert rel <= 1e-6, name


def test_rows_hold_source_and_target(tmp_path):
    """A row: the source padded to data.source_len (masked), the target + end token padded to
    train.seq_len (-100); fields renamed by data.columns; nothing crosses from one to the other."""
    from shardlm.config.load import load_config
    from shardlm.data.loader import build_dataset
    from shardlm.data.loader import Loader

    path = tmp_path / "pairs.jsonl"
    rng = torch.Generator().manual_seed(0)

    def text(letters: str, n: int) -> str:
        return "".join(letters[i] for i in torch.randint(0, 3, (n,), generator=rng).tolist())

    path.write_text("".join(json.dumps({"q": text("abc", 2 * i), "a": text("fed", 1 + i % 5)}) + "\n"
                            for i in range(1, 41)))
    cfg = load_config(overrides={**_overrides(tmp_path, "t5"), "data.source": str(path),
                                 "data.columns": "source=q,target=a", "data.source_len": 6}).validate()
    data = build_dataset(cfg.data, cfg.model.vocab_size, None, 8)
    assert data.source_len == 6 and data.meta["row_len"] == 14 and data.meta["n_truncated"] > 0
    loader = Loader(data.train, seq_len=8, micro_batch=4, grad_accum=1, seed=0,
                    mask=data.train_mask, source_len=6)
    (source, mask, labels), y = loader.micro_batches(0)[0]
    assert source.shape == mask.shape == (4, 6) and labels.shape == (4, 8) and labels is y
    tok = data.tokenizer
    for row in range(4):
        src = tok.decode(source[row][mask[row] == 1].tolist())
        tgt = labels[row][labels[row] != -100].tolist()
        assert src and set(src) <= set("abc")
        assert tgt[-1] == data.eot_id or len(tgt) == 8  # ends with the end token unless cut
        assert set(tok.decode(tgt[:-1])) <= set("fed")
        kept = int(mask[row].sum())
        assert mask[row, :kept].all() and not mask[row, kept:].any()  # padding only at the end


@pytest.mark.parametrize("family", FAMILIES)
def test_learns_a_trivial_mapping_and_generates_it_greedily(tmp_path, family):
    """a -> x, b -> y, c -> z: after 30 steps greedy generation gives each target's tokens and
    then the end token (seconds on a CPU)."""
    from shardlm.models.seq2seq import generate_seq2seq
    from shardlm.train.loop import train

    pairs, rng = {"a": "x", "b": "y", "c": "z"}, torch.Generator().manual_seed(0)
    path = tmp_path / "map.jsonl"
    path.write_text("".join(json.dumps({"source": k, "target": pairs[k]}) + "\n"
                            for k in ("abc"[i] for i in torch.randint(0, 3, (200,), generator=rng).tolist())))
    overrides = _overrides(tmp_path, family, data__source=str(path), train__seq_len=4,
                           data__source_len=4, train__lr=1e-2, train__steps=30, train__warmup_steps=2)
    run = _run(overrides)
    train(run)
    tok, end = run.dataset.tokenizer, run.dataset.eot_id
    for source, target in pairs.items():
        ids = torch.tensor([tok.encode(source).ids])
        out = generate_seq2seq(run.model, ids, torch.ones_like(ids), 4, end, temperature=0)
        assert out[0].tolist() == tok.encode(target).ids + [end], (source, out)
