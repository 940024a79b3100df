"""The static batch on a tiny random model (Days 27-28): its rows in one pool, a ragged prefill in one
step, and every row's tokens equal to its solo run whatever else is in the batch."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanoserve.generate import greedy_ids
from nanoserve.stages import BatchedPagedKVCache, NoCacheSession, StaticBatch, greedy_generate_batch
from nanoserve.stages import greedy_session_ids as session_ids

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12], [13, 14, 15], [16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28], [29, 30]]
KERNELS = {"compiled": None, "torch-ops": False}  # the `road` fixture's name -> compiled=


def solo_logits(model, prompt, steps, compiled=None):
    """Logits (steps + 1, V) of a one-prompt static batch: the prefill's, then each step's."""
    sb = StaticBatch(model, [prompt], [steps], compiled=compiled)
    out = [sb.prefill()] + [sb.step() for _ in range(steps)]
    return torch.cat(out)


def batch_logits(model, prompts, steps, block_size=16, compiled=None):
    """Logits (B, steps + 1, V) of one static batch."""
    sb = StaticBatch(model, prompts, [steps] * len(prompts), block_size, compiled)
    out = [sb.prefill()] + [sb.step() for _ in range(steps)]
    return torch.stack(out, 1)


# ---- the batched paged cache -------------------------------------------------------------------


def test_each_row_has_its_own_block_table(tiny_cfg):
    kv = BatchedPagedKVCache.for_batch(tiny_cfg, [5, 1, 9], max_new_tokens=4, block_size=4)
    assert kv.manager.num_blocks == math.ceil(9 / 4) + math.ceil(5 / 4) + math.ceil(13 / 4)
    assert kv.batch_size == 3 and kv.block_size == 4 and kv.manager.pool.prefix is None
    chunks = kv.prefill_chunks([[1] * 5, [2], [3] * 9])
    assert [len(t.blocks) for t in kv.tables] == [2, 1, 3]
    blocks = [b for t in kv.tables for b in t.blocks]
    assert len(set(blocks)) == len(blocks)  # no block shared between rows
    assert [(list(c.token_ids), c.num_computed, list(c.block_table)) for c in chunks] == [
        ([1] * 5, 0, kv.tables[0].blocks), ([2], 0, kv.tables[1].blocks), ([3] * 9, 0, kv.tables[2].blocks)]
    chunks = kv.decode_chunks([7, 8, 9])
    assert kv.context_lens == [6, 2, 10]
    assert [(list(c.token_ids), c.num_computed) for c in chunks] == [([7], 5), ([8], 1), ([9], 9)]
    kv.free()
    assert kv.manager.pool.num_free == kv.manager.num_blocks
    kv.manager.pool.check()


def test_the_batched_cache_refuses_misuse(tiny_cfg):
    kv = BatchedPagedKVCache.for_batch(tiny_cfg, [3, 3], max_new_tokens=2)
    with pytest.raises(ValueError, match="before prefill_chunks"):
        kv.decode_chunks([1, 2])
    with pytest.raises(ValueError, match="3 prompts, the cache has 2 rows"):
        kv.prefill_chunks([[1], [2], [3]])
    kv.prefill_chunks([[1, 2, 3], [4, 5, 6]])
    with pytest.raises(ValueError, match="one token per row"):
        kv.decode_chunks([1])
    with pytest.raises(ValueError, match="prefilled once"):
        kv.prefill_chunks([[1, 2, 3], [4, 5, 6]])
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        BatchedPagedKVCache(kv.manager, kv.storage, 0)


# ---- static batches and greedy_generate_batch ----------------------------------------------------


@pytest.mark.parametrize("block_size", [16, 4, 1])  # below KEY_MULTIPLE, the gathered width is rounded up
def test_rows_equal_their_solo_runs_bit_for_bit_in_any_batch_of_two_or_more(tiny_model, block_size, road):
    steps = 6
    compiled = KERNELS[road]
    in_pair = [batch_logits(tiny_model, [p, PROMPTS[0]], steps, block_size, compiled)[0] for p in PROMPTS]
    for B in range(2, len(PROMPTS) + 1):
        logits = batch_logits(tiny_model, PROMPTS[:B], steps, block_size, compiled)
        for i in range(B):
            assert torch.equal(logits[i], in_pair[i]), (B, i)


def test_a_solo_run_agrees_with_its_row_to_rounding(tiny_model, road):
    """A batch of one prefills a prompt of two or more tokens with the batch's kernels: the same bits as its
    row. Its decode steps are steps of one token (the one-row road): the same to fp32 rounding, and the
    same tokens."""
    compiled = KERNELS[road]
    logits = batch_logits(tiny_model, PROMPTS, 6, compiled=compiled)
    for i, p in enumerate(PROMPTS):
        solo = solo_logits(tiny_model, p, 6, compiled)
        if len(p) > 1:
            assert torch.equal(solo[0], logits[i, 0]), i
        torch.testing.assert_close(solo, logits[i], atol=1e-4, rtol=0)
        assert torch.equal(solo.argmax(-1), logits[i].argmax(-1))


def test_greedy_generate_batch_equals_each_solo_run_and_the_single_sequence_paths(tiny_model, road):
    compiled = KERNELS[road]
    lens = [4, 1, 7, 2, 5]
    out = greedy_generate_batch(tiny_model, PROMPTS, max_new_tokens=lens, compiled=compiled)
    assert [len(o) for o in out] == lens
    for p, n, o in zip(PROMPTS, lens, out):
        assert o == greedy_generate_batch(tiny_model, [p], max_new_tokens=n, compiled=compiled)[0]
        assert o == greedy_ids(tiny_model, p, n)  # the engine's road: generate
        assert o == session_ids(tiny_model, NoCacheSession(tiny_model), p, n)  # the Day 08 loop, no cache at all


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(st.integers(3, 255), min_size=1, max_size=24), min_size=1, max_size=6),
       st.integers(1, 6))
def test_property_every_row_equals_its_solo_run(tiny_model, road, prompts, new_tokens):
    compiled = KERNELS[road]
    out = greedy_generate_batch(tiny_model, prompts, max_new_tokens=new_tokens, compiled=compiled)
    for p, o in zip(prompts, out):
        solo = greedy_generate_batch(tiny_model, [p], new_tokens, compiled=compiled)[0]
        assert torch.equal(torch.tensor(o), torch.tensor(solo))


def test_the_batch_runs_on_the_road_it_was_given(tiny_model, road):
    sb = StaticBatch(tiny_model, PROMPTS[:2], [1, 1], compiled=KERNELS[road])
    assert sb.compiled == (road == "compiled")
    assert sb.runner.attention == ("compiled" if road == "compiled" else "torch")


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
    assert sb.kv.manager.pool.num_free == sb.kv.manager.num_blocks


def test_run_gives_every_block_back(tiny_model):
    sb = StaticBatch(tiny_model, PROMPTS, [3] * len(PROMPTS), block_size=4)
    tokens = sb.run()
    assert [len(t) for t in tokens] == [4] * len(PROMPTS)
    assert sb.kv.manager.pool.num_free == sb.kv.manager.num_blocks
    sb.kv.manager.pool.check()


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
