"""Online softmax against the full softmax: equal to fp32 rounding whatever the block size, ragged
tails and grouped-query heads included; and each state along the way is the attention over the keys
read so far."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.attention.causal import causal_attention
from nanoserve.attention.online import (
    SoftmaxState,
    block_state,
    causal_mask,
    full_attention,
    merge,
    online_attention,
    online_states,
)


def case(T, S, H, K, D, seed=0, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g) * spread
    k, v = torch.randn(2, S, K, D, generator=g)
    return q, k, v


@settings(max_examples=40, deadline=None)
@given(T=st.integers(1, 6), extra=st.integers(0, 70), K=st.sampled_from([1, 2, 3]), rep=st.sampled_from([1, 3]),
       D=st.sampled_from([8, 16, 64]), block=st.sampled_from([1, 3, 16, 256]), seed=st.integers(0, 1000))
def test_online_equals_the_full_softmax_to_fp32_rounding(T, extra, K, rep, D, block, seed):
    q, k, v = case(T, T + extra, K * rep, K, D, seed)
    want = full_attention(q.double(), k.double(), v.double())
    torch.testing.assert_close(online_attention(q, k, v, block).double(), want, atol=2e-6, rtol=1e-5)


def test_full_attention_is_the_engines_attention():
    """The reference the online form is pinned to is the one every other path is pinned to (SDPA)."""
    q, k, v = case(5, 37, 9, 3, 64)
    sdpa = causal_attention(q[None], k[None], v[None], 37 - 5)[0]
    torch.testing.assert_close(full_attention(q, k, v).reshape(5, -1), sdpa, atol=1e-6, rtol=1e-5)


def test_large_scores_do_not_overflow():
    """The running max is why: scores in the hundreds would overflow e^s in fp32 without it."""
    q, k, v = case(2, 50, 4, 2, 16, spread=40.0)
    out = online_attention(q, k, v, block=7)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), full_attention(q.double(), k.double(), v.double()), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block", [1, 4, 16])
def test_each_state_is_the_attention_over_the_keys_read_so_far(block):
    q, k, v = case(1, 40, 6, 2, 16, seed=3)
    states = online_states(q, k, v, block)
    assert len(states) == -(-40 // block) and [s.keys for s in states][-1] == 40
    for s in states:  # one decode query over the first s.keys keys: it sits at the last of them
        want = full_attention(q, k[: s.keys], v[: s.keys])
        torch.testing.assert_close(s.output(), want, atol=2e-6, rtol=1e-5)
    ms = torch.stack([s.m for s in states])
    assert (ms[1:] >= ms[:-1]).all()  # the running max never falls


def test_merge_is_order_free_and_keeps_an_empty_side_empty():
    q, k, v = case(3, 20, 4, 2, 8, seed=5)
    vis = causal_mask(3, 20)
    a, b = block_state(q, k[:9], v[:9], vis[:, :9]), block_state(q, k[9:], v[9:], vis[:, 9:])
    ab, ba = merge(a, b), merge(b, a)
    torch.testing.assert_close(ab.output(), ba.output())
    torch.testing.assert_close(ab.output(), full_attention(q, k, v), atol=2e-6, rtol=1e-5)
    empty = SoftmaxState(torch.full((3, 4), float("-inf")), torch.zeros(3, 4), torch.zeros(3, 4, 8))
    assert torch.equal(merge(empty, empty).l, torch.zeros(3, 4)) and not merge(empty, empty).acc.isnan().any()
    assert torch.equal(merge(empty, a).output(), a.output())


def test_a_chunk_after_cached_context_masks_only_its_own_future():
    q, k, v = case(4, 30, 6, 3, 16, seed=7)
    out = online_attention(q, k, v, block=8, start=26)
    torch.testing.assert_close(out, full_attention(q, k, v, start=26), atol=2e-6, rtol=1e-5)


def test_a_block_size_below_one_is_refused():
    q, k, v = case(1, 4, 2, 1, 8)
    with pytest.raises(ValueError, match="block=0"):
        online_attention(q, k, v, block=0)
