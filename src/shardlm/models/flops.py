"""Parameter and FLOP counts as pure functions of a ModelConfig: no tensors are allocated.

`count_params` equals `sum(p.numel() for p in build_model(cfg).parameters())` (tests check it for
every preset), so the planner and the MFU meter can size a 70B model without building one.
"""

from __future__ import annotations

from shardlm.config.model import ModelConfig

RECOMPUTE_MODES = ("none", "full", "selective")


def resolved_d_ff(cfg: ModelConfig) -> int:
    """MLP hidden width: `d_ff` if set, else 4*d for GELU, else LLaMA's SwiGLU rule.

    LLaMA keeps the SwiGLU MLP's parameters (3 matrices) equal to a 4*d GELU MLP's (2 matrices):
    hidden = 2/3 * 4*d, rounded up to a multiple of `ffn_multiple_of` (Meta's llama/model.py).
    """
    if cfg.d_ff:
        return cfg.d_ff
    if cfg.mlp == "gelu":
        return 4 * cfg.d_model
    hidden = int(2 * 4 * cfg.d_model / 3)
    m = cfg.ffn_multiple_of
    return m * ((hidden + m - 1) // m)


def head_dim(cfg: ModelConfig) -> int:
    """One attention head's width: model.head_dim, else d_model / n_heads."""
    return cfg.head_dim or cfg.d_model // cfg.n_heads


def attention_width(cfg: ModelConfig) -> int:
    """The queries' total width, n_heads · head_dim: d_model unless model.head_dim says otherwise
    (what attention's QKᵀ and AV multiply over, per token and key)."""
    return cfg.n_heads * head_dim(cfg)


def expert_d_ff(cfg: ModelConfig) -> int:
    """One routed expert's hidden width: `expert_d_ff`, else the dense MLP's."""
    return cfg.expert_d_ff or resolved_d_ff(cfg)


def is_moe_block(cfg: ModelConfig, index: int) -> bool:
    """Block `index` has a mixture of experts (models/moe.py): every `moe_every`-th block, the
    last of each run (moe_every 2: blocks 1, 3, 5, ... as GShard's every other layer)."""
    return cfg.experts > 0 and (index + 1) % max(1, cfg.moe_every) == 0


def moe_layers(cfg: ModelConfig) -> list[int]:
    return [i for i in range(cfg.n_layers) if is_moe_block(cfg, i)]


def _mlp_matmul(cfg: ModelConfig, width: int) -> int:
    return (3 if cfg.mlp == "swiglu" else 2) * cfg.d_model * width


def _mlp_biases(cfg: ModelConfig, width: int) -> int:
    return (width * (2 if cfg.mlp == "swiglu" else 1) + cfg.d_model) if cfg.bias else 0


def _attention_matmul(cfg: ModelConfig) -> int:
    d, hd = cfg.d_model, head_dim(cfg)
    n_kv = cfg.n_kv_heads or cfg.n_heads
    return d * (cfg.n_heads + 2 * n_kv) * hd + cfg.n_heads * hd * d


def _mlp_widths(cfg: ModelConfig, moe: bool, active: bool) -> list[int]:
    """The hidden widths of the MLPs a token goes through (active) or that exist: the dense
    MLP's; or the routed experts' (top_k of them, or all) and the shared experts' one MLP."""
    if not moe:
        return [resolved_d_ff(cfg)]
    f = expert_d_ff(cfg)
    shared = [cfg.shared_experts * f] if cfg.shared_experts else []
    return [f] * (cfg.top_k if active else cfg.experts) + shared


def _block_matmul_params(cfg: ModelConfig, moe: bool = False, active: bool = True) -> int:
    """Weight elements of one block's linears: fused qkv, attention proj, the MLPs' matrices
    (a MoE block's router and the experts a token visits, or all of them with active=False)."""
    router = cfg.d_model * cfg.experts if moe else 0
    return _attention_matmul(cfg) + router + sum(_mlp_matmul(cfg, w) for w in _mlp_widths(cfg, moe, active))


def _norm_params(cfg: ModelConfig) -> int:
    has_bias = cfg.norm == "layernorm" and (cfg.bias or cfg.norm_bias)
    return cfg.d_model * (2 if has_bias else 1)


def _block_params(cfg: ModelConfig, moe: bool = False, active: bool = False) -> int:
    biases = 0
    hd, n_kv = head_dim(cfg), cfg.n_kv_heads or cfg.n_heads
    if cfg.bias or cfg.qkv_bias:
        biases = (cfg.n_heads + 2 * n_kv) * hd
    if cfg.bias:
        biases += cfg.d_model + sum(_mlp_biases(cfg, w) for w in _mlp_widths(cfg, moe, active))
    qk_norms = 0
    if cfg.qk_norm:  # per head (head_dim weights each), or over the whole q and k projections
        qk_norms = 2 * hd if cfg.qk_norm_width == "head" else (cfg.n_heads + n_kv) * hd
    norms = 4 if cfg.norm_placement == "sandwich" else 2
    return _block_matmul_params(cfg, moe, active) + biases + norms * _norm_params(cfg) + qk_norms


def _root_params(cfg: ModelConfig) -> int:
    embeddings = cfg.vocab_size * cfg.d_model
    if cfg.position == "learned":
        embeddings += cfg.max_seq_len * cfg.d_model
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model
    return embeddings + _norm_params(cfg) + head


def count_params(cfg: ModelConfig) -> int:
    """Unique parameters of the built model; a tied head shares the embedding and counts once.
    A mixture of experts counts every expert (active_params: those a token uses)."""
    return sum(_block_params(cfg, is_moe_block(cfg, i)) for i in range(cfg.n_layers)) + _root_params(cfg)


def active_params(cfg: ModelConfig) -> int:
    """Parameters one token's forward uses: count_params with top_k of each MoE block's routed
    experts instead of all (equal to count_params for a dense model)."""
    return sum(_block_params(cfg, is_moe_block(cfg, i), active=True) for i in range(cfg.n_layers)) \
        + _root_params(cfg)


def matmul_params(cfg: ModelConfig) -> int:
    """Weight elements multiplied per token: every block linear (a MoE block's router, its top_k
    routed experts and its shared ones), plus the head (tied or not).

    Embedding lookups do no multiply-adds and are excluded; biases and norms are not matmuls.
    """
    return sum(_block_matmul_params(cfg, is_moe_block(cfg, i)) for i in range(cfg.n_layers)) \
        + cfg.d_model * cfg.vocab_size


def flops_per_token(cfg: ModelConfig, seq_len: int, recompute: str = "none") -> float:
    """Training FLOPs (forward + backward) per token at sequence length `seq_len`.

    PaLM (Chowdhery et al. 2022, appendix B): 6*N for the matmuls (2 forward, 4 backward per
    weight element) plus 12*n_layers*d_model*seq_len for attention (n_heads*head_dim
    in place of d_model where model.head_dim differs): QK^T and AV are 2*T*d each
    per token and layer forward (4*T*d), twice that backward. Like PaLM and torch's
    FlopCounterMode, attention is counted dense, not halved for the causal mask, so at long
    sequences these "model FLOPs" overstate the useful work.

    recompute="full" (blocks checkpointed by `apply_ac`) adds a second forward of each block, the
    familiar "8N, 4/3 of 6N", minus what torch does not redo: the head sits outside the
    blocks, and torch's non-reentrant checkpoint stops recomputing once every tensor backward
    needs exists again, so the block's last linear (MLP `proj`/`down`, whose output backward never
    reads) is skipped. Extra = n_layers * (2*(N_block - d_model*d_ff) + 4*d_model*seq_len).
    recompute="selective" keeps every matmul and attention output, so it recomputes only
    element-wise ops and adds no matmul FLOPs.

    MFU conventionally uses recompute="none" (recomputation is not model work). Kernels may do
    more: torch's CPU/flash attention backward recomputes QK^T (another 2*T*d per token and
    layer), which FlopCounterMode counts and this function, as PaLM, does not.
    """
    return _flops(cfg, seq_len, recompute, attention_forward=4, attention_backward=8)


def kernel_flops_per_token(cfg: ModelConfig, seq_len: int, recompute: str = "none") -> float:
    """The FLOPs the kernels execute per token (what the planner's time model divides by the
    device's rate): the matmuls as in flops_per_token, attention as a causal flash kernel does
    it — every product over the unmasked half only, and the backward recomputing the scores:
    forward QKᵀ and PV (2·T·d per token and layer, half of 4·T·d), backward the scores again,
    dP, dV, dQ and dK (5·T·d). 7·L·d·s against PaLM's 12·L·d·s: at long sequences, where
    attention dominates, the model-FLOP count overstates the step's work by up to 12/7."""
    return _flops(cfg, seq_len, recompute, attention_forward=2, attention_backward=5)


def _flops(cfg: ModelConfig, seq_len: int, recompute: str, attention_forward: int,
           attention_backward: int) -> float:
    """6N + (forward + backward)·L·d·s, and a second forward of the blocks for 'full'."""
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute = {recompute!r}; choose one of {', '.join(RECOMPUTE_MODES)}")
    per_token = cfg.n_layers * attention_width(cfg) * seq_len
    flops = 6 * matmul_params(cfg) + (attention_forward + attention_backward) * per_token
    if recompute == "full":  # every block again but its MLPs' last linears
        recomputed = sum(_block_matmul_params(cfg, moe) - cfg.d_model * sum(_mlp_widths(cfg, moe, True))
                         for moe in map(lambda i: is_moe_block(cfg, i), range(cfg.n_layers)))
        flops += 2 * recomputed + attention_forward * per_token
    return float(flops)


def kernel_forward_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """The forward's share of kernel_flops_per_token (2N + 2·L·d·s)."""
    return float(2 * matmul_params(cfg) + 2 * cfg.n_layers * attention_width(cfg) * seq_len)


def pipeline_split(cfg: ModelConfig, seq_len: int, pp: int, explicit: str = "", virtual: int = 1,
                   placement: str = "loop") -> list[int]:
    """Blocks per global pipeline stage (`pp` of them): `explicit` ('4,4,3,5',
    parallel.pp_layers) checked, or the balanced split (dims.split_layers) by forward FLOPs per
    token as the kernels execute them: a block 2·N_block + 2·d·s (causal attention), the head
    2·d·V on the last stage, the embedding (a lookup) nothing. With `virtual` chunks per rank
    (stage g on rank g mod pp/virtual, the interleaved schedule) what is balanced is each
    rank's sum: ranks' totals split as for pp/virtual stages, each total shared evenly by its
    chunks (when every rank has a block per chunk). With `placement` 'v' (two chunks a rank,
    rank r holding stages r and pp-1-r: the head on rank 0) likewise, the head's cost on the
    first rank. The runtime and the planner both split with this."""
    from shardlm.config.dims import parse_layers, split_layers

    if explicit:
        return parse_layers(explicit, cfg.n_layers, pp)
    head = _head_in_blocks(cfg, seq_len)
    ranks = pp // virtual
    if placement == "v" and ranks > 1:  # rank r holds stages r and pp-1-r; the head is rank 0's
        totals = split_layers(cfg.n_layers, ranks, head, 0.0)
        if min(totals) >= 2:
            down = [(n + 1) // 2 for n in totals]
            return down + [n - d for n, d in zip(reversed(totals), reversed(down))]
        return split_layers(cfg.n_layers, pp, 0.0, head)
    if virtual > 1 and ranks > 1:
        totals = split_layers(cfg.n_layers, ranks, 0.0, head)
        if min(totals) >= virtual:
            per = [[n // virtual + (v < n % virtual) for v in range(virtual)] for n in totals]
            return [per[g % ranks][g // ranks] for g in range(pp)]
    return split_layers(cfg.n_layers, pp, 0.0, head)


def _head_in_blocks(cfg: ModelConfig, seq_len: int) -> float:
    block = (matmul_params(cfg) - cfg.d_model * cfg.vocab_size) / cfg.n_layers  # the mean block
    return 2 * cfg.d_model * cfg.vocab_size / (2 * block + 2 * attention_width(cfg) * seq_len)


def stage_shares(cfg: ModelConfig, seq_len: int, split: list[int]) -> list[float]:
    """Each stage's share of the model's forward FLOPs for a split (the head on the last)."""
    costs = [float(n) for n in split]
    costs[-1] += _head_in_blocks(cfg, seq_len)
    return [c / sum(costs) for c in costs]


def encoder_decoder_flops_per_token(encoder_matmul: int, decoder_matmul: int, cross_kv_matmul: int,
                                    head_matmul: int, encoder_layers: int, decoder_layers: int,
                                    attention_width: int, source_len: int, target_len: int) -> float:
    """Training FLOPs of an encoder-decoder (T5, BART) per *target* token, the unit the loop's
    tokens/s counts (train.seq_len per row; the source_len encoder tokens come with it).

    6·N·tokens per weight element, each linear counted over the tokens it actually multiplies:
    the encoder's over the S source tokens, the decoder's over the T target tokens — except the
    cross-attention's key/value projections, which read the encoder's S outputs — and the head
    over T. Attention as PaLM counts it (flops_per_token: 12·width per query-key pair and layer,
    dense, forward + backward): encoder self-attention S², decoder self-attention T², cross
    attention T·S. `*_matmul` are weight elements (embedding lookups excluded), `attention_width`
    the heads × head size (T5's inner_dim, BART's d_model). Per example, divided by T."""
    S, T, width = source_len, target_len, attention_width
    matmuls = 6 * (encoder_matmul * S + (decoder_matmul - cross_kv_matmul) * T
                   + cross_kv_matmul * S + head_matmul * T)
    attention = 12 * width * (encoder_layers * S * S + decoder_layers * (T * T + T * S))
    return float(matmuls + attention) / T


CPU_HALF_IN_FP32_MAX_LEN = 256
"""On the CPU, SDPA on bf16 / fp16 inputs of at most this many positions runs in fp32 (the inputs
cast up, the output cast back): torch 2.13's fused CPU kernel pays a fixed cost per call in its
half-precision backward — forward + backward, 9 heads of 64 (3 kv), measured on an Intel Xeon with
AMX: 1.49 / 0.58 ms at 64 positions, 4.4 / 2.0 at 128, 6.2 / 4.9 at 256, 22 / 28 at 768, 40 / 62
at 1024 (bf16 / in fp32); in a LoRA fine-tune of 128-token rows split into documents the bf16
backward was 34% of the step (bench/bench_finetune.py). Longer sequences keep the half kernel,
and so does a call without backward (evaluation, generation: its forward is the fast half;
a decoding step's one query against a long cache would copy the cache). fp32 is the more exact
of the two; nothing is lost but a copy of q, k and v. Here, torch-free, for the planner too
(planner/activations.py counts what the fp32 kernel keeps); used by models/attention.py sdpa."""
