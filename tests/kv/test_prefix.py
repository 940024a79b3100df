"""Prefix caching: full blocks named by chained hashes, found again by later prompts, evicted LRU only
when the free list is empty, and never handed out on a hash collision."""

from __future__ import annotations

import doctest

import pytest

from nanoserve.kv import prefix as prefix_module
from nanoserve.kv.blocks import BlockManager, BlockTable
from nanoserve.kv.prefix import chain_hashes, hash_block


def test_docstring_example():
    assert doctest.testmod(prefix_module).failed == 0


def test_hash_chain_depends_on_parent():
    hs = chain_hashes([1, 2, 3, 4, 5], 2)
    assert len(hs) == 2 and hs[1] == hash_block(hs[0], [3, 4])
    assert chain_hashes([9, 9, 3, 4], 2)[1] != hs[1]


def compute(m: BlockManager, t: BlockTable, ids: list[int]) -> None:
    """A stand-in step: slots for the tokens, (their K/V written,) then the full blocks named."""
    m.append_slots(t, ids)
    m.commit(t)


def test_prefix_hit_reuses_full_blocks_and_computes_the_last_token():
    m = BlockManager(num_blocks=8, block_size=2)
    a = m.new_table()
    assert m.match_prefix(a, [1, 2, 3, 4, 5]) == 0
    compute(m, a, [1, 2, 3, 4, 5])
    assert a.hashes == chain_hashes([1, 2, 3, 4, 5], 2)
    m.free(a)
    assert m.pool.num_free == 8 and len(m.pool.prefix.evictable) == 2  # two full blocks kept
    b = m.new_table()
    assert m.match_prefix(b, [1, 2, 3, 4, 5, 6]) == 4
    assert b.token_ids == [1, 2, 3, 4] and b.hashes == chain_hashes([1, 2, 3, 4], 2)
    c = m.new_table()
    assert m.match_prefix(c, [1, 2, 3, 4]) == 2  # a full hit would leave nothing to compute: last block redone
    d = m.new_table()
    assert m.match_prefix(d, [1, 2, 7, 4, 5]) == 2  # diverges in block 1
    assert m.pool.refcount[b.blocks[0]] == 3
    assert (m.pool.prefix.queries, m.pool.prefix.hits) == (1 + 2 + 1 + 2, 0 + 2 + 1 + 1)  # a lookup stops at a miss


def test_match_prefix_needs_an_empty_table_and_a_cache():
    m = BlockManager(num_blocks=4, block_size=2)
    t = m.new_table()
    compute(m, t, [1, 2, 3])
    with pytest.raises(ValueError, match="match_prefix needs an empty block table"):
        m.match_prefix(t, [1, 2, 3])
    plain = BlockManager(num_blocks=4, block_size=2, prefix_caching=False)
    u = plain.new_table()
    compute(plain, u, [1, 2, 3])
    plain.free(u)
    assert plain.match_prefix(plain.new_table(), [1, 2, 3]) == 0 and plain.pool.num_free == 4


def test_a_half_written_block_is_never_named():
    m = BlockManager(num_blocks=4, block_size=4)
    t = m.new_table()
    m.append_slots(t, [1, 2, 3, 4, 5])  # slots given, K/V not yet written: no commit
    assert len(m.pool.prefix) == 0
    m.commit(t)
    assert len(m.pool.prefix) == 1  # only the full block, after the step


def test_cached_blocks_are_evicted_only_when_needed_lru_first():
    m = BlockManager(num_blocks=4, block_size=2)
    for prompt in ([1, 1, 0], [2, 2, 0]):  # each leaves one cached full block behind
        t = m.new_table()
        compute(m, t, prompt)
        m.free(t)
    assert list(m.pool.free_list) == [1, 3] and list(m.pool.prefix.evictable) == [0, 2]
    m.pool.allocate(2)  # the free list is enough: nothing evicted
    assert len(m.pool.prefix) == 2
    m.pool.allocate(1)  # now the least recently used cached block goes
    assert m.pool.prefix.evictions == 1
    t = m.new_table()
    assert m.match_prefix(t, [1, 1, 0]) == 0 and m.match_prefix(m.new_table(), [2, 2, 0]) == 2


def test_hash_collision_is_caught_by_the_token_check(monkeypatch):
    monkeypatch.setattr("nanoserve.kv.blocks.hash_block", lambda parent, tokens: b"same")
    m = BlockManager(num_blocks=4, block_size=2)
    a = m.new_table()
    compute(m, a, [1, 2, 3])
    b = m.new_table()
    assert m.match_prefix(b, [5, 6, 7]) == 0  # same name, other tokens: a miss, not a wrong hit
    assert m.pool.prefix.queries == 1 and m.pool.prefix.hits == 0


def test_reset_prefix_cache_forgets_every_cached_block_only_while_none_is_in_use():
    m = BlockManager(num_blocks=8, block_size=2)
    a = m.new_table()
    compute(m, a, [1, 2, 3, 4, 5])
    assert not m.reset_prefix_cache()  # a's blocks are in use: nothing is done
    assert m.match_prefix(m.new_table(), [1, 2, 3, 4, 5]) == 4
    m = BlockManager(num_blocks=8, block_size=2)
    a = m.new_table()
    compute(m, a, [1, 2, 3, 4, 5])
    m.free(a)
    hits = m.pool.prefix.hits
    assert m.reset_prefix_cache()
    m.pool.check()
    assert len(m.pool.free_list) == 8 and not m.pool.prefix.evictable and len(m.pool.prefix) == 0
    assert m.match_prefix(m.new_table(), [1, 2, 3, 4, 5]) == 0 and m.pool.prefix.hits == hits
    assert BlockManager(4, 2, prefix_caching=False).reset_prefix_cache()  # no cache: nothing to forget
