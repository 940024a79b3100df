"""The reference read: prefix attention (prompt, decode, chunk: one rule) and the gather of a sequence's blocks."""

from __future__ import annotations

import pytest
import torch

from nanoserve.attention.reference import gather_blocks, prefix_attention


@pytest.mark.parametrize("start, T", [(0, 5), (4, 1), (4, 3)], ids=["prompt", "decode", "chunk"])
def test_prefix_attention_against_written_out_softmax(start, T):
    g = torch.Generator().manual_seed(start + T)
    B, H, K, D, S = 2, 6, 2, 8, start + T
    q = torch.randn(B, T, H, D, generator=g)
    keys, values = torch.randn(2, B, K, S, D, generator=g)  # (B, K, S, D) each
    kr, vr = keys.repeat_interleave(H // K, dim=1), values.repeat_interleave(H // K, dim=1)  # (B, H, S, D)
    scores = q.transpose(1, 2) @ kr.transpose(-1, -2) / D**0.5  # (B, H, T, S)
    future = torch.arange(S)[None, :] > start + torch.arange(T)[:, None]  # (T, S)
    expected = (scores.masked_fill(future, float("-inf")).softmax(-1) @ vr).transpose(1, 2).reshape(B, T, H * D)
    torch.testing.assert_close(prefix_attention(q, keys, values, start), expected, atol=1e-6, rtol=1e-5)


def test_gather_blocks_reads_a_sequence_back_in_table_order():
    bs, K, D = 3, 2, 4
    k_pool = torch.arange(5 * bs * K * D, dtype=torch.float32).view(5, bs, K, D)
    v_pool = -k_pool
    k, v = gather_blocks(k_pool, v_pool, [4, 0, 2], 7)  # blocks 4, 0, then one token of block 2
    assert k.shape == v.shape == (7, K, D) and k.is_contiguous()
    assert torch.equal(k, torch.cat([k_pool[4], k_pool[0], k_pool[2, :1]])) and torch.equal(v, -k)
    assert torch.equal(gather_blocks(k_pool, v_pool, torch.tensor([1, 3, 0, 0]), 2)[0], k_pool[1, :2])
