"""The torchrun command line that starts one node's agent: the launch targets (launch/targets.py)
and the planner's suggested command (planner/report.py) both write it from here. Text only: no
torch import."""

from __future__ import annotations


def nnodes_arg(nodes: int, min_nodes: int = 0) -> str:
    """torchrun's --nnodes: N, or MIN:MAX for an elastic job of min_nodes to `nodes` machines."""
    return f"{min_nodes}:{nodes}" if min_nodes and min_nodes != nodes else str(nodes)


def torchrun_argv(nodes: int, per_node: int, endpoint: str, train_args: list[str],
                  rdzv_id: str = "", max_restarts: int = 0, min_nodes: int = 0) -> list[str]:
    """The one multi-node command line: a torchrun agent on a node, `per_node` workers, meeting
    the other `nodes - 1` agents at the c10d rendezvous `endpoint` (HOST:PORT; the agent on HOST
    hosts it), each worker running `shardlm train train_args`. The same line on every node.
    `min_nodes`: an elastic job (--nnodes=MIN:MAX), its gang restarted at each change of members."""
    argv = ["torchrun", f"--nnodes={nnodes_arg(nodes, min_nodes)}", f"--nproc-per-node={per_node}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}"]
    argv += [f"--rdzv-id={rdzv_id}"] if rdzv_id else []
    argv += [f"--max-restarts={max_restarts}"] if max_restarts else []
    return argv + ["-m", "shardlm", "train", *train_args]
