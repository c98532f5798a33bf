"""Chaos as data: the tiny run every chaos trial trains, and the disk and input faults (issue 25,
part B), deterministic cases each checked once. bench/chaos.py imports this module (never the
other way).

    python bench/chaos.py --cases all            # every case below (about a minute)
    python bench/chaos.py --cases disk_full_2_ranks,lora_rank_too_large

Each case runs `shardlm train` in a fresh process (a disk fault injected by a sitecustomize on
PYTHONPATH) and checks the exit status, one message and no traceback, no `.part` left, `latest`
where it should be, and for a refused input no run directory.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from common.cli import read_jsonl, train_argv


def overrides(root: Path, name: str, steps: int, every: int) -> dict:
    """The run's config: tiny, fp32 (bitwise resume), every step logged."""
    return {"model.preset": "gpt-tiny", "precision.compute": "fp32", "train.seq_len": 64,
            "train.micro_batch": 8, "train.steps": steps, "train.warmup_steps": 2,
            "train.eval_every": 0, "train.eval_batches": 2, "train.sample_tokens": 0,
            "train.log_every": 1, "data.max_bytes": 1_000_000, "checkpoint.every": every,
            "run.dir": str(root / "runs"), "run.name": name, "run.progress": "off"}


def command(root: Path, name: str, steps: int, every: int, *extra: str,
            restarts: int = 3) -> list[str]:
    """The run as 2 ranks under torchrun, restarted up to `restarts` times."""
    return train_argv(overrides(root, name, steps, every), *extra, nproc=2, restarts=restarts)


def losses(run_dir: Path) -> dict[int, float]:
    """step -> loss, the later record winning (a resumed run logs its steps again)."""
    return {r["step"]: r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl", "loss")}


_FSYNC_FAILS = """
import errno, os
_real_fsync, _latest = os.fsync, os.environ["SHARDLM_CHAOS_FULL_AFTER"]
_code = getattr(errno, os.environ.get("SHARDLM_CHAOS_ERRNO", "ENOSPC"))
def _fsync(fd):
    name = os.readlink(f"/proc/self/fd/{fd}") if isinstance(fd, int) else ""
    if name.endswith(".safetensors.part") and os.path.exists(_latest):
        raise OSError(_code, os.strerror(_code))
    return _real_fsync(fd)
os.fsync = _fsync
"""


@dataclass
class Case:
    name: str
    expected: str
    exit_code: int | None = None
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems


def _train(root: Path, name: str, *args: str, nproc: int = 0, steps: int = 4, every: int = 2,
           env: dict | None = None, resume: list[str] | None = None) -> tuple[int, str]:
    """`shardlm train` (under --nproc when nproc > 0) on the tiny config, `args` replacing its
    keys (an `--x=` drops x); (exit, its output)."""
    given = {a.split("=", 1)[0] for a in args}
    values = {k: v for k, v in overrides(root, name, steps, every).items() if f"--{k}" not in given}
    argv = train_argv(values, *[a for a in args if not a.endswith("=")],
                      *(["--resume", *resume] if resume is not None else []), nproc=nproc)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})
    (root / f"{name}.log").write_text(proc.stdout + proc.stderr)
    return proc.returncode, proc.stdout + proc.stderr


def _latest(run_dir: Path) -> str | None:
    try:
        return json.loads((run_dir / "checkpoints" / "latest").read_text())["step_dir"]
    except (OSError, ValueError, KeyError):
        return None


def _check(case: Case, condition: bool, problem: str) -> None:
    if not condition:
        case.problems.append(problem)


def _disk_full(root: Path, case: Case, code: str, nproc: int, *args: str) -> None:
    hooks = root / "hooks"
    hooks.mkdir(exist_ok=True)
    (hooks / "sitecustomize.py").write_text(_FSYNC_FAILS)
    run_dir = root / "runs" / case.name
    env = {"PYTHONPATH": os.pathsep.join([str(hooks), os.environ.get("PYTHONPATH", "")]),
           "SHARDLM_CHAOS_FULL_AFTER": str(run_dir / "checkpoints" / "latest"),
           "SHARDLM_CHAOS_ERRNO": code}
    case.exit_code, out = _train(root, case.name, *args, nproc=nproc, env=env)
    _check(case, case.exit_code == 4, f"exit {case.exit_code}, not 4")
    _check(case, f"({code})" in out and "checkpoint step-00000004: writing" in out,
           "no message naming the checkpoint file and the errno")
    _check(case, "MB free there" in out, "no bytes needed / free in the message")
    _check(case, "Traceback" not in out, "a traceback")
    _check(case, not [p for p in run_dir.rglob("*") if p.name.endswith(".part")], ".part left")
    _check(case, _latest(run_dir) == "step-00000002", f"latest is {_latest(run_dir)}")


def case_disk_full_2_ranks(root: Path, case: Case) -> None:
    _disk_full(root, case, "ENOSPC", 2)


def case_quota_exceeded_async_save(root: Path, case: Case) -> None:
    _disk_full(root, case, "EDQUOT", 0, "--checkpoint.async=true")


def _corrupted_run(root: Path, case: Case) -> Path:
    """A finished 2-rank ZeRO-3 run with checkpoints at steps 2 and 4, one bit of step 4's rank-1
    shard flipped (same size: only its SHA-256, checked when loading, tells)."""
    code, _ = _train(root, case.name, "--parallel.zero_stage=3", nproc=2)
    run_dir = root / "runs" / case.name
    shard = run_dir / "checkpoints" / "step-00000004" / "rank-00001.safetensors"
    if code != 0 or not shard.exists():  # no 2-rank shard layout: the case cannot be set up
        raise RuntimeError(f"setting up {case.name} failed (exit {code})")
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    return run_dir


def case_resume_run_dir_with_corrupted_shard(root: Path, case: Case) -> None:
    run_dir = _corrupted_run(root, case)
    case.exit_code, out = _train(root, case.name, "--train.steps=6", "--parallel.zero_stage=3",
                                 nproc=2, resume=[str(run_dir)])
    _check(case, case.exit_code == 0, f"exit {case.exit_code}, not 0")
    _check(case, "step-00000004/rank-00001.safetensors is corrupt" in out,
           "the rejected checkpoint and its reason not logged")
    _check(case, f"resumed from {run_dir / 'checkpoints' / 'step-00000002'}" in out,
           "did not resume from step 2")
    _check(case, max(losses(run_dir), default=0) == 6, "did not finish step 6")


def case_resume_named_corrupted_checkpoint(root: Path, case: Case) -> None:
    run_dir = _corrupted_run(root, case)
    ckpt = run_dir / "checkpoints" / "step-00000004"
    case.exit_code, out = _train(root, case.name, "--train.steps=6", "--parallel.zero_stage=3",
                                 nproc=2, resume=[str(ckpt)])
    _check(case, case.exit_code == 2, f"exit {case.exit_code}, not 2")
    _check(case, "rank-00001.safetensors is corrupt" in out, "the reason not given")


def _refused(root: Path, case: Case, *args: str, says: str) -> None:
    case.exit_code, out = _train(root, case.name, *args, steps=1, every=0)
    _check(case, case.exit_code == 2, f"exit {case.exit_code}, not 2")
    _check(case, says in out, f"no message with {says!r}")
    _check(case, "Traceback" not in out, "a traceback")
    _check(case, not (root / "runs" / case.name).exists(), "the run directory was made")


def case_invalid_hf_tokenizer(root: Path, case: Case) -> None:
    hf = root / "hf-bad-tokenizer"
    hf.mkdir(exist_ok=True)
    (hf / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 512,
        "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6, "eos_token_id": 1}))
    (hf / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": ')
    _refused(root, case, f"--model.hf_path={hf}", "--model.preset=", "--train.seq_len=32",
             says=f"its tokenizer {str(hf / 'tokenizer.json')!r}")


def case_lora_rank_too_large(root: Path, case: Case) -> None:
    _refused(root, case, "--lora.rank=65", says="lora.rank = 65 is larger than the layers it adapts")


def case_random_bytes_named_txt(root: Path, case: Case) -> None:
    corpus = root / "corpus-random"
    corpus.mkdir(exist_ok=True)
    (corpus / "a.txt").write_text("def f(x):\n    return x + 1\n" * 4000)
    (corpus / "b.txt").write_bytes(random.Random(0).randbytes(100_000))
    _refused(root, case, f"--data.source={corpus}", f"--data.cache_dir={root / 'cache'}",
             says=f"{str(corpus / 'b.txt')!r} is not UTF-8 text")


CASES = {
    "disk_full_2_ranks": ("exit 4, one message, no .part, latest kept", case_disk_full_2_ranks),
    "quota_exceeded_async_save": ("exit 4, one message, no .part, latest kept",
                                  case_quota_exceeded_async_save),
    "resume_run_dir_with_corrupted_shard": ("falls back to step 2, says why, finishes",
                                            case_resume_run_dir_with_corrupted_shard),
    "resume_named_corrupted_checkpoint": ("refused, says why", case_resume_named_corrupted_checkpoint),
    "invalid_hf_tokenizer": ("exit 2 naming the file, no run dir", case_invalid_hf_tokenizer),
    "lora_rank_too_large": ("exit 2 naming the layers, no run dir", case_lora_rank_too_large),
    "random_bytes_named_txt": ("exit 2 naming the file, no run dir", case_random_bytes_named_txt),
}
"""name -> (what must happen, the case). Append new cases here."""
