"""KV cache groups and the hybrid block manager, without tensors: layers cut into equal groups, a sliding group
giving back the blocks its window has left behind, prefix hits that need only the window's blocks, forks that copy
on write per group, and the pool whole again after random workloads with preemption and aborts."""

from __future__ import annotations

import doctest

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.config import ModelConfig
from nanoserve.engine import Request, Scheduler, SchedulerConfig
from nanoserve.kv import BlockManager, RequestTooLarge, groups, hybrid
from nanoserve.kv.groups import KVCacheGroup, kv_cache_groups, single_group
from nanoserve.kv.hybrid import NULL_BLOCK, HybridBlockManager
from nanoserve.sampling import SamplingParams


def gemma_like(n_layers: int = 18, window: int = 512) -> ModelConfig:
    """Gemma 3's layer pattern (every 6th layer full) on the tiny config's sizes."""
    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n_layers)]
    return ModelConfig.tiny_gemma3(n_layers=n_layers, layer_types=types, sliding_window=window)


def manager(window: int = 8, bs: int = 4, num_blocks: int = 64, prefix_caching: bool = True) -> HybridBlockManager:
    """One full group (layer 2) and two sliding ones (layers 0, 1), as the tiny Gemma 3 has."""
    return HybridBlockManager([KVCacheGroup((2,)), KVCacheGroup((0,), window), KVCacheGroup((1,), window)],
                              num_blocks, bs, prefix_caching)


def test_docstring_examples():
    assert doctest.testmod(groups).failed == 0 and doctest.testmod(hybrid).failed == 0


def test_layers_are_cut_into_equal_groups_of_one_kind_full_first():
    groups = kv_cache_groups(gemma_like())
    assert [g.window for g in groups] == [None, 512, 512, 512, 512, 512]
    assert groups[0].layers == (5, 11, 17) and groups[1].layers == (0, 1, 2)
    assert {len(g.layers) for g in kv_cache_groups(gemma_like(26))} == {2}  # Gemma 3 1B: 4 full, 22 sliding
    assert kv_cache_groups(ModelConfig.tiny()) == single_group(ModelConfig.tiny()) == [KVCacheGroup((0, 1))]


def test_a_sliding_group_gives_back_what_its_window_left_and_a_full_one_keeps_all():
    m = manager()
    t = m.new_table()
    for n in range(1, 41):  # one token a step, as decoding does
        m.append_slots(t, [n])
        m.commit(t)
        m.pool.check()
        full, *sliding = t.groups
        assert NULL_BLOCK not in full and len(full) == -(-n // 4)
        for blocks in sliding:  # the next query (position n) sees n - 7 .. n: every block under it is live
            live = [i for i, b in enumerate(blocks) if b != NULL_BLOCK]
            assert live == list(range(max(0, n - 7) // 4, -(-n // 4)))
    assert m.num_held(t) == 10 + 2 * 2 == m.pool.num_used  # 10 full blocks; each window (keys 33 .. 40) 2
    m.free(t)
    assert m.pool.num_used == 0
    m.pool.check()


def test_the_most_blocks_held_bounds_a_chunked_prefill_and_refuses_what_cannot_fit():
    m = manager(num_blocks=32)
    t = m.new_table()
    peak = 0
    for s in range(0, 60, 6):  # a 60-token prompt in chunks of 6
        m.append_slots(t, list(range(s, s + 6)))
        peak = max(peak, m.num_held(t))
        m.commit(t)
    assert peak <= m.max_blocks_held(60, 6) == 15 + 2 * 5 < 15 * 3  # a window of 8 and a chunk of 6: 5 blocks
    with pytest.raises(RequestTooLarge, match="holds up to 45 blocks of 4 tokens over its 3 KV cache groups"):
        m.check_fits(60, 60)
    assert BlockManager(8, 4).max_blocks_held(33, 4) == 9  # one table for all layers holds every block


def test_a_prefix_hit_needs_only_the_window_of_a_sliding_group():
    """A finished request leaves every block named: a second prompt that shares 24 of its tokens finds all 6 full
    blocks of the full group; of each sliding group it takes only the blocks under the window of position 24."""
    m = manager()
    first = m.new_table()
    m.append_slots(first, list(range(30)))
    m.commit(first)
    m.free(first)
    prompt = list(range(24)) + [99, 98, 97]
    t = m.new_table()
    assert m.match_prefix(t, prompt) == 24
    full, *sliding = t.groups
    assert NULL_BLOCK not in full and len(full) == 6
    assert all(b == [NULL_BLOCK] * 4 + b[4:] and NULL_BLOCK not in b[4:] for b in sliding)  # keys 17 .. 23
    assert m.pool.prefix.hits == 6 and m.pool.prefix.queries == 6
    m.append_slots(t, prompt[24:])
    m.commit(t)
    m.free(t)
    m.pool.check()


def test_a_prefix_hit_shrinks_to_where_a_sliding_window_was_evicted():
    """The full group's blocks are all cached, but a sliding group's block 5 is gone: the hit stops where every
    window it needs is still there (position 20 needs blocks 3 and 4 of each sliding group)."""
    m = manager()
    first = m.new_table()
    m.append_slots(first, list(range(30)))
    m.commit(first)
    gone = first.groups[1][5]
    m.free(first)
    m.pool.prefix.evictable.move_to_end(gone, last=False)  # the least recently used: the next one evicted
    taken = m.pool.allocate(len(m.pool.free_list) + 1)  # every free block, then that one
    assert gone in taken
    for b in taken:
        m.pool.free(b)
    t = m.new_table()
    assert m.match_prefix(t, list(range(29))) == 20
    m.free(t)


def test_fork_shares_every_group_and_copies_the_shared_tail_per_group():
    m = manager()
    parent = m.new_table()
    m.append_slots(parent, list(range(22)))
    m.commit(parent)
    child = m.fork(parent)
    assert child.groups == parent.groups and child.skipped == parent.skipped
    slots, copies = m.append_slots(child, [7])
    assert len(copies) == 3 and [dst for _, dst in copies] == [g[-1] for g in child.groups]
    assert all(p[:-1] == c[:-1] for p, c in zip(parent.groups, child.groups))
    for t in (parent, child):
        m.free(t)
    assert m.pool.num_used == 0
    m.pool.check()


def test_truncate_gives_back_the_tail_of_every_group():
    m = manager(prefix_caching=False)
    t = m.new_table()
    m.append_slots(t, list(range(18)))
    m.commit(t)
    m.append_slots(t, [1, 2, 3, 4, 5])  # drafts
    m.truncate(t, 19)
    assert all(len(b) == 5 for b in t.groups) and t.num_tokens == 19
    m.free(t)
    assert m.pool.num_used == 0


def request(rid: int, prompt: list[int], max_new: int) -> Request:
    return Request(str(rid), prompt, SamplingParams(temperature=0), max_new)


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_property_scheduler_workloads_on_the_hybrid_pool(data):
    """Random prompts (some sharing a prefix), budgets, tiny pools and aborts, planned by the scheduler on the
    hybrid manager: the pool's invariants hold after every step, a sliding table never holds a block its
    window does not need nor lacks one it does, every request ends, and the pool is whole again."""
    bs, window = data.draw(st.sampled_from([1, 2, 4])), data.draw(st.integers(1, 12))
    prefix = data.draw(st.lists(st.integers(0, 9), max_size=10))
    reqs = [request(i, (prefix if data.draw(st.booleans()) else []) +
                    data.draw(st.lists(st.integers(0, 9), min_size=1, max_size=24)), data.draw(st.integers(1, 12)))
            for i in range(data.draw(st.integers(1, 5)))]
    budget, prefix_caching = data.draw(st.integers(1, 32)), data.draw(st.booleans())
    need = max(manager(window, bs).max_blocks_held(r.num_prompt_tokens + r.max_new_tokens, budget) for r in reqs)
    m = manager(window, bs, need + data.draw(st.integers(0, need)), prefix_caching)
    sched = Scheduler(m, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget))
    for r in reqs:
        sched.add(r)
    aborts = {data.draw(st.integers(0, 60)): r for r in reqs if data.draw(st.booleans())}
    for step in range(2000):
        if not sched.has_unfinished():
            break
        if step in aborts and not aborts[step].finished:
            sched.finish(aborts[step])
        plan = sched.schedule(step)
        sched.update_from_output(plan, {c.request: [7] for c in plan.chunks if c.completes}, 0.0, step)
        m.pool.check()
        for r in sched.running:
            for w, blocks in zip(m.windows, r.table.groups):
                skip = m.num_skipped(w, r.num_computed_tokens)
                assert blocks[:skip] == [NULL_BLOCK] * skip and NULL_BLOCK not in blocks[skip:]
    assert not sched.has_unfinished()
    assert all(r == 0 for r in m.pool.refcount) and m.pool.num_free == m.num_blocks


def test_append_refuses_what_the_table_would_hold_beyond_the_whole_pool():
    """The refusal counts the blocks the table holds now, so once the windows have given blocks back (commit), a
    chunk that did not fit goes in."""
    m = manager(num_blocks=14)
    t = m.new_table()
    m.append_slots(t, list(range(12)))  # 3 blocks in each of the 3 groups
    with pytest.raises(RequestTooLarge, match="17 tokens would hold 15 blocks of 4 tokens; the pool has 14"):
        m.append_slots(t, [1, 2, 3, 4, 5])
    assert t.num_tokens == 12 and m.num_held(t) == 9
    m.commit(t)  # the next query (position 12) sees keys 5 .. 12: block 0 of each sliding group goes back
    m.append_slots(t, [1, 2, 3, 4, 5])
    assert m.num_held(t) == 5 + 2 * 4
