"""Padded prefill, the batched paged cache and greedy_generate_batch on a tiny random model (Days 27-28)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.batch import (
    ROW_MULTIPLE,
    BatchedPagedKVCache,
    StaticBatch,
    decode_attention,
    forward_rows,
    greedy_generate_batch,
    key_bias,
    pad_batch,
    padded_prefill,
    prefill_attention,
    value_bags,
)
from nanoserve.generate import greedy_ids

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12], [13, 14, 15], [16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28], [29, 30]]


PATHS = pytest.mark.parametrize("kernels", [False, None], ids=["torch-ops", "default"])
"""Both decode paths: torch's ops, and the default (the compiled kernels where they build)."""


def solo_logits(model, prompt, steps, kernels=None):
    """Logits (steps + 1, V) of a one-prompt static batch: the prefill's, then each step's."""
    sb = StaticBatch(model, [prompt], [steps], kernels=kernels)
    out = [sb.prefill()] + [sb.step() for _ in range(steps)]
    return torch.cat(out)


def batch_logits(model, prompts, steps, block_size=16, kernels=None):
    """Logits (B, steps + 1, V) of one static batch."""
    sb = StaticBatch(model, prompts, [steps] * len(prompts), block_size, kernels)
    out = [sb.prefill()] + [sb.step() for _ in range(steps)]
    return torch.stack(out, 1)


# ---- padding -----------------------------------------------------------------------------------


def test_pad_batch_right_pads_and_counts_positions_from_zero():
    b = pad_batch([[5, 6, 7], [8], [9, 10, 11, 12, 13]], pad_id=0)
    assert b.ids.shape == (3, 8)  # longest 5, rounded up to ROW_MULTIPLE
    assert b.ids[1].tolist() == [8, 0, 0, 0, 0, 0, 0, 0]
    assert b.key_mask.sum(1).tolist() == [3, 1, 5]
    assert b.positions[2].tolist() == list(range(8))
    assert b.last_index.tolist() == [2, 0, 4]


@pytest.mark.parametrize("prompts, match", [([], "empty batch: need at least one prompt"),
                                             ([[1, 2], []], "at least one token")])
def test_pad_batch_refuses_empty_prompts(prompts, match):
    with pytest.raises(ValueError, match=match):
        pad_batch(prompts)


def test_forward_rows_rounds_batches_up_but_leaves_one_alone():
    assert [forward_rows(b) for b in (1, 2, 3, 4, 5, 8, 9, 32)] == [1, 4, 4, 4, 8, 8, 12, 32]
    assert ROW_MULTIPLE == 4


def test_padded_prefill_matches_each_prompt_alone(tiny_model):
    logits = padded_prefill(tiny_model, PROMPTS)  # (B, V)
    assert logits.shape == (len(PROMPTS), tiny_model.cfg.vocab_size)
    for i, p in enumerate(PROMPTS):
        plain = tiny_model(torch.tensor([p]), last_only=True)[0]  # the model's own no-cache forward
        torch.testing.assert_close(logits[i], plain, atol=1e-4, rtol=0)
        assert torch.equal(logits[i], padded_prefill(tiny_model, [p])[0])  # and bit for bit its solo run


def test_prefill_attention_ignores_padding_and_never_makes_nan():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 8, 4, 16), torch.randn(2, 8, 2, 16), torch.randn(2, 8, 2, 16)
    out = prefill_attention(q, k, v, [5, 0])  # row 1 is all padding
    assert torch.isfinite(out).all()
    assert out[1].abs().sum() == 0 and out[0, 5:].abs().sum() == 0
    k2, v2 = k.clone(), v.clone()
    k2[0, 5:], v2[0, 5:] = 1e4, float("nan")  # whatever sits in the padding is never read
    assert torch.equal(prefill_attention(q, k2, v2, [5, 0])[0, :5], out[0, :5])


def test_decode_attention_reads_only_keys_in_context():
    torch.manual_seed(0)
    R, H, K, L, D = 2, 4, 2, 32, 16
    q, k = torch.randn(R, 1, H, D), torch.randn(R, K, L, D)  # k gathered head-major (R, K, L, D)
    pool = torch.randn(R * K * L + 5, D)  # values stay in a pool: row key_rows[r, k, l] holds v[r, k, l]
    key_rows = torch.randperm(pool.shape[0])[: R * K * L]
    bags = value_bags(key_rows, R, K, H // K)
    mask = torch.arange(L)[None] < torch.tensor([[3], [L]])
    bias = key_bias(mask, K)
    assert bias.shape == (R * K, 1, L) and bias[0, 0, 3:].eq(float("-inf")).all() and bias[:K, 0, :3].eq(0).all()
    out = decode_attention(q, k, pool, bags, bias)
    k2, pool2 = k.clone(), pool.clone()
    k2[0, :, 3:] = 1e4  # whatever sits past a row's context is never read
    pool2[key_rows.view(R, K, L)[0, :, 3:].reshape(-1)] = 1e4
    assert torch.equal(decode_attention(q, k2, pool2, bags, bias), out)
    v = pool[key_rows].view(R, K, L, D)
    for r, n in enumerate([3, L]):
        ref = torch.nn.functional.scaled_dot_product_attention(q[r : r + 1].transpose(1, 2), k[r : r + 1, :, :n],
                                                               v[r : r + 1, :, :n], enable_gqa=True)
        torch.testing.assert_close(out[r].view(H, D), ref[0, :, 0], atol=1e-6, rtol=0)


# ---- the batched paged cache -------------------------------------------------------------------


def test_each_row_has_its_own_block_table(tiny_cfg):
    kv = BatchedPagedKVCache.for_batch(tiny_cfg, [5, 1, 9], max_new_tokens=4, block_size=4)
    assert kv.cache.num_blocks == math.ceil(9 / 4) + math.ceil(5 / 4) + math.ceil(13 / 4)
    step = kv.prefill_step(pad_batch([[1] * 5, [2], [3] * 9]))
    assert [len(t.blocks) for t in kv.tables] == [2, 1, 3]
    blocks = [b for t in kv.tables for b in t.blocks]
    assert len(set(blocks)) == len(blocks)  # no block shared between rows
    assert step.slot_mapping[1].tolist() == [kv.tables[1].blocks[0] * 4] + [-1] * 11
    assert step.write_slots.numel() == 5 + 1 + 9
    step = kv.decode_step([7, 8, 9])
    assert kv.context_lens == [6, 2, 10]
    assert step.positions[:3, 0].tolist() == [5, 1, 9]
    assert step.block_tables.shape == (forward_rows(3), 3)
    assert step.key_mask[:3].sum(1).tolist() == [6, 2, 10]
    kv.free()
    assert kv.cache.pool.num_free == kv.cache.num_blocks
    kv.cache.pool.check()


def test_decode_gather_reads_each_rows_own_history_head_major(tiny_cfg):
    """The decode step's one-index gather (key_rows) lands each row's keys (R, K, L, D) exactly as the
    reference read of that row's block table (PagedKVCache.gather), for every layer."""
    kv = BatchedPagedKVCache.for_batch(tiny_cfg, [5, 1, 9], max_new_tokens=4, block_size=4)
    kv.prefill_step(pad_batch([[1] * 5, [2], [3] * 9]))
    g = torch.Generator().manual_seed(0)
    kv.cache.k.copy_(torch.randn(kv.cache.k.shape, generator=g))  # every slot a different number
    kv.cache.v.copy_(torch.randn(kv.cache.v.shape, generator=g))
    step = kv.decode_step([7, 8, 9])
    R, L = step.key_mask.shape
    K, D = tiny_cfg.n_kv_heads, tiny_cfg.head_dim
    for layer in range(tiny_cfg.n_layers):
        for pool in (kv.cache.k, kv.cache.v):
            got = pool[layer].view(-1, D).index_select(0, step.key_rows).view(R, K, L, D)
            for i, table in enumerate(kv.tables):
                n = table.num_tokens
                ref = (kv.cache.gather(layer, table.blocks, n)[0 if pool is kv.cache.k else 1])  # (n, K, D)
                assert torch.equal(got[i, :, :n], ref.transpose(0, 1))


def test_dummy_rows_of_a_decode_step_stay_finite(tiny_model):
    kv = BatchedPagedKVCache.for_batch(tiny_model.cfg, [3, 1, 5], max_new_tokens=2)
    kv.prefill_step(pad_batch([[1, 2, 3], [4], [5, 6, 7, 8, 9]]))
    step = kv.decode_step([10, 11, 12])
    R = step.positions.shape[0]
    assert R == 4 and step.slot_mapping[3:, 0].tolist() == [-1]  # one dummy row, written nowhere
    with torch.inference_mode():
        logits = tiny_model(torch.tensor([[10], [11], [12], [0]]), step.positions, kv.backend(step), last_only=True)
    assert logits.shape[0] == R and torch.isfinite(logits).all()


def test_decode_step_refuses_misuse(tiny_cfg):
    kv = BatchedPagedKVCache.for_batch(tiny_cfg, [3, 3], max_new_tokens=2)
    with pytest.raises(ValueError, match="before prefill_step"):
        kv.decode_step([1, 2])
    kv.prefill_step(pad_batch([[1, 2, 3], [4, 5, 6]]))
    with pytest.raises(ValueError, match="one token per row"):
        kv.decode_step([1])
    with pytest.raises(ValueError, match="prefilled once"):
        kv.prefill_step(pad_batch([[1, 2, 3], [4, 5, 6]]))


# ---- static batches and greedy_generate_batch ----------------------------------------------------


@PATHS
@pytest.mark.parametrize("block_size", [16, 4, 1])  # below KEY_MULTIPLE, the gathered width is rounded up
def test_rows_equal_their_solo_runs_bit_for_bit_in_any_batch_of_two_or_more(tiny_model, block_size, kernels):
    steps = 6
    in_pair = [batch_logits(tiny_model, [p, PROMPTS[0]], steps, block_size, kernels)[0] for p in PROMPTS]
    for B in range(2, len(PROMPTS) + 1):
        logits = batch_logits(tiny_model, PROMPTS[:B], steps, block_size, kernels)
        for i in range(B):
            assert torch.equal(logits[i], in_pair[i]), (B, i)


@PATHS
def test_a_solo_run_agrees_with_its_row_to_rounding(tiny_model, kernels):
    logits = batch_logits(tiny_model, PROMPTS, 6, kernels=kernels)
    for i, p in enumerate(PROMPTS):
        solo = solo_logits(tiny_model, p, 6, kernels)
        assert torch.equal(solo[0], logits[i, 0])  # the prefill pads to ROW_MULTIPLE rows alone too
        torch.testing.assert_close(solo, logits[i], atol=1e-4, rtol=0)


@PATHS
def test_greedy_generate_batch_equals_each_solo_run_and_the_single_sequence_path(tiny_model, kernels):
    lens = [4, 1, 7, 2, 5]
    out = greedy_generate_batch(tiny_model, PROMPTS, max_new_tokens=lens, kernels=kernels)
    assert [len(o) for o in out] == lens
    for p, n, o in zip(PROMPTS, lens, out):
        assert o == greedy_generate_batch(tiny_model, [p], max_new_tokens=n, kernels=kernels)[0]
        assert o == greedy_ids(tiny_model, p, n)  # the Day 08 loop, no cache at all


@PATHS
@settings(max_examples=12, deadline=None)
@given(st.lists(st.lists(st.integers(3, 255), min_size=1, max_size=24), min_size=1, max_size=6),
       st.integers(1, 6))
def test_property_every_row_equals_its_solo_run(tiny_model, kernels, prompts, new_tokens):
    out = greedy_generate_batch(tiny_model, prompts, max_new_tokens=new_tokens, kernels=kernels)
    for p, o in zip(prompts, out):
        solo = greedy_generate_batch(tiny_model, [p], new_tokens, kernels=kernels)[0]
        assert torch.equal(torch.tensor(o), torch.tensor(solo))


def test_a_finished_row_keeps_its_slot_and_blocks_until_the_batch_ends(tiny_model):
    sb = StaticBatch(tiny_model, [[5, 6, 7], [8, 9]], stop_steps=[1, 6], block_size=2)
    sb.prefill()
    for _ in range(6):
        sb.step()
    assert sb.done and sb.n_steps == 6
    assert [len(t) for t in sb.tokens] == [2, 7]  # the prefill's token, then one per budgeted step
    assert sb.kv.context_lens == [3 + 6, 2 + 6]  # the finished row kept being forwarded and cached
    assert [len(t.blocks) for t in sb.kv.tables] == [5, 4]
    with pytest.raises(RuntimeError, match="done"):
        sb.step()
    sb.kv.free()
    assert sb.kv.cache.pool.num_free == sb.kv.cache.num_blocks


def test_stop_steps_and_max_new_tokens_say_the_same_thing(tiny_model):
    a = greedy_generate_batch(tiny_model, PROMPTS[:3], stop_steps=[0, 3, 1])
    b = greedy_generate_batch(tiny_model, PROMPTS[:3], max_new_tokens=[1, 4, 2])
    assert a == b and [len(x) for x in a] == [1, 4, 2]


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_new_tokens=2, stop_steps=[1, 1]), "exactly one"),
    (dict(), "exactly one"),
    (dict(max_new_tokens=[2]), "for each of the 2 prompts"),
    (dict(max_new_tokens=0), "int >= 1"),
    (dict(stop_steps=[1, -1]), "ints >= 0"),
    (dict(max_new_tokens=2.5), r"int >= 1.*got 2\.5"),
    (dict(stop_steps=3), "stop_steps must be a list of ints"),
    (dict(stop_steps=[1]), "2 prompts but 1 stop_steps"),
    (dict(max_new_tokens=2, block_size=0), "block_size=0 must be an int"),
])
def test_bad_budgets_are_refused(tiny_model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        greedy_generate_batch(tiny_model, [[1, 2], [3]], **kwargs)


@pytest.mark.parametrize("prompts, match", [
    ([], "empty batch"),
    ([[1, 2], []], "prompt 1: prompt is empty"),
    ([[1, 2], [3, 999]], "prompt 1: .*outside the vocabulary"),
    ([[1] * 600], "prompt 0: .*context"),
    ("hello", "got text 'hello'"),
    ([[1, 2], "hello"], "prompt 1: prompt is text"),
    ([[1, 2], 7], "prompt 1: expected a sequence of token ids, got 7"),
    ([[1, 2], [3, 4.0]], r"prompt 1: .*not token ids \(integers\): \[4\.0\]"),
    ([[True, 2]], "prompt 0: .*not token ids"),
])
def test_bad_prompts_are_refused_naming_the_row(tiny_model, prompts, match):
    with pytest.raises(ValueError, match=match):
        greedy_generate_batch(tiny_model, prompts, max_new_tokens=2)
    with pytest.raises(ValueError, match=match):  # the cache-less prefill refuses the same rows
        padded_prefill(tiny_model, prompts)


def test_room_for_every_new_token_is_checked_per_row(tiny_model):
    ctx = tiny_model.cfg.max_position_embeddings
    with pytest.raises(ValueError, match=rf"prompt 1: prompt has {ctx - 3} tokens; the model's context is {ctx}, "
                                         r"leaving room for 3 of the 5 tokens"):
        greedy_generate_batch(tiny_model, [[1, 2], [1] * (ctx - 3)], max_new_tokens=5)
    assert len(greedy_generate_batch(tiny_model, [[1] * (ctx - 3)], max_new_tokens=3)[0]) == 3  # exactly fits


def test_integer_arrays_and_tensors_are_prompts(tiny_model):
    ids = [[5, 6, 7], [8, 9]]
    expect = greedy_generate_batch(tiny_model, ids, max_new_tokens=3)
    assert greedy_generate_batch(tiny_model, [torch.tensor(p) for p in ids], max_new_tokens=3) == expect


def test_step_order_is_enforced(tiny_model):
    sb = StaticBatch(tiny_model, [[1, 2]], [2])
    with pytest.raises(RuntimeError, match="before prefill"):
        sb.step()
    sb.prefill()
    with pytest.raises(RuntimeError, match="twice"):
        sb.prefill()
