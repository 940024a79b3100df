"""Causal self-attention (prompt, decode, chunk: one rule; a padded batch of prompts) and the reference
gather of a sequence's blocks."""

from __future__ import annotations

import pytest
import torch

from nanoserve.attention.causal import causal_attention, no_cache_backend
from nanoserve.attention.reference import gather_blocks


@pytest.mark.parametrize("start, T", [(0, 5), (4, 1), (4, 3)], ids=["prompt", "decode", "chunk"])
def test_causal_attention_against_written_out_softmax(start, T):
    g = torch.Generator().manual_seed(start + T)
    B, H, K, D, S = 2, 6, 2, 8, start + T
    q = torch.randn(B, T, H, D, generator=g)
    keys, values = torch.randn(2, B, S, K, D, generator=g)  # (B, S, K, D) each
    kr = keys.transpose(1, 2).repeat_interleave(H // K, dim=1)  # (B, H, S, D)
    vr = values.transpose(1, 2).repeat_interleave(H // K, dim=1)
    scores = q.transpose(1, 2) @ kr.transpose(-1, -2) / D**0.5  # (B, H, T, S)
    future = torch.arange(S)[None, :] > start + torch.arange(T)[:, None]  # (T, S)
    expected = (scores.masked_fill(future, float("-inf")).softmax(-1) @ vr).transpose(1, 2).reshape(B, T, H * D)
    torch.testing.assert_close(causal_attention(q, keys, values, start), expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(causal_attention(q, keys, values), expected, atol=1e-6, rtol=1e-5)  # start = S - T


def test_causal_attention_refuses_keys_that_do_not_reach_the_queries():
    q, k = torch.zeros(1, 3, 2, 4), torch.zeros(1, 4, 1, 4)
    with pytest.raises(ValueError, match="need 5 keys, got 4"):
        causal_attention(q, k, k, start=2)
    with pytest.raises(ValueError, match="key_mask"):
        causal_attention(q, k, k, start=1, key_mask=torch.ones(1, 4, dtype=torch.bool))


def test_padding_mask_keeps_real_rows_exact(tiny_cfg):
    """A padded key must change nothing for the real queries; an all-padding row stays finite."""
    cfg = tiny_cfg
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 5, cfg.n_heads, cfg.head_dim, generator=g)
    k = torch.randn(2, 5, cfg.n_kv_heads, cfg.head_dim, generator=g)
    v = torch.randn(2, 5, cfg.n_kv_heads, cfg.head_dim, generator=g)
    mask = torch.tensor([[True] * 5, [False] * 5])
    out = causal_attention(q, k, v, 0, mask)
    assert torch.isfinite(out).all()
    assert torch.allclose(out[0], causal_attention(q[:1], k[:1], v[:1])[0], atol=1e-6)
    half = torch.tensor([[True] * 3 + [False] * 2])
    k2, v2 = k[:1].clone(), v[:1].clone()
    k2[:, 3:], v2[:, 3:] = 1e4, 1e4  # whatever sits in the padding keys is never read by the real queries
    assert torch.equal(causal_attention(q[:1], k2, v2, 0, half)[:, :3],
                       causal_attention(q[:1], k[:1], v[:1], 0, half)[:, :3])
    assert torch.equal(no_cache_backend(half)(0, q[:1], k2, v2)[:, :3], causal_attention(q[:1], k2, v2, 0, half)[:, :3])


def test_gather_blocks_reads_a_sequence_back_in_table_order():
    bs, K, D = 3, 2, 4
    k_pool = torch.arange(5 * bs * K * D, dtype=torch.float32).view(5, bs, K, D)
    v_pool = -k_pool
    k, v = gather_blocks(k_pool, v_pool, [4, 0, 2], 7)  # blocks 4, 0, then one token of block 2
    assert k.shape == v.shape == (7, K, D) and k.is_contiguous()
    assert torch.equal(k, torch.cat([k_pool[4], k_pool[0], k_pool[2, :1]])) and torch.equal(v, -k)
    assert torch.equal(gather_blocks(k_pool, v_pool, torch.tensor([1, 3, 0, 0]), 2)[0], k_pool[1, :2])
