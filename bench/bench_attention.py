"""Attention backends on this machine (models/attention.py): which kernel is fastest with
document masks, and what a forward + backward keeps, next to the planner's formula.

1. Kernels: q, k, v of (4, 8, T, 64) fp32, rows cut into documents of mean length --doc; forward
   + backward (forward alone for FlexAttention) of each backend through `prepare` + `attend`,
   median of --reps; 'sdpa, one document' is plain causal attention.
2. Memory: a 2-layer decoder's peak bytes of live tensors (tests/memory_ledger.StorageLedger)
   during forward + loss + backward at two lengths, against planner.activations.activation_peak.

Reproduce:  PYTHONPATH=src python bench/bench_attention.py            (~3 min, 1 thread)
Short rows (per_document vs one masked call where a row holds few documents):
            PYTHONPATH=src python bench/bench_attention.py --threads 2 --cases 128:60,192:60,256:60,384:60,512:60
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from common import MiB, machine, reproduce, table, timed_steps

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from memory_ledger import decoder_peak_bytes  # noqa: E402

from shardlm.config.model import ModelConfig  # noqa: E402
from shardlm.models.decoder import build_model  # noqa: E402
from shardlm.models.attention import attend, prepare  # noqa: E402
from shardlm.data.packed import positions_from_starts  # noqa: E402
from shardlm.planner.activations import ActivationDtypes, activation_peak


def document_positions(B: int, T: int, mean: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    starts = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):
        at = 0
        while at < T:
            starts[b, at] = True
            at += int(torch.randint(mean // 2, mean * 3 // 2 + 1, (1,), generator=g))
    return positions_from_starts(starts)


def timed(fn, reps: int) -> float:
    """Milliseconds: the median of `reps` calls after one untimed call."""
    return statistics.median(timed_steps(lambda _: fn(), 1, reps)["seconds"]) * 1e3


def kernels(T: int, mean: int, reps: int) -> dict[str, float]:
    B, H, D = 4, 8, 64
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, generator=g).requires_grad_() for _ in range(3))
    positions = document_positions(B, T, mean)

    def train(backend: str, docs: torch.Tensor | None):
        def run():
            out = attend(q, k, v, prepare(backend, docs, T, q.device, q.dtype))
            out.backward(torch.ones_like(out))
        return run

    def infer(backend: str):
        def run():
            with torch.no_grad():
                attend(q.detach(), k.detach(), v.detach(), prepare(backend, positions, T, q.device, q.dtype))
        return run

    return {"sdpa, one document": timed(train("sdpa", None), reps),
            "sdpa + mask": timed(train("sdpa", positions), reps),
            "per_document": timed(train("per_document", positions), reps),
            "math + mask": timed(train("math", positions), reps),
            "forward: sdpa + mask": timed(infer("sdpa"), reps),
            "forward: per_document": timed(infer("per_document"), reps),
            "forward: flex": timed(infer("flex"), reps)}


def peak_memory(attention: str, s: int) -> tuple[int, float]:
    cfg = ModelConfig(vocab_size=512, n_layers=2, n_heads=4, d_model=256, max_seq_len=2048,
                      attention=attention)
    torch.manual_seed(0)
    measured = decoder_peak_bytes(build_model(cfg).float(), 1, s)
    predicted = activation_peak(cfg, s, 1, cfg.n_layers, 1, ActivationDtypes(4, 4, False), "none", 1,
                                False, True, (0, 1, 1.0))
    return measured, predicted.bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--cases", default="512:128,2048:128,2048:16", metavar="T:DOC,...",
                   help="row lengths T with documents of mean length DOC")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{machine()}; {args.threads} thread(s); ms, median of {args.reps}\n")
    cases = [tuple(int(n) for n in case.split(":")) for case in args.cases.split(",")]
    results = {case: kernels(*case, args.reps) for case in cases}
    print(table(["kernel (B=4, H=8, D=64, fp32)", *(f"T={T}, docs ~{m}" for T, m in cases)],
                [[name, *(f"{results[c][name]:.1f}" for c in cases)] for name in results[cases[0]]]))
    rows = []
    for attention in ("sdpa", "math"):
        for s in (256, 1024):
            measured, predicted = peak_memory(attention, s)
            rows.append([attention, s, f"{measured / MiB:.2f}", f"{predicted / MiB:.2f}", f"{predicted / measured:.3f}"])
    print("\n" + table(("backend", "s", "measured peak MiB", "formula MiB", "formula / measured"), rows))
    print(f"\n{reproduce()}")

if __name__ == "__main__":
    main()
