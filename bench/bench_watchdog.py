"""What the collective watchdog costs per collective on the host: Comm.all_reduce(...).wait() of
a small tensor in a one-rank group (every code path of a real group runs), without a watchdog and
with one. On gloo a tracked wait is two dict operations under a lock; on NCCL it also records a
CUDA event (comm.collectives.DeviceDone) that the watchdog's thread polls. Host time only: on
NCCL the loop never synchronises, as training does not.

    python bench/bench_watchdog.py                 # CUDA + NCCL where there is a GPU, else gloo
    python bench/bench_watchdog.py --calls 20000
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))


def _measure(rank: int, world_size: int, calls: int) -> dict:
    import torch
    import torch.distributed as dist

    from shardlm.comm.collectives import Comm, CommLedger, DeviceDone
    from shardlm.comm.watchdog import CollectiveWatchdog

    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.ones(16, device=device)
    out = {"backend": str(dist.get_backend()), "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    watchdog = CollectiveWatchdog(600.0, rank, DeviceDone if device == "cuda" else None)
    for name, dog in (("none", None), ("watchdog", watchdog), ("none again", None)):
        comm = Comm(dist.group.WORLD, "dp", CommLedger(), dog)
        for _ in range(100):
            comm.all_reduce(x).wait()
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            comm.all_reduce(x).wait()
        out[name] = (time.perf_counter() - start) / calls * 1e6
        if device == "cuda":
            torch.cuda.synchronize()
    out["pending_at_end"] = len(watchdog._pending)
    watchdog.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=5000)
    args = parser.parse_args(argv)
    from common import machine, reproduce, start_ranks  # after src is on sys.path

    with tempfile.TemporaryDirectory() as tmp:
        (r,) = start_ranks(_measure, 1, tmp, args.calls, timeout=600)
    print(f"{machine()}\n{r['backend']} on {r['device']}, {args.calls} all_reduce + wait of 16 elements, host us per call:")
    print(f"  no watchdog {r['none']:.1f} / {r['none again']:.1f} (before / after), with the watchdog "
          f"{r['watchdog']:.1f}: +{r['watchdog'] - (r['none'] + r['none again']) / 2:.1f} us; "
          f"entries left once the device finished: {r['pending_at_end']}")
    print(reproduce())
    return 0


if __name__ == "__main__":
    sys.exit(main())
