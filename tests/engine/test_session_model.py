"""Sessions on the real SmolLM2: every engine road gives the no-cache loop's greedy tokens, prefix hits
change nothing but the work done, and n samples share their prompt's blocks."""

from __future__ import annotations

import pytest

from nanoserve.engine import NoCacheSession, PagedSession, paged_session
from nanoserve.generate import generate, greedy_ids
from nanoserve.kv import PagedKVCache
from nanoserve.kv.contiguous import cached_session
from nanoserve.sampling import SamplingParams

MAX_NEW = 24  # with ignore_eos: on past the answer's EOS, as far as this prompt's greedy choices have no near-tie


@pytest.fixture(scope="module")
def chat_prompt(tok):
    return tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])


@pytest.fixture(scope="module")
def no_cache_ids(model, chat_prompt):
    return greedy_ids(model, chat_prompt, MAX_NEW, NoCacheSession(model))


def test_the_no_cache_answer(tok, no_cache_ids):
    assert tok.decode(no_cache_ids[:7]) == "The capital of France is Paris."


def test_generate_with_no_session_gives_the_no_cache_tokens(model, chat_prompt, no_cache_ids):
    """generate's default road (a paged session sized for the request, compiled kernels where they build)."""
    assert greedy_ids(model, chat_prompt, MAX_NEW) == no_cache_ids


@pytest.mark.parametrize("attention", ["reference", "torch", "compiled"])
def test_every_attention_implementation_gives_the_no_cache_tokens(request, model, chat_prompt, no_cache_ids,
                                                                   attention):
    if attention == "compiled":
        request.getfixturevalue("compiled")
    session = paged_session(model, 128, 16, attention=attention)
    assert greedy_ids(model, chat_prompt, MAX_NEW, session) == no_cache_ids


@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_paged_greedy_equals_no_cache_and_contiguous(model, chat_prompt, no_cache_ids, road, block_size):
    kernels = None if road == "compiled" else False
    assert greedy_ids(model, chat_prompt, MAX_NEW, paged_session(model, 128, block_size, kernels=kernels)) == \
        no_cache_ids
    if block_size == 16:
        assert greedy_ids(model, chat_prompt, MAX_NEW, cached_session(model, 128)) == no_cache_ids


def test_the_engine_prefill_is_near_the_fp64_reference(model, chat_prompt, fp64_logits, fp64_tol, road):
    kernels = None if road == "compiled" else False
    logits = paged_session(model, 64, 16, kernels=kernels).prefill(chat_prompt).double()
    assert (logits - fp64_logits(chat_prompt)[-1]).abs().max().item() < fp64_tol[0]


def test_prefix_hit_on_a_shared_system_prompt(model, tok):
    system = {"role": "system", "content": "You are a concise assistant. Answer in one short sentence."}
    prompts = [tok.encode_chat([system, {"role": "user", "content": q}])
               for q in ("What is the capital of Italy?", "Name a primary colour.")]
    cache = PagedKVCache.for_tokens(model.cfg, 256, block_size=8)
    first = PagedSession(model, cache)
    greedy_ids(model, prompts[0], 4, first)
    first.free()  # its full blocks stay cached
    second = PagedSession(model, cache)
    got = greedy_ids(model, prompts[1], 16, second)
    shared = next(i for i, (a, b) in enumerate(zip(*prompts)) if a != b)  # tokens the prompts have in common
    assert second.prompt_computed == len(prompts[1]) - shared // 8 * 8  # every shared full block was a hit
    assert got == greedy_ids(model, prompts[1], 16, paged_session(model, 128, 8, prefix_caching=False))


def test_n_samples_share_prompt_blocks_and_match_unshared_runs(model, chat_prompt):
    n, bs, max_tokens = 3, 16, 12
    P = len(chat_prompt)
    params = [SamplingParams(temperature=0.9, seed=100 + i, max_tokens=max_tokens, ignore_eos=True) for i in range(n)]
    cache = PagedKVCache.for_tokens(model.cfg, 4 * 128, block_size=bs)
    parent = PagedSession(model, cache)
    parent.prefill(chat_prompt)
    sessions = [parent] + [parent.fork() for _ in range(n - 1)]
    assert cache.pool.num_used == cache.blocks_needed(P)  # n sequences, one copy of the prompt
    shared = [cache.pool.refcount[b] for b in parent.table.blocks]
    assert shared == [n] * len(shared)
    samples = [generate(model, chat_prompt, p, session=s).token_ids for p, s in zip(params, sessions)]
    # each holds P + max_tokens - 1 tokens; full prompt blocks stay shared, the partial tail was copied on write
    own = cache.blocks_needed(P + max_tokens - 1) - P // bs
    assert cache.pool.num_used == P // bs + n * own
    assert [cache.pool.refcount[b] for b in parent.table.blocks[: P // bs]] == [n] * (P // bs)
    solo = [generate(model, chat_prompt, p, session=paged_session(model, 128, bs)).token_ids for p in params]
    assert samples == solo
    assert len({tuple(s) for s in samples}) > 1
    for s in sessions:
        s.free()
    cache.pool.check()
    assert cache.pool.num_free == cache.num_blocks
