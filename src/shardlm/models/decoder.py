"""One decoder-only transformer covering GPT-2 and LLaMA, chosen by `ModelConfig` fields.

GPT-2 (Radford et al. 2019): LayerNorm, learned positions, GELU MLP, biases, tied head.
LLaMA (Touvron et al. 2023): RMSNorm, rotary positions, SwiGLU MLP, no biases, GQA from LLaMA 2.
The mapped checkpoint families' variations (docs/finetuning.md, "Checkpoint families") are
fields too: RoPE scaling and head width (Llama 3.1-3.3), q/k norms (Qwen3), Gemma's (1 + w)
norms, scaled embeddings, GeGLU, sandwich norms, soft-capping and sliding-window blocks.

The model is built on the meta device and initialised per parameter from (seed, name)
(models/init.py), so a 7B model costs nothing to construct and is materialised once, whole on
one process or a ZeRO unit at a time on each rank (torchtitan's pattern, made order-free).
"""

from __future__ import annotations

import math
from typing import Callable, Collection

import torch
import torch.nn.functional as F
from torch import nn

from shardlm.config.model import ModelConfig
from shardlm.models.attention import AttentionMask, attend, choose_backend, prepare
from shardlm.models.flops import head_dim, is_moe_block, moe_layers, resolved_d_ff
from shardlm.models.init import materialize, parameter_generator
from shardlm.models.kv_cache import KVCache, LayerCache, cached_attention
from shardlm.models.lora import adapter_initial_value, is_adapter
from shardlm.models.moe import MoE, MoEStats
from shardlm.models.rope import apply_rope, rope_frequencies, rope_tables, rotary_dim  # noqa: F401
from shardlm.data.packed import PackedTokens

# Linears that write into the residual stream: GPT-2 scales their init by 1/sqrt(2*n_layers) so
# the residual's variance does not grow with depth (Radford et al. 2019, section 2.3).
RESIDUAL_PROJECTIONS = ("attn.proj", "mlp.proj", "mlp.down", "shared.proj", "shared.down",
                        "experts.proj", "experts.down")

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each (T, hs/2), or (B, 1, T, hs/2) per document


def _norm(cfg: ModelConfig, dim: int = 0) -> nn.Module:
    """The model's norm over `dim` features (0 = d_model)."""
    dim = dim or cfg.d_model
    if cfg.norm == "rmsnorm":
        return OffsetRMSNorm(dim, cfg.norm_eps) if cfg.norm_offset else nn.RMSNorm(dim, eps=cfg.norm_eps)
    return nn.LayerNorm(dim, eps=cfg.norm_eps, bias=cfg.bias or cfg.norm_bias)


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: x/rms(x)·(1 + w) in fp32, then x's dtype (its transformers arithmetic:
    the weight is added to 1 before the product, which is rounded once)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).type_as(x)


class OffsetRMSNorm(nn.Module):
    """model.norm_offset: RMSNorm whose weight is stored as the offset from 1 (Gemma), so it
    starts at 0; same `weight` / `normalized_shape` / `eps` attributes as nn.RMSNorm."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.normalized_shape, self.eps = (dim,), eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return offset_rms_norm(x, self.weight, self.eps)


class CausalAttention(nn.Module):
    """softmax(q kᵀ·scale + causal mask) v: the part of attention that mixes positions, a module
    of its own so context parallelism can replace it (parallel/context/attention.py: the ring). `scale`
    None = 1/√d; `softcap` > 0: Gemma 2's c·tanh(scores/c)."""

    def __init__(self, scale: float | None = None, softcap: float = 0.0) -> None:
        super().__init__()
        self.scale, self.softcap = scale, softcap

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: AttentionMask | None = None) -> torch.Tensor:
        """`mask`: the backend, document and window mask of this forward (models/attention.py);
        None = plain causal SDPA."""
        return attend(q, k, v, mask, self.scale, self.softcap)


class Attention(nn.Module):
    """Causal self-attention with one fused q/k/v projection; n_kv_heads < n_heads is GQA/MQA.
    model.qk_norm: an RMSNorm over each query and key head before RoPE (Qwen3)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads or cfg.n_heads
        self.head_dim = head_dim(cfg)
        qkv_out = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        self.qkv = nn.Linear(cfg.d_model, qkv_out, bias=cfg.bias or cfg.qkv_bias)
        self.proj = nn.Linear(self.n_heads * self.head_dim, cfg.d_model, bias=cfg.bias)
        self.qk_norm_all = cfg.qk_norm and cfg.qk_norm_width == "all"
        if cfg.qk_norm:  # OLMo-2's over the whole projection, else over each head
            q_width, k_width = ((self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim)
                                if self.qk_norm_all else (self.head_dim, self.head_dim))
            self.q_norm, self.k_norm = _norm(cfg, q_width), _norm(cfg, k_width)
        self.core = CausalAttention(cfg.attention_scale or None, cfg.attn_softcap)

    def forward(self, x: torch.Tensor, rope: Rope | None, cache: LayerCache | None = None,
                mask: AttentionMask | None = None) -> torch.Tensor:
        """`cache` (generation, models/kv_cache.py): x holds only the new tokens; their keys and
        values join the cache's and the queries attend to all of them."""
        qkv = self.qkv(x)  # (B, T, …): T the whole sequence, also when x is a sequence-parallel chunk
        B, T, _ = qkv.shape
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        if self.qk_norm_all:  # (B, T, nh*hs), (B, T, nkv*hs)
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        if hasattr(self, "q_norm") and not self.qk_norm_all:  # per head, over hs
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache is not None:  # incremental decoding: the past tokens' k, v from the cache
            y = cached_attention(q, *cache.append(k, v), scale=self.core.scale)  # (B, nh, T, hs)
        else:
            y = self.core(q, k, v) if mask is None else self.core(q, k, v, mask=mask)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, q_size)  # (B, T, nh*hs)
        return self.proj(y)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"gelu_tanh": _gelu_tanh, "gelu": F.gelu, "silu": F.silu}
"""model.activation -> the function (models' 'auto' resolved by each MLP)."""


class GeluMLP(nn.Module):
    """GPT-2's MLP: fc, GELU (tanh approximation, as GPT-2 was trained; model.activation may
    say otherwise: GPT-NeoX's exact one), proj."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, resolved_d_ff(cfg), bias=cfg.bias)
        self.proj = nn.Linear(resolved_d_ff(cfg), cfg.d_model, bias=cfg.bias)
        self.activation = ACTIVATIONS["gelu_tanh" if cfg.activation == "auto" else cfg.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.activation(self.fc(x)))


class SwiGLU(nn.Module):
    """LLaMA's gated MLP (Shazeer 2020): down(silu(gate(x)) * up(x)), gate and up fused.

    `gate_up.weight` rows [0, hidden) are HF's gate_proj, rows [hidden, 2*hidden) its up_proj.
    model.activation 'gelu_tanh' makes it GeGLU (Gemma).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.activation = ACTIVATIONS["silu" if cfg.activation == "auto" else cfg.activation]
        self.hidden = resolved_d_ff(cfg)
        self.gate_up = nn.Linear(cfg.d_model, 2 * self.hidden, bias=cfg.bias)
        self.down = nn.Linear(self.hidden, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # (B, T, hidden) each
        return self.down(self.activation(gate) * up)




def is_sliding(cfg: ModelConfig, index: int) -> bool:
    """Whether block `index` attends within model.sliding_window only (every block, or all but
    each global_every-th)."""
    if not cfg.sliding_window:
        return False
    return not cfg.global_every or (index + 1) % cfg.global_every != 0


def dense_mlp(cfg: ModelConfig) -> nn.Module:
    return SwiGLU(cfg) if cfg.mlp == "swiglu" else GeluMLP(cfg)


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)); the MLP a mixture of
    experts (models/moe.py) in the blocks `model.moe_every` picks when model.experts > 0.
    model.norm_placement 'sandwich' (Gemma 2, 3) also normalises each output before it joins
    the residual: x + post_norm(attn(norm(x))); 'post' (OLMo-2) normalises the output only, with
    the same attn_norm / mlp_norm: x + attn_norm(attn(x)). Granite scales each output by
    model.residual_multiplier. model.parallel_residual (GPT-NeoX): x + attn(norm(x)) +
    mlp(mlp_norm(x))."""

    def __init__(self, cfg: ModelConfig, index: int = 0, stats: MoEStats | None = None) -> None:
        super().__init__()
        self.attn_norm = _norm(cfg)
        self.attn = Attention(cfg)
        self.mlp_norm = _norm(cfg)
        self.mlp = MoE(cfg, index, stats, dense_mlp) if is_moe_block(cfg, index) else dense_mlp(cfg)
        if cfg.norm_placement == "sandwich":
            self.attn_post_norm, self.mlp_post_norm = _norm(cfg), _norm(cfg)
        self.sliding = is_sliding(cfg, index)
        """Whether this block attends within model.sliding_window only (its mask and RoPE)."""
        self.rope_table = ("" if cfg.nope_every and (index + 1) % cfg.nope_every == 0 else
                           "rope_local" if self.sliding and cfg.rope_local_theta else "rope")
        """Which RoPE tables the block rotates with ('' = none: NoPE, model.nope_every)."""
        self.post, self.residual_multiplier = cfg.norm_placement == "post", cfg.residual_multiplier
        self.parallel_residual = cfg.parallel_residual

    def forward(self, x: torch.Tensor, rope: Rope | None = None, cache: LayerCache | None = None,
                mask: AttentionMask | None = None) -> torch.Tensor:
        if self.post:  # OLMo-2
            h = self.attn_norm(self.attn(x, rope, cache=cache, mask=mask))  # (B, T, C)
        else:
            h = self.attn(self.attn_norm(x), rope, cache=cache, mask=mask)  # (B, T, C)
        if hasattr(self, "attn_post_norm"):
            h = self.attn_post_norm(h)
        if self.parallel_residual:  # GPT-NeoX: both on the block's input, summed as it sums them
            return x + (h + self.mlp(self.mlp_norm(x)))  # (B, T, C)
        x = x + (h if self.residual_multiplier == 1.0 else h * self.residual_multiplier)
        h = self.mlp_norm(self.mlp(x)) if self.post else self.mlp(self.mlp_norm(x))  # (B, T, C)
        if hasattr(self, "mlp_post_norm"):
            h = self.mlp_post_norm(h)
        return x + (h if self.residual_multiplier == 1.0 else h * self.residual_multiplier)


class Decoder(nn.Module):
    """Token embedding, `n_layers` blocks, final norm, linear head to vocabulary logits."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        if cfg.position == "learned":
            self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.moe_stats = MoEStats(moe_layers(cfg), cfg.experts) if cfg.experts else None
        """What the mixture-of-experts layers did this step (models/moe.py), when there are any."""
        self.blocks = nn.ModuleList(Block(cfg, i, self.moe_stats) for i in range(cfg.n_layers))
        self.norm_f = _norm(cfg)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.position == "rope":
            # Non-persistent: derived from the config, so checkpoints do not carry them.
            half = rotary_dim(cfg) // 2
            self.register_buffer("rope_cos", torch.empty(cfg.max_seq_len, half), persistent=False)
            self.register_buffer("rope_sin", torch.empty(cfg.max_seq_len, half), persistent=False)
            if cfg.rope_local_theta:  # the sliding blocks' own plain RoPE (Gemma 3)
                self.register_buffer("rope_local_cos", torch.empty(cfg.max_seq_len, half), persistent=False)
                self.register_buffer("rope_local_sin", torch.empty(cfg.max_seq_len, half), persistent=False)
        if cfg.tie_embeddings:  # GPT-2: the head is the embedding's Parameter
            self.head.weight = self.tok_emb.weight
        self.attention_backend = cfg.attention
        """model.attention; 'auto' is fixed per run by models.attention.configure (the trainer),
        or else chosen at each forward for the input's device."""
        self.context = None
        """Context parallelism's CPState (parallel/context/attention.py), when the sequence is split."""
        self.layers = range(cfg.n_layers)
        """The blocks this model runs: all, or a pipeline stage's (parallel/pipeline/stages.py)."""

    def initial_value(self, name: str, seed: int) -> torch.Tensor:
        """The initial values of parameter `name` (fp32, CPU), a function of (seed, name) only:
        normal(0, init_std) for matrices and embeddings, init_std/sqrt(2*n_layers) for the
        residual projections, zeros for biases, ones for norm weights; LoRA adapters as
        models/lora.py says. Any subset of the parameters can be initialised, in any order, on
        any rank (models/init.py)."""
        shape = self.get_parameter(name).shape
        if is_adapter(name):
            return adapter_initial_value(name, tuple(shape), seed)
        module_name, _, attr = name.rpartition(".")
        module = self.get_submodule(module_name)
        if isinstance(module, OffsetRMSNorm):  # weight 0 scales by 1
            return torch.zeros(shape)
        if isinstance(module, (nn.LayerNorm, nn.RMSNorm)) and attr == "weight":
            return torch.ones(shape)
        if attr.endswith("bias"):
            return torch.zeros(shape)
        std = self.cfg.init_std
        if name.removesuffix(".weight").endswith(RESIDUAL_PROJECTIONS):
            std /= math.sqrt(2 * self.cfg.n_layers)
        return torch.empty(shape).normal_(0.0, std, generator=parameter_generator(seed, name))

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Buffers derived from the config (not saved): the RoPE tables."""
        if self.cfg.position == "rope":
            cos, sin = rope_tables(rotary_dim(self.cfg), self.cfg.max_seq_len, self.cfg.rope_theta,
                                   *rope_frequencies(self.cfg))
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)
            if self.cfg.rope_local_theta:
                cos, sin = rope_tables(rotary_dim(self.cfg), self.cfg.max_seq_len, self.cfg.rope_local_theta)
                self.rope_local_cos.copy_(cos)
                self.rope_local_sin.copy_(sin)

    def fused_parts(self) -> dict[str, tuple[int, ...]]:
        """Each fused projection's weight -> the rows of the separate matrices it joins
        (attn.qkv: q, k, v; mlp.gate_up: gate, up), whole-model sizes whatever cuts them."""
        cfg, hd = self.cfg, head_dim(self.cfg)
        q, kv = cfg.n_heads * hd, (cfg.n_kv_heads or cfg.n_heads) * hd
        parts = {}
        for name, _ in self.named_parameters():
            if name.endswith(".attn.qkv.weight"):
                parts[name] = (q, kv, kv)
            elif name.endswith(".gate_up.weight"):
                parts[name] = (resolved_d_ff(cfg),) * 2
        return parts

    def forward(self, idx: torch.Tensor | PackedTokens, hidden: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        """idx (B, T) token ids -> logits (B, T, vocab_size).

        idx may be PackedTokens (data.document_mask, shardlm/data/packed.py): rows of several
        documents, each token's position counted from its document's start (learned positions
        and RoPE angles restart at 0), and attention kept inside each document.

        With a `cache` (generation, models/kv_cache.py) idx holds only the tokens after the
        cache's `length` ones: their positions start there, and every block reads and extends
        its layer's keys and values.

        A pipeline stage (parallel/pipeline/stages.py) runs its own blocks only: a later stage takes
        the previous stage's output as `hidden` (idx still gives the positions), and every
        stage but the last returns its hidden states (B, T, C) instead of logits."""
        documents = counted = None
        if isinstance(idx, PackedTokens):
            if cache is not None:
                raise ValueError("packed documents (PackedTokens) cannot be decoded with a KV cache")
            idx, documents, counted = idx.ids, idx.positions, idx.counted  # (B, T) each
        B, T = idx.shape
        past = cache.length if cache is not None else 0
        if past + T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {past + T} exceeds model.max_seq_len = {self.cfg.max_seq_len}; "
                             f"crop the input or raise model.max_seq_len")
        positions = None
        if self.context is not None:  # context parallelism: this rank's part of the sequence
            idx, positions = self.context.split(idx, documents)  # (B, T/cp), their positions
        if positions is None:
            positions = torch.arange(past, past + T, device=idx.device) if documents is None else documents
        if hidden is None:
            x = self.tok_emb(idx)  # (B, T, C)
            if self.cfg.embedding_multiplier != 1.0:  # Gemma: sqrt(d_model)
                x = x * self.cfg.embedding_multiplier
            if self.cfg.position == "learned":
                x = x + self.pos_emb(positions)  # (B, T, C)
        else:
            x = hidden
            if getattr(self, "tp", None) is not None:  # the embedding decides it on the first stage
                self.tp.decide(idx)
        ropes = {"": None, "rope": self._rope("rope", positions)}  # by Block.rope_table
        if self.cfg.rope_local_theta:
            ropes["rope_local"] = self._rope("rope_local", positions)
        # once per forward, shared by every block (a KV cache's decoding runs its own attention)
        masks = {False: self._attention_mask(documents, T, x) if cache is None else None}
        masks[True] = (self._attention_mask(documents, T, x, self.cfg.sliding_window)
                       if cache is None and self.cfg.sliding_window else masks[False])
        for i in self.layers:
            block = self.blocks[i]
            rope, mask = ropes[block.rope_table], masks[block.sliding]
            if cache is None:
                x = block(x, rope) if mask is None else block(x, rope, mask=mask)  # (B, T, C)
            else:
                x = block(x, rope, cache=cache.layers[i])  # (B, T, C)
        if self.layers.stop < self.cfg.n_layers:  # a pipeline stage before the last
            return x
        if counted is not None and self.context is None and getattr(self, "tp", None) is None:
            # SFT: only the positions whose target carries loss need logits (the head and the
            # loss over the vocabulary are ~1/5 of a small model's step); cut and vocabulary-
            # parallel heads keep the whole sequence
            x = x[counted].unsqueeze(0)  # (1, N, C), in row order
        logits = self.head(self.norm_f(x))  # (B, T, vocab), or (1, N, vocab)
        if self.cfg.logits_divisor != 1.0:  # Granite
            logits = logits / self.cfg.logits_divisor
        if self.cfg.logit_softcap:  # Gemma 2: c·tanh(logits/c)
            logits = torch.tanh(logits / self.cfg.logit_softcap) * self.cfg.logit_softcap
        return logits

    def _rope(self, prefix: str, positions: torch.Tensor) -> Rope | None:
        """The (cos, sin) rows of `positions` from the tables `prefix`_cos/_sin; None without RoPE."""
        if self.cfg.position != "rope":
            return None
        cos, sin = getattr(self, f"{prefix}_cos")[positions], getattr(self, f"{prefix}_sin")[positions]
        if positions.dim() == 2:  # per-row positions: (B, 1, T, hs/2) for the heads
            return cos.unsqueeze(1), sin.unsqueeze(1)
        return cos, sin

    def _attention_mask(self, documents: torch.Tensor | None, T: int, x: torch.Tensor,
                        window: int = 0) -> AttentionMask | None:
        """The backend's mask for this forward (models/attention.py), in the dtype q will have;
        `window`: the sliding blocks' mask."""
        device, cfg = x.device, self.cfg
        backend = choose_backend(self.attention_backend, device.type, documents is not None, compiled=False,
                                 softcap=cfg.attn_softcap > 0, window=cfg.sliding_window > 0)
        dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else x.dtype
        return prepare(backend, documents, T, device, dtype, window)


def build_model(cfg: ModelConfig, device: torch.device | str = "cpu", seed: int = 0) -> Decoder:
    """Construct on the meta device (free), then allocate once on `device` and initialise.
    `device="meta"` stops after construction: shapes and parameter counts of any size, no
    memory; the trainer builds that way and lets parallelize() materialise it piece by piece.
    """
    with torch.device("meta"):
        model = Decoder(cfg)
    if torch.device(device).type == "meta":
        return model
    return materialize(model, device, seed)


@torch.no_grad()
def generate(model: nn.Module, idx: torch.Tensor, max_new_tokens: int, temperature: float = 0.8,
             top_k: int | None = 50, generator: torch.Generator | None = None,
             use_cache: bool = True, stop_ids: Collection[int] = (),
             on_token: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
    """Append up to `max_new_tokens` sampled tokens to idx (B, T); returns (B, T + new).

    With `use_cache` (models/kv_cache.py) the prompt runs once and each later step only the new
    token; once the sequence outgrows model.max_seq_len every step recomputes its last
    max_seq_len tokens (the window's positions shift, so nothing cached stays valid). Without,
    the whole (cropped) context every step. Context parallelism runs without the cache (every
    rank the whole sequence), and so do soft-capped and sliding-window models. temperature 0 picks the most likely token; top_k None or 0
    samples from the full distribution. `stop_ids` (a chat template's end of turn, the
    generation config's eos ids): generation ends after the step at which every row has drawn
    one (kept in the output). `on_token` is called with each step's tokens (B, 1) as they are
    drawn (streaming).
    """
    max_len = model.cfg.max_seq_len
    if model.cfg.attn_softcap or model.cfg.sliding_window:
        use_cache = False  # the cache's kernel has neither soft-capping nor a window
    stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=idx.device)
    context = getattr(model, "context", None)  # context parallel: every rank the whole sequence
    if context is not None:
        with context.whole_sequences():
            return _sample(model, idx, max_new_tokens, max_len, temperature, top_k, generator, False,
                           stops, on_token)
    return _sample(model, idx, max_new_tokens, max_len, temperature, top_k, generator, use_cache,
                   stops, on_token)


def _sample(model, idx, max_new_tokens, max_len, temperature, top_k, generator, use_cache,
            stops, on_token) -> torch.Tensor:
    cache = KVCache(model.cfg.n_layers) if use_cache else None
    stopped = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)  # (B,)
    for _ in range(max_new_tokens):
        if cache is not None and idx.shape[1] <= max_len:  # the tokens the cache has not seen
            logits = model(idx[:, cache.length:], cache=cache)[:, -1, :]
        else:
            logits = model(idx[:, -max_len:])[:, -1, :]  # (B, vocab), or this rank's part of it
        token = next_token(model, logits, temperature, top_k, generator)  # (B, 1)
        idx = torch.cat((idx, token), dim=1)
        if on_token is not None:
            on_token(token)
        if stops.numel():
            stopped |= torch.isin(token[:, 0], stops)
            if bool(stopped.all()):
                break
    return idx


def next_token(model: nn.Module, logits: torch.Tensor, temperature: float, top_k: int | None,
               generator: torch.Generator | None) -> torch.Tensor:
    """The next token (B, 1) from the last position's logits (B, vocab), or this rank's
    vocabulary part of them (gathered first)."""
    if hasattr(model.head, "gather"):  # a vocabulary-parallel head (parallel/tensor/decoder.py)
        logits = model.head.gather(logits)
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)  # (B, 1)
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)  # (B, 1)
