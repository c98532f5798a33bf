"""The transformers path (models/hf_build.py): a model.hf_path whose model_type our decoder does
not map — here GPT-J, which nobody maps (tests/test_hf_path.py covers the mapped ones) — trains
as transformers' own GPTJForCausalLM from the CLI, fp32 pinned, a tiny random save_pretrained
checkpoint with a WordLevel tokenizer.

- the trainer's first-step logits are the library's own (from_pretrained) within 1e-5;
- ZeRO-3 on 2 gloo ranks = one process (losses and parameters within 1e-6 relative), and tp = 2
  by GPT-J's base_model_tp_plan (with ZeRO-1, CPU optimizer offload and full recomputation) = one
  process within 1e-5 relative, the tolerance of tests/test_tp_hf.py (the sums' order changes);
- a LoRA run from the CLI: its adapters (PEFT's format) load in peft.PeftModel with our logits;
- a full fine-tune from the CLI exported by save_pretrained loads with from_pretrained, every
  tensor equal to the trained one; a LoRA checkpoint resumes bitwise; LoRA also on a
  CausalLMAdapter given to build_run;
- what the path cannot do (pp, cp, fp8, document masks, tp for a model without a
  base_model_tp_plan or one whose plan cuts a fused q/k/v) is a ConfigError before anything is spawned or created; the path is said
  before spawning, by the CLI.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from shardlm.config.load import load_config
from shardlm.errors import ConfigError
from test_hf_path import SPECIAL, VOCAB, WORDS, overrides

transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402

LINE = ("(gptj) through transformers' GPTJForCausalLM: mapped families get every axis; this path "
        "supports ZeRO 0-3, offload, recomputation, LoRA, tp by base_model_tp_plan; not "
        "pp/cp/ep/fp8/document masks")


def make_gptj_dir(root: Path) -> Path:
    """A tiny random GPTJForCausalLM (rotary on 8 of each head's 16 dims, no dropout), every
    tensor perturbed, saved with a WordLevel tokenizer of exactly VOCAB tokens."""
    torch.manual_seed(0)
    config = transformers.GPTJConfig(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
                                     n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=1, eos_token_id=1)
    model = transformers.GPTJForCausalLM(config).eval()
    with torch.no_grad():  # norms start at 1 and biases at 0: perturb so every tensor matters
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    out = root / "gptj"
    model.save_pretrained(out)
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(SPECIAL + WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(out / "tokenizer.json"))
    return out


@pytest.fixture(scope="module")
def gptj(tmp_path_factory) -> Path:
    return make_gptj_dir(tmp_path_factory.mktemp("gptj"))


def _cli(values: dict) -> list[str]:
    return ["train"] + [f"--{k}={v}" for k, v in values.items()]


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_first_step_logits_are_the_librarys(tmp_path, gptj):
    from shardlm.models.hf_build import route_line
    from shardlm.train.build import build_run
    from shardlm.train.step import train_step

    cfg = load_config(overrides=overrides(tmp_path, gptj)).validate()
    assert route_line(cfg.model) == f"model: {gptj} {LINE}"
    run = build_run(cfg)
    assert type(run.model.model).__name__ == "GPTJForCausalLM"
    reference = transformers.AutoModelForCausalLM.from_pretrained(gptj).eval()
    x, y = run.train_loader.micro_batches(0)[0]
    window = torch.cat([x, y[:, -1:]], dim=1)  # ours predicts y from x: the library's labels shift
    with torch.no_grad():
        ours = run.model(x)
        theirs = reference(input_ids=window, labels=window)
    torch.testing.assert_close(ours, theirs.logits[:, :-1], atol=1e-5, rtol=1e-5)
    assert train_step(run, 0)[0] == pytest.approx(theirs.loss.item(), abs=1e-5)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def test_zero3_and_tp_on_two_ranks_match_one_process(tmp_path, gptj):
    from shardlm.launch.spawn import run_ranks
    from test_tensor_parallel import whole_params
    from zero_cases import reference_case, train_cases

    base = overrides(tmp_path, gptj, train__lr=1e-3)
    zero3 = {**base, "parallel.zero_stage": 3}
    tp = {**base, "parallel.zero_stage": 1, "zero.offload_optimizer": "cpu",
          "activation.checkpoint": "full"}
    steps = 2
    ranks = run_ranks(train_cases, 2, tmp_path, [(zero3, steps, -1), ({**tp, "parallel.tp": 2}, steps, -1)],
                      timeout=600)
    ref = reference_case(zero3, 2, steps)  # the 2 ranks' micro-batches as accumulation steps
    got = ranks[0][0]
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-6)
    for name, value in ref["params"].items():
        assert torch.equal(ranks[1][0]["params"][name], got["params"][name]), name
        assert _rel(got["params"][name], value) <= 1e-6, name
    # tp = 2: one data-parallel rank, so the reference is one process with the same batch
    tp_ref = reference_case(tp, 1, steps)
    cut = [ranks[r][1] for r in range(2)]
    assert {n.rsplit(".", 2)[-2] for n in cut[0]["splits"]} == {"q_proj", "k_proj", "v_proj",
                                                               "out_proj", "fc_in", "fc_out"}
    for result in cut:
        assert result["losses"] == pytest.approx(tp_ref["losses"], rel=1e-5)
    whole = whole_params(cut)
    assert whole.keys() == tp_ref["params"].keys()
    worst = max((_rel(whole[n], v), n) for n, v in tp_ref["params"].items())
    assert worst[0] <= 1e-5, worst
    start = transformers.AutoModelForCausalLM.from_pretrained(gptj).state_dict()
    assert not torch.equal(whole["model.lm_head.weight"], start["lm_head.weight"])  # it trained


def test_lora_adapters_load_in_peft_with_our_logits(tmp_path, gptj, capsys):
    """lora.targets = '' adapts every linear but the head (PEFT's 'all-linear'); 3 steps at a
    high learning rate move both A and B away from their start."""
    peft = pytest.importorskip("peft")
    from shardlm.checkpoint.weights import load_for_inference
    from shardlm.cli.main import main

    values = overrides(tmp_path, gptj, lora__rank=4, lora__alpha=8, train__steps=3, train__lr=1e-2)
    assert main(_cli(values)) == 0
    assert LINE in capsys.readouterr().out
    run_dir = tmp_path / "runs" / "latest"
    adapter = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())
    assert adapter["target_modules"] == ["attn.k_proj", "attn.out_proj", "attn.q_proj", "attn.v_proj",
                                         "mlp.fc_in", "mlp.fc_out"]
    ours, _, _ = load_for_inference(run_dir, torch.device("cpu"))
    assert ours.model.transformer.h[1].mlp.fc_out.lora_B.weight.abs().min() > 0
    base = transformers.AutoModelForCausalLM.from_pretrained(gptj).eval()
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    plain = _logits(base, ids)
    loaded = peft.PeftModel.from_pretrained(base, run_dir / "adapter").eval()
    theirs = _logits(loaded, ids)
    torch.testing.assert_close(theirs, _logits(ours.model, ids), atol=1e-5, rtol=1e-5)
    assert (theirs - plain).abs().max() > 1e-3  # the adapters changed the model
    # --merge: the adapters folded into the weights, a plain GPTJForCausalLM computing the same
    assert main(["export", "--checkpoint", str(run_dir), "--format", "hf", "--merge", "--out",
                 str(tmp_path / "merged")]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    torch.testing.assert_close(_logits(merged, ids), theirs, atol=1e-5, rtol=1e-5)


def test_a_lora_checkpoint_resumes_bitwise(tmp_path, gptj):
    """3 steps straight, or 2 then a resume from the step-2 checkpoint (adapters, their AdamW
    state, the frozen base) in a new run: the third loss and every parameter identical."""
    from shardlm.checkpoint.sharded import CHECKPOINTS
    from shardlm.train.build import build_run
    from shardlm.train.loop import train

    base = overrides(tmp_path, gptj, train__steps=3, train__lr=1e-2, lora__rank=4,
                     parallel__zero_stage=1, checkpoint__every=2)
    straight = build_run(load_config(overrides={**base, "run.name": "straight"}).validate())
    losses = train(straight).losses
    resumed = build_run(load_config(overrides={
        **base, "run.name": "resumed", "checkpoint.every": 0,
        "checkpoint.resume": str(straight.run_dir / CHECKPOINTS / "step-00000002")}).validate())
    assert resumed.start_step == 2
    assert train(resumed).losses == losses[2:]
    for (name, a), (_, b) in zip(straight.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), name


def test_export_loads_with_from_pretrained_with_equal_tensors(tmp_path, gptj, capsys):
    """A full fine-tune at ZeRO-3 with its parameters offloaded to the CPU and full
    recomputation; the run's sample and `shardlm generate` go through the library's generate."""
    from safetensors.torch import load_file

    from shardlm.cli.main import main

    values = overrides(tmp_path, gptj, train__steps=2, train__lr=1e-3, parallel__zero_stage=3,
                       zero__offload_params="cpu", activation__checkpoint="full",
                       train__sample_tokens=4, train__sample_prompt="w1")
    assert main(_cli(values)) == 0
    run_dir = (tmp_path / "runs" / "latest").resolve()
    assert main(["generate", "--checkpoint", str(run_dir), "--prompt", "w1 w2", "--tokens", "3",
                 "--temperature", "0"]) == 0
    printed = capsys.readouterr().out
    assert "sample:\nw1 " in printed and len(printed.strip().splitlines()[-1].split()) == 5, printed
    out = tmp_path / "exported"
    assert main(["export", "--checkpoint", str(run_dir), "--format", "hf", "--out", str(out)]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(exported).__name__ == "GPTJForCausalLM" and exported.config.use_cache
    trained = load_file(run_dir / "model.safetensors")
    start = transformers.AutoModelForCausalLM.from_pretrained(gptj).state_dict()
    state = exported.state_dict()
    assert {f"model.{n}" for n in state} == set(trained)
    for name, value in state.items():
        assert torch.equal(value, trained[f"model.{name}"]), name
    assert not torch.equal(state["transformer.h.0.attn.q_proj.weight"],
                           start["transformer.h.0.attn.q_proj.weight"])  # it trained


def test_lora_on_a_model_given_to_build_run(tmp_path, gptj):
    """The Python API's CausalLMAdapter (built on meta) takes LoRA too: the adapted model starts
    as the base (B = 0) with the base's own initial values, and a step moves only adapters."""
    from hf_cases import hf_model
    from shardlm.models.init import materialize
    from shardlm.train.build import build_run
    from shardlm.train.step import train_step

    values = {**overrides(tmp_path, gptj, lora__rank=4, lora__targets="self_attn.q_proj,mlp.down_proj"),
              "model.preset": "gpt-tiny"}  # its vocabulary (512) is hf_cases' llama's
    del values["model.hf_path"]
    run = build_run(load_config(overrides=values).validate(), model=hf_model("llama", "meta"))
    base = materialize(hf_model("llama", "meta"), "cpu", run.cfg.train.seed)
    assert run.model.lora.targets == [f"model.model.layers.{i}.{n}" for i in range(2)
                                      for n in ("self_attn.q_proj", "mlp.down_proj")]
    x, _ = run.train_loader.micro_batches(0)[0]
    with torch.no_grad():
        torch.testing.assert_close(run.model(x), base(x), atol=0, rtol=0)
    before = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    train_step(run, 0)
    moved = {n for n, p in run.model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all(".lora_" in n for n in moved), moved


def _config_dir(root: Path, gptj: Path, family: str) -> Path:
    """A config.json and the tokenizer, all a check before spawning reads: BLOOM (no
    base_model_tp_plan), CodeGen (a plan cutting its fused, interleaved qkv_proj)."""
    out = root / family
    ids = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=1)
    config = (transformers.BloomConfig(hidden_size=64, n_layer=2, n_head=4, **ids) if family == "bloom"
              else transformers.CodeGenConfig(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, **ids))
    config.save_pretrained(out)
    (out / "tokenizer.json").write_bytes((gptj / "tokenizer.json").read_bytes())
    return out


@pytest.mark.parametrize("extra, message", [
    ({"parallel.pp": 2}, r"trains through transformers .*parallel.pp = 2 \(pipeline stages"),
    ({"parallel.cp": 2}, r"trains through transformers .*parallel.cp = 2 \(ring attention"),
    ({"precision.compute": "fp8"}, r"trains through transformers .*precision.compute = 'fp8'"),
    ({"data.document_mask": "on"}, r"trains through transformers .*set data.document_mask = 'off'"),
    ({"parallel.tp": 2, "model.hf_path": "bloom"}, r"BloomForCausalLM has no base_model_tp_plan"),
    ({"parallel.tp": 2, "model.hf_path": "codegen"}, r"h.0.attn.qkv_proj colwise.*a fused projection"),
    ({"parallel.tp": 2, "lora.rank": 4}, r"trains through transformers .*lora.rank = 4 with parallel.tp = 2"),
], ids=["pp", "cp", "fp8", "document-mask", "tp-without-plan", "tp-fused-qkv", "lora-tp"])
def test_what_the_path_cannot_do_is_refused_before_spawning(tmp_path, gptj, capsys, extra, message):
    from shardlm.cli.main import main

    if extra.get("model.hf_path") in ("bloom", "codegen"):
        extra = {**extra, "model.hf_path": str(_config_dir(tmp_path, gptj, extra["model.hf_path"]))}
    values = {**overrides(tmp_path, gptj), **extra}
    assert main(["train", "--nproc", "2"] + _cli(values)[1:]) != 0
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert not (tmp_path / "runs").exists()  # nothing created, nothing spawned


def test_an_unknown_model_type_is_named(tmp_path, gptj):
    from shardlm.train.build import check_inputs

    (tmp_path / "odd").mkdir()
    config = json.loads((gptj / "config.json").read_text())
    (tmp_path / "odd" / "config.json").write_text(json.dumps({**config, "model_type": "odd-lm"}))
    (tmp_path / "odd" / "tokenizer.json").write_bytes((gptj / "tokenizer.json").read_bytes())
    cfg = load_config(overrides=overrides(tmp_path, tmp_path / "odd")).validate()
    with pytest.raises(ConfigError, match=r"model_type 'odd-lm' is not one transformers .* knows"):
        check_inputs(cfg)
