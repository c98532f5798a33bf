"""Activation memory per rank (Korthikanti et al. 2022, section 4, adapted to our decoder and
checked against what autograd saves: tests/test_planner.py measures it): what one block saves per
token by recomputation mode, the context-parallel ring's buffers, and the peak of saved
activations plus backward's worst transient. Split out of memory.py, which sums them with the
model states and buffers.

Pure functions; no torch, no process group, no allocation. Formulas and sources:
docs/planner.md section 3; notation: workload.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlm.config.model import ModelConfig
from shardlm.hardware.catalog import Cluster
from shardlm.models import flops
from shardlm.planner.workload import DTYPE_BYTES, Item, Strategy


@dataclass(frozen=True)
class ActivationDtypes:
    compute: int
    """e: bytes of matmul inputs and outputs (autocast's dtype, or fp32)."""
    residual: int
    """r: bytes of the residual stream: the parameters' dtype (fp32 in the one-process run)."""
    norms_in_fp32: bool
    """CUDA autocast runs layer_norm in fp32, so it saves an fp32 copy of its input."""
    cpu_half_attention: bool = False
    """Half-precision compute on a CPU, one process's attention kernel (no cp ring): sequences
    of at most CPU_HALF_IN_FP32_MAX_LEN positions attend in fp32 (models/attention.py sdpa)."""


def activation_dtypes(s: Strategy, cluster: Cluster) -> ActivationDtypes:
    compute = DTYPE_BYTES[s.dtypes.compute]
    return ActivationDtypes(compute, 4 if s.local else compute,
                            cluster.calibration.norms_in_fp32 and s.dtypes.compute != "fp32",
                            cluster.device.kind == "cpu" and compute < 4 and s.layout.cp == 1)


def _norm_saved(m: ModelConfig, dt: ActivationDtypes) -> tuple[float, str]:
    """Bytes per token one norm saves. LayerNorm: its input and mean/rstd (in the input dtype,
    or fp32 under CUDA autocast). torch's RMSNorm is decomposed and runs in fp32 under
    autocast: it saves an fp32 input, the fp32 normalised x (for the weight's gradient) and
    rstd."""
    h = m.d_model
    if m.norm == "rmsnorm":
        return 8 * h + 4, "(8h+4)"
    r = 4 if dt.norms_in_fp32 else dt.residual
    return r * h + 2 * r, f"({r}h+{2 * r})"


def visited_width(m: ModelConfig, experts: tuple[int, int, float]) -> float:
    """The MLP hidden width one token's activations span: the dense MLP's, or for a MoE block
    its top_k routed experts' (× the capacity factor: the busiest expert's rows) and the shared
    experts' (models.flops.expert_d_ff)."""
    if not experts[0]:
        return flops.resolved_d_ff(m)
    return flops.expert_d_ff(m) * (experts[1] * experts[2] + m.shared_experts)


def block_activation(m: ModelConfig, dt: ActivationDtypes, mode: str, tp: int = 1,
                     sp: bool = False, experts: tuple[int, int, float] = (0, 1, 1.0),
                     seq: int = 0) -> tuple[float, str]:
    """Bytes per token one block keeps for backward, and the formula.

    Korthikanti eq. (1): sbh(34 + 5as/h) in 16-bit for Megatron's GPT. Ours differs in two
    stated ways: no dropout (its 3 masks: 2sbh + as²b) and torch's scaled_dot_product_attention
    (flash / memory-efficient kernels keep Q, K, V, the output and a logsumexp, never the s x s
    scores: the 5as²b term becomes 4as bytes), so a 16-bit GPT-2 block keeps 32sbh + 4asb.
    tp divides what lives between the column- and row-parallel linears; sequence parallelism
    (sp) divides the rest (eq. 3-4). 'selective' is our runtime's policy (keep matmul and
    attention outputs, recompute element-wise ops), 'full' keeps the block input only.

    model.attention = 'math' (models/attention.py, the unfused reference) keeps the s x s
    probabilities instead of the logsumexp: e·a·s bytes per token in place of 4a (`seq` = s is
    then needed); with GQA its attention keeps e·a·s + 4·e·h (q, k and v expanded to every query
    head, the output's copy). Every other backend (sdpa, per_document, flex) stores no s² term.
    Measured: tests/test_attention.py.

    Half precision on a CPU at s <= CPU_HALF_IN_FP32_MAX_LEN (dt.cpu_half_attention; `seq`
    needed): the kernel runs on fp32 copies of q, k and v and keeps them and its fp32 output,
    4(q+2kv) + 4q, where the half kernel kept the projection's output (q, k, v were views of it,
    or v was with RoPE) and, with RoPE, the rotated q and k; the projection's input stays e·q.
    selective: the kept attention output is the fp32 one (4q for e·q). Measured:
    tests/test_planner.py.
    """
    h, a, e, r = m.d_model, m.n_heads, dt.compute, dt.residual
    hd = flops.head_dim(m)  # model.head_dim where a family sets it (Gemma, Qwen3): q = a·hd, not h
    q, kv = a * hd, (m.n_kv_heads or a) * hd
    f, moe = visited_width(m, experts), 0.0
    if experts[0]:  # a MoE block also keeps each choice's input row and output row (gathered
        # for the expert, weighted by the gate) and the router's fp32 logits and probabilities
        moe = experts[1] * experts[2] * 2 * e * h + 8 * experts[0]
    rope = m.position == "rope"
    mlp_mult = 4 if m.mlp == "swiglu" else 2
    math = m.attention == "math"
    if math and seq <= 0:
        raise ValueError("model.attention = 'math' keeps s x s probabilities: block_activation needs seq")
    scores = e * a * seq if math else 4 * a  # probabilities, or the fused kernels' fp32 logsumexp
    in_fp32 = dt.cpu_half_attention and not math and 0 < seq <= flops.CPU_HALF_IN_FP32_MAX_LEN and e < 4
    out = 4 if in_fp32 else e  # the bytes of the attention kernel's output it keeps
    scores_text = f"{e}as" if math else "4a"
    if mode == "full":
        value = r * h / (tp if sp else 1)
        return value, f"{r}h{'/t' if sp and tp > 1 else ''} (block input only)"
    if mode == "selective":
        sharded = e * (q + 2 * kv) + scores + out * q + e * f * (mlp_mult // 2) + moe
        replicated = r * h + 2 * e * h  # block input, attention and MLP output-projection outputs
        text = (f"{r}h + 2·{e}h + ({e}(q+2kv) + {scores_text} + {out}q + {e}·{mlp_mult // 2}f)/t "
                "(matmul and attention outputs)")
    else:
        norm, norm_text = _norm_saved(m, dt)
        replicated = 2 * norm + 2 * e * h  # two norms' saved tensors, their outputs (linear inputs)
        attention = (e * (q + 2 * kv) + scores + e * q
                     + (e * (q + kv) + e * q if rope else 0))  # rotated q, k; proj-input copy
        if math and kv != q:  # GQA: q, k and v as per-head copies for the matmuls, the output's
            # copy for the projection; the projection's own output is no longer kept (measured)
            attention = scores + 4 * e * q
        if in_fp32:  # fp32 q, k, v and output kept by the kernel, the projection's input in e
            attention = 4 * (q + 2 * kv) + scores + 4 * q + e * q
        sharded = attention + mlp_mult * e * f + moe
        text = (f"2·{norm_text} + 2·{e}h + ({e}(q+2kv) + {scores_text} + {e}q + {mlp_mult}·{e}f"
                + (f" + {e}(2q+kv) rope" if rope else "") + ")/t")
        if in_fp32:
            text = (f"2·{norm_text} + 2·{e}h + (4(q+2kv) + {scores_text} + 4q + {e}q + "
                    f"{mlp_mult}·{e}f)/t (attention in fp32)")
    if tp > 1:
        replicated = replicated / tp if sp else replicated
    return replicated + sharded / tp, text


def cp_ring_buffers(m: ModelConfig, dt: ActivationDtypes, tp: int = 1) -> tuple[float, str]:
    """Bytes per local token of the context-parallel ring's transients inside one block's
    attention (parallel/context/attention.py _RingAttention), the larger of its two passes; tp splits
    the heads. Forward: the key/value block held and the one arriving (2 x 2·kv·e), the fp32
    running output (4h) and log-sum-exp (4a), a block's partial output (e·h). Backward: the two
    key/value blocks (2 x 2·kv·e), the fp32 key/value gradient travelling with its block and
    the one arriving (2 x 2·kv·4), the fp32 query gradient (4h). With GQA each block is also
    expanded to the query heads (2·e·h)."""
    a, e = m.n_heads, dt.compute
    h = flops.attention_width(m)  # the queries' width: d_model unless model.head_dim sets it
    kv = (m.n_kv_heads or a) * flops.head_dim(m)
    expand = 2 * e * h if kv != h else 0
    forward = 4 * e * kv + 4 * h + 4 * a + e * h + expand
    backward = 4 * e * kv + 16 * kv + 4 * h + expand
    text = (f"max(forward 4·{e}kv + 4h + 4a + {e}h, backward 4·{e}kv + 16kv + 4h)"
            + (f" + 2·{e}h (GQA expansion)" if expand else "") + ("/t" if tp > 1 else ""))
    return max(forward, backward) / tp, text


def cp_saved(m: ModelConfig, dt: ActivationDtypes, tp: int = 1, a2a: int = 1,
             all_to_all: bool | None = None) -> tuple[float, str]:
    """Bytes per local token one block's attention keeps under context parallelism beyond what
    block_activation counts for the one-process kernel (no recomputation), and the formula;
    `a2a` = U, the all-to-all degree (1: the ring alone); `all_to_all` whether the heads are
    exchanged (default U > 1). Measured in one process (tests/test_planner_axes.py) and by
    bench/bench_cp.py --sweep (docs/benchmarks.md).

    The projection's input. Without rotation q is a view of the qkv projection's output, the CPU
    flash kernel writes its output in that (B, T, h, d) order, and the output projection's input
    is a view of the tensor the kernel saved (one storage). The ring's op allocates its output
    (B, h, T/C, d) and saves it (parallel/context/ops.py), Ulysses' kernel gets q from the
    all-to-all in (B, h/U, T, d) order and writes its output so: the projection's input is then
    a copy of its own, + e·q. With RoPE the one-process kernel already writes such an output
    (block_activation counts the copy): + 0.
    The all-to-all's packed buffer. Ulysses and the hybrid send q, k and v in one exchange and
    attend views of the one buffer it returns (parallel/context/ulysses.py): with RoPE the rotated q and
    k and the qkv projection's output (which v viewed) are no longer kept, - e·(q + kv); without
    it the buffer replaces the projection's output byte for byte.
    Replicated key/value heads: fewer key/value heads per tensor-parallel rank than U are
    replicated up to U before the exchange (replicate_kv), and each rank keeps max(h_kv, U)/U of
    them for the U·T/C tokens its group holds: + 2·e·d·(max(h_kv, U) - h_kv).
    The log-sum-exp stays 4a per local token in every mode (the ring's h x T/C rows, Ulysses'
    h/U x T)."""
    all_to_all = a2a > 1 if all_to_all is None else all_to_all
    e, hd, rope = dt.compute, flops.head_dim(m), m.position == "rope"
    heads, kv = m.n_heads // tp, max(1, (m.n_kv_heads or m.n_heads) // tp)
    value, parts = 0.0, []
    if not rope:
        value += e * heads * hd
        parts.append(f"{e}q (the op's output and the projection's copy)")
    if all_to_all and rope:
        value -= e * (heads + kv) * hd
        parts.append(f"- {e}(q+kv) (q, k, v kept as the all-to-all's one buffer)")
    if all_to_all and kv < a2a:
        value += 2 * e * hd * (a2a - kv)
        parts.append(f"2·{e}·d·(U={a2a} - h_kv={kv}) (key/value heads replicated for the all-to-all)")
    return value, " + ".join(parts) or "0"


def loss_saved(m: ModelConfig, dt: ActivationDtypes, tp: int = 1, sp: bool = False) -> float:
    """Bytes per token the loss's forward keeps for its backward (trainer.loss_of): the final
    norm's saved tensors, the head's input (e·h; both split by sequence parallelism) and the
    fp32 log-probabilities (4V, vocabulary-parallel with tp)."""
    return _final_saved(m, dt, tp, sp) + 4 * m.vocab_size / tp


def _final_saved(m: ModelConfig, dt: ActivationDtypes, tp: int, sp: bool) -> float:
    """Bytes per token of the final norm's saved tensors and the head's input."""
    norm, _ = _norm_saved(m, dt)
    return (norm + dt.compute * m.d_model) / (tp if sp else 1)


def activation_peak(m: ModelConfig, seq: int, micro: int, layers: int, in_flight: float,
                    dt: ActivationDtypes, mode: str, tp: int, sp: bool, with_loss: bool,
                    experts: tuple[int, int, float], cp: int = 1, loss_in_flight: float = 1,
                    offloaded: int = 0, cp_a2a: int = 1) -> Item:
    """Saved activations of `in_flight` micro-batches (pipeline.pp_in_flight: 1F1B's first
    stage holds p of them, GPipe's every stage all m) plus the worst transient of backward: the
    loss, or one block's recomputation.

    The loss (trainer.loss_of): logits in e, an fp32 copy, fp32 log-probabilities saved; its
    backward holds the saved log-probs, their gradient and the logits' gradient in fp32:
    12V bytes per token (vocabulary-parallel with tp). A block's backward recomputes what its
    mode dropped and holds gradients: e(h + 2f) bytes per token (measured).

    Context parallelism (cp > 1) gives each rank b·s/cp of the tokens for everything (the
    embedding, every block, the loss: parallel/context/attention.py), so every per-token term above is
    per local token; without recomputation each block keeps cp_saved's more (`cp_a2a` = U, the
    all-to-all degree: 1 ring, C Ulysses); the ring's buffers (cp_ring_buffers) join a block's
    backward.

    Activation offload (`offloaded` of the `layers` blocks, workload.offloaded_blocks): their
    saved activations live in host memory (counted there: _stage_memory), except ~2 blocks'
    worth of one micro-batch kept on the device — an assumption: the block whose copy to host
    is in flight at the end of forward, and in backward the block in use plus the one prefetched
    (parallel/blocks/activation.py: block b's backward fetches block b-1's).
    """
    tokens = micro * seq / cp
    per_layer, text, full = _block_saved(m, dt, mode, tp, sp, experts, seq, cp, cp_a2a)
    saved = (layers - offloaded) * in_flight * tokens * per_layer + min(2, offloaded) * tokens * per_layer
    final = _final_saved(m, dt, tp, sp)
    recompute = tokens * (full - per_layer + _backward_working(m, dt, experts, tp, seq))
    if m.norm == "rmsnorm" and with_loss:  # the final norm's backward, its inputs still saved
        recompute = max(recompute, tokens * (final + 16 * m.d_model))
    loss = tokens * (final + 12 * m.vocab_size / tp) if with_loss else 0.0
    # The loss's micro-batches in flight (`loss_in_flight`: GPipe's last stage holds all m)
    # keep what it saved in forward: the final norm's tensors, the head's input and the fp32
    # log-probabilities (4V/t per token); the one being backwarded is in `loss`.
    waiting = (loss_in_flight - 1) * tokens * (final + 4 * m.vocab_size / tp) if with_loss else 0.0
    # int64 inputs and targets: whole sequences (every rank of a context-parallel group loads
    # them), plus this rank's cut of both
    ids = 16 * micro * seq * in_flight * (1 + 1 / cp if cp > 1 else 1)
    bs = "b·s/cp" if cp > 1 else "b·s"
    kept = f"(L={layers} - {offloaded} offloaded)" if offloaded else f"L={layers}"
    parts = [Item("saved by blocks", saved,
                  f"{kept} x {in_flight:g} micro-batch(es) x {bs}={tokens:,.0f} x {per_layer:,.0f} B"
                  f" = {text}" + (f"; + {min(2, offloaded)} offloaded block(s) of one micro-batch on the "
                                  f"device (the copy in flight / the prefetched block)" if offloaded else "")),
             Item("backward peak", max(loss, recompute),
                  f"max(loss: {bs} x (final norm + 12V/t) = {loss / 1e9:.3g} GB, "
                  f"one block's {'recompute + ' if mode != 'none' else ''}gradients "
                  f"e(h+2f) = {recompute / 1e9:.3g} GB)"),
             *([Item("saved for the loss", waiting, f"{loss_in_flight - 1:g} more micro-batch(es) in flight x "
                     f"{bs} x (final norm + 4V/t fp32 log-probabilities)")] if waiting else []),
             Item("token ids", ids, "16 B x b·s (int64 inputs, targets)"
                  + (" x (1 + 1/cp): whole sequences and this rank's cut" if cp > 1 else ""))]
    ring = 0.0
    if cp > 1:
        per_token, ring_text = cp_ring_buffers(m, dt, tp)
        ring = tokens * per_token
        parts.append(Item("cp ring buffers", ring, f"{bs} x {per_token:,.0f} B = {ring_text}: "
                          f"one block's attention at a time (a block's backward)"))
    fused = m.attention != "math"
    if not fused:  # math's boolean mask, built once per forward, shared by the blocks: b·s² bytes
        mask = micro * seq * seq * in_flight
        ids += mask
        parts.append(Item("attention mask", mask, "b·s² bytes (model.attention = 'math': one boolean "
                          "mask per forward)"))
    phases = {"loss": saved + waiting + loss + ids, "blocks": saved + waiting + recompute + ring + ids}
    return Item("activations", max(phases.values()), f"{mode} recompute; " + (
        "fused attention (no s² term)" if fused else "math attention (s² probabilities kept)"), parts, phases)


def _block_saved(m: ModelConfig, dt: ActivationDtypes, mode: str, tp: int, sp: bool,
                 experts: tuple[int, int, float], seq: int, cp: int, cp_a2a: int) -> tuple[float, str, float]:
    """(bytes a block saves per local token under `mode`, how, what it saves with no
    recomputation): with cp > 1 the cp modes' own saved tensors join the latter, and the former
    when nothing is recomputed ('selective' reruns the ring / all-to-all, 'full' the block)."""
    per_layer, text = block_activation(m, dt, mode, tp, sp, experts, seq)
    full, _ = block_activation(m, dt, "none", tp, sp, experts, seq)
    if cp > 1:
        extra, extra_text = cp_saved(m, dt, tp, cp_a2a)
        full += extra
        if mode == "none":
            per_layer, text = per_layer + extra, f"{text} + {extra_text} (context parallel)"
    return per_layer, text, full


def _backward_working(m: ModelConfig, dt: ActivationDtypes, experts: tuple[int, int, float], tp: int,
                      seq: int) -> float:
    """Bytes per token a block's backward holds besides what it recomputes. It holds the
    gradient of its output and, at the MLP, two f-wide gradients at once (measured: silu/gelu
    backward); torch's decomposed RMSNorm backward holds four fp32 h-vectors (worst at the final
    norm)."""
    working = dt.compute * (m.d_model + 2 * visited_width(m, experts) / tp)
    if m.attention == "math":  # its backward holds the s x s gradients of the probabilities and
        # of the scores at once, per head, after the MLP's have gone: the larger of the two (measured)
        working = max(working, dt.compute * (m.d_model + 2 * m.n_heads * seq / tp))
    if m.norm == "rmsnorm":
        working = max(working, 16 * m.d_model)
    return working
