"""The paged attention backend's three implementations against each other, on random pools with
shuffled block tables: the compiled kernel and the torch ops against the reference gather, and
each request's rows bit-identical whatever else is in its step (hypothesis)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanoserve.attention import IMPLEMENTATIONS, Chunk, PagedAttention, choose, prepare
from nanoserve.kv import KVStorage

H, K, D = 4, 2, 16  # grouped-query: two query heads per kv head


class Step:
    """A step of requests (context, query length) in a random pool; each request's blocks come from a
    shuffled free list, so tables are scattered. The step's own new k/v are written into their slots
    first, as PagedAttention does, so every implementation reads the same numbers."""

    def __init__(self, requests, block_size, seed=0, pool=None, tables=None, qkv=None):
        g = torch.Generator().manual_seed(seed)
        need = [math.ceil((c + t) / block_size) for c, t in requests]
        if pool is None:
            n_blocks = sum(need) + 3
            pool = torch.randn(2, n_blocks, block_size, K, D, generator=g)
        self.k_pool, self.v_pool = pool[0].clone(), pool[1].clone()
        if tables is None:
            free = torch.randperm(self.k_pool.shape[0], generator=g).tolist()
            tables = [[free.pop() for _ in range(n)] for n in need]
        self.tables = tables
        self.chunks = [Chunk([1] * t, c, table) for (c, t), table in zip(requests, tables)]
        self.ids, self.md = prepare(self.chunks, block_size)
        N = self.ids.numel()
        if qkv is None:
            qkv = [torch.randn(N, H, D, generator=g), torch.randn(N, K, D, generator=g),
                   torch.randn(N, K, D, generator=g)]
        self.q, self.k, self.v = qkv
        n = self.md.num_tokens
        self.k_pool.view(-1, K, D)[self.md.slot_mapping] = self.k[:n]
        self.v_pool.view(-1, K, D)[self.md.slot_mapping] = self.v[:n]

    def run(self, impl: str) -> torch.Tensor:
        with torch.inference_mode():
            return IMPLEMENTATIONS[impl](self.q, self.k, self.v, self.k_pool, self.v_pool, self.md, {})

    def rows(self, r: int) -> slice:
        qsl = self.md.query_start_loc.tolist()
        return slice(qsl[r], qsl[r + 1])


MIXED = [  # (cached context, query tokens): every kind of request, contexts off the block boundaries
    (0, 7),  # a whole prompt
    (33, 1),  # a decode token
    (20, 5),  # a chunk after cached context
    (0, 1),  # a one-token prompt
    (250, 1),  # a long decode, beside short ones
    (17, 16),  # a chunk of 16
    (1, 3),  # a chunk after one cached token
    (5, 1),
]

# compiled and torch against the reference: fp32 rounding of the same sums in other orders
# (SDPA's, batched products', the kernel's polynomial exp). Outputs are of order 1.
ATTENTION_TOL = 2e-6


@pytest.mark.parametrize("impl", ["compiled", "torch"])
@pytest.mark.parametrize("block_size", [1, 16, 256])
@pytest.mark.parametrize("requests", [MIXED, MIXED[:1], MIXED[1:2], MIXED[2:3], [(0, 1)], [(40, 1), (3, 1), (90, 1)]],
                         ids=["mixed", "prompt", "decode", "chunk", "one-token", "decodes"])
def test_implementations_agree_with_the_reference(request, impl, block_size, requests):
    if impl == "compiled":
        request.getfixturevalue("compiled")
    step = Step(requests, block_size, seed=block_size)
    ref, out = step.run("reference"), step.run(impl)
    assert out.shape == ref.shape == (step.ids.numel(), H * D)
    n = step.md.num_tokens
    assert torch.equal(out[n:], torch.zeros_like(out[n:])) and torch.equal(ref[n:], out[n:])  # padding rows: zero
    err = (out - ref).abs().max().item()
    assert err < ATTENTION_TOL, f"{impl} is {err:.2e} from the reference"


def test_the_reference_is_causal_attention_over_the_gathered_sequence():
    """Each request's rows against a plain softmax over its keys 0..position, written out in fp64."""
    step = Step(MIXED, 16, seed=1)
    out = step.run("reference")
    for r, (ctx, T) in enumerate(MIXED):
        slots = torch.tensor([step.tables[r][p // 16] * 16 + p % 16 for p in range(ctx + T)])
        keys = step.k_pool.view(-1, K, D)[slots].double()  # (S, K, D)
        vals = step.v_pool.view(-1, K, D)[slots].double()
        q = step.q[step.rows(r)].double()  # (T, H, D)
        kh, vh = keys.repeat_interleave(H // K, 1), vals.repeat_interleave(H // K, 1)  # (S, H, D)
        scores = torch.einsum("thd,shd->hts", q, kh) / D**0.5
        future = torch.arange(ctx + T)[None, :] > ctx + torch.arange(T)[:, None]  # (T, S)
        want = torch.einsum("hts,shd->thd", scores.masked_fill(future, float("-inf")).softmax(-1), vh)
        torch.testing.assert_close(out[step.rows(r)].double(), want.reshape(T, H * D), atol=1e-6, rtol=0)


def test_choose_picks_by_the_kernels_and_refuses_what_cannot_run():
    assert choose(True) == "compiled" and choose(False) == "torch"
    assert choose(True, "reference") == "reference" and choose(False, "torch") == "torch"
    with pytest.raises(ValueError, match="attention='compiled' needs the compiled kernels on"):
        choose(False, "compiled")
    with pytest.raises(ValueError, match=r"attention='flash': choose one of \['compiled', 'reference', 'torch'\]"):
        choose(True, "flash")
    assert set(IMPLEMENTATIONS) == {"reference", "torch", "compiled"}


@pytest.mark.parametrize("impl", ["reference", "torch", "compiled"])
def test_paged_attention_writes_the_real_tokens_then_attends(request, tiny_cfg, impl):
    """The backend the model calls: the step's k/v go to their slots (padding rows nowhere), then attention."""
    if impl == "compiled":
        request.getfixturevalue("compiled")
    storage = KVStorage(tiny_cfg, num_blocks=6, block_size=4)
    chunks = [Chunk([1, 2, 3], 0, [4]), Chunk([9], 5, [2, 0])]
    ids, md = prepare(chunks, 4)
    N, Hm, Km, Dm = ids.numel(), tiny_cfg.n_heads, tiny_cfg.n_kv_heads, tiny_cfg.head_dim
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, N, Hm, Dm, generator=g)
    k, v = torch.randn(2, 1, N, Km, Dm, generator=g)
    with torch.inference_mode():
        out = PagedAttention(storage, md, impl)(1, q, k, v)
    assert out.shape == (1, N, Hm * Dm)
    assert md.slot_mapping.tolist() == [16, 17, 18, 1]
    k_slots, v_slots = storage.k[1].view(-1, Km, Dm), storage.v[1].view(-1, Km, Dm)
    assert torch.equal(k_slots[md.slot_mapping], k[0, :4]) and torch.equal(v_slots[md.slot_mapping], v[0, :4])
    assert int((k_slots.abs().sum((1, 2)) != 0).sum()) == 4  # four real tokens written, the padding rows nowhere
    assert storage.k[0].abs().sum() == 0  # other layers untouched
    assert torch.equal(out[0, 4:], torch.zeros(N - 4, Hm * Dm))


# ---- batch invariance: a request's rows do not depend on the rest of the step ----------------------

request_st = st.tuples(st.integers(0, 70), st.integers(1, 20))  # (cached context, query tokens)
decode_st = st.tuples(st.integers(0, 90), st.just(1))
others_st = st.lists(st.one_of(request_st, decode_st), min_size=0, max_size=4)


def step_with(target, others, where, block_size, target_kv, target_qkv, seed):
    """`target` at index `where` among `others`, in one pool whose first blocks hold the target's K/V
    (target_kv (2, blocks, bs, K, D)). The target's table, K/V and q, k, v rows are the same whatever
    the others are; the others' blocks are scattered through the rest of the pool."""
    g = torch.Generator().manual_seed(seed)
    own = target_kv.shape[1]
    need = [math.ceil((c + t) / block_size) for c, t in others]
    n_blocks = own + sum(need) + 1
    pool = torch.randn(2, n_blocks, block_size, K, D, generator=g)
    pool[:, :own] = target_kv
    free = (own + torch.randperm(n_blocks - own, generator=g)).tolist()
    tables = [[free.pop() for _ in range(n)] for n in need]
    requests = list(others)
    requests.insert(where, target)
    tables.insert(where, list(range(own)))
    _, md = prepare([Chunk([1] * t, c, tb) for (c, t), tb in zip(requests, tables)], block_size)
    N = md.positions.numel()  # rows, padding included
    qkv = [torch.randn(N, H, D, generator=g), torch.randn(N, K, D, generator=g), torch.randn(N, K, D, generator=g)]
    start = md.query_start_loc[where].item()
    for t, rows in zip(qkv, target_qkv):
        t[start: start + target[1]] = rows
    return Step(requests, block_size, pool=pool, tables=tables, qkv=qkv)


@pytest.mark.parametrize("impl", ["torch", "compiled"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(target=st.one_of(request_st, decode_st), others=st.tuples(others_st, others_st),
       where=st.tuples(st.integers(0, 4), st.integers(0, 4)), block_size=st.sampled_from([1, 3, 16, 256]),
       seed=st.integers(0, 2**16))
def test_a_requests_rows_are_bit_identical_whatever_else_is_in_the_step(request, impl, target, others, where,
                                                                         block_size, seed):
    if impl == "compiled":
        request.getfixturevalue("compiled")
    g = torch.Generator().manual_seed(seed)
    ctx, T = target
    target_kv = torch.randn(2, math.ceil((ctx + T) / block_size), block_size, K, D, generator=g)
    target_qkv = [torch.randn(T, H, D, generator=g), torch.randn(T, K, D, generator=g),
                  torch.randn(T, K, D, generator=g)]
    outs = []
    for i in range(2):
        at = min(where[i], len(others[i]))
        step = step_with(target, others[i], at, block_size, target_kv, target_qkv, seed + i + 1)
        outs.append(step.run(impl)[step.rows(at)])
    assert torch.equal(outs[0], outs[1])
