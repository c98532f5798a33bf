"""The spawn helper works: real ranks, a real process group, collectives agree."""

import torch
import torch.distributed as dist

from shardlm.launch.spawn import run_ranks
from shardlm.launch.runtime import init_runtime


def _collectives(rank: int, world_size: int) -> dict:
    runtime = init_runtime("auto")
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    gathered = [torch.zeros(1) for _ in range(world_size)]
    dist.all_gather(gathered, torch.tensor([float(rank)]))
    return {"rank": runtime.rank, "world": runtime.world_size, "backend": runtime.backend,
            "sum": total.item(), "gathered": [g.item() for g in gathered],
            "threads": torch.get_num_threads()}


def test_two_ranks_all_reduce_and_gather(tmp_path):
    out = run_ranks(_collectives, 2, tmp_path)
    assert [o["rank"] for o in out] == [0, 1]
    for o in out:
        assert o["world"] == 2
        assert o["backend"] == ("nccl" if torch.cuda.is_available() else "gloo")
        assert o["sum"] == 3.0
        assert o["gathered"] == [0.0, 1.0]
        assert o["threads"] >= 1


def _fails_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank 1")


def test_failure_on_a_rank_is_reported(tmp_path):
    try:
        run_ranks(_fails_on_rank_one, 2, tmp_path)
    except RuntimeError as e:
        assert "boom on rank 1" in str(e) and "rank 1" in str(e)
    else:
        raise AssertionError("a failing rank must fail the test")
