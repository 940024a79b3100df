"""The paged pool's storage (write, copy, gather) beside the block manager whose numbers it follows: the
manager's copy-on-write copies made by the storage, and a hypothesis state machine over random workloads on
tiny pools, checking that every sequence reads back exactly its own K/V."""

from __future__ import annotations

import doctest
import zlib
from array import array

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from torch import Tensor

from nanoserve.config import ModelConfig
from nanoserve.kv import storage as storage_module
from nanoserve.kv.blocks import BlockManager, BlockTable, OutOfBlocks, RequestTooLarge
from nanoserve.kv.storage import KVStorage


class Pool(BlockManager):
    """A block manager and its storage, paired as the engine pairs them: `append` gives new tokens slots and
    makes the copies the manager asks for (the model runner's job in the engine)."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int = 16, prefix_caching: bool = True):
        super().__init__(num_blocks, block_size, prefix_caching)
        self.storage = KVStorage(cfg, num_blocks, block_size)
        self.k, self.v = self.storage.k, self.storage.v

    def append(self, table: BlockTable, ids: list[int]) -> Tensor:
        slots, copies = self.append_slots(table, ids)
        self.storage.copy_blocks(copies)
        return torch.tensor(slots, dtype=torch.long)

    def write(self, layer, slots, k, v) -> None:
        self.storage.write(layer, slots, k, v)

    def gather(self, layer, blocks, length):
        return self.storage.gather(layer, blocks, length)

# storage just big enough to hold a recognisable value per token: 1 layer, 1 kv head, 2 numbers
STORE_CFG = ModelConfig.tiny(n_layers=1, n_heads=2, n_kv_heads=1, head_dim=2)


def pool_state(cache: Pool) -> tuple:
    pool = cache.pool
    evictable = list(pool.prefix.evictable) if pool.prefix else []
    return list(pool.free_list), list(pool.refcount), evictable


def test_docstring_example():
    assert doctest.testmod(storage_module).failed == 0


def test_storage_is_vllms_layout_and_its_bytes():
    cfg = ModelConfig.tiny()
    s = KVStorage(cfg, num_blocks=5, block_size=3, dtype=torch.bfloat16)
    assert s.k.shape == s.v.shape == (cfg.n_layers, 5, 3, cfg.n_kv_heads, cfg.head_dim)
    assert s.nbytes == 2 * cfg.n_layers * 5 * 3 * cfg.n_kv_heads * cfg.head_dim * 2
    assert (s.num_blocks, s.block_size) == (5, 3)


def test_write_then_gather_reads_back_in_position_order():
    cfg = ModelConfig.tiny()
    cache = Pool(cfg, num_blocks=6, block_size=3)
    filler = cache.new_table()
    cache.append(filler, [0, 0])  # so the real sequence's blocks are not 0, 1, 2
    t = cache.new_table()
    torch.manual_seed(0)
    k = torch.randn(7, cfg.n_kv_heads, cfg.head_dim)  # (T, K, D)
    v = torch.randn(7, cfg.n_kv_heads, cfg.head_dim)
    slots = cache.append(t, list(range(7)))
    assert t.blocks == [1, 2, 3] and slots.dtype == torch.long
    cache.write(1, slots, k, v)
    kk, vv = cache.gather(1, t.blocks, 7)
    assert torch.equal(kk, k) and torch.equal(vv, v)
    assert cache.k[1, 1].reshape(-1)[: k[:3].numel()].equal(k[:3].reshape(-1))  # vLLM layout: block, slot, K, D
    assert cache.k[0].abs().sum() == 0  # another layer is untouched


def test_copy_blocks_copies_every_layer():
    cfg = ModelConfig.tiny()
    s = KVStorage(cfg, num_blocks=4, block_size=2)
    s.k.copy_(torch.randn(s.k.shape))
    s.v.copy_(torch.randn(s.v.shape))
    before_k, before_v = s.k.clone(), s.v.clone()
    s.copy_blocks([(0, 3), (2, 1)])
    assert torch.equal(s.k[:, 3], before_k[:, 0]) and torch.equal(s.v[:, 1], before_v[:, 2])
    assert torch.equal(s.k[:, [0, 2]], before_k[:, [0, 2]])  # the sources are left as they were


def test_the_managers_copies_made_by_the_storage():
    """The manager says (src, dst); the storage copies src's K/V into dst, in every layer, before the new
    token is written: the child's copied block holds exactly the parent's K/V."""
    cfg = ModelConfig.tiny()
    cache = Pool(cfg, num_blocks=6, block_size=4)
    parent = cache.new_table()
    slots = cache.append(parent, [1, 2, 3, 4, 5, 6])
    g = torch.Generator().manual_seed(0)
    for layer in range(cfg.n_layers):
        cache.write(layer, slots, *torch.randn(2, 6, cfg.n_kv_heads, cfg.head_dim, generator=g))
    child = cache.fork(parent)
    slot = cache.append(child, [7])
    src, dst = parent.blocks[1], child.blocks[1]
    assert src != dst and slot.tolist() == [dst * 4 + 2]
    assert torch.equal(cache.k[:, dst], cache.k[:, src]) and torch.equal(cache.v[:, dst], cache.v[:, src])
    for layer in range(cfg.n_layers):  # the child reads the parent's history through its own blocks
        assert all(torch.equal(a, b) for a, b in zip(cache.gather(layer, child.blocks, 6),
                                                      cache.gather(layer, parent.blocks, 6)))


def test_fork_shares_and_copies_on_write():
    cache = Pool(STORE_CFG, num_blocks=6, block_size=2)
    t = cache.new_table()
    cache.write(0, cache.append(t, [1, 2, 3]), torch.ones(3, 1, 2), torch.ones(3, 1, 2))
    u = cache.fork(t)
    assert u.blocks == t.blocks and cache.pool.refcount[t.blocks[0]] == 2
    used = cache.pool.num_used
    slot = cache.append(u, [4])  # writes into the shared, partly filled block 1 -> copied first
    assert u.blocks[0] == t.blocks[0] and u.blocks[1] != t.blocks[1]
    assert cache.pool.num_used == used + 1 and cache.pool.refcount[t.blocks[1]] == 1
    cache.write(0, slot, torch.full((1, 1, 2), 9.0), torch.full((1, 1, 2), 9.0))
    assert torch.equal(cache.gather(0, t.blocks, 3)[0], torch.ones(3, 1, 2))  # parent untouched
    assert cache.gather(0, u.blocks, 4)[0][:, 0, 0].tolist() == [1.0, 1.0, 1.0, 9.0]  # copied prefix + new
    cache.free(t)
    cache.free(u)
    cache.pool.check()
    assert cache.pool.num_free == 6


# --- property tests over random workloads ---

def compute(cache: Pool, t: BlockTable, ids: list[int]) -> None:
    """A stand-in forward: each token's k/v is a function of the whole prefix up to it."""
    start = t.num_tokens
    slots = cache.append(t, ids)
    if not ids:
        return
    k = torch.stack([expected_kv(t.token_ids[: p + 1]) for p in range(start, t.num_tokens)])
    cache.write(0, slots, k, k + 0.5)
    cache.commit(t)


def expected_kv(prefix: list[int]) -> torch.Tensor:
    """(1, 2): a value that changes when any earlier token changes (crc of the prefix, and its length)."""
    crc = zlib.crc32(array("q", prefix).tobytes()) % (1 << 20)
    return torch.tensor([[float(crc), float(len(prefix))]])


class PagedPoolMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / free / prefix hits on a small pool. Tokens come from {0, 1, 2}
    so prompts share prefixes often; the stand-in forward makes every token's k/v a function of its prefix,
    so a prefix hit or a copied block that returns anything else is caught."""

    @initialize(num_blocks=st.integers(1, 10), block_size=st.sampled_from([1, 2, 3, 4]),
                prefix_caching=st.booleans())
    def setup(self, num_blocks, block_size, prefix_caching):
        self.cache = Pool(STORE_CFG, num_blocks, block_size, prefix_caching=prefix_caching)
        self.seqs: list[BlockTable] = []

    def _grow(self, t: BlockTable, ids: list[int]) -> bool:
        before = (pool_state(self.cache), list(t.blocks), list(t.token_ids))
        try:
            compute(self.cache, t, ids)
        except (OutOfBlocks, RequestTooLarge):
            assert (pool_state(self.cache), t.blocks, t.token_ids) == before  # refused, nothing changed
            return False
        return True

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=12))
    def new_sequence(self, prompt):
        t = self.cache.new_table()
        hit = self.cache.match_prefix(t, prompt)
        assert hit % self.cache.block_size == 0 and hit <= len(prompt) - 1
        if self._grow(t, prompt[hit:]):
            self.seqs.append(t)
        else:
            self.cache.free(t)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), ids=st.lists(st.integers(0, 2), min_size=1, max_size=5))
    def append(self, data, ids):
        self._grow(self.seqs[data.draw(st.integers(0, len(self.seqs) - 1))], ids)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), ids=st.lists(st.integers(0, 2), max_size=3))
    def fork(self, data, ids):
        child = self.cache.fork(self.seqs[data.draw(st.integers(0, len(self.seqs) - 1))])
        self.seqs.append(child)
        self._grow(child, ids)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        self.cache.free(self.seqs.pop(data.draw(st.integers(0, len(self.seqs) - 1))))

    @invariant()
    def pool_is_consistent(self):
        if not hasattr(self, "cache"):
            return
        pool = self.cache.pool
        pool.check()  # refcounts >= 0, never free and referenced, no leak
        users = [0] * pool.num_blocks
        for t in self.seqs:
            for b in t.blocks:
                users[b] += 1
        assert users == pool.refcount  # every reference is a table's, and every table's is counted

    @invariant()
    def every_slot_reads_back_what_computing_wrote(self):
        for t in getattr(self, "seqs", []):
            k, v = self.cache.gather(0, t.blocks, t.num_tokens)
            want = torch.stack([expected_kv(t.token_ids[: p + 1]) for p in range(t.num_tokens)])
            assert torch.equal(k, want) and torch.equal(v, want + 0.5)

    def teardown(self):
        if hasattr(self, "cache"):
            for t in self.seqs:
                self.cache.free(t)
            self.cache.pool.check()
            assert self.cache.pool.num_free == self.cache.num_blocks
            assert self.cache.pool.refcount == [0] * self.cache.num_blocks


PagedPoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None,
                                              suppress_health_check=[HealthCheck.too_slow])
test_paged_pool_properties = PagedPoolMachine.TestCase
