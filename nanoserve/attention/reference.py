"""The reference read of a paged pool: gather each request's blocks into a contiguous copy, then
attend (Day 18). Slow, plain, and the oracle every other implementation is tested against.

Shapes: T new queries, S keys, H query heads, K kv heads, D head_dim.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .metadata import AttentionMetadata


def prefix_attention(q: Tensor, keys: Tensor, values: Tensor, start: int) -> Tensor:
    """T new queries over S = start + T keys, causal among the new ones, grouped-query.

    q (B, T, H, D); keys/values (B, K, S, D) -> (B, T, H*D). Three cases, one rule
    (query t, at position start + t, sees keys [0, start + t]):
    a prompt on an empty cache is plain causal attention; one decode query sees every
    key, so it needs no mask at all; a chunk on top of a prefix gets an explicit mask.
    """
    B, T, H, D = q.shape
    S = keys.shape[2]
    mask = None
    if T > 1 and start > 0:
        mask = torch.arange(S, device=q.device)[None, :] <= start + torch.arange(T, device=q.device)[:, None]  # (T, S)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys, values, attn_mask=mask, is_causal=T > 1 and start == 0, enable_gqa=True
    )  # (B, H, T, D)
    return out.transpose(1, 2).reshape(B, T, H * D)


def gather_blocks(k_pool: Tensor, v_pool: Tensor, blocks: Tensor | Sequence[int],
                  length: int) -> tuple[Tensor, Tensor]:
    """A sequence's first `length` keys and values, copied out of one layer's pools (blocks, bs, K, D)
    in table order: contiguous (length, K, D) tensors."""
    bs, K, D = k_pool.shape[1:]
    blocks = torch.as_tensor(blocks, dtype=torch.long)[: -(-length // bs)]
    k = k_pool.index_select(0, blocks).view(-1, K, D)[:length]  # (length, K, D)
    v = v_pool.index_select(0, blocks).view(-1, K, D)[:length]
    return k, v


def attend(q: Tensor, k: Tensor, v: Tensor, k_pool: Tensor, v_pool: Tensor, md: AttentionMetadata,
           scratch: dict) -> Tensor:
    """Request by request: gather its keys and values, attend its queries over them. q (N, H, D);
    k/v (N, K, D) the step's own (already in the pool; unused here) -> (N, H*D), padding rows zero."""
    N, H, D = q.shape
    out = q.new_zeros(N, H * D)
    qsl = md.query_start_loc.tolist()
    for r, seq_len in enumerate(md.seq_lens_host):
        s, e = qsl[r], qsl[r + 1]
        kc, vc = gather_blocks(k_pool, v_pool, md.block_tables[r], seq_len)  # (seq_len, K, D)
        out[s:e] = prefix_attention(q[None, s:e], kc.transpose(0, 1)[None], vc.transpose(0, 1)[None],
                                    seq_len - (e - s))[0]
    return out
