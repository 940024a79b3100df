"""The reference read of a paged pool: gather each request's blocks into a contiguous copy, then
attend (Day 18). Slow, plain, and the oracle every other implementation is tested against.

Shapes: T new queries, S keys, H query heads, K kv heads, D head_dim.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .causal import causal_attention
from .metadata import AttentionMetadata


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
        out[s:e] = causal_attention(q[None, s:e], kc[None], vc[None])[0]
    return out
