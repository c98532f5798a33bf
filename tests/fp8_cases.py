"""Rank-side functions for the FP8 tests (importable by spawned ranks)."""

from __future__ import annotations

import torch

from shardlm.config.load import load_config
from shardlm.train.build import build_run
from shardlm.train.step import train_step


def fp8_case(overrides: dict, steps: int) -> dict:
    """Train `steps` steps; return the losses, each step's fp8 JSONL figures (fp8_overflow,
    fp8_underflow, ...) and the whole parameters in fp32."""
    run = build_run(load_config(overrides=overrides).validate())
    out = {"losses": [], "records": []}
    for step in range(steps):
        result = train_step(run, step)
        out["losses"].append(result.loss)
        out["records"].append(dict(result.state.fp8_record))
    with run.strategy.full_parameters():
        out["params"] = {n: p.detach().float().cpu().clone() for n, p in run.model.named_parameters()}
    return out


def fp8_cases(rank: int, world_size: int, cases: list[tuple[dict, int]], tp_linears: bool = False):
    """Each case's fp8_case; with `tp_linears`, (those, tp_linears_cases) from the same spawn."""
    torch.manual_seed(0)
    trained = [fp8_case(overrides, steps) for overrides, steps in cases]
    return (trained, tp_linears_cases(rank, world_size)) if tp_linears else trained


class _Recording:
    """Wraps a quantiser's `cast`: the last rounded tensor of each role, kept (fp32)."""

    def __init__(self, quantiser) -> None:
        self.seen: dict[str, torch.Tensor] = {}
        cast = quantiser.cast

        def recording(x, role, record, scale=None):
            out, counts = cast(x, role, record, scale)
            self.seen[role] = out.detach().float().clone()
            return out, counts

        quantiser.cast = recording


def tp_linears_cases(rank: int, world_size: int) -> dict:
    """tp_linears_case without and with sequence parallelism (one spawn)."""
    return {sp: tp_linears_case(rank, world_size, sp) for sp in (False, True)}


def tp_linears_case(rank: int, world_size: int, sequence_parallel: bool) -> dict:
    """An fp8 column-parallel linear then a row-parallel one (parallel/tensor/decoder.py, as apply_tp
    builds them from Fp8Linears) on this rank, and one process's two Fp8Linears on the whole
    weights: what each rounded (input, weight, output gradient) and the outputs and gradients."""
    import torch.distributed as dist
    from torch import nn

    from shardlm.comm.collectives import Comm, CommLedger
    from shardlm.models.fp8 import Fp8Linear, Fp8Quantiser, Fp8Stats
    from shardlm.parallel.tensor.decoder import _with_fp8
    from shardlm.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
    from shardlm.parallel.tensor.regions import TPState
    from shardlm.models.placement import even_range

    torch.manual_seed(0)
    d, hidden = 32, 48
    x = torch.randn(2, 8, d)  # (B, T, C)
    grad = torch.randn(2, 8, d) * torch.logspace(-2, 2, d)  # a wide range: E5M2 rounds visibly
    whole = [nn.Linear(d, hidden), nn.Linear(hidden, d)]
    one = [Fp8Linear.from_linear(m, Fp8Quantiser("tensorwise", 128, Fp8Stats())) for m in whole]
    one_seen = [_Recording(m.fp8) for m in one]
    x1 = x.clone().requires_grad_()
    one[1](one[0](x1)).backward(grad)

    tp = TPState(Comm(dist.group.WORLD, "tp", CommLedger()), sequence_parallel)
    tp.sharded = sequence_parallel
    lo, hi = even_range(hidden, world_size, rank)
    col = ColumnParallelLinear(d, hi - lo, True, tp)
    row = RowParallelLinear(hi - lo, d, True, tp)
    with torch.no_grad():
        col.weight, col.bias = nn.Parameter(whole[0].weight[lo:hi].clone()), nn.Parameter(whole[0].bias[lo:hi].clone())
        row.weight, row.bias = nn.Parameter(whole[1].weight[:, lo:hi].clone()), nn.Parameter(whole[1].bias.clone())
    fresh = [Fp8Linear.from_linear(m, Fp8Quantiser("tensorwise", 128, Fp8Stats())) for m in whole]
    col, row = _with_fp8(col, fresh[0], tp), _with_fp8(row, fresh[1], tp)
    seen = [_Recording(col.fp8), _Recording(row.fp8)]
    t_lo, t_hi = even_range(x.shape[1], world_size, rank) if sequence_parallel else (0, x.shape[1])
    xr = x[:, t_lo:t_hi].clone().requires_grad_()
    y = row(col(xr))
    y.backward(grad[:, t_lo:t_hi])
    return {"one": {"seen": [s.seen for s in one_seen], "y": one[1](one[0](x)).detach().float(),
                    "x_grad": x1.grad, "w_grads": [m.weight.grad for m in whole]},
            "tp": {"seen": [s.seen for s in seen], "y": y.detach().float(), "x_grad": xr.grad,
                   "w_grads": [col.weight.grad, row.weight.grad], "rows": (lo, hi), "seq": (t_lo, t_hi)}}
