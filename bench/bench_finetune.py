"""Memory and speed of full fine-tuning vs LoRA vs QLoRA (lora.quantize = nf4), one process.

Each mode runs in a fresh subprocess (this script with --child): ZeRO stage 1 on one rank, bf16
compute, --steps steps. Measured: peak RSS (VmHWM, build included), the ledger
(model_state_bytes) beside the formula (full 16 Ψ, lora 2 Ψ + 16 Ψa, qlora 2 (Ψ - Ψq) +
0.516 Ψq + 16 Ψa, peft 2 Ψ + 12 Ψa bytes), tokens/s after the first step. "peft" is
transformers' Llama with peft's LoRA and a plain loop. --instruct DIR fine-tunes a saved
checkpoint on chats against the loop a user writes on it (bench/finetune_loop.py: loop,
loop-nodoc, qloop); step 1's losses must agree. --profile N prints each side's op table.
Results: docs/benchmarks.md, "Fine-tuning"; docs/finetuning.md.

Reproduce:
    PYTHONPATH=src python bench/bench_finetune.py --modes qlora,lora,peft          # llama-1b
    PYTHONPATH=src python bench/bench_finetune.py --modes qlora,lora,full,peft \
        --set model.n_layers=4 --set model.vocab_size=32000
    PYTHONPATH=src python bench/bench_finetune.py --modes lora@2,qlora@2      # ZeRO-3, 2 ranks
    PYTHONPATH=src python bench/bench_finetune.py --instruct /tmp/bench-instruct \
        --modes lora,loop,loop-nodoc,qlora,qloop --precision fp32 --seq 128 --micro-batch 4 --rank 8
    PYTHONPATH=src python bench/bench_finetune.py --instruct /tmp/bench-instruct --lockstep \
        --modes lora,loop,qlora,qloop --precision fp32 --seq 128 --micro-batch 4 --rank 8 --steps 9 \
        --run-steps 1000
--run-steps N: train.compile = 'auto' as a run of N steps decides it (a long fine-tune compiles
its blocks on a CPU: train/resolve.py decide_compile); without it the bench's few steps train eager.
--lockstep runs the modes side by side, one step of each in turn, and prints each step's ratio
too: on a shared VM whose speed drifts ±25% over minutes, the modes run one after another can
land in different phases of it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import (GiB, bench_parser, machine, peak_rss_bytes, prepare, reproduce, run_overrides, start_ranks, table,
                    timed_steps)
from shardlm.config.load import load_config


def profiled(step, at: int, rows: int) -> str:
    """torch.profiler's op table (top `rows` by self CPU time) of one more step, `step(at)`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(at)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


LOCKSTEP_ENV = "SHARDLM_BENCH_LOCKSTEP"
"""Set by --lockstep in each child: its steps wait for the parent's word (lockstep_turns)."""


def lockstep_turns():
    """None, or under --lockstep the `after` of timed_steps: say READY (built) and wait for the
    parent's word now, then after each step print STEPPED and wait for the word again (stdin's
    end after the last), all outside the timed steps: the parent runs one child's step at a
    time, the children in turn. The modes then share the machine's drift (±25% over minutes on a
    shared 2-core VM) step by step instead of one mode's whole run each."""
    if os.environ.get(LOCKSTEP_ENV) != "1":
        return None
    print("READY", flush=True)
    sys.stdin.readline()

    def stepped(step: int, seconds: float) -> None:
        print("STEPPED", flush=True)
        sys.stdin.readline()
    return stepped


def child(overrides: dict, steps: int, profile: int = 0) -> dict:
    from shardlm.launch.allocator import apply_malloc_policy
    from shardlm.train.build import build_run
    from shardlm.train.step import train_step

    cfg = load_config(overrides=overrides).validate()
    apply_malloc_policy(cfg.run.malloc_mmap_threshold)  # first, as shardlm.cli.train.train_here does
    start = time.perf_counter()
    run = build_run(cfg)
    build_s, build_rss = time.perf_counter() - start, peak_rss_bytes()
    timed = timed_steps(lambda step: train_step(run, step).loss, 0, steps, after=lockstep_turns())
    losses, times = timed["losses"], timed["seconds"]
    tokens = run.cfg.train.micro_batch * run.cfg.train.seq_len * run.cfg.train.grad_accum
    quant = getattr(run.model, "quant", None)
    lora = getattr(run.model, "lora", None)
    result = {"build_s": build_s, "build_rss": build_rss, "peak_rss": peak_rss_bytes(),
              "losses": losses, "step_s": times,
              "tokens_per_s": tokens * max(len(times) - 1, 1) / sum(times[1:] or times),
              "ledger": run.strategy.model_state_bytes(), "predicted": run.strategy.predicted_state_bytes(),
              "params": sum(p.numel() for p in run.model.parameters() if p.is_floating_point())
              + (quant.numel if quant else 0),
              "trainable": lora.trainable if lora else sum(p.numel() for p in run.model.parameters()),
              "quantized": quant.numel if quant else 0, "quantized_bytes": quant.nbytes if quant else 0,
              "threads": torch.get_num_threads()}
    # after the peak is read: the profiler's own records stay out of it
    return {**result, "profile": profiled(lambda step: train_step(run, step), steps, profile) if profile else ""}


def rank_child(rank: int, world_size: int, overrides: dict, steps: int) -> dict:
    """`child` on one of `world_size` spawned ranks (a mode "lora@2": ZeRO-3 over 2 ranks)."""
    return child(overrides, steps)


def ranks_child(overrides: dict, steps: int, ranks: int, directory: str) -> dict:
    """`child` on `ranks` ranks, ZeRO-3: the largest peak RSS of a rank, rank 0's ledger (every
    rank holds the same share), tokens/s of the whole group."""
    os.makedirs(directory, exist_ok=True)
    results = start_ranks(rank_child, ranks, directory, {**overrides, "parallel.zero_stage": 3}, steps)
    out = dict(results[0])
    out["peak_rss"] = max(r["peak_rss"] for r in results)
    out["build_rss"] = max(r["build_rss"] for r in results)
    out["tokens_per_s"] = sum(r["tokens_per_s"] for r in results)
    out["ranks"] = ranks
    return out


def peft_child(overrides: dict, steps: int, rank: int) -> dict:
    """What a user does today: transformers' LlamaForCausalLM of the same shape in bf16 (random
    weights), peft's LoRA on q/k/v/o/gate/up/down (ours fuses qkv and gate_up: the same
    adapted linears), torch's AdamW over the adapters, a plain loop, the same batch shape."""
    import transformers
    from peft import LoraConfig, get_peft_model

    from shardlm.checkpoint.export import hf_config

    cfg = load_config(overrides=overrides).validate()
    start = time.perf_counter()
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # built in bf16, as from_pretrained(dtype=bf16) loads
    model = transformers.LlamaForCausalLM(hf_config(cfg.model, None))
    torch.set_default_dtype(torch.float32)
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=16, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    for p in model.parameters():  # adapters in fp32, as our master copies (peft's autocast_adapter_dtype)
        if p.requires_grad:
            p.data = p.data.float()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    build_s, build_rss = time.perf_counter() - start, peak_rss_bytes()
    t = cfg.train
    ids = torch.randint(0, cfg.model.vocab_size, (t.micro_batch, t.seq_len + 1), generator=torch.Generator().manual_seed(0))

    def step(_: int) -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss)

    return plain_result(model, optimizer, timed_steps(step, 0, steps), t.micro_batch * t.seq_len,
                        build_s, build_rss)


def loop_child(overrides: dict, steps: int, rank: int, mode: str, profile: int = 0) -> dict:
    """The plain transformers + peft loop (finetune_loop.py) on shardlm's batches for `overrides`."""
    from finetune_loop import loop_step, plain_model, same_batches

    cfg = load_config(overrides=overrides).validate()
    loader = same_batches(cfg)
    start = time.perf_counter()
    model = plain_model(cfg.model.hf_path, cfg.precision.compute, rank, cfg.lora.alpha,
                        "nf4" if mode == "qloop" else "none")
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.train.lr)
    build_s, build_rss = time.perf_counter() - start, peak_rss_bytes()
    def step(at: int) -> float:
        return loop_step(model, optimizer, loader.micro_batches(at), mode != "loop-nodoc")

    timed = timed_steps(step, 0, steps, after=lockstep_turns())
    t = cfg.train
    result = plain_result(model, optimizer, timed, t.micro_batch * t.seq_len * t.grad_accum, build_s, build_rss)
    return {**result, "profile": profiled(step, steps, profile) if profile else ""}  # after the peak is read


def plain_result(model, optimizer, timed: dict, tokens: int, build_s: float, build_rss: int) -> dict:
    """A plain loop's row (peft_child, loop_child), in `child`'s keys: its parameters' and
    AdamW state's bytes for the ledger, no formula or prediction of ours."""
    times = timed["seconds"]
    return {"build_s": build_s, "build_rss": build_rss, "peak_rss": peak_rss_bytes(), "losses": timed["losses"],
            "step_s": times, "tokens_per_s": tokens * max(len(times) - 1, 1) / sum(times[1:] or times),
            "ledger": {"params": sum(p.numel() * p.element_size() for p in model.parameters()),
                       "optimizer": sum(v.numel() * v.element_size() for s in optimizer.state.values()
                                        for v in s.values() if torch.is_tensor(v))},
            "predicted": {}, "params": sum(p.numel() for p in model.parameters()),
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "quantized": 0, "quantized_bytes": 0, "threads": torch.get_num_threads()}


def formula(mode: str, r: dict, width: int = 2) -> float:
    """Model-state bytes per rank; a mode "X@N" is X's ZeRO-3 over N ranks: everything / N (the
    ledger counts this rank's shard; an adapter too small to split is padded, so a few bytes more).
    `width`: bytes of a compute-dtype element (bf16 2; fp32 4, where the master is the parameter,
    so what trains is 4 + 4 + 8 = 16 bytes as in bf16)."""
    mode, _, ranks = mode.partition("@")
    if ranks:
        return formula(mode, r, width) / int(ranks)
    psi, psi_a, psi_q = r["params"], r["trainable"], r["quantized"]
    if mode == "full":
        return 16 * psi
    if mode.startswith(("loop", "qloop")):  # measured, no formula of ours
        return float("nan")
    if mode == "peft":  # bf16 base, fp32 adapters and AdamW moments (no separate master)
        return 2 * (psi - psi_a) + 12 * psi_a
    base = width * (psi - psi_a)
    if mode == "qlora":
        base = width * (psi - psi_a - psi_q) + r["quantized_bytes"]
    return base + 16 * psi_a


def main() -> None:
    parser = bench_parser(__doc__, "llama-1b", 128, 1)
    parser.add_argument("--modes", default="qlora,lora,peft",
                        help="comma-separated: full, lora, qlora, peft (transformers + peft, a plain "
                             "loop); MODE@N: that mode with ZeRO-3 over N spawned ranks (lora@2)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16, help="lora.rank")
    parser.add_argument("--max-bytes", type=int, default=2_000_000, help="data.max_bytes")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="another config override, e.g. model.n_layers=4 (repeatable)")
    parser.add_argument("--dir", default="/tmp/bench-finetune")
    parser.add_argument("--instruct", default="", metavar="DIR",
                        help="fine-tune a SmolLM2-135M-Instruct-shaped checkpoint on chats, built "
                             "once in DIR (finetune_loop.py); modes loop, loop-nodoc, qloop: the "
                             "plain transformers + peft loop on the same batches")
    parser.add_argument("--chats", type=int, default=2000, help="--instruct: chats in the data (at most ~2,700)")
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after the timed steps, one more step under torch.profiler: print its N "
                             "ops of most self CPU time (one-process modes; not timed)")
    parser.add_argument("--lockstep", action="store_true",
                        help="run the modes side by side, one step of each in turn (step i of every "
                             "mode, then step i + 1): each built alone first, then timed under the "
                             "same drift of the machine; one-process modes (not peft, not MODE@N)")
    parser.add_argument("--run-steps", type=int, default=0, metavar="N",
                        help="train.compile = 'auto' decided as `shardlm train` decides it for a run "
                             "of N steps (default: --steps, which is short: eager); --set "
                             "train.compile=... overrides")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    overrides = {
        "model.preset": args.preset, "train.micro_batch": args.micro_batch, "train.seq_len": args.seq,
        "train.steps": args.steps, "train.lr": 1e-4, "data.max_bytes": args.max_bytes, "parallel.zero_stage": 1,
        "checkpoint.every": 0, **run_overrides(os.path.join(args.dir, "runs"), args.set, precision=args.precision)}
    if args.instruct:
        from finetune_loop import chat_jsonl, instruct_checkpoint

        root = Path(args.instruct)
        chats = chat_jsonl(root / "chats.jsonl", args.chats)
        overrides.update({"model.hf_path": str(instruct_checkpoint(root / "smollm2-135m-shape", chats)),
                          "data.source": str(chats), "data.format": "chat", "data.max_bytes": 0})
        overrides.pop("model.preset")
    modes = {"full": {}, "lora": {"lora.rank": args.rank},
             "qlora": {"lora.rank": args.rank, "lora.quantize": "nf4"}}
    compile_said = []
    if not any(item.startswith("train.compile=") for item in args.set):
        from shardlm.train.resolve import decide_compile

        steps = args.run_steps or args.steps
        wanted = [m.partition("@")[0] for m in ([args.child] if args.child else args.modes.split(","))]
        for mode in [m for m in wanted if m in modes]:  # a child decides for its own mode only
            cfg = load_config(overrides={**overrides, **modes[mode], "train.steps": steps}).validate()
            on, why, _ = decide_compile(cfg, torch.device("cpu"))
            modes[mode] = {**modes[mode], "train.compile": on}
            compile_said.append(f"{mode}: train.compile = auto for a run of {steps} steps: "
                                f"{'on' if on else 'off'} ({why})")
    if args.child:
        mode, _, ranks = args.child.partition("@")
        if mode == "peft":
            result = peft_child(overrides, args.steps, args.rank)
        elif mode in ("loop", "loop-nodoc", "qloop"):
            result = loop_child({**overrides, "lora.rank": args.rank}, args.steps, args.rank, mode, args.profile)
        else:
            result = (ranks_child({**overrides, **modes[mode]}, args.steps, int(ranks), args.dir) if ranks
                      else child({**overrides, **modes[mode]}, args.steps, args.profile))
        print("RESULT " + json.dumps(result), flush=True)
        return
    cfg = load_config(overrides=overrides).validate()
    prepare(cfg, 1, mmap_threshold=None, precision=args.precision)  # the children's allocator: their own
    model = f"{args.instruct} (SmolLM2-135M shape) on {args.chats} chats" if args.instruct else args.preset
    print(f"{machine()}; {model} {' '.join(args.set)}, {args.precision} compute, ZeRO stage 1 "
          f"on one process, batch {args.micro_batch}x{args.seq}, {args.steps} steps, lora.rank "
          f"{args.rank}", flush=True)
    for line in compile_said:
        print(line, flush=True)
    rows, width = [], 2 if args.precision == "bf16" else 4
    modes = args.modes.split(",")
    outputs = lockstep(modes, args.steps) if args.lockstep else [
        (mode, *_finished(subprocess.run([sys.executable, __file__, "--child", mode, *sys.argv[1:]],
                                         capture_output=True, text=True))) for mode in modes]
    for mode, code, stdout, stderr in outputs:
        found = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
        if code or not found:
            print(f"{mode}: FAILED (exit {code})\n{stderr[-3000:]}", flush=True)
            continue
        r = json.loads(found[-1][len("RESULT "):])
        rows.append((mode, r))
        ledger = sum(r["ledger"].values())
        print(f"{mode}: peak RSS {r['peak_rss'] / GiB:.2f} GiB (after build {r['build_rss'] / GiB:.2f}), "
              f"ledger {ledger / GiB:.2f} GiB, formula {formula(mode, r, width) / GiB:.2f} GiB, "
              f"{r['tokens_per_s']:.1f} tokens/s (steps {[round(x, 2) for x in r['step_s']]} s), "
              f"build {r['build_s']:.0f} s, losses "
              f"{[round(x, 3) for x in r['losses']]}", flush=True)
        if r.get("profile"):
            print(f"{mode}: one step under torch.profiler, ops by self CPU time\n{r['profile']}", flush=True)
    header = ("mode", "trainable", "formula GiB", "ledger GiB", "peak RSS GiB", "tokens/s")
    print("\n" + table(header, [[mode, f"{r['trainable'] / 1e6:,.1f}M of {r['params'] / 1e6:,.1f}M",
                                 f"{formula(mode, r, width) / GiB:.2f}", f"{sum(r['ledger'].values()) / GiB:.2f}",
                                 f"{r['peak_rss'] / GiB:.2f}", f"{r['tokens_per_s']:.1f}"] for mode, r in rows]))
    found = dict(rows)
    for ours, theirs in (("lora", "loop"), ("lora", "loop-nodoc"), ("qlora", "qloop"), ("qlora", "loop")):
        if ours in found and theirs in found:
            a, b = found[ours], found[theirs]
            # the same step's batch on both sides: each step's ratio, after the first
            paired = sorted(y / x for x, y in zip(a["step_s"][1:], b["step_s"][1:]))
            print(f"shardlm {ours} / plain {theirs}: {a['tokens_per_s'] / b['tokens_per_s']:.2f}x tokens/s"
                  + (f" (step by step: median {statistics.median(paired):.2f}x, {paired[0]:.2f}-"
                     f"{paired[-1]:.2f}x)" if paired else "")
                  + f", peak RSS {a['peak_rss'] / GiB:.2f} / {b['peak_rss'] / GiB:.2f} GiB; step-1 loss "
                  f"{a['losses'][0]:.4f} / {b['losses'][0]:.4f}")
    print(f"\n{reproduce()}")


def _finished(proc: subprocess.CompletedProcess) -> tuple[int, str, str]:
    return proc.returncode, proc.stdout, proc.stderr


def lockstep(modes: list[str], steps: int) -> list[tuple[str, int, str, str]]:
    """--lockstep: each mode's child started and built in turn (alone on the machine), then step
    i of every mode in the order given before step i + 1 of any; (mode, exit code, stdout,
    stderr) of each once all have finished."""
    if any(m == "peft" or "@" in m for m in modes):
        raise SystemExit("--lockstep: one-process modes only (not peft, not MODE@N)")
    env = {**os.environ, LOCKSTEP_ENV: "1"}
    children, outs = [], []  # by position: a mode may be given twice
    for mode in modes:
        err = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a chatty child never blocks
        proc = subprocess.Popen([sys.executable, __file__, "--child", mode, *sys.argv[1:]], env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
        children.append((mode, proc, err))
        outs.append(_read_until(proc, "READY"))  # built before the next one starts
    for _ in range(steps):
        for i, (_, proc, _) in enumerate(children):
            try:
                proc.stdin.write("go\n")
                proc.stdin.flush()
            except (BrokenPipeError, ValueError):  # it died: its exit code and stderr say why
                continue
            outs[i] += _read_until(proc, "STEPPED")
    results = []
    for (mode, proc, err), out in zip(children, outs):
        rest, _ = proc.communicate()
        err.seek(0)
        results.append((mode, proc.returncode, out + rest, err.read()))
    return results


def _read_until(proc: subprocess.Popen, word: str) -> str:
    """The child's stdout up to and including the line `word` (or its end, if it died)."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.strip() == word:
            break
    return "".join(lines)


if __name__ == "__main__":
    main()
