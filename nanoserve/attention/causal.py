"""Causal self-attention, and the protocol every place that keeps keys and values follows (Day 05).

A decoder's attention is one rule: the query at position p sees the keys at positions 0..p. Every
road of the engine computes it with `causal_attention`, whatever holds the keys: the forward's own
new tokens (no cache), a contiguous cache, or blocks gathered out of a paged pool.

Where the keys and values go is a *KV backend*'s business (`KVBackend`): the model hands it each
layer's rotated q, k, v and takes back the attention output. `no_cache_backend` keeps nothing;
`stages.contiguous.KVCache` keeps a contiguous cache; `attention.paged.PagedAttention` a paged pool.

Shapes: B batch, T new queries, S keys, H query heads, K kv heads (H a multiple of K), D head_dim.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import kernels


class KVBackend(Protocol):
    """Where attention reads and writes K/V. Called once per layer per forward."""

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q (B, T, H, D), k/v (B, T, K, D), already rotated -> output (B, T, H*D). A backend that can also honour
        a sliding window (the query at p sees keys p - window + 1 .. p) takes `window=` and says so with a true
        `supports_sliding_window` attribute; a model asks for the window only of such a backend."""
        ...


def causal_attention(q: Tensor, k: Tensor, v: Tensor, start: int | None = None,
                     key_mask: Tensor | None = None, window: int | None = None) -> Tensor:
    """T queries at positions start .. start+T-1 over S keys at positions 0 .. S-1: query t sees keys
    0 .. start + t. Grouped-query, by torch's fused kernel.

    q (B, T, H, D); k/v (B, S, K, D) -> (B, T, H*D). `start` defaults to S - T: the queries are the
    last T keys' own tokens (a prompt on an empty cache has start 0, one decode query sees every key).
    `key_mask` (B, S) bool marks real keys in a padded batch of prompts (start 0); a padding query is
    let see itself so its softmax stays finite. `window`: a sliding layer's, the query at p sees only keys
    p - window + 1 .. p.
    """
    B, T, H, D = q.shape
    S = k.shape[1]
    start = S - T if start is None else start
    if start + T != S:
        raise ValueError(f"queries at positions {start}..{start + T - 1} need {start + T} keys, got {S}")
    mask = None
    if window is not None and start + T > window:  # some query would see a key the window has left behind
        if key_mask is not None:
            raise ValueError("a sliding window over a padded batch of prompts is not supported")
        qpos = start + torch.arange(T, device=q.device)[:, None]
        kpos = torch.arange(S, device=q.device)[None, :]
        mask = (kpos <= qpos) & (kpos > qpos - window)  # (T, S)
    elif key_mask is not None:
        if start != 0:
            raise ValueError("key_mask is for a padded batch of whole prompts (start 0)")
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        mask = causal[None] & key_mask[:, None, :]  # (B, T, T)
        mask = (mask | torch.eye(T, dtype=torch.bool, device=q.device)[None])[:, None]  # (B, 1, T, T)
    elif T > 1 and start > 0:  # a chunk after cached keys: causal among the new, every old key visible
        mask = torch.arange(S, device=q.device)[None, :] <= start + torch.arange(T, device=q.device)[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
        is_causal=mask is None and T > 1, enable_gqa=True)  # (B, H, T, D)
    return out.transpose(1, 2).reshape(B, T, H * D)


def bf16_prompt_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """A whole prompt's attention with its products in bf16, as a bf16 model's matrices are (Day 42): the compiled
    kernel where the CPU has AVX512_BF16 (q, k, v and the softmax weights rounded to bf16, every sum in fp32),
    else `causal_attention`, whose weights stay fp32 (the same numbers to a weight's bf16 rounding).
    q (T, H, D), k/v (T, K, D) -> (T, H*D)."""
    if kernels.prompt_attention_bf16_here(q.shape[-1]) and not torch.is_grad_enabled():
        return kernels.prompt_attention_bf16(q, k, v, q.shape[-1] ** -0.5)
    return causal_attention(q[None], k[None], v[None], 0)[0]


def no_cache_backend(key_mask: Tensor | None = None, bf16: bool = False) -> KVBackend:
    """The backend with no memory: each forward attends over exactly its own tokens. `bf16`: a bf16 model on the
    compiled road, whose prompts take `bf16_prompt_attention`. The fp32 one honours a sliding window."""
    if bf16 and key_mask is None:  # (one prompt, the usual case, needs no stack)
        return lambda layer, q, k, v: (bf16_prompt_attention(q[0], k[0], v[0])[None] if len(q) == 1 else
                                       torch.stack([bf16_prompt_attention(*row) for row in zip(q, k, v)]))

    def backend(layer: int, q: Tensor, k: Tensor, v: Tensor, window: int | None = None) -> Tensor:
        return causal_attention(q, k, v, 0, key_mask, window)

    backend.supports_sliding_window = True  # type: ignore[attr-defined]
    return backend
