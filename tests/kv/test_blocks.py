"""KV blocks without tensors: the pool's free list and refcounts, block tables and slots, and the block
manager's sequence operations, copy-on-write included, as plain lists and counts."""

from __future__ import annotations

import doctest
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanoserve.kv import blocks as blocks_module
from nanoserve.kv.blocks import BlockManager, BlockPool, BlockTable, OutOfBlocks, RequestTooLarge, check_block_size


def pool_state(pool: BlockPool) -> tuple:
    evictable = list(pool.prefix.evictable) if pool.prefix else []
    return list(pool.free_list), list(pool.refcount), evictable


def test_docstring_example():
    assert doctest.testmod(blocks_module).failed == 0


# --- BlockPool ---

def test_pool_allocate_free_roundtrip():
    pool = BlockPool(4, 16)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_free == 1 and pool.num_used == 3
    pool.incref(a[0])
    pool.free(a[0])
    assert pool.refcount[a[0]] == 1
    for b in a:
        pool.free(b)
    pool.check()
    assert pool.num_free == 4 and pool.refcount == [0] * 4


def test_out_of_blocks_is_all_or_nothing():
    pool = BlockPool(3, 2)
    pool.allocate(2)
    before = pool_state(pool)
    with pytest.raises(OutOfBlocks, match="need 2, 1 free of 3") as e:
        pool.allocate(2)
    assert isinstance(e.value, RuntimeError) and (e.value.needed, e.value.free, e.value.total) == (2, 1, 3)
    assert pool_state(pool) == before
    assert pool.can_allocate(1) and not pool.can_allocate(2)


def test_pool_refuses_misuse_without_changing_state():
    pool = BlockPool(2, 4)
    (b,) = pool.allocate(1)
    pool.free(b)
    before = pool_state(pool)
    with pytest.raises(ValueError, match="double free"):
        pool.free(b)
    with pytest.raises(ValueError, match="incref of free block"):
        pool.incref(b)
    with pytest.raises(ValueError, match="outside the pool"):
        pool.free(7)
    assert pool_state(pool) == before


@pytest.mark.parametrize("bs", [0, 257, -1, 2.0, True])
def test_block_size_is_bounded(bs):
    with pytest.raises(ValueError, match="block_size"):
        BlockPool(4, bs)
    with pytest.raises(ValueError, match="block_size"):
        check_block_size(bs)


def test_a_pool_has_blocks():
    with pytest.raises(ValueError, match="num_blocks=0 must be >= 1"):
        BlockPool(0, 4)


@pytest.mark.parametrize("bs", [1, 256])
def test_block_size_extremes_work(bs):
    m = BlockManager(num_blocks=3, block_size=bs)
    t = m.new_table()
    slots, copies = m.append_slots(t, list(range(bs + 1)))
    assert len(t.blocks) == 2 and copies == [] and slots == list(range(bs + 1))


def test_request_larger_than_pool_is_refused_up_front():
    m = BlockManager(num_blocks=4, block_size=8)
    t = m.new_table()
    with pytest.raises(RequestTooLarge, match="needs 5 blocks of 8 tokens; the pool has 4 blocks"):
        m.append_slots(t, list(range(33)))
    assert t.blocks == [] and m.pool.num_free == 4
    m.check_fits(32)
    with pytest.raises(RequestTooLarge):
        m.check_fits(33)


# --- block tables and slots ---

def test_slot_mapping():
    t = BlockTable(block_size=4, blocks=[7, 2])
    assert t.slots(0, 8) == [28, 29, 30, 31, 8, 9, 10, 11]
    with pytest.raises(IndexError, match="position 8 has no block"):
        t.slot(8)


# --- BlockManager: append_slots, fork, free, and the copies it asks for ---

def test_append_slots_allocates_as_the_sequence_grows():
    m = BlockManager(num_blocks=8, block_size=4)
    t = m.new_table()
    assert m.append_slots(t, [1, 2, 3]) == ([0, 1, 2], [])
    assert m.append_slots(t, [4, 5]) == ([3, 4], [])  # fills block 0, opens block 1
    assert t.blocks == [0, 1] and t.token_ids == [1, 2, 3, 4, 5] and t.num_tokens == 5
    assert m.append_slots(t, []) == ([], [])


def test_append_slots_returns_the_copy_on_write_pairs():
    """A fork shares every block; the first to write into the shared, partly filled tail gets a fresh
    block, and append_slots says which block's K/V to copy into it: (src, dst)."""
    m = BlockManager(num_blocks=6, block_size=4)
    parent = m.new_table()
    m.append_slots(parent, [1, 2, 3, 4, 5, 6])  # blocks 0 (full) and 1 (half)
    child = m.fork(parent)
    assert child.blocks == parent.blocks == [0, 1] and m.pool.refcount[:2] == [2, 2]
    assert m.blocks_to_append(child, 1) == 1  # the tail must be copied first
    slots, copies = m.append_slots(child, [7])
    assert copies == [(1, 2)] and child.blocks == [0, 2] and slots == [2 * 4 + 2]
    assert m.pool.refcount[:3] == [2, 1, 1]  # the full block stays shared; the tail is the parent's alone again
    slots, copies = m.append_slots(parent, [8])  # nobody shares its tail any more: written in place
    assert copies == [] and parent.blocks == [0, 1] and slots == [1 * 4 + 2]
    m.free(parent)
    m.free(child)
    m.pool.check()
    assert m.pool.num_free == 6


def test_a_shared_full_tail_needs_no_copy():
    m = BlockManager(num_blocks=6, block_size=2)
    parent = m.new_table()
    m.append_slots(parent, [1, 2, 3, 4])  # two full blocks
    child = m.fork(parent)
    assert m.blocks_to_append(child, 1) == 1  # one new block, nothing copied
    slots, copies = m.append_slots(child, [5])
    assert copies == [] and child.blocks[:2] == parent.blocks and slots == [child.blocks[2] * 2]


def test_copy_on_write_is_all_or_nothing():
    m = BlockManager(num_blocks=2, block_size=4)
    parent = m.new_table()
    m.append_slots(parent, [1, 2, 3])
    child = m.fork(parent)
    m.pool.allocate(1)  # the last free block goes elsewhere
    before = (pool_state(m.pool), list(child.blocks), list(child.token_ids))
    with pytest.raises(OutOfBlocks, match="need 1, 0 free of 2"):
        m.append_slots(child, [4])
    assert (pool_state(m.pool), child.blocks, child.token_ids) == before


def test_free_gives_every_reference_back_and_empties_the_table():
    m = BlockManager(num_blocks=4, block_size=2, prefix_caching=False)
    t = m.new_table()
    m.append_slots(t, [1, 2, 3])
    u = m.fork(t)
    m.free(t)
    assert t.blocks == [] and t.token_ids == [] and m.pool.num_used == 2  # u still holds them
    m.free(u)
    assert m.pool.num_free == 4
    m.pool.check()


def test_the_manager_holds_no_tensors():
    m = BlockManager(num_blocks=4, block_size=2)
    t = m.new_table()
    m.append_slots(t, [1, 2, 3])
    m.commit(t)
    m.fork(t)

    def tensors(obj, seen=()):
        if isinstance(obj, torch.Tensor):
            return 1
        if id(obj) in seen or not hasattr(obj, "__dict__"):
            return 0
        return sum(tensors(v, (*seen, id(obj))) for v in vars(obj).values())

    assert tensors(m) == 0 and tensors(t) == 0


def test_the_block_bookkeeping_imports_no_torch():
    """A scheduler can plan with it (admit? preempt?) without touching a tensor library at all."""
    pkg = str(Path(blocks_module.__file__).resolve().parent.parent)
    code = ("import importlib, sys, types\n"
            "for name, path in (('nanoserve', ''), ('nanoserve.kv', '/kv')):\n"
            f"    m = types.ModuleType(name); m.__path__ = [{pkg!r} + path]; sys.modules[name] = m\n"
            "importlib.import_module('nanoserve.kv.blocks')\n"
            "print(' '.join(m for m in ('torch', 'numpy') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == []
