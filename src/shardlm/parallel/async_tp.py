"""Overlapped ("asynchronous") tensor parallelism (parallel.async_tp): with sequence parallelism,
the all-gather before a column-parallel matmul and the reduce-scatter after a row-parallel one
are cut into pieces, each in flight while the matmul of the rows already here (or of the next
piece's partial sums) runs. The decomposition of Wang et al. 2023 ("Overlap communication with
dependent computation via decomposition in large deep learning models", ASPLOS), as torchtitan's
async TP (PyTorch SymmetricMemory's fused all-gather-matmul / matmul-reduce-scatter) and
Megatron-LM's tp_comm_overlap do it on GPUs; here through comm.Comm's asynchronous handles, so
every byte is in the ledger and under the watchdog.

Layout. Sequence-sharded activations are (B, t, C) on each of the N ranks; the whole sequence
T = N·t is rank-major (rank r holds positions r·t .. r·t + t - 1), kept sequence-first in memory
(T, B, C) as collective_ops.gather_seq / reduce_scatter_seq keep it. Each rank's chunk is cut
into P = N pieces of rows [lo, hi) (placement.even_range); "piece s" is rows lo_s..hi_s of every
rank's chunk, N·(hi_s - lo_s) sequence positions.

    column (all-gather -> x Wᵀ + b): every piece's all-gather is launched at once; this rank's
      own rows are multiplied first (they need no communication) while the pieces travel, then
      each piece's other ranks' rows as it lands, each one matmul written straight into the output.
      Backward: grad_x = grad_y W piece by piece, each piece's reduce-scatter launched as soon
      as its rows are computed (the next piece's rows are computed while it travels); the
      weight's gradient grad_yᵀ x_full is one matmul over the gathered input saved from the
      forward (what the blocking version's autograd saves too: the same memory, no second
      all-gather, and the same single matmul, so the same bits).
    row (x Wᵀ -> reduce-scatter): piece by piece, each piece's partial sums computed and their
      reduce-scatter launched while the next piece's are computed; this rank's rows land in
      place. Backward: the mirror of the column forward (all-gather of the output gradient's
      pieces overlapping grad_x's matmuls, own rows first), the weight's gradient one matmul.

Same bits as the blocking version (tests/test_async_tp.py, fp32, 2 ranks): a matmul's output
row depends only on its input row (the reduction runs over the features, whichever rows are
computed together, above a BLAS's small-matrix sizes: docs/architecture.md), the weight
gradients are the same single matmuls, and each sum over 2 ranks is one addition (commutative).
Over N > 2 ranks each piece is reduced by its own collective, in the order the backend picks for
that buffer (gloo's matched the whole buffer's at 4 ranks, measured; not guaranteed by every
algorithm). The ledger sees the same bytes: the pieces' all-gathers sum to the whole
all-gather's output, their reduce-scatters to its input (only the call count grows, P times);
under activation recomputation one reduce-scatter more per block is repeated (the fused node
saves its input only when it returns: planner.traffic.tp_comm_bytes(async_tp=True)).
"""

from __future__ import annotations

import torch

from shardlm.comm.collectives import Comm
from shardlm.models.placement import even_range
from shardlm.parallel.collective_ops import comm_of


def piece_ranges(t: int, pieces: int) -> list[tuple[int, int]]:
    """[lo, hi) of each piece of a rank's t sequence rows (the non-empty ones)."""
    ranges = [even_range(t, pieces, i) for i in range(pieces)]
    return [(lo, hi) for lo, hi in ranges if hi > lo]


def _gather_pieces(local: torch.Tensor, comm: Comm, ranges) -> list:
    """Launch every piece's all-gather. local: (t, B, C) sequence-first, this rank's chunk.
    Returns [(handle, buffer (N, hi - lo, B, C))] in piece order."""
    launched = []
    for lo, hi in ranges:
        piece = local[lo:hi].contiguous()
        buffer = local.new_empty((comm.size, *piece.shape))
        launched.append((comm.all_gather(buffer.view(-1), piece.view(-1)), buffer))
    return launched


class _Product:
    """rows @ w (+ bias) written straight into a destination view (torch.mm's out=: neither the
    rows, strided views of the activations, nor the result are copied), in the dtype autocast
    multiplies in (the operands cast as autocast casts them); a destination of another dtype (an
    fp32 gradient of an autocast matmul) gets the product cast, as autograd's cast backward does."""

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None, like: torch.Tensor):
        kind = like.device.type
        self.kind = kind
        self.dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else like.dtype
        self.w = w.to(self.dtype)
        self.bias = None if bias is None else bias.to(self.dtype)

    def __call__(self, rows: torch.Tensor, dest: torch.Tensor) -> None:
        rows = rows.to(self.dtype)
        with torch.autocast(self.kind, enabled=False):
            target = dest if dest.dtype == self.dtype else torch.empty_like(dest, dtype=self.dtype)
            if self.bias is None:
                torch.mm(rows, self.w, out=target)
            else:
                torch.addmm(self.bias, rows, self.w, out=target)
            if target is not dest:
                dest.copy_(target)


def _seq_rows(seq_first: torch.Tensor) -> torch.Tensor:
    """(n, B, C) sequence-first rows as one (n·B, C) matrix (a view when contiguous)."""
    return seq_first.reshape(-1, seq_first.shape[-1])


def _gathered_matmul(local: torch.Tensor, weight: torch.Tensor, comm: Comm, ranges, transposed: bool,
                     whole: torch.Tensor, bias: torch.Tensor | None = None,
                     dtype: torch.dtype | None = None) -> torch.Tensor:
    """All-gather along the sequence overlapped with out = whole_input @ (Wᵀ if transposed else W)
    (+ bias, fused as F.linear fuses it: see _fused_bias). local (t, B, C) sequence-first; whole:
    (N, t, B, C), filled with the gathered input. Returns out (B, T, F) contiguous (in `dtype`,
    default the product's): own rows first, then each piece's other-rank rows as it lands, each
    one matmul of a gathered buffer's rows, straight into a sequence-first result (N, t, B, F)."""
    n, t, batch, rank = comm.size, local.shape[0], local.shape[1], comm.rank
    w = weight.t() if transposed else weight
    launched = _gather_pieces(local, comm, ranges)
    product = _Product(w, bias, local)
    out = local.new_empty((n, t, batch, w.shape[1]), dtype=dtype or product.dtype)
    product(_seq_rows(local), _seq_rows(out[rank]))
    whole[rank] = local
    for (lo, hi), (handle, buffer) in zip(ranges, launched):
        handle.wait()
        whole[:, lo:hi] = buffer
        for other in (r for r in range(n) if r != rank):
            product(_seq_rows(buffer[other]), _seq_rows(out[other, lo:hi]))
    # (B, T, F) as the blocking matmul lays it out (one transposed copy, none for B = 1)
    return out.view(n * t, batch, -1).transpose(0, 1).contiguous()


def _matmul_scattered(x: torch.Tensor, weight: torch.Tensor, extra: torch.Tensor | None, comm: Comm,
                      ranges, transposed: bool, dtype: torch.dtype | None = None) -> torch.Tensor:
    """out = x @ (Wᵀ if transposed else W) (+ extra), reduce-scattered along the sequence piece
    by piece. x (B, T, K) whole sequence; extra (B, T, F) or None. Returns this rank's
    (t, B, F), sequence-first, in `dtype` (default the product's). Each (rank, piece)'s rows are
    one matmul written straight into the reduce-scatter's sequence-first buffer."""
    n, batch = comm.size, x.shape[0]
    t = x.shape[1] // n
    w = weight.t() if transposed else weight
    product = _Product(w, None, x)
    mine = x.new_empty((t, batch, w.shape[1]), dtype=dtype or product.dtype)
    launched = []
    for lo, hi in ranges:
        seq_first = mine.new_empty((n, hi - lo, batch, w.shape[1]))  # rank r's rows r-th
        for r in range(n):
            rows = x[:, r * t + lo:r * t + hi].transpose(0, 1)  # (hi-lo, B, K)
            product(_seq_rows(rows), _seq_rows(seq_first[r]))
            if extra is not None:  # the blocking version's (partial + extra), element by element
                seq_first[r] += extra[:, r * t + lo:r * t + hi].transpose(0, 1)
        launched.append((comm.reduce_scatter(mine[lo:hi].view(-1), seq_first.view(-1),
                                             scratch_input=True), seq_first))
    for handle, _ in launched:
        handle.wait()
    return mine


def _fused_bias(whole: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the blocking version's F.linear adds the bias inside the matmul (addmm: its
    gathered (B, T, C) input is contiguous, i.e. B = 1) rather than after it (matmul, then
    add_): the two round differently, so the pieces do as it does."""
    n, t, batch, c = whole.shape
    return bias is not None and whole.view(n * t, batch, c).transpose(0, 1).is_contiguous()


def _autocast_state(x: torch.Tensor) -> tuple[str, bool, torch.dtype]:
    """The autocast state the forward ran under, replayed around the backward's matmuls (what
    torch.amp.custom_fwd / custom_bwd do, for whichever device x is on): the blocking version's
    matmuls run under autocast in both passes."""
    kind = x.device.type
    return kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)


def _weight_grad(grad_out: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """∂L/∂W of out = in Wᵀ: grad_outᵀ·in as one matmul over every row, the one autograd's mm
    backward does for F.linear (grad.t().mm(input) for a transposed weight operand)."""
    return torch.mm(grad_out.reshape(-1, grad_out.shape[-1]).t(), inputs.reshape(-1, inputs.shape[-1]))


class _AllGatherMatmul(torch.autograd.Function):
    """x_local (B, t, C) -> (y = gather(x) Wᵀ + b (B, T, out), gather(x) (B, T, C)): the
    column-parallel linear after sequence parallelism's all-gather, decomposed (module doc)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, pieces):
        comm = comm_of(group)
        batch, t = x.shape[0], x.shape[1]
        ranges = piece_ranges(t, pieces)
        whole = x.new_empty((comm.size, t, batch, x.shape[-1]))
        fused = _fused_bias(whole, bias)
        y = _gathered_matmul(x.transpose(0, 1), weight, comm, ranges, True, whole, bias if fused else None)
        if bias is not None and not fused:
            y.add_(bias)
        gathered = whole.view(comm.size * t, batch, -1).transpose(0, 1)  # (B, T, C), as gather_seq's
        ctx.save_for_backward(gathered, weight)
        ctx.group, ctx.ranges, ctx.has_bias = group, ranges, bias is not None
        ctx.autocast = _autocast_state(x)
        ctx.set_materialize_grads(False)  # the gathered input's gradient: None unless LoRA read it
        return y, gathered

    @staticmethod
    def backward(ctx, grad_y, grad_gathered):
        gathered, weight = ctx.saved_tensors
        kind, enabled, dtype = ctx.autocast
        if grad_y is None:  # the output unused (never in a model): its gradient is zero
            grad_y = gathered.new_zeros((*gathered.shape[:2], weight.shape[0]))
        with torch.autocast(kind, dtype=dtype, enabled=enabled):
            return _AllGatherMatmul._backward(ctx, grad_y, grad_gathered, gathered, weight)

    @staticmethod
    def _backward(ctx, grad_y, grad_gathered, gathered, weight):
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:  # grad_gathered: LoRA's path read the gathered input too
            grad_x = _matmul_scattered(grad_y, weight, grad_gathered, comm_of(ctx.group), ctx.ranges,
                                       False, gathered.dtype).transpose(0, 1)
        if ctx.needs_input_grad[1]:
            grad_w = _weight_grad(grad_y, gathered).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_y.sum_to_size(grad_y.shape[-1])
        return grad_x, grad_w, grad_b, None, None


class _MatmulReduceScatter(torch.autograd.Function):
    """x (B, T, K) -> reduce-scatter(x Wᵀ + extra) (B, t, out): the row-parallel linear before
    sequence parallelism's reduce-scatter, decomposed (module doc). `extra`: LoRA's partial sum
    of the update, added before the one reduction (or None)."""

    @staticmethod
    def forward(ctx, x, weight, extra, group, pieces):
        comm = comm_of(group)
        ranges = piece_ranges(x.shape[1] // comm.size, pieces)
        mine = _matmul_scattered(x, weight, extra, comm, ranges, True)
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.ranges, ctx.has_extra = group, ranges, extra is not None
        ctx.autocast = _autocast_state(x)
        return mine.transpose(0, 1)

    @staticmethod
    def backward(ctx, grad_mine):
        kind, enabled, dtype = ctx.autocast
        with torch.autocast(kind, dtype=dtype, enabled=enabled):
            return _MatmulReduceScatter._backward(ctx, grad_mine, *ctx.saved_tensors)

    @staticmethod
    def _backward(ctx, grad_mine, x, weight):
        comm = comm_of(ctx.group)
        local = grad_mine.transpose(0, 1)  # (t, B, out)
        batch, t = grad_mine.shape[0], grad_mine.shape[1]
        whole = local.new_empty((comm.size, t, batch, grad_mine.shape[-1]))
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = _gathered_matmul(local, weight, comm, ctx.ranges, False, whole, dtype=x.dtype)
        else:  # an input that needs no gradient (only the weight's is wanted): the gathered gradient alone
            for (lo, hi), (handle, buffer) in zip(ctx.ranges, _gather_pieces(local, comm, ctx.ranges)):
                handle.wait()
                whole[:, lo:hi] = buffer
        grad_full = whole.view(comm.size * t, batch, -1).transpose(0, 1)  # (B, T, out), as gather_seq's
        grad_w = (_weight_grad(grad_full, x).to(weight.dtype)
                  if ctx.needs_input_grad[1] else None)
        grad_extra = grad_full if ctx.has_extra and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_extra, None, None


def all_gather_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      group: str, pieces: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(gather(x) Wᵀ + b, gather(x)) for this rank's sequence chunk x (B, t, C), the gather over
    the group `group` (collective_ops.op_group) cut into `pieces` per rank chunk."""
    return _AllGatherMatmul.apply(x, weight, bias, group, pieces)


def matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, extra: torch.Tensor | None,
                          group: str, pieces: int) -> torch.Tensor:
    """reduce-scatter(x Wᵀ + extra) along the sequence: this rank's (B, t, out) of the sum."""
    return _MatmulReduceScatter.apply(x, weight, extra, group, pieces)
