"""A key/value cache for incremental decoding with our Decoder (models/decoder.py).

Generation without a cache recomputes the whole context for every new token: O(T²) tokens
through the model for T tokens. With one, the prompt is run once (the prefill) and every later
step runs only the new token, its queries attending to the keys and values every layer kept of
the tokens before it (positions continue from the cache's length: learned or RoPE alike).

    cache = KVCache(model.cfg.n_layers)
    logits = model(prompt, cache=cache)          # (B, T, vocab); cache.length == T
    logits = model(next_ids, cache=cache)        # (B, 1, vocab) at position T

The keys stored are after RoPE (each token rotated by its own position once) and before
grouped-query broadcasting (n_kv_heads rows, not n_heads).
"""

from __future__ import annotations

import torch

from shardlm.models.attention import sdpa


class LayerCache:
    """One attention layer's keys and values so far, each (B, n_kv_heads, length, head_dim)."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the new tokens' k, v (B, nkv, T_new, hs); all of them so far, (B, nkv, length, hs)."""
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


class KVCache:
    """Every layer's LayerCache; `length` tokens are cached (the next token's position)."""

    def __init__(self, n_layers: int) -> None:
        self.layers = [LayerCache() for _ in range(n_layers)]

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float | None = None) -> torch.Tensor:
    """Causal attention of T_new queries (B, nh, T_new, hs) that are the *last* T_new of the
    keys (B, nkv, T_all, hs): query i sees keys 0 .. T_all - T_new + i. SDPA's is_causal aligns
    the mask top-left, right only without a past; one query sees every key, no mask at all."""
    new, total = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if new == total:
        return sdpa(q, k, v, gqa, is_causal=True, scale=scale)
    if new == 1:
        return sdpa(q, k, v, gqa, scale=scale)
    past = total - new
    allowed = torch.ones(new, total, dtype=torch.bool, device=q.device).tril(diagonal=past)  # (T_new, T_all)
    return sdpa(q, k, v, gqa, attn_mask=allowed, scale=scale)
