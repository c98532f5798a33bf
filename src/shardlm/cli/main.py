"""The `shardlm` command: train, launch, generate, chat, eval, export, presets, estimate, plan,
study, compare."""

from __future__ import annotations

import argparse
import logging
import sys

from shardlm.cli.chat import chat_args, cmd_chat
from shardlm.cli.launch import cmd_launch, launch_args
from shardlm.cli.planner import calibrate_args, cmd_calibrate, cmd_estimate, cmd_plan, planner_args
from shardlm.studies.compare import cmd_compare, compare_args
from shardlm.errors import ConfigError
from shardlm.studies import cmd_study, study_args
from shardlm.cli.train import cmd_train

EPILOG = """\
examples:
  shardlm train                                   train the default small GPT on the built-in corpus
  shardlm train configs/gpt2-124m.toml --train.steps=100
  shardlm train --model.preset=llama-tiny --precision.compute=bf16
  shardlm train --nproc 2 --checkpoint.every=100 --max-restarts 2
                                                  2 workers; a dead worker restarts the gang from
                                                  the latest checkpoint
  shardlm train --resume                          continue the newest run that has a checkpoint
  shardlm train --nproc 2 --parallel.zero_stage=3 --dry-run
                                                  resolve and check the config, print the layout
                                                  and the predicted memory per rank; no training
  shardlm train --help-config                     every config key, its default and meaning
  shardlm launch --target slurm --nodes 2 --gpus-per-node 8 configs/gpt2-124m.toml --train.steps=100
                                                  an sbatch script for 2 x 8 ranks (also torchrun,
                                                  k8s, vertex; --out FILE, --submit)
  shardlm generate --checkpoint runs/latest --prompt "def fib("
  shardlm chat --checkpoint ./llama-dir --prompt "Hello"
                                                  a run or a transformers directory through its own
                                                  chat template (no --prompt: a REPL)
  shardlm eval --checkpoint runs/latest --data.val_source=test.parquet
                                                  val_loss, val_perplexity, val_token_accuracy
  shardlm export --checkpoint runs/latest --format hf --out hf-model/
  shardlm export --checkpoint runs/latest --format peft --out adapter/
                                                  a LoRA run's adapters for peft (--format hf
                                                  --merge: folded into the weights)
  shardlm compare runs/candidate runs/reference --rtol 1e-4
                                                  two runs' loss, grad norm, tokens/s, memory per
                                                  step; exit status 1 from the first step whose
                                                  loss differs beyond the tolerance
  shardlm presets                                 the named model shapes
  shardlm estimate --model gpt2-1.5b --gpus 8xV100-16GB --zero-stage 3 --micro-batch 4 --seq 1024
                                                  per-rank memory by category, with formulas, and
                                                  whether it fits (exit status 1 if it does not)
  shardlm estimate --params 7.5e9 --gpus 64xV100-32GB --zero-stage 1 --precision fp16
  shardlm plan --model llama-7b --gpus 2x8xA100-80GB
                                                  ranked strategies that fit, and why the best wins
  shardlm plan --model gpt-mini --gpus 2xcpu --runtime-only --json
  shardlm study max-batch --gpus 8xV100-16GB      a study measured here (each point a train run) and
                                                  predicted on the cluster: report.md, PNGs, JSONL
                                                  (also offload-rescue, zero-sweep, strategies,
                                                  scaling; --quick: seconds)
  shardlm plan --model llama-7b --gpus 8xA100-80GB --tokens 1e10 --cloud aws
                                                  with time to train, cost, energy and CO2 for
                                                  1e10 tokens (list price, --price-per-hour USD)
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardlm", description="Train language models efficiently on one device or many.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _train_args(sub)
    launch_args(sub)
    _generate_args(sub)
    chat_args(sub)
    _eval_args(sub)
    sub.add_parser("presets", help="list the named model shapes with parameter counts")
    _export_args(sub)
    _estimate_args(sub)
    _plan_args(sub)
    calibrate_args(sub.add_parser(
        "calibrate", help="time the model's own matmuls on this machine (best of N, cached) against "
                          "the peak and the planner's assumption"))
    study_args(sub)
    compare_args(sub)
    return parser


def _train_args(sub) -> None:
    """`shardlm train`: a config file, overrides, local workers, a dry run, a resume."""
    train = sub.add_parser(
        "train", help="train a model (config file + --section.key=value overrides)",
        description="Train a model. Settings: defaults < model preset < CONFIG (TOML) < overrides "
                    "such as --train.steps=100. See --help-config for every key.")
    train.add_argument("config", nargs="?", help="TOML config file (optional)")
    train.add_argument("--help-config", action="store_true", help="list every config key and exit")
    train.add_argument("--nproc", type=int, default=0, metavar="N",
                       help="start N local worker processes (torch's elastic launcher); "
                            "under torchrun leave this out")
    train.add_argument("--max-restarts", type=int, default=0, metavar="K",
                       help="with --nproc: when a worker dies, restart all of them (up to K "
                            "times); they resume from the run's latest checkpoint")
    train.add_argument("--quorum-endpoint", default="127.0.0.1:0", metavar="HOST:PORT",
                       help="with --nproc and parallel.fault_tolerant: where the replicas' quorum "
                            "store listens and the replicas reach it — an address of this "
                            "machine on the network they share (PORT 0: a free one). Default "
                            "127.0.0.1:0, loopback: one machine")
    train.add_argument("--dry-run", action="store_true",
                       help="resolve and validate the whole config (the auto plan too), print the "
                            "resolved layout and the predicted memory per rank, and exit without "
                            "training (status 0 if it is valid, whether or not it fits)")
    train.add_argument("--gpus", metavar="CLUSTER",
                       help="with --dry-run: predict for this cluster (8xA100-80GB, "
                            "2x8xH100-80GB) instead of this machine; its size is the world size")
    train.add_argument("--resume", nargs="?", const="", default=None, metavar="PATH",
                       help="continue from a checkpoint: a run directory (its latest), a "
                            "checkpoint directory, or nothing for the newest run under run.dir "
                            "that has one. The run continues in that run's directory unless "
                            "run.name is given")


def _generate_args(sub) -> None:
    """`shardlm generate`: sampling from a trained run."""
    gen = sub.add_parser("generate", help="sample text from a trained run (a KV cache: the prompt "
                                          "runs once, then one token per step)")
    gen.add_argument("--checkpoint", default="runs/latest", help="run directory (default runs/latest)")
    gen.add_argument("--prompt", default="def ", help="text to continue; for an encoder-decoder "
                                                      "(seq2seq) run, the source to transform")
    gen.add_argument("--tokens", type=int, default=200, help="tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=50)
    gen.add_argument("--beams", type=int, default=1,
                     help="beam search with this many beams (encoder-decoder runs, --temperature 0)")
    gen.add_argument("--no-cache", action="store_true",
                     help="recompute the whole context for every token (decoder-only; for comparison)")
    gen.add_argument("--seed", type=int, default=0)


def _eval_args(sub) -> None:
    """`shardlm eval`: a run's (or a transformers directory's) held-out figures."""
    ev = sub.add_parser("eval", help="a trained run's val_loss, val_perplexity and "
                                     "val_token_accuracy on its held-out split (or --data.* "
                                     "overrides: e.g. --data.val_source=test.parquet), one JSON "
                                     "line; --base: its base checkpoint's beside it")
    ev.add_argument("--checkpoint", default="runs/latest",
                    help="run directory (default runs/latest), or a transformers directory (with "
                         "--data.source / --data.val_source, --data.format)")
    ev.add_argument("--base", action="store_true",
                    help="also score the run's model.hf_path, untrained, on the same split (a "
                         "second JSON line)")


def _export_args(sub) -> None:
    """`shardlm export`: a run in transformers' or peft's format."""
    exp = sub.add_parser("export", help="write a trained run in another library's format")
    exp.add_argument("--checkpoint", default="runs/latest", help="run directory (default runs/latest)")
    exp.add_argument("--format", choices=["hf", "peft"], default="hf",
                     help="hf: a transformers directory (the class of the run's model.family: GPT-2, "
                          "Llama, Qwen, Gemma, ... docs/finetuning.md; a LoRA run's base, or "
                          "merged with --merge); "
                          "peft: a LoRA run's adapters (adapter_config.json + "
                          "adapter_model.safetensors) for that base")
    exp.add_argument("--merge", action="store_true",
                     help="with --format hf, a LoRA run: fold the adapters into the weights, "
                          "W + (alpha/r) B A")
    exp.add_argument("--out", required=True, help="output directory")
    exp.add_argument("--force", action="store_true",
                     help="write into a non-empty output directory (files of the same names are "
                          "replaced)")


def _estimate_args(sub) -> None:
    """`shardlm estimate`: one configuration's memory and step time; its layout as options."""
    est = sub.add_parser(
        "estimate", help="per-rank memory and step time of one configuration, before running it",
        description="Predict per-rank memory by category (with the formula behind each line), "
                    "whether it fits, and the step time. Pure arithmetic: no GPU, no processes. "
                    "Exit status 0 if it fits, 1 if it does not.")
    planner_args(est)
    est.add_argument("--zero-stage", type=int, default=0, choices=[0, 1, 2, 3])
    est.add_argument("--micro-batch", type=int, default=1, metavar="B", help="sequences per rank per pass")
    est.add_argument("--grad-accum", type=int, default=1, metavar="M", help="micro-batches per step")
    est.add_argument("--dp-replicate", type=int, default=1, metavar="R")
    est.add_argument("--dp-shard", type=int, default=-1, metavar="N", help="-1: every rank left")
    for name, what in (("tp", "tensor-parallel degree"), ("cp", "context-parallel degree"),
                       ("pp", "pipeline-parallel degree (1f1b schedule, balanced split)"),
                       ("ep", "expert-parallel degree (modelled; not in the runtime yet)")):
        est.add_argument(f"--{name}", type=int, default=1, metavar="D", help=what)
    est.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false",
                     help="with --tp > 1: model plain tensor parallelism (default: sequence parallel)")
    est.add_argument("--recompute", default="none", choices=["none", "selective", "full"],
                     help="activation checkpointing (the config's activation.checkpoint)")
    est.add_argument("--offload-optimizer", default="none", choices=["none", "cpu", "nvme"])
    est.add_argument("--offload-params", default="none", choices=["none", "cpu", "nvme"],
                     help="stage 3 only")


def _plan_args(sub) -> None:
    """`shardlm plan`: the search's batch and ranking options."""
    plan = sub.add_parser(
        "plan", help="rank the strategies that fit by predicted throughput, and say why",
        description="Search data/tensor/pipeline/expert parallel degrees, ZeRO stage, offload, "
                    "activation checkpointing and the micro-batch split of a fixed global batch; "
                    "list what fits, fastest first, and explain the choice.")
    planner_args(plan)
    plan.add_argument("--global-batch", type=int, metavar="SEQS",
                      help="sequences per optimizer step (default: --batch-tokens / --seq)")
    plan.add_argument("--batch-tokens", type=int, default=2**20, metavar="TOKENS",
                      help="tokens per optimizer step when --global-batch is not given (1Mi)")
    plan.add_argument("--runtime-only", action="store_true",
                      help="only what `shardlm train` runs today")
    plan.add_argument("--top", type=int, default=8, help="plans to list")
    plan.add_argument("--rank-by", choices=["speed", "cost"], default="speed",
                      help="order plans by time to train (speed) or by cost for --tokens (on one "
                           "cluster the two agree: same devices, same price)")


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from shardlm.checkpoint.weights import load_for_inference
    from shardlm.launch.runtime import pick_device
    from shardlm.data.tokenizer import eot_id
    from shardlm.models.decoder import generate
    from shardlm.models.hf import CausalLMAdapter, Seq2SeqAdapter
    from shardlm.models.hf_build import generate_causal
    from shardlm.models.seq2seq import generate_seq2seq

    device = pick_device("auto")
    model, tokenizer, cfg = load_for_inference(args.checkpoint, device)
    idx = torch.tensor([tokenizer.encode(args.prompt).ids], device=device)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    if isinstance(model, Seq2SeqAdapter):  # the prompt is the source; the target is printed
        if args.no_cache:
            raise ConfigError("--no-cache is for decoder-only runs; an encoder-decoder generates "
                              "with transformers' own cache")
        # The end token the targets were trained with (data/seq2seq.py): the checkpoint's eos,
        # or our BPE's <|endoftext|>.
        end = model.model.config.eos_token_id if cfg.model.hf_path else eot_id(tokenizer)
        out = generate_seq2seq(model, idx, torch.ones_like(idx), args.tokens, end,
                               temperature=args.temperature, top_k=args.top_k,
                               num_beams=args.beams, generator=generator)
    else:
        if args.beams != 1:
            raise ConfigError(f"--beams {args.beams}: beam search is for encoder-decoder runs; "
                              f"drop --beams (decoder-only runs sample or decode greedily)")
        if isinstance(model, CausalLMAdapter):  # the transformers path: the library's generate
            out = generate_causal(model, idx, args.tokens, temperature=args.temperature,
                                  top_k=args.top_k, generator=generator)
        else:
            out = generate(model, idx, args.tokens, temperature=args.temperature, top_k=args.top_k,
                           generator=generator, use_cache=not args.no_cache)
    print(tokenizer.decode(out[0].tolist()))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from shardlm.checkpoint.export import export_hf, export_peft

    if args.format == "peft":
        if args.merge:
            raise ConfigError("--merge goes with --format hf (a merged transformers model); "
                              "--format peft writes the adapters alone")
        out = export_peft(args.checkpoint, args.out, force=args.force)
        print(f"wrote {out} (load with peft.PeftModel.from_pretrained(base, {str(out)!r}), base: "
              f"`shardlm export --format hf` of the same run)")
        return 0
    out = export_hf(args.checkpoint, args.out, force=args.force, merge=args.merge)
    print(f"wrote {out} (load with transformers.AutoModelForCausalLM.from_pretrained({str(out)!r}))")
    return 0


def cmd_eval(args: argparse.Namespace, overrides: list[str]) -> int:
    """One JSON line per model: the run's (or a transformers directory's) figures; with --base,
    then its model.hf_path's on the same split, rendered and masked the same way."""
    import json

    from shardlm.checkpoint.hf_dir import is_hf_dir
    from shardlm.config.load import parse_overrides
    from shardlm.train.evaluate import evaluate_checkpoint

    parsed = parse_overrides(overrides)
    if is_hf_dir(args.checkpoint):
        if args.base:
            raise ConfigError(f"--base scores a run's model.hf_path beside the run; "
                              f"{args.checkpoint!r} is a transformers directory itself")
        print(json.dumps(evaluate_base(args.checkpoint, None, parsed)))
        return 0
    print(json.dumps(evaluate_checkpoint(args.checkpoint, parsed)))
    if args.base:
        print(json.dumps(evaluate_base(args.checkpoint, args.checkpoint, parsed)))
    return 0


def evaluate_base(hf_path: str, run: str | None, overrides: dict[str, str]) -> dict:
    """`shardlm eval` of a transformers directory as it is: `hf_path` (its config from
    `overrides`: data.*, train.seq_len, ...), or `run`'s model.hf_path under `run`'s config
    (without its adapters). The model is saved as a run of no steps in a temporary directory
    and scored by train.evaluate.evaluate_checkpoint: the same data, template, masks and sums
    as a trained run's evaluation."""
    import copy
    import tempfile
    from pathlib import Path

    import torch

    from shardlm.checkpoint.weights import load_config_json, resolve_run_dir, save_weights
    from shardlm.cli.chat import load_hf_for_inference
    from shardlm.train.evaluate import EDITABLE, evaluate_checkpoint

    editable = {k: v for k, v in overrides.items() if k.startswith(EDITABLE)}
    if run is None:
        model, tokenizer, cfg = load_hf_for_inference(hf_path, torch.device("cpu"), overrides)
    else:
        cfg = copy.deepcopy(load_config_json(resolve_run_dir(run)))
        if not cfg.model.hf_path:
            raise ConfigError(f"--base: {run!r} has no model.hf_path (trained from scratch): "
                              f"there is no base checkpoint to score beside it")
        hf_path = cfg.model.hf_path
        model, tokenizer, _ = load_hf_for_inference(hf_path, torch.device("cpu"))
        cfg.lora.rank, cfg.lora.quantize = 0, "none"  # the base alone
    with tempfile.TemporaryDirectory(prefix="shardlm-base-") as tmp:
        save_weights(Path(tmp) / "base", model, cfg.validate(), tokenizer)
        result = evaluate_checkpoint(Path(tmp) / "base", editable)
    return {**result, "checkpoint": str(hf_path)}


def cmd_presets() -> int:
    from shardlm.config.model import ModelConfig
    from shardlm.models.flops import count_params
    from shardlm.models.flops import active_params
    from shardlm.config.presets import ALIASES, PRESETS

    aliases = {v: k for k, v in ALIASES.items()}
    for name, shape in PRESETS.items():
        cfg = ModelConfig(preset=name, **shape)
        alias = f" (alias {aliases[name]})" if name in aliases else ""
        experts = (f" experts={cfg.experts} top-{cfg.top_k} ({active_params(cfg) / 1e6:.1f}M active)"
                   if cfg.experts else "")
        print(f"{name:21s} {count_params(cfg) / 1e6:10.1f}M  layers={cfg.n_layers:<3d} "
              f"d_model={cfg.d_model:<5d} heads={cfg.n_heads}/{cfg.n_kv_heads or cfg.n_heads} "
              f"vocab={cfg.vocab_size}{experts}{alias}")
    return 0


def joined_overrides(argv: list[str]) -> list[str]:
    """`--section.key value` as `--section.key=value`, so that argparse never takes the value for
    the optional CONFIG positional (`shardlm train --model.hf_path DIR` names no TOML file)."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if (arg.startswith("--") and "=" not in arg and "." in arg and i + 1 < len(argv)
                and not argv[i + 1].startswith("--")):
            out.append(f"{arg}={argv[i + 1]}")
            i += 2
            continue
        out.append(arg)
        i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = _parser()
    args, rest = parser.parse_known_args(joined_overrides(sys.argv[1:] if argv is None else argv))
    try:
        if args.command == "train":
            return cmd_train(args, rest)
        if args.command == "launch":
            return cmd_launch(args, rest)
        if args.command == "eval":
            return cmd_eval(args, rest)
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "export":
            return cmd_export(args)
        if args.command == "chat":
            return cmd_chat(args)
        if args.command == "presets":
            return cmd_presets()
        if args.command == "estimate":
            return cmd_estimate(args)
        if args.command == "plan":
            return cmd_plan(args)
        if args.command == "calibrate":
            return cmd_calibrate(args)
        if args.command == "study":
            return cmd_study(args)
        if args.command == "compare":
            return cmd_compare(args)
        parser.print_help()
        return 0
    except ConfigError as e:
        print(f"shardlm: error: {e}", file=sys.stderr)
        return 2
    except FloatingPointError as e:  # the non-finite guard: a clear stop, not a traceback
        print(f"shardlm: stopped: {e}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
