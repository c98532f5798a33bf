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
from shardlm.parallel.tensor.ops import comm_of


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


def _amp(x: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype the blocking version's matmuls would run in (None: autocast off), read
    where the op is called and passed to it: the ops below run their matmuls, forward and
    backward, under exactly that autocast state (what torch.amp.custom_fwd / custom_bwd do),
    whether they are called eagerly or from a compiled graph."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


def _under(x: torch.Tensor, amp: torch.dtype | None):
    return torch.autocast(x.device.type, dtype=amp, enabled=amp is not None)


def _weight_grad(grad_out: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """∂L/∂W of out = in Wᵀ: grad_outᵀ·in as one matmul over every row, the one autograd's mm
    backward does for F.linear (grad.t().mm(input) for a transposed weight operand)."""
    return torch.mm(grad_out.reshape(-1, grad_out.shape[-1]).t(), inputs.reshape(-1, inputs.shape[-1]))


# The decomposed linears are torch custom ops (as parallel/tensor/ops.py's collectives), so a
# compiled block (train.compile) holds each as one opaque node, not a graph break: Dynamo cannot
# trace the pieces' process-group calls. Their backward is an op too (register_autograd); the
# bias's gradient, a plain sum, is left to the traced backward.
_NONE = torch.empty(0)


@torch.library.custom_op("shardlm::all_gather_matmul", mutates_args=())
def _all_gather_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: str,
                       pieces: int, amp: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x_local (B, t, C) -> (y = gather(x) Wᵀ + b (B, T, out), gather(x) (B, T, C)): the
    column-parallel linear after sequence parallelism's all-gather, decomposed (module doc)."""
    comm = comm_of(group)
    batch, t = x.shape[0], x.shape[1]
    ranges = piece_ranges(t, pieces)
    whole = x.new_empty((comm.size, t, batch, x.shape[-1]))
    fused = _fused_bias(whole, bias)
    with _under(x, amp):
        y = _gathered_matmul(x.transpose(0, 1), weight, comm, ranges, True, whole, bias if fused else None)
        if bias is not None and not fused:
            y.add_(bias)
    return y, whole.view(comm.size * t, batch, -1).transpose(0, 1)  # (B, T, C), as gather_seq's


@_all_gather_matmul.register_fake
def _(x, weight, bias, group, pieces, amp):
    batch, t, c = x.shape
    n = comm_of(group).size
    return (x.new_empty((batch, n * t, weight.shape[0]), dtype=amp or x.dtype),
            x.new_empty((n * t, batch, c)).transpose(0, 1))


@torch.library.custom_op("shardlm::all_gather_matmul_backward", mutates_args=())
def _all_gather_matmul_backward(grad_y: torch.Tensor, grad_gathered: torch.Tensor | None, gathered: torch.Tensor,
                                weight: torch.Tensor, group: str, pieces: int, amp: torch.dtype | None,
                                need_x: bool, need_w: bool) -> list[torch.Tensor]:
    """[∂L/∂x_local (B, t, C), ∂L/∂W] (an empty tensor for one not needed): the input's gradient
    grad_y W (+ grad_gathered: LoRA read the gathered input too) reduce-scattered piece by piece,
    the weight's one matmul over the gathered input saved from the forward."""
    grad_x = grad_w = _NONE
    ranges = piece_ranges(gathered.shape[1] // comm_of(group).size, pieces)
    with _under(grad_y, amp):
        if need_x:
            grad_x = _matmul_scattered(grad_y, weight, grad_gathered, comm_of(group), ranges, False,
                                       gathered.dtype).transpose(0, 1)
        if need_w:
            grad_w = _weight_grad(grad_y, gathered).to(weight.dtype)
    return [grad_x, grad_w]


@_all_gather_matmul_backward.register_fake
def _(grad_y, grad_gathered, gathered, weight, group, pieces, amp, need_x, need_w):
    batch, big_t, c = gathered.shape
    t = big_t // comm_of(group).size
    return [gathered.new_empty((t, batch, c)).transpose(0, 1) if need_x else _NONE,
            torch.empty_like(weight) if need_w else _NONE]


def _all_gather_matmul_setup(ctx, inputs, output) -> None:
    x, weight, bias, group, pieces, amp = inputs
    ctx.save_for_backward(output[1], weight)
    ctx.group, ctx.pieces, ctx.amp, ctx.has_bias = group, pieces, amp, bias is not None
    ctx.set_materialize_grads(False)  # the gathered input's gradient: None unless LoRA read it


def _all_gather_matmul_grad(ctx, grad_y, grad_gathered):
    gathered, weight = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    if grad_y is None:  # the output unused (never in a model): its gradient is zero
        grad_y = gathered.new_zeros((*gathered.shape[:2], weight.shape[0]), dtype=ctx.amp or gathered.dtype)
    grad_x, grad_w = _all_gather_matmul_backward(grad_y, grad_gathered, gathered, weight, ctx.group, ctx.pieces,
                                                 ctx.amp, need_x, need_w)
    grad_b = None
    if ctx.has_bias and need_b:
        with _under(grad_y, ctx.amp):
            grad_b = grad_y.sum_to_size(grad_y.shape[-1])
    return grad_x if need_x else None, grad_w if need_w else None, grad_b, None, None, None


_all_gather_matmul.register_autograd(_all_gather_matmul_grad, setup_context=_all_gather_matmul_setup)


@torch.library.custom_op("shardlm::matmul_reduce_scatter", mutates_args=())
def _matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, extra: torch.Tensor | None, group: str,
                           pieces: int, amp: torch.dtype | None) -> torch.Tensor:
    """x (B, T, K) -> reduce-scatter(x Wᵀ + extra) (B, t, out): the row-parallel linear before
    sequence parallelism's reduce-scatter, decomposed (module doc). `extra`: LoRA's partial sum
    of the update, added before the one reduction (or None)."""
    comm = comm_of(group)
    with _under(x, amp):
        mine = _matmul_scattered(x, weight, extra, comm, piece_ranges(x.shape[1] // comm.size, pieces), True)
    return mine.transpose(0, 1)


@_matmul_reduce_scatter.register_fake
def _(x, weight, extra, group, pieces, amp):
    batch, big_t, _ = x.shape
    t = big_t // comm_of(group).size
    return x.new_empty((t, batch, weight.shape[0]), dtype=amp or x.dtype).transpose(0, 1)


@torch.library.custom_op("shardlm::matmul_reduce_scatter_backward", mutates_args=())
def _matmul_reduce_scatter_backward(grad_mine: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, group: str,
                                    pieces: int, amp: torch.dtype | None, need_x: bool, need_w: bool,
                                    need_extra: bool) -> list[torch.Tensor]:
    """[∂L/∂x (B, T, K), ∂L/∂W, ∂L/∂extra (B, T, out)] (empty where not needed): the mirror of
    the column forward (all-gather of the output gradient's pieces overlapping grad_x's matmuls,
    own rows first), the weight's gradient one matmul over the gathered output gradient."""
    comm = comm_of(group)
    ranges = piece_ranges(grad_mine.shape[1], pieces)
    local = grad_mine.transpose(0, 1)  # (t, B, out)
    batch, t = grad_mine.shape[0], grad_mine.shape[1]
    whole = local.new_empty((comm.size, t, batch, grad_mine.shape[-1]))
    grad_x = grad_w = _NONE
    with _under(grad_mine, amp):
        if need_x:
            grad_x = _gathered_matmul(local, weight, comm, ranges, False, whole, dtype=x.dtype)
        else:  # an input that needs no gradient (only the weight's is wanted): the gathered gradient alone
            for (lo, hi), (handle, buffer) in zip(ranges, _gather_pieces(local, comm, ranges)):
                handle.wait()
                whole[:, lo:hi] = buffer
        grad_full = whole.view(comm.size * t, batch, -1).transpose(0, 1)  # (B, T, out), as gather_seq's
        if need_w:
            grad_w = _weight_grad(grad_full, x).to(weight.dtype)
    return [grad_x, grad_w, grad_full if need_extra else _NONE]


@_matmul_reduce_scatter_backward.register_fake
def _(grad_mine, x, weight, group, pieces, amp, need_x, need_w, need_extra):
    batch, t, out = grad_mine.shape
    n = comm_of(group).size
    return [torch.empty_like(x, memory_format=torch.contiguous_format) if need_x else _NONE,
            torch.empty_like(weight) if need_w else _NONE,
            grad_mine.new_empty((n * t, batch, out)).transpose(0, 1) if need_extra else _NONE]


def _matmul_reduce_scatter_setup(ctx, inputs, output) -> None:
    x, weight, extra, group, pieces, amp = inputs
    ctx.save_for_backward(x, weight)
    ctx.group, ctx.pieces, ctx.amp, ctx.has_extra = group, pieces, amp, extra is not None


def _matmul_reduce_scatter_grad(ctx, grad_mine):
    x, weight = ctx.saved_tensors
    need_x, need_w, need_extra = ctx.needs_input_grad[:3]
    need_extra = need_extra and ctx.has_extra
    grad_x, grad_w, grad_extra = _matmul_reduce_scatter_backward(grad_mine, x, weight, ctx.group, ctx.pieces,
                                                                 ctx.amp, need_x, need_w, need_extra)
    return (grad_x if need_x else None, grad_w if need_w else None, grad_extra if need_extra else None,
            None, None, None)


_matmul_reduce_scatter.register_autograd(_matmul_reduce_scatter_grad, setup_context=_matmul_reduce_scatter_setup)


def all_gather_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      group: str, pieces: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(gather(x) Wᵀ + b, gather(x)) for this rank's sequence chunk x (B, t, C), the gather over
    the group `group` (collective_ops.op_group) cut into `pieces` per rank chunk."""
    return _all_gather_matmul(x, weight, bias, group, pieces, _amp(x))


def matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, extra: torch.Tensor | None,
                          group: str, pieces: int) -> torch.Tensor:
    """reduce-scatter(x Wᵀ + extra) along the sequence: this rank's (B, t, out) of the sum."""
    return _matmul_reduce_scatter(x, weight, extra, group, pieces, _amp(x))
