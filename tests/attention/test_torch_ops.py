"""The torch-ops attention's pieces: the decode rows' gathered rectangle, its mask bias, and the value
sums straight from the pool, each against a plain reading of the same keys."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanoserve.attention import Chunk, prepare
from nanoserve.attention.causal import causal_attention
from nanoserve.attention.reference import gather_blocks
from nanoserve.attention.torch_ops import KEY_MULTIPLE, decode_attention, decode_layout, key_bias, value_bags


def test_decode_attention_reads_only_keys_in_context():
    torch.manual_seed(0)
    R, H, K, L, D = 2, 4, 2, 32, 16
    q, k = torch.randn(R, 1, H, D), torch.randn(R, K, L, D)  # k gathered head-major (R, K, L, D)
    pool = torch.randn(R * K * L + 5, D)  # values stay in a pool: row key_rows[r, k, l] holds v[r, k, l]
    key_rows = torch.randperm(pool.shape[0])[: R * K * L].view(R, K, L)
    bags = value_bags(key_rows, H // K)
    mask = torch.arange(L)[None] < torch.tensor([[3], [L]])
    bias = key_bias(mask, K)
    assert bias.shape == (R * K, 1, L) and bias[0, 0, 3:].eq(float("-inf")).all() and bias[:K, 0, :3].eq(0).all()
    out = decode_attention(q, k, pool, bags, bias)
    assert out.shape == (R, 1, H * D)
    k2, pool2 = k.clone(), pool.clone()
    k2[0, :, 3:] = 1e4  # whatever sits past a row's context is never read
    pool2[key_rows[0, :, 3:].reshape(-1)] = 1e4
    assert torch.equal(decode_attention(q, k2, pool2, bags, bias), out)
    v = pool[key_rows]  # (R, K, L, D)
    for r, n in enumerate([3, L]):
        ref = F.scaled_dot_product_attention(q[r: r + 1].transpose(1, 2), k[r: r + 1, :, :n], v[r: r + 1, :, :n],
                                             enable_gqa=True)
        torch.testing.assert_close(out[r].view(H, D), ref[0, :, 0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("n", [1, 7, 40])
def test_decode_attention_without_a_bias_equals_causal_attention(n):
    """Every key in context (the contiguous cache's read): no bias, against causal attention."""
    g = torch.Generator().manual_seed(n)
    H, K, D, max_len = 6, 2, 8, 48
    keys, values = torch.randn(2, 1, K, max_len, D, generator=g)  # a layer's storage, (1, K, S, D) each
    q = torch.randn(1, 1, H, D, generator=g)
    rows = (torch.arange(K)[:, None] * max_len + torch.arange(n))[None]  # (1, K, n): kv head g's row l
    got = decode_attention(q, keys[:, :, :n], values.reshape(-1, D), value_bags(rows, H // K))
    expected = causal_attention(q, keys[:, :, :n].transpose(1, 2), values[:, :, :n].transpose(1, 2), start=n - 1)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def test_value_bags_hold_each_heads_rows_in_key_order():
    key_rows = torch.arange(2 * 2 * 3).view(2, 2, 3)  # (R, K, L)
    rows, offsets = value_bags(key_rows, rep=2)
    assert offsets.tolist() == list(range(0, 24, 3))  # one bag of L rows per (row, query head)
    assert rows.view(2, 2, 2, 3)[1, 0, 1].tolist() == [6, 7, 8]  # row 1, kv head 0, its second query head


@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
def test_decode_layout_reads_each_rows_own_history_head_major(block_size):
    """The decode rows' one-index gather lands each row's keys (R, K, L, D) exactly as the reference read
    of that row's block table; L is the longest row rounded up to KEY_MULTIPLE, past it the mask."""
    K, D = 2, 8
    lens = [5, 1, 19]
    need = [-(-n // block_size) for n in lens]
    g = torch.Generator().manual_seed(block_size)
    n_blocks = sum(need) + 2
    k_pool = torch.randn(n_blocks, block_size, K, D, generator=g)
    free = torch.randperm(n_blocks, generator=g).tolist()
    chunks = [Chunk([1], n - 1, [free.pop() for _ in range(b)]) for n, b in zip(lens, need)]
    _, md = prepare(chunks, block_size)
    key_rows, bias = decode_layout(md.block_tables, md.seq_lens, block_size, K, torch.float32)
    L = key_rows.shape[2]
    assert L == -(-max(lens) // KEY_MULTIPLE) * KEY_MULTIPLE and key_rows.shape == (3, K, L)
    got = k_pool.reshape(-1, D).index_select(0, key_rows.reshape(-1)).view(3, K, L, D)
    for r, n in enumerate(lens):
        ref, _ = gather_blocks(k_pool, k_pool, md.block_tables[r], n)  # (n, K, D)
        assert torch.equal(got[r, :, :n], ref.transpose(0, 1))
        assert bias.view(3, K, L)[r, :, :n].eq(0).all() and bias.view(3, K, L)[r, :, n:].eq(float("-inf")).all()
