"""The whole GPU check in one run: the `cuda` test lane, then shardlm against a plain PyTorch
loop on one GPU (our decoder at Llama 3.2 1B's shape, bf16, seq 2048; the plain loop is what a
careful PyTorch user writes, on the same model, batches and schedule), shardlm's levers and the
long-context hop, written as one JSON + one markdown report into OUT_DIR. docs/gpu.md says what
each row is and how MFU is counted; each configuration runs in its own process.

    bash bench/gpu_check.sh OUT_DIR                # from a bare GPU machine (wheels in .whl/)
    PYTHONPATH=src python bench/gpu_check.py OUT_DIR [--skip-tests] [--only a,b] [--budget-s 420]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SHAPE = {"model.preset": "llama-1b", "model.vocab_size": 32000, "model.max_seq_len": 2048,
         "model.tie_embeddings": True}

CONFIGS: dict[str, tuple[str, dict]] = {
    # name: (loop, overrides beyond the common ones)
    "plain": ("plain", {}),
    "shardlm": ("shardlm", {}),
    "plain+compile": ("plain", {"train.compile": True}),
    "shardlm+compile": ("shardlm", {"train.compile": True}),
    "cp-hop-32k": ("hop", {"kernel": "fused"}),
    "cp-hop-32k-math": ("hop", {"kernel": "math"}),
    "zero3+cpu-optimizer": ("shardlm", {"parallel.zero_stage": 3, "zero.offload_optimizer": "cpu"}),
    "activation-offload": ("shardlm", {"activation.offload": "cpu"}),
    "recompute-full": ("shardlm", {"activation.checkpoint": "full"}),
    "recompute-selective": ("shardlm", {"activation.checkpoint": "selective"}),
    "fp8": ("shardlm", {"precision.compute": "fp8"}),
    "fp8+compile": ("shardlm", {"precision.compute": "fp8", "train.compile": True}),
}
SLOW = {"zero3+cpu-optimizer"}
"""Configurations whose step is seconds (a host AdamW over 1B parameters): fewer timed steps."""


TINY = {"model.preset": "llama-tiny", "model.max_seq_len": 64}
"""--tiny: a seconds-long smoke run of the script itself (with --device cpu, on any machine):
seq 64, every configuration in one child process, the hop at 512 tokens; FP8 emulated and
compiled rows listed as not run on a CPU (compiling takes minutes there)."""
SHAPE_NAME = {False: "llama-1b's shape (vocab 32000)", True: "llama-tiny"}
HOP = {"tokens": 32768, "heads": 2, "head_dim": 128}
"""The long-context row's hop (--tiny: 512 tokens)."""


def common_overrides(args, work: Path) -> dict:
    return {**(TINY if args.tiny else SHAPE), "precision.compute": "bf16", "run.device": args.device,
            "train.seq_len": args.seq,
            "train.micro_batch": args.micro_batch, "train.steps": 1000, "train.warmup_steps": 10,
            "train.eval_every": 0, "train.sample_tokens": 0, "checkpoint.every": 0,
            "data.max_bytes": 4_000_000, "run.dir": str(work / "runs"), "run.progress": "off"}


# -- one configuration, in its own process ------------------------------------------------------


def matmul_tflops(n: int = 8192, reps: int = 10) -> float:
    import torch

    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    return 2 * n ** 3 * reps / (time.perf_counter() - start) / 1e12


def _plain(overrides: dict, warmup: int, timed: int) -> dict:
    """The plain PyTorch loop on shardlm's model and batches."""
    import torch
    import torch.nn.functional as F

    from shardlm.config.load import load_config
    from shardlm.data.loader import Loader, build_dataset
    from shardlm.models.decoder import build_model
    from shardlm.parallel.data.zero.optim import lr_at, param_groups

    cfg = load_config(overrides=overrides).validate()
    t, device = cfg.train, torch.device(cfg.run.device)
    dataset = build_dataset(cfg.data, cfg.model.vocab_size, None, t.seq_len)
    loader = Loader(dataset.train, t.seq_len, t.micro_batch, 1, t.seed)
    model = build_model(cfg.model, device, seed=t.seed)
    # shardlm's schedule and weight-decay groups, so both loops take the same steps
    optimizer = torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2),
                                  eps=t.eps, fused=True)
    forward = torch.compile(model) if t.compile else model

    def step(i: int) -> float:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(i, t)
        (x, y), = loader.micro_batches(i)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = forward(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return _timed(step, warmup, timed, cfg)


def _shardlm(overrides: dict, warmup: int, timed: int) -> dict:
    from shardlm.config.load import load_config
    from shardlm.train.build import build_run
    from shardlm.train.step import train_step

    run = build_run(load_config(overrides=overrides).validate())
    return _timed(lambda i: train_step(run, i).loss, warmup, timed, run.cfg)


def _clock(step, warmup: int, timed: int, cuda: bool) -> tuple[list, float, float]:
    """step(i)'s results over `warmup` then `timed` calls, the warm-up's seconds and the
    timed calls' mean, each span closed by a device synchronisation."""
    import torch

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    results, spans, start = [], [], time.perf_counter()
    for first, count in ((0, warmup), (warmup, timed)):
        results += [step(i) for i in range(first, first + count)]
        sync()
        spans.append(time.perf_counter() - start)
        start = time.perf_counter()
    return results, spans[0], spans[1] / timed


def _timed(step, warmup: int, timed: int, cfg) -> dict:
    import torch

    from shardlm.models.flops import flops_per_token

    cuda = cfg.run.device.startswith("cuda")
    losses, warm_s, seconds = _clock(step, warmup, timed, cuda)
    return {"losses": losses, "warmup_s": warm_s, "step_s": seconds,
            "tokens_per_s": cfg.train.micro_batch * cfg.train.seq_len / seconds,
            "flops_per_token": flops_per_token(cfg.model, cfg.train.seq_len),
            "peak_device_bytes": torch.cuda.max_memory_allocated() if cuda else 0}


def _hop(kernel: str, args, timed: int) -> dict:
    """One context-parallel hop (the diagonal block: cp = 1) forward + backward, fused or math."""
    from shardlm.parallel.context import ring_blocks

    tokens = 512 if args.tiny else HOP["tokens"]
    heads, d = HOP["heads"], HOP["head_dim"]
    kernels = ring_blocks._has_cpu_flash, ring_blocks._has_cuda_fused
    if kernel == "math":  # the portable path every device has
        ring_blocks._has_cpu_flash = ring_blocks._has_cuda_fused = lambda q: False
    try:
        return _time_hop(ring_blocks, args.device, tokens, heads, d, timed, kernel)
    finally:
        ring_blocks._has_cpu_flash, ring_blocks._has_cuda_fused = kernels


def _time_hop(ring_blocks, device: str, tokens: int, heads: int, d: int, timed: int, kernel: str) -> dict:
    import torch

    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, heads, tokens, d, generator=g).to(device, torch.bfloat16) for _ in range(4))
    cuda = device.startswith("cuda")

    def step(i: int) -> None:
        out, lse = ring_blocks.block_forward(q, k, v, True, d ** -0.5)
        ring_blocks.block_backward(dout, q, k, v, out, lse, True, d ** -0.5)

    _, warm_s, seconds = _clock(step, 1, timed, cuda)
    return {"losses": [], "warmup_s": warm_s, "step_s": seconds, "tokens_per_s": tokens / seconds,
            "flops_per_token": 0, "peak_device_bytes": torch.cuda.max_memory_allocated() if cuda else 0,
            "shape": f"{tokens} tokens, {heads} heads of {d}, bf16, causal, {kernel}"}


def run_one(name: str, args) -> dict:
    import torch

    loop, extra = CONFIGS[name]
    if args.device == "cpu" and extra.get("train.compile"):
        return {"name": name, "not_run": "compile is not timed on a CPU (the smoke mode)"}
    work = Path(args.work)
    overrides = {**common_overrides(args, work), **extra, "run.name": name.replace("+", "-")}
    if args.device == "cpu" and extra.get("precision.compute") == "fp8":
        overrides["precision.fp8_emulate"] = True  # a CPU has no FP8 matmuls
    timed = max(2, args.timed // 3) if name in SLOW else args.timed
    try:
        if loop == "hop":
            out = _hop(extra["kernel"], args, max(1, timed // 4))
        else:
            out = (_plain if loop == "plain" else _shardlm)(overrides, args.warmup, timed)
    except torch.OutOfMemoryError as e:
        return {"name": name, "error": f"out of memory: {str(e).splitlines()[0]}"}
    out["name"] = name
    out["timed_steps"] = timed
    return out


def _caught(name: str, args) -> dict:
    """run_one, a failure its row's error (the CPU smoke runs every row in one process)."""
    import traceback

    try:
        return run_one(name, args)
    except Exception:  # noqa: BLE001 - reported in the row
        return {"name": name, "error": traceback.format_exc()[-1500:]}


# -- the whole check -----------------------------------------------------------------------------


def environment() -> dict:
    import importlib.metadata as md

    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "host": platform.node()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=torch.cuda.get_device_name(0), capability=f"{props.major}.{props.minor}",
                   gpu_memory_gib=round(props.total_memory / 2**30, 1), gpus=torch.cuda.device_count())
    for package in ("transformers", "peft", "torchao", "bitsandbytes", "triton"):
        try:
            env[package] = md.version(package)
        except md.PackageNotFoundError:
            env[package] = None
    return env


CUDA_MARK = re.compile(r"^(?:\w+ = pytest\.mark\.cuda|@pytest\.mark\.cuda)\b", re.M)  # a line that marks


def lane_files(folder: Path) -> list[Path]:
    """The test files in `folder` that mark `cuda` tests (pytestmark, a named mark, a decorator)."""
    return [p for p in sorted(folder.glob("test_*.py")) if CUDA_MARK.search(p.read_text())]


def run_tests(out: Path, timeout: int, where: str = "tests") -> dict:
    """pytest -m cuda over the files that mark `cuda` tests (tests/test_cuda*.py, test_watchdog.py):
    counts and each test's outcome."""
    import xml.etree.ElementTree as ET

    xml = out / "cuda-tests.xml"
    # Only files that mark `cuda` tests: a CPU module whose import the GPU image lacks (datasets)
    # is never collected. -n 0: the lane's tests share one GPU and read the process's peak.
    base = ROOT / where
    files = ([str(p.relative_to(ROOT)) for p in lane_files(base)] if base.is_dir() else [where])
    command = [sys.executable, "-m", "pytest", "-m", "cuda", *files, "-q", "-rA", "-n", "0",
               "--continue-on-collection-errors",
               "-p", "no:cacheprovider", f"--junitxml={xml}", "-s"]
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        log, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        log, code = f"{e.stdout or ''}{e.stderr or ''}\nTIMED OUT after {timeout} s", -1
    (out / "cuda-tests.log").write_text(log if isinstance(log, str) else log.decode())
    cases = {}
    if xml.exists():
        for case in ET.parse(xml).getroot().iter("testcase"):
            outcome = "passed"
            for tag in ("failure", "error", "skipped"):
                node = case.find(tag)
                if node is not None:
                    outcome = f"{tag}: {(node.get('message') or '')[:300]}"
            cases[case.get("name")] = outcome
        xml.unlink()
    return {"exit_code": code, "seconds": round(time.perf_counter() - start, 1), "cases": cases}


def run_bench(args, out: Path, deadline: float) -> tuple[list[dict], float | None]:
    names = [n for n in CONFIGS if not args.only or n in args.only.split(",")]
    rows = []
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    env = {**os.environ, "SHARDLM_CACHE": str(work / "cache"), "PYTHONUNBUFFERED": "1"}
    matmul = None
    try:
        import torch

        matmul = matmul_tflops() if args.device == "cuda" else None
        torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001 - reported, the rest still runs
        print(f"matmul probe failed: {e}", flush=True)
    # one process per configuration on a GPU (an out-of-memory ends that row only); the CPU
    # smoke mode runs them all in one child (imports and the tokenizer once)
    groups = [[n] for n in names] if args.device != "cpu" else [names]
    for group in groups:
        left = deadline - time.monotonic()
        if left < 30:
            rows += [{"name": name, "error": "not run: the check's time budget was spent"} for name in group]
            continue
        result_file = work / f"{group[0]}.json"
        command = [sys.executable, __file__, "--one", ",".join(group), "--work", str(work), "--result", str(result_file),
                   "--seq", str(args.seq), "--micro-batch", str(args.micro_batch),
                   "--device", args.device, *(["--tiny"] if args.tiny else []),
                   "--warmup", str(args.warmup), "--timed", str(args.timed)]
        print(f"== {', '.join(group)}", flush=True)
        limit = min(left, args.config_timeout_s * len(group))
        try:
            proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
            tail = (proc.stdout + proc.stderr)[-1500:]
            got = (json.loads(result_file.read_text()) if result_file.exists()
                   else [{"name": name, "error": f"exit {proc.returncode}: {tail}"} for name in group])
        except subprocess.TimeoutExpired:
            got = [{"name": name, "error": f"timed out after {limit:.0f} s"} for name in group]
        for row in got:
            print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
        rows += got
    peak = 989e12  # H100 / H200 SXM dense bf16 (hardware.catalog)
    for row in rows:
        if row.get("flops_per_token"):
            achieved = row["tokens_per_s"] * row["flops_per_token"]
            row["mfu"] = achieved / peak
            row["mfu_of_matmul"] = achieved / (matmul * 1e12) if matmul else None
    return rows, matmul


def markdown(report: dict) -> str:
    from common import table  # bench/ is on sys.path: this script's own directory

    env, lines = report["environment"], []
    lines.append(f"# GPU check — {env.get('gpu', 'no GPU')} ({report['date']})\n")
    lines.append(f"torch {env['torch']} (CUDA {env['cuda']}), Python {env['python']}, transformers "
                 f"{env['transformers']}, peft {env['peft']}, torchao {env['torchao']}, bitsandbytes "
                 f"{env['bitsandbytes']}. Reproduce: `{report['command']}`\n")
    tests = report.get("tests")
    if tests:
        counts = collections.Counter(outcome.split(":")[0] for outcome in tests["cases"].values())
        lines.append(f"## cuda tests: {', '.join(f'{v} {k}' for k, v in counts.items())} "
                     f"(exit {tests['exit_code']}, {tests['seconds']} s)\n")
        lines += [f"- `{name}`: {outcome}" for name, outcome in tests["cases"].items()]
        lines.append("")
    rows = report.get("bench") or []
    if rows:
        matmul = report.get("matmul_tflops")
        lines.append(f"## Benchmark: {report['bench_shape']}\n")
        lines.append(f"Measured 8192³ bf16 matmul: {matmul:.0f} TFLOP/s. MFU against 989 TFLOP/s "
                     f"(dense bf16 peak) and against that matmul.\n" if matmul else "")
        cells = []
        for row in rows:
            if "error" in row or "not_run" in row:
                why = f"not run: {row['not_run']}" if "not_run" in row else str(row["error"][:200])
                cells.append([row["name"], "—", "—", "—", "—", "—", why, "—"])
                continue
            losses = ", ".join(f"{x:.4f}" for x in row["losses"][:3]) or row.get("shape", "")
            of_matmul = f"{row['mfu_of_matmul']:.1%}" if row.get("mfu_of_matmul") else "—"
            mfu = f"{row['mfu']:.1%}" if row.get("mfu") else "—"
            cells.append([row["name"], f"{row['tokens_per_s']:,.0f}", f"{row['step_s']:.3f}", mfu,
                          of_matmul, f"{row['peak_device_bytes'] / 2**30:.1f}", losses, f"{row['warmup_s']:.1f}"])
        lines.append(table(("configuration", "tokens/s", "step (s)", "MFU (989)", "MFU (matmul)",
                            "peak memory (GiB)", "first losses (or the hop)", "warm-up (s)"), cells))
        by = {r["name"]: r for r in rows if "tokens_per_s" in r}
        ratios = [(a, b) for a, b in (("shardlm", "plain"), ("shardlm+compile", "plain+compile"))
                  if a in by and b in by]
        if ratios:
            lines.append("")
            lines += [f"- {a} / {b}: {by[a]['tokens_per_s'] / by[b]['tokens_per_s']:.3f}x tokens/s"
                      for a, b in ratios]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", help="directory for gpu_check.json / gpu_check.md / cuda-tests.log")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--only", default="", help="comma-separated configurations: " + ", ".join(CONFIGS))
    parser.add_argument("--budget-s", type=float, default=450, help="the whole check's time budget")
    parser.add_argument("--tests-timeout-s", type=int, default=300)
    parser.add_argument("--tests", default="tests", help="where pytest looks for `cuda` tests: a folder or one file")
    parser.add_argument("--config-timeout-s", type=float, default=150)
    parser.add_argument("--seq", type=int, default=None, help="2048 (--tiny: 64)")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timed", type=int, default=8)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (with --tiny)")
    parser.add_argument("--tiny", action="store_true", help="llama-tiny instead of the 1B shape")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.seq = args.seq or (64 if args.tiny else 2048)
    sys.path.insert(0, str(ROOT / "src"))
    if args.one:
        rows = [_caught(name, args) for name in args.one.split(",")]
        Path(args.result).write_text(json.dumps(rows))
        return 0
    if not args.out:
        parser.error("OUT_DIR is required")
    deadline = time.monotonic() + args.budget_s
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "environment": environment(),
              "command": "bash bench/gpu_check.sh OUT_DIR",
              "bench_shape": f"our decoder at {SHAPE_NAME[args.tiny]}, bf16, seq {args.seq}, "
                             f"micro-batch {args.micro_batch}, {args.warmup} warm-up + {args.timed} "
                             f"timed steps"}
    print(json.dumps(report["environment"]), flush=True)
    if not args.skip_tests:
        report["tests"] = run_tests(out, args.tests_timeout_s, args.tests)
        print(json.dumps(report["tests"], indent=1), flush=True)
        (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    if not args.skip_bench:
        report["bench"], report["matmul_tflops"] = run_bench(args, out, deadline)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    (out / "gpu_check.md").write_text(markdown(report))
    print(markdown(report), flush=True)
    failed = report.get("tests", {}).get("exit_code", 0) not in (0,)
    return 1 if failed or any("error" in r for r in report.get("bench", [])) else 0


if __name__ == "__main__":
    sys.exit(main())
