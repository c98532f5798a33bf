"""Exit stress (issue 25): finished runs must exit 0, every time. Each configuration that aborted
at interpreter exit (`terminate called without an active exception`) is run --repeat times
through the real command line, and the outcomes are counted.

    python bench/stress_exit.py                      # --repeat 200 of each (hours on 2 cores)
    python bench/stress_exit.py --repeat 20 --only zero3-offload

Configurations (3 steps of a tiny model): zero3-offload, zero3 (`shardlm train --nproc 2`),
torchrun-agents (two torchrun agents on loopback). 'aborted': the output says `terminate called`
or a worker exits -6; 'failed': any other non-zero exit. tests/test_exit_stress.py is the CI form.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from common import machine, reproduce, table
from common.cli import src_env, train_argv

TINY = ["--precision.compute=fp32", "--train.seq_len=64", "--train.micro_batch=8", "--train.steps=3",
        "--train.warmup_steps=1", "--train.eval_every=0", "--train.eval_batches=2",
        "--train.sample_tokens=0", "--data.max_bytes=1000000", "--run.progress=off",
        "--run.device=cpu"]
CONFIGS = {
    "zero3-offload": ["--model.preset=llama-tiny", "--parallel.zero_stage=3", "--activation.offload=cpu"],
    "zero3": ["--model.preset=gpt-tiny", "--parallel.zero_stage=3"],
    "torchrun-agents": ["--model.preset=gpt-tiny", "--parallel.zero_stage=3"],
}
TIMEOUT_S = 300


def local_command(config: str, run_dir: Path) -> list[str]:
    return train_argv({}, *CONFIGS[config], *TINY, f"--run.dir={run_dir}", nproc=2)


def run_local(config: str, run_dir: Path) -> tuple[int, str]:
    done = subprocess.run(local_command(config, run_dir), env=src_env(), capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    return done.returncode, done.stdout + done.stderr


def agents_command(config: str, run_dir: Path, port: int, name: str) -> list[str]:
    """One agent of a 2-node torchrun job on loopback (what `shardlm launch --target torchrun`
    writes, with the store hosted by this script: is_host=0)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={name}",
            "--rdzv-conf=is_host=0,last_call_timeout=2", "--local-addr=127.0.0.1",
            "-m", "shardlm", "train", *CONFIGS[config], *TINY, f"--run.dir={run_dir}",
            f"--run.name={name}"]


def run_agents(config: str, run_dir: Path) -> tuple[int, str]:
    from shardlm.launch.runtime import loopback_store
    from shardlm.launch.local import loopback_interface

    store = loopback_store("127.0.0.1", 0, True, datetime.timedelta(seconds=TIMEOUT_S))
    name = uuid.uuid4().hex[:12]
    env = src_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1",
                  GLOO_SOCKET_IFNAME=loopback_interface())
    with tempfile.TemporaryDirectory() as logs:
        agents = [subprocess.Popen(agents_command(config, run_dir, store.port, name), env=env,
                                   stdout=open(Path(logs) / f"agent{i}.log", "w"),
                                   stderr=subprocess.STDOUT) for i in range(2)]
        deadline = time.monotonic() + TIMEOUT_S
        codes = []
        for agent in agents:
            try:
                codes.append(agent.wait(max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                agent.kill()
                codes.append(agent.wait())
        text = "".join((Path(logs) / f"agent{i}.log").read_text() for i in range(2))
    del store
    return max(codes, key=abs), text


def classify(code: int, text: str) -> str:
    if "terminate called" in text or "exitcode  : -6" in text or "(SIGABRT)" in text:
        return "aborted"
    return "ok" if code == 0 else "failed"


def reproduce_config(config: str) -> str:
    """The one command a row stands for, as a user types it."""
    if config == "torchrun-agents":
        line = agents_command(config, Path("runs"), 29400, "job")
        return ("two agents (c10d store on 127.0.0.1:29400, is_host=0: host it, as this script "
                f"does): `{shlex.join(['python', *line[1:]])}`")
    return f"`{shlex.join(['shardlm', *local_command(config, Path('runs'))[3:]])}`"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=200, help="runs of each configuration")
    parser.add_argument("--only", choices=sorted(CONFIGS), action="append",
                        help="run only this configuration (repeatable)")
    parser.add_argument("--dir", type=Path, default=None, help="where the runs go (default: a temp dir)")
    args = parser.parse_args(argv)
    configs = args.only or list(CONFIGS)
    root = args.dir or Path(tempfile.mkdtemp(prefix="stress-exit-"))
    rows = []
    for config in configs:
        counts = {"ok": 0, "aborted": 0, "failed": 0}
        first_bad = ""
        start = time.monotonic()
        for i in range(args.repeat):
            run_dir = root / config
            code, text = (run_agents if config == "torchrun-agents" else run_local)(config, run_dir)
            outcome = classify(code, text)
            counts[outcome] += 1
            if outcome != "ok" and not first_bad:
                first_bad = text[-2000:]
            print(f"{config} {i + 1}/{args.repeat}: {outcome} (exit {code})", file=sys.stderr, flush=True)
        rows.append((config, counts, time.monotonic() - start))
        if first_bad:
            print(f"--- {config}: the first bad run's output (tail):\n{first_bad}", file=sys.stderr)
    header = ("configuration", "runs", "aborted (SIGABRT at exit)", "other failures", "s / run", "reproduce")
    print("\n" + table(header, [[config, sum(counts.values()), counts["aborted"], counts["failed"],
                                 f"{seconds / max(1, sum(counts.values())):.1f}", reproduce_config(config)]
                                for config, counts, seconds in rows]))
    print(f"\n{datetime.date.today()}, {machine()}\n{reproduce()}")
    return 0 if all(c["aborted"] == c["failed"] == 0 for _, c, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
