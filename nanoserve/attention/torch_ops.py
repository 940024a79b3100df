"""A paged step's attention in batched torch ops (Days 13 and 28).

Decode requests (one query each) go together: their keys are gathered into one (R, K, L)
rectangle, L the longest request's blocks rounded up to KEY_MULTIPLE keys, in the head-major
order the scores' matmul reads; keys past a request's length get a -inf bias. The values are
never gathered: each query head's output is a weighted sum of value rows, which is exactly
what F.embedding_bag computes, straight from the pool seen as rows of D numbers.

A whole prompt (nothing cached before it) attends over its own new k/v with the fused causal
kernel, one call per request on exactly its tokens: the call its solo run makes. A chunk after
cached context takes the reference read.

Batch invariance: every request's numbers are computed from its own keys only. A key past a
request's length adds an exact zero, and since the softmax and value sums vectorise over
KEY_MULTIPLE keys, rounding L up to it keeps a request's rounding independent of the longest one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .causal import causal_attention
from .metadata import AttentionMetadata
from .reference import gather_blocks

KEY_MULTIPLE = 16
"""Keys per decode row are rounded up to this: the fp32 lanes of an AVX-512 register, a multiple of AVX2's."""


def decode_attention(q: Tensor, keys: Tensor, values: Tensor, bags: tuple[Tensor, Tensor],
                     bias: Tensor | None = None) -> Tensor:
    """One new query per row over that row's keys (grouped-query): scores as one batched matmul (which
    also adds the mask bias), a softmax, then each query head's weighted sum of its value rows.

    q (R, 1, H, D); keys (R, K, L, D) head-major; values: the rows the bags index, (rows, D);
    bags from `value_bags`; bias (R*K, 1, L) from `key_bias`, or None when every key is in context.
    -> (R, 1, H*D)."""
    R, _, H, D = q.shape
    K, L = keys.shape[1], keys.shape[2]
    qg = q.reshape(R * K, H // K, D)  # the query heads that share each kv head
    kt = keys.reshape(R * K, L, D).transpose(1, 2)
    # bias + scale * q @ k.T in one call: the 0/-inf bias adds exactly what a masked_fill would
    scores = torch.bmm(qg, kt).mul_(D**-0.5) if bias is None else torch.baddbmm(bias, qg, kt, alpha=D**-0.5)
    rows, offsets = bags
    out = F.embedding_bag(rows, values, offsets, mode="sum",
                          per_sample_weights=torch.softmax(scores, dim=-1).view(-1))  # (R * H, D)
    return out.view(R, 1, H * D)


def value_bags(key_rows: Tensor, rep: int) -> tuple[Tensor, Tensor]:
    """embedding_bag indices for `decode_attention`: one bag per (row, query head), holding the value
    rows of that row's keys under the head's kv head, in key order. key_rows (R, K, L)."""
    R, K, L = key_rows.shape
    rows = key_rows[:, :, None, :].expand(R, K, rep, L).reshape(-1)  # (R * K * rep * L,)
    return rows, torch.arange(0, rows.numel(), L)


def key_bias(key_mask: Tensor, n_kv_heads: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """`decode_attention`'s mask as an additive bias: 0 on keys in context, -inf past it, one
    (1, L) row per (row, kv head), broadcast over that head's query heads. key_mask (R, L)."""
    bias = torch.zeros(key_mask.shape, dtype=dtype).masked_fill_(~key_mask, float("-inf"))
    return bias[:, None, None, :].expand(-1, n_kv_heads, -1, -1).reshape(-1, 1, key_mask.shape[1])


def decode_layout(block_tables: Tensor, seq_lens: Tensor, block_size: int, n_kv_heads: int,
                  dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """What every layer of a step reuses for its decode rows: the pool rows of each row's keys
    (R, K, L) (rows of a layer's pool seen as (slots * K, D)), and the mask bias (R*K, 1, L)."""
    L = -(-int(seq_lens.max()) // KEY_MULTIPLE) * KEY_MULTIPLE
    pos = torch.arange(L)
    tables = F.pad(block_tables, (0, max(0, -(-L // block_size) - block_tables.shape[1])))  # block 0 past the end
    key_slots = tables[:, pos // block_size] * block_size + pos % block_size  # (R, L) each key's pool slot
    key_rows = key_slots[:, None, :] * n_kv_heads + torch.arange(n_kv_heads)[None, :, None]  # (R, K, L)
    key_mask = pos[None, :] < seq_lens[:, None]  # (R, L)
    return key_rows, key_bias(key_mask, n_kv_heads, dtype)


def prompt_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """A whole prompt's causal attention over its own new k/v (`causal_attention` on one sequence).
    q (T, H, D), k/v (T, K, D) -> (T, H*D)."""
    return causal_attention(q[None], k[None], v[None], 0)[0]


def attend(q: Tensor, k: Tensor, v: Tensor, k_pool: Tensor, v_pool: Tensor, md: AttentionMetadata,
           scratch: dict) -> Tensor:
    """q (N, H, D); k/v (N, K, D) the step's own; pools (blocks, bs, K, D) -> (N, H*D), padding rows zero.
    `scratch` keeps what the first layer builds for the others."""
    N, H, D = q.shape
    K = k.shape[1]
    if "decode" not in scratch:
        qsl = md.query_start_loc.tolist()
        dec = [r for r, n in enumerate(md.query_lens) if n == 1]
        layout = None
        if dec:
            idx = torch.tensor(dec)
            key_rows, bias = decode_layout(md.block_tables[idx], md.seq_lens[idx], md.block_size, K, q.dtype)
            layout = (torch.tensor([qsl[r] for r in dec]), key_rows.reshape(-1), value_bags(key_rows, H // K), bias)
        scratch["decode"] = layout
        scratch["others"] = [(r, qsl[r], qsl[r + 1]) for r, n in enumerate(md.query_lens) if n > 1]
    out = q.new_zeros(N, H * D)
    if scratch["decode"] is not None:
        rows, key_rows, bags, bias = scratch["decode"]
        keys = k_pool.reshape(-1, D).index_select(0, key_rows).view(rows.numel(), K, -1, D)  # (R, K, L, D)
        out[rows] = decode_attention(q[rows][:, None], keys, v_pool.reshape(-1, D), bags, bias)[:, 0]
    for r, s, e in scratch["others"]:
        seq_len = md.seq_lens_host[r]
        if seq_len == e - s:  # a whole prompt: its own k/v, the fused causal kernel, as its solo run
            out[s:e] = prompt_attention(q[s:e], k[s:e], v[s:e])
        else:  # a chunk after cached context: the reference read
            kc, vc = gather_blocks(k_pool, v_pool, md.block_tables[r], seq_len)
            out[s:e] = causal_attention(q[None, s:e], kc[None], vc[None])[0]
    return out


def window_layout(md: AttentionMetadata, window: int, n_kv_heads: int, rep: int, dtype: torch.dtype) -> dict:
    """What every sliding layer of a step reuses. Decode rows together, as `attend` lays them out but each row's
    keys starting at its window's first (position seq_len - window, not below 0): the rows, their keys' pool rows
    (R, K, L), the value bags and the mask bias. Each other request alone: its rows (s, e), the pool slots of the
    keys its queries' windows cover (positions max(0, first query - window + 1) .. its last), and the mask (T, S)
    of which of those each query sees (None: all of them)."""
    qsl = md.query_start_loc.tolist()
    dec = [r for r, n in enumerate(md.query_lens) if n == 1]
    layout: dict = {"decode": None, "others": []}
    if dec:
        lens = md.seq_lens[torch.tensor(dec)]
        first = (lens - window).clamp(min=0)
        L = -(-int((lens - first).max()) // KEY_MULTIPLE) * KEY_MULTIPLE
        pos = first[:, None] + torch.arange(L)[None, :]  # (R, L) each key's position, past the row's end masked
        tables = md.block_tables[torch.tensor(dec)]
        tables = F.pad(tables, (0, max(0, -(-int(pos.max() + 1) // md.block_size) - tables.shape[1])))
        key_slots = tables.gather(1, pos // md.block_size) * md.block_size + pos % md.block_size
        key_rows = key_slots[:, None, :] * n_kv_heads + torch.arange(n_kv_heads)[None, :, None]  # (R, K, L)
        layout["decode"] = (torch.tensor([qsl[r] for r in dec]), key_rows.reshape(-1), value_bags(key_rows, rep),
                            key_bias(pos < lens[:, None], n_kv_heads, dtype))
    for r, (n, seq_len) in enumerate(zip(md.query_lens, md.seq_lens_host)):
        if n == 1:
            continue
        first_q = seq_len - n
        pos = torch.arange(max(0, first_q - window + 1), seq_len)
        slots = md.block_tables[r][pos // md.block_size] * md.block_size + pos % md.block_size
        qpos = torch.arange(first_q, seq_len)[:, None]
        mask = (pos[None, :] <= qpos) & (pos[None, :] > qpos - window)  # (T, S)
        layout["others"].append((qsl[r], qsl[r + 1], slots, None if bool(mask.all()) else mask))
    return layout


def window_attend(q: Tensor, k_pool: Tensor, v_pool: Tensor, md: AttentionMetadata, window: int,
                  scratch: dict) -> Tensor:
    """A sliding layer's paged attention: the query at position p over its request's keys p - window + 1 .. p, only
    those read from the pool: decode rows in one gathered rectangle (`decode_attention`), each other request alone.
    q (N, H, D); pools (blocks, bs, K, D) -> (N, H*D)."""
    N, H, D = q.shape
    K = k_pool.shape[-2]
    if k_pool.dtype != q.dtype:  # a bf16 cache read by fp32 queries: its numbers widened (a copy of the pool)
        k_pool, v_pool = k_pool.to(q.dtype), v_pool.to(q.dtype)
    key = ("window", window)
    if key not in scratch:
        scratch[key] = window_layout(md, window, K, H // K, q.dtype)
    layout = scratch[key]
    out = q.new_zeros(N, H * D)
    if layout["decode"] is not None:
        rows, key_rows, bags, bias = layout["decode"]
        keys = k_pool.reshape(-1, D).index_select(0, key_rows).view(rows.numel(), K, -1, D)  # (R, K, L, D)
        out[rows] = decode_attention(q[rows][:, None], keys, v_pool.reshape(-1, D), bags, bias)[:, 0]
    keys, values = k_pool.reshape(-1, K, D), v_pool.reshape(-1, K, D)
    for s, e, slots, mask in layout["others"]:
        kc, vc = keys.index_select(0, slots), values.index_select(0, slots)  # (S, K, D)
        o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1)[None], kc.transpose(0, 1)[None],
                                           vc.transpose(0, 1)[None], attn_mask=mask, enable_gqa=True)  # (1, H, T, D)
        out[s:e] = o[0].transpose(0, 1).reshape(e - s, H * D)
    return out
