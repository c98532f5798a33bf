"""Fault-tolerant replicas (parallel.fault_tolerant): a run that loses a replica mid-way, against
the same run without a fault, and against ordinary dp_replicate = 2 training.

Three runs of `shardlm train --nproc 2`: ordinary (dp_replicate = 2), fault-free
(parallel.fault_tolerant = true) and killed (replica 1 SIGKILLed after step --kill, restarted,
rejoining from replica 0's state). For each: wall time, replica 0's loss and quorum per step; for
the killed run the seconds to rejoin, the steps alone and the samples missed. Curves to --plot.

    PYTHONPATH=src python bench/bench_fault_tolerance.py                 # gpt-mini, kill at 10 of 30
    PYTHONPATH=src python bench/bench_fault_tolerance.py --preset gpt-tiny --seq 64 --steps 12 --kill 4
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import machine, plot, reproduce, table
from common.cli import read_jsonl, src_env, train_argv


def launch(root: Path, name: str, args, fault_tolerant: bool, kill: int = 0) -> dict:
    """One `shardlm train --nproc 2` run; its wall time, its output lines with their times."""
    values = {"model.preset": args.preset, "precision.compute": "fp32", "run.device": "cpu",
              "train.seq_len": args.seq, "train.micro_batch": args.micro_batch,
              "train.steps": args.steps, "train.warmup_steps": 3, "train.eval_every": 0,
              "train.eval_batches": 4, "train.sample_tokens": 0, "data.max_bytes": 3_000_000,
              "run.dir": str(root), "run.name": name, "run.progress": "off",
              "parallel.dp_replicate": 2, "parallel.fault_tolerant": fault_tolerant}
    env = src_env(**({"SHARDLM_REPLICA_FAULTS": f"1:kill@{kill}"} if kill else {}))
    argv = train_argv(values, nproc=2, restarts=1 if kill else None, unbuffered=True)
    lines: list[tuple[float, str]] = []
    start = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    reader = threading.Thread(target=lambda: lines.extend((time.perf_counter() - start, l) for l in proc.stdout))
    reader.start()
    code = proc.wait()
    reader.join()
    if code != 0:
        sys.exit(f"{name}: exit {code}\n" + "".join(l for _, l in lines[-40:]))
    metrics = root / name / ("replica-0" if fault_tolerant else "") / "metrics.jsonl"
    records = read_jsonl(metrics, "loss")
    said = lambda text: next((t for t, l in lines if text in l), None)  # noqa: E731
    return {"wall_s": time.perf_counter() - start, "records": records,
            "killed_at_s": said("kill now"), "rejoined_at_s": said("rejoined at step")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt-mini")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill", type=int, default=10, help="replica 1 dies after this step")
    parser.add_argument("--plot", default="", help="a PNG of the loss curves")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-ft-") as tmp:
        root = Path(tmp)
        runs = {"ordinary": launch(root, "ordinary", args, False),
                "fault-free": launch(root, "fault-free", args, True),
                "killed": launch(root, "killed", args, True, args.kill)}
    losses = {k: [r["loss"] for r in v["records"]] for k, v in runs.items()}
    killed = runs["killed"]
    quorums = [r["quorum"] for r in killed["records"]]
    alone = [r["step"] for r in killed["records"] if len(r["quorum"]) == 1]
    rejoin = next((r["step"] for r in killed["records"] if r["quorum_joined"]), None)
    tokens = args.micro_batch * args.seq  # a replica's share of a step
    rows = [[name, f"{run['wall_s']:.1f}", f"{losses[name][-1]:.4f}",
             f"{run['records'][-1].get('val_loss', float('nan')):.4f}",
             " ".join("2" if len(r.get("quorum", [0, 1])) == 2 else "1" for r in run["records"])]
            for name, run in runs.items()]
    print(table(["run", "wall s", "last loss (replica 0)", "val loss (replica 0's share)",
                 "replicas averaged, step by step"], rows))
    same = losses["ordinary"] == losses["fault-free"]
    print(f"\nfault-free fault-tolerant run = ordinary dp_replicate = 2, loss per step bit for bit: {same}")
    first_diff = next((i + 1 for i, (a, b) in enumerate(zip(losses["fault-free"], losses["killed"])) if a != b), None)
    print(f"killed run: replica 1 killed after step {args.kill}; first step whose loss differs from the "
          f"fault-free run: {first_diff}; replica 0 alone at steps {alone[0] if alone else '-'}.."
          f"{alone[-1] if alone else '-'} ({len(alone)} steps, {len(alone) * tokens:,} tokens of replica 1's "
          f"share not trained on); replica 1 "
          + (f"rejoined after step {rejoin}" if rejoin is not None else "had not rejoined when the run ended"))
    if killed["killed_at_s"] is not None and killed["rejoined_at_s"] is not None:
        print(f"kill -> rejoin: {killed['rejoined_at_s'] - killed['killed_at_s']:.1f} s (the restarted "
              f"process's start-up, then the state from replica 0); wall time vs fault-free: "
              f"{killed['wall_s'] - runs['fault-free']['wall_s']:+.1f} s")
    print(f"final loss gap (killed - fault-free): {losses['killed'][-1] - losses['fault-free'][-1]:+.4f}")
    print(f"quorums: {quorums}")
    if args.plot:
        def draw(ax) -> None:
            for name, style in (("ordinary", ":"), ("fault-free", "-"), ("killed", "--")):
                ax.plot(range(1, len(losses[name]) + 1), losses[name], style, label=name)
            if alone:
                ax.axvspan(alone[0] - 0.5, alone[-1] + 0.5, alpha=0.15, label="replica 0 alone")

        plot(args.plot, f"{args.preset}, 2 replicas, replica 1 killed after step {args.kill}", "step",
             "training loss (replica 0's log)", draw)
    print(machine())
    print(reproduce())


if __name__ == "__main__":
    main()
