"""The stages and the engine on the real SmolLM2: every road (no cache, contiguous, paged on every attention
implementation, the engine) gives the no-cache loop's greedy tokens, prefix hits change nothing but the work
done, and the engine's n samples share their prompt's blocks."""

from __future__ import annotations

import pytest

from nanoserve.engine import LLMEngine
from nanoserve.generate import generate, greedy_ids
from nanoserve.sampling import SamplingParams
from nanoserve.stages import NoCacheSession, PagedSession, cached_session, paged_session
from nanoserve.stages import greedy_session_ids as session_ids

MAX_NEW = 24  # with ignore_eos: on past the answer's EOS, as far as this prompt's greedy choices have no near-tie


@pytest.fixture(scope="module")
def chat_prompt(tok):
    return tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])


@pytest.fixture(scope="module")
def no_cache_ids(model, chat_prompt):
    return session_ids(model, NoCacheSession(model), chat_prompt, MAX_NEW)


def test_the_no_cache_answer(tok, no_cache_ids):
    assert tok.decode(no_cache_ids[:7]) == "The capital of France is Paris."


def test_the_engine_gives_the_no_cache_tokens(model, chat_prompt, no_cache_ids):
    """generate's road: one request in an engine sized for it, compiled kernels where they build."""
    assert greedy_ids(model, chat_prompt, MAX_NEW) == no_cache_ids


@pytest.mark.parametrize("attention", ["reference", "torch", "compiled"])
def test_every_attention_implementation_gives_the_no_cache_tokens(request, model, chat_prompt, no_cache_ids,
                                                                   attention):
    if attention == "compiled":
        request.getfixturevalue("compiled")
    session = paged_session(model, 128, 16, attention=attention)
    assert session_ids(model, session, chat_prompt, MAX_NEW) == no_cache_ids


@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_paged_greedy_equals_no_cache_and_contiguous(model, chat_prompt, no_cache_ids, road, block_size):
    compiled = None if road == "compiled" else False
    assert session_ids(model, paged_session(model, 128, block_size, compiled=compiled), chat_prompt, MAX_NEW) == \
        no_cache_ids
    if block_size == 16:
        assert session_ids(model, cached_session(model, 128), chat_prompt, MAX_NEW) == no_cache_ids


def test_the_engine_prefill_is_near_the_fp64_reference(model, chat_prompt, fp64_logits, fp64_tol, road):
    compiled = None if road == "compiled" else False
    logits = paged_session(model, 64, 16, compiled=compiled).prefill(chat_prompt).double()
    assert (logits - fp64_logits(chat_prompt)[-1]).abs().max().item() < fp64_tol[0]


def test_prefix_hit_on_a_shared_system_prompt(model, tok):
    system = {"role": "system", "content": "You are a concise assistant. Answer in one short sentence."}
    prompts = [tok.encode_chat([system, {"role": "user", "content": q}])
               for q in ("What is the capital of Italy?", "Name a primary colour.")]
    first = paged_session(model, 256, 8)
    session_ids(model, first, prompts[0], 4)
    first.free()  # its full blocks stay cached
    second = PagedSession(first.manager, first.runner)
    got = session_ids(model, second, prompts[1], 16)
    shared = next(i for i, (a, b) in enumerate(zip(*prompts)) if a != b)  # tokens the prompts have in common
    assert second.prompt_computed == len(prompts[1]) - shared // 8 * 8  # every shared full block was a hit
    assert got == session_ids(model, paged_session(model, 128, 8, prefix_caching=False), prompts[1], 16)


def test_n_samples_share_prompt_blocks_and_match_unshared_runs(model, chat_prompt):
    """The engine computes the prompt once for n samples: after that step the prompt's blocks are held n times,
    the partly filled tail is copied on each sample's first write, and sample i equals a request alone seeded
    seed + i."""
    n, bs, max_tokens = 3, 16, 12
    P = len(chat_prompt)
    engine = LLMEngine(model, num_blocks=64, block_size=bs, enable_prefix_caching=False)
    rid = engine.add_request(chat_prompt, SamplingParams(temperature=0.9, seed=100, max_tokens=max_tokens,
                                                         ignore_eos=True, n=n))
    engine.step()
    pool, blocks = engine.manager.pool, engine.sequence(rid, 0).table.blocks
    assert pool.num_used == engine.manager.blocks_needed(P)  # n sequences, one copy of the prompt
    assert [pool.refcount[b] for b in blocks] == [n] * len(blocks)
    engine.step()  # each sample writes its first token: the shared partial block is copied, full ones stay
    own = engine.manager.blocks_needed(P + 1) - P // bs
    assert pool.num_used == P // bs + n * own
    assert [pool.refcount[b] for b in blocks[: P // bs]] == [n] * (P // bs)
    while engine.has_unfinished_requests():
        engine.step()
    samples = [engine.sequence(rid, i).output_token_ids for i in range(n)]
    solo = [generate(model, chat_prompt, SamplingParams(temperature=0.9, seed=100 + i, max_tokens=max_tokens,
                                                         ignore_eos=True)).token_ids for i in range(n)]
    assert samples == solo
    assert len({tuple(s) for s in samples}) > 1
    engine.check_idle()
