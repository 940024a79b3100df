"""The paged KV cache on tiny pools and a tiny random model: pool bookkeeping, slots, copy-on-write,
prefix caching, and hypothesis property tests over random workloads."""

from __future__ import annotations

import zlib
from array import array

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from nanoserve.config import ModelConfig
from nanoserve.generate import NoCacheSession, generate, greedy_ids
from nanoserve.paged import (
    BlockPool,
    BlockTable,
    OutOfBlocks,
    PagedAttention,
    PagedKVCache,
    PagedSession,
    RequestTooLarge,
    generate_n,
    paged_session,
    paged_step,
)
from nanoserve.pagedbench import Comparison, interleaved, read_csv, utilisation_trace, write_csv
from nanoserve.prefix import chain_hashes, hash_block
from nanoserve.sampling import SamplingParams
from nanoserve.timing import summarize

# storage just big enough to hold a recognisable value per token: 1 layer, 1 kv head, 2 numbers
STORE_CFG = ModelConfig.tiny(n_layers=1, n_heads=2, n_kv_heads=1, head_dim=2)


def pool_state(pool: BlockPool) -> tuple:
    evictable = list(pool.prefix.evictable) if pool.prefix else []
    return list(pool.free_list), list(pool.refcount), evictable


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


@pytest.mark.parametrize("bs", [0, 257, -1])
def test_block_size_is_bounded(bs):
    with pytest.raises(ValueError, match="block_size"):
        BlockPool(4, bs)


@pytest.mark.parametrize("bs", [1, 256])
def test_block_size_extremes_work(bs):
    cache = PagedKVCache(STORE_CFG, num_blocks=3, block_size=bs)
    t = cache.new_table()
    cache.append(t, list(range(bs + 1)))
    assert len(t.blocks) == 2


def test_request_larger_than_pool_is_refused_up_front():
    cache = PagedKVCache(STORE_CFG, num_blocks=4, block_size=8)
    t = cache.new_table()
    with pytest.raises(RequestTooLarge, match="needs 5 blocks of 8 tokens; the pool has 4 blocks"):
        cache.append(t, list(range(33)))
    assert t.blocks == [] and cache.pool.num_free == 4


# --- block tables, slots, write and gather ---

def test_slot_mapping():
    t = BlockTable(block_size=4, blocks=[7, 2])
    assert t.slots(0, 8) == [28, 29, 30, 31, 8, 9, 10, 11]
    with pytest.raises(IndexError, match="position 8 has no block"):
        t.slot(8)


def test_write_then_gather_reads_back_in_position_order():
    cfg = ModelConfig.tiny()
    cache = PagedKVCache(cfg, num_blocks=6, block_size=3)
    filler = cache.new_table()
    cache.append(filler, [0, 0])  # so the real sequence's blocks are not 0, 1, 2
    t = cache.new_table()
    torch.manual_seed(0)
    k = torch.randn(7, cfg.n_kv_heads, cfg.head_dim)  # (T, K, D)
    v = torch.randn(7, cfg.n_kv_heads, cfg.head_dim)
    slots = cache.append(t, list(range(7)))
    assert t.blocks == [1, 2, 3]
    cache.write(1, slots, k, v)
    kk, vv = cache.gather(1, t.blocks, 7)
    assert torch.equal(kk, k) and torch.equal(vv, v)
    assert cache.k[1, 1].reshape(-1)[: k[:3].numel()].equal(k[:3].reshape(-1))  # vLLM layout: block, slot, K, D


def test_fork_shares_and_copies_on_write():
    cache = PagedKVCache(STORE_CFG, num_blocks=6, block_size=2)
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


# --- prefix caching ---

def test_hash_chain_depends_on_parent():
    hs = chain_hashes([1, 2, 3, 4, 5], 2)
    assert len(hs) == 2 and hs[1] == hash_block(hs[0], [3, 4])
    assert chain_hashes([9, 9, 3, 4], 2)[1] != hs[1]


def _compute(cache: PagedKVCache, t: BlockTable, ids: list[int]) -> None:
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


def test_prefix_hit_reuses_full_blocks_and_computes_the_last_token():
    cache = PagedKVCache(STORE_CFG, num_blocks=8, block_size=2)
    a = cache.new_table()
    assert cache.match_prefix(a, [1, 2, 3, 4, 5]) == 0
    _compute(cache, a, [1, 2, 3, 4, 5])
    cache.free(a)
    assert cache.pool.num_free == 8 and len(cache.pool.prefix.evictable) == 2  # two full blocks kept
    b = cache.new_table()
    assert cache.match_prefix(b, [1, 2, 3, 4, 5, 6]) == 4
    c = cache.new_table()
    assert cache.match_prefix(c, [1, 2, 3, 4]) == 2  # a full hit would leave nothing to compute: last block redone
    d = cache.new_table()
    assert cache.match_prefix(d, [1, 2, 7, 4, 5]) == 2  # diverges in block 1
    assert cache.pool.refcount[b.blocks[0]] == 3


def test_cached_blocks_are_evicted_only_when_needed_lru_first():
    cache = PagedKVCache(STORE_CFG, num_blocks=4, block_size=2)
    for prompt in ([1, 1, 0], [2, 2, 0]):  # each leaves one cached full block behind
        t = cache.new_table()
        _compute(cache, t, prompt)
        cache.free(t)
    assert list(cache.pool.free_list) == [1, 3] and list(cache.pool.prefix.evictable) == [0, 2]
    cache.pool.allocate(2)  # the free list is enough: nothing evicted
    assert len(cache.pool.prefix) == 2
    cache.pool.allocate(1)  # now the least recently used cached block goes
    t = cache.new_table()
    assert cache.match_prefix(t, [1, 1, 0]) == 0 and cache.match_prefix(cache.new_table(), [2, 2, 0]) == 2


def test_hash_collision_is_caught_by_the_token_check(monkeypatch):
    monkeypatch.setattr("nanoserve.paged.hash_block", lambda parent, tokens: b"same")
    cache = PagedKVCache(STORE_CFG, num_blocks=4, block_size=2)
    a = cache.new_table()
    _compute(cache, a, [1, 2, 3])
    b = cache.new_table()
    assert cache.match_prefix(b, [5, 6, 7]) == 0  # same name, other tokens: a miss, not a wrong hit
    assert cache.pool.prefix.queries == 1 and cache.pool.prefix.hits == 0


# --- property tests over random workloads ---

class PagedPoolMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / free / prefix hits on a small pool. Tokens come from {0, 1, 2}
    so prompts share prefixes often; the stand-in forward makes every token's k/v a function of its prefix,
    so a prefix hit or a copied block that returns anything else is caught."""

    @initialize(num_blocks=st.integers(1, 10), block_size=st.sampled_from([1, 2, 3, 4]),
                prefix_caching=st.booleans())
    def setup(self, num_blocks, block_size, prefix_caching):
        self.cache = PagedKVCache(STORE_CFG, num_blocks, block_size, prefix_caching=prefix_caching)
        self.seqs: list[BlockTable] = []

    def _grow(self, t: BlockTable, ids: list[int]) -> bool:
        before = (pool_state(self.cache.pool), list(t.blocks), list(t.token_ids))
        try:
            _compute(self.cache, t, ids)
        except (OutOfBlocks, RequestTooLarge):
            assert (pool_state(self.cache.pool), t.blocks, t.token_ids) == before  # refused, nothing changed
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


# --- the tiny model on the paged cache ---

@pytest.mark.parametrize("bs", [1, 3, 16, 256])
def test_tiny_greedy_matches_no_cache(tiny_model, bs):
    prompt = list(range(3, 23))
    ref = greedy_ids(tiny_model, prompt, 12, NoCacheSession(tiny_model))
    assert greedy_ids(tiny_model, prompt, 12, paged_session(tiny_model, 64, bs)) == ref


def test_tiny_prefix_hit_gives_same_tokens(tiny_model):
    cache = PagedKVCache(tiny_model.cfg, num_blocks=16, block_size=4)
    shared = list(range(3, 14))
    first = PagedSession(tiny_model, cache)
    greedy_ids(tiny_model, shared + [20, 21], 6, first)
    first.free()
    second = PagedSession(tiny_model, cache)
    prompt = shared + [30, 31, 32]
    got = greedy_ids(tiny_model, prompt, 6, second)
    assert second.prompt_computed == len(prompt) - 8  # two full blocks of the shared part were found
    assert got == greedy_ids(tiny_model, prompt, 6, NoCacheSession(tiny_model))


def test_tiny_prefix_hit_kv_is_what_computing_gives(tiny_model):
    """The K/V a hit hands over equals, bit for bit, what a cache without prefix caching computes for it."""
    shared = list(range(3, 20))
    cache = PagedKVCache(tiny_model.cfg, num_blocks=32, block_size=4)
    first = PagedSession(tiny_model, cache)
    first.prefill(shared + [40, 41, 42])
    first.free()
    hit_session = PagedSession(tiny_model, cache)
    prompt = shared + [50, 51]
    hit_session.prefill(prompt)
    hit = len(prompt) - hit_session.prompt_computed
    assert hit == 16
    plain = PagedKVCache(tiny_model.cfg, num_blocks=32, block_size=4, prefix_caching=False)
    fresh = PagedSession(tiny_model, plain)
    fresh.prefill(prompt)
    for layer in range(tiny_model.cfg.n_layers):
        kh, vh = cache.gather(layer, hit_session.table.blocks, len(prompt))
        kf, vf = plain.gather(layer, fresh.table.blocks, len(prompt))
        assert torch.equal(kh[:hit], kf[:hit]) and torch.equal(vh[:hit], vf[:hit])
        torch.testing.assert_close(kh, kf, rtol=0, atol=1e-5)  # the computed tail: same math, other mask path


def test_tiny_batched_decode_rows_match_solo(tiny_model):
    """PagedAttention over B rows of a shared pool: each row's logits equal its solo run."""
    cache = PagedKVCache(tiny_model.cfg, num_blocks=12, block_size=4)
    prompts = [list(range(5, 12)), list(range(40, 53))]
    sessions = [PagedSession(tiny_model, cache) for _ in prompts]
    nxt = [int(s.prefill(p).argmax()) for s, p in zip(sessions, prompts)]
    for s, tok in zip(sessions, nxt):
        cache.append(s.table, [tok])
    step = paged_step([s.table for s in sessions], 1)
    with torch.inference_mode():
        batched = tiny_model(torch.tensor([[t] for t in nxt]), step.positions, PagedAttention(cache, step),
                             last_only=True)  # (B, V)
    for row, p in enumerate(prompts):
        solo = paged_session(tiny_model, 32, 4)
        solo.prefill(p)
        torch.testing.assert_close(batched[row], solo.decode(nxt[row]), rtol=0, atol=1e-5)


def test_tiny_generate_n_shares_prompt_and_matches_solo_seeds(tiny_model):
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=8, n=3, ignore_eos=True)
    prompt = list(range(3, 13))
    cache = PagedKVCache(tiny_model.cfg, num_blocks=16, block_size=4)
    outs = generate_n(tiny_model, prompt, params, cache)
    solo = [generate(tiny_model, prompt, SamplingParams(temperature=1.0, seed=11 + i, max_tokens=8, ignore_eos=True),
                     session=paged_session(tiny_model, 32, 4)).token_ids for i in range(3)]
    assert [o.token_ids for o in outs] == solo
    assert len({tuple(s) for s in solo}) > 1  # the seeds really differ
    assert cache.pool.num_used == 0


# --- pagedbench's pure parts ---

def test_utilisation_trace_counts_real_blocks():
    pts = utilisation_trace([(3, 2)], block_size=2, max_len=8, max_running=1)
    assert [(p.tokens, p.paged_slots, p.contiguous_slots) for p in pts] == [(3, 4, 8), (4, 4, 8), (5, 6, 8)]
    with pytest.raises(ValueError, match="max_len=8"):
        utilisation_trace([(5, 4)], block_size=2, max_len=8, max_running=1)


def test_utilisation_paged_wastes_under_one_block_per_request():
    reqs = [(7, 30), (50, 3), (1, 90), (20, 20)] * 3
    for p in utilisation_trace(reqs, block_size=16, max_len=128, max_running=3):
        assert 0 <= p.paged_slots - p.tokens < 16 * p.running
        assert p.contiguous_slots == 128 * p.running


def test_interleaved_round_robin_after_warmup():
    calls = []
    samples = interleaved([lambda: calls.append("a"), lambda: calls.append("b")], repeats=3, warmup=1)
    assert "".join(calls) == "abababab" and [len(s) for s in samples] == [3, 3]


def test_bench_csv_roundtrip(tmp_path):
    s = summarize([0.002, 0.001, 0.003])
    rows = [Comparison("step", 128, 16, s, summarize([0.004, 0.004, 0.004]))]
    write_csv(tmp_path / "b.csv", rows, "python -m nanoserve.pagedbench", "box")
    meta, back = read_csv(tmp_path / "b.csv")
    assert meta == {"command": "python -m nanoserve.pagedbench", "machine": "box"}
    assert back[0]["measure"] == "step" and back[0]["context"] == 128 and back[0]["ratio"] == 2.0
    assert back[0]["contiguous_ms"] == 2.0 and back[0]["n"] == 3
