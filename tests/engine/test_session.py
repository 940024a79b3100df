"""Sessions on the tiny model: the paged session (every attention implementation, every block size) gives
the no-cache session's tokens; prefix hits change the work, not the numbers; forks share blocks."""

from __future__ import annotations

import importlib

import pytest
import torch

from nanoserve.attention import Chunk
from nanoserve.engine import ModelRunner, NoCacheSession, PagedSession, paged_session
from nanoserve.generate import generate, generate_n, greedy_ids
from nanoserve.kv import PagedKVCache
from nanoserve.sampling import SamplingParams

KERNELS = {"compiled": None, "torch-ops": False}  # the `road` fixture's name -> kernels=
PROMPT = list(range(3, 23))


@pytest.fixture(scope="module")
def no_cache_tokens(tiny_model):
    return greedy_ids(tiny_model, PROMPT, 12, NoCacheSession(tiny_model))


@pytest.mark.parametrize("bs", [1, 3, 16, 256])
def test_tiny_greedy_matches_no_cache(tiny_model, no_cache_tokens, road, bs):
    assert greedy_ids(tiny_model, PROMPT, 12, paged_session(tiny_model, 64, bs, kernels=KERNELS[road])) == \
        no_cache_tokens


@pytest.mark.parametrize("attention", ["reference", "torch", "compiled"])
def test_every_attention_implementation_gives_the_no_cache_tokens(request, tiny_model, no_cache_tokens, attention):
    if attention == "compiled":
        request.getfixturevalue("compiled")
    session = paged_session(tiny_model, 64, 4, attention=attention)
    assert session.runner.attention == attention
    assert greedy_ids(tiny_model, PROMPT, 12, session) == no_cache_tokens


def test_generate_runs_a_paged_session_sized_for_the_request(tiny_model, no_cache_tokens, monkeypatch):
    """No session given: the engine's own road, a pool just big enough for prompt + max_tokens."""
    gen = importlib.import_module("nanoserve.generate")  # (the package's `generate` attribute is the function)
    made = []
    real = gen.paged_session

    def spy(model, max_len, *args, **kwargs):
        made.append(real(model, max_len, *args, **kwargs))
        return made[-1]

    monkeypatch.setattr(gen, "paged_session", spy)
    assert greedy_ids(tiny_model, PROMPT, 12) == no_cache_tokens
    (session,) = made
    assert session.cache.num_blocks * session.cache.block_size >= len(PROMPT) + 12
    assert session.cache.num_blocks == -(-(len(PROMPT) + 12) // 16)


def test_the_paged_prefill_logits_are_the_no_cache_ones(tiny_model, road):
    with torch.inference_mode():
        want = tiny_model(torch.tensor([PROMPT]), last_only=True)[0]
    got = paged_session(tiny_model, 32, 4, kernels=KERNELS[road]).prefill(PROMPT)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


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
        torch.testing.assert_close(kh, kf, rtol=0, atol=1e-5)  # the computed tail: same math, other step shape


def test_tiny_batched_decode_rows_match_solo(tiny_model, road):
    """One runner step of two sessions' decode tokens in a shared pool: each row's logits equal its solo run."""
    cache = PagedKVCache(tiny_model.cfg, num_blocks=12, block_size=4)
    prompts = [list(range(5, 12)), list(range(40, 53))]
    sessions = [PagedSession(tiny_model, cache, KERNELS[road]) for _ in prompts]
    nxt = [int(s.prefill(p).argmax()) for s, p in zip(sessions, prompts)]
    chunks = []
    for s, tok in zip(sessions, nxt):
        cache.append(s.table, [tok])
        chunks.append(Chunk([tok], s.table.num_tokens - 1, s.table.blocks))
    batched = ModelRunner(tiny_model, cache, KERNELS[road]).execute(chunks)  # (2, V)
    for row, p in enumerate(prompts):
        solo = paged_session(tiny_model, 32, 4, kernels=KERNELS[road])
        solo.prefill(p)
        torch.testing.assert_close(batched[row], solo.decode(nxt[row]), rtol=0, atol=1e-5)


def test_a_new_prefill_starts_a_new_sequence_and_free_gives_blocks_back(tiny_model):
    cache = PagedKVCache(tiny_model.cfg, num_blocks=8, block_size=4, prefix_caching=False)
    s = PagedSession(tiny_model, cache)
    s.prefill([5, 6, 7, 8, 9])
    s.decode(10)
    other = s.prefill([11, 12])
    assert s.table.token_ids == [11, 12] and cache.pool.num_used == 1
    fresh = PagedSession(tiny_model, cache)
    assert torch.equal(other, fresh.prefill([11, 12]))
    fresh.free()
    s.free()
    assert s.last_logits is None and cache.pool.num_used == 0
    cache.pool.check()


def test_a_fork_holds_its_parents_history_and_logits(tiny_model):
    cache = PagedKVCache(tiny_model.cfg, num_blocks=8, block_size=4)
    parent = PagedSession(tiny_model, cache, attention="torch")
    logits = parent.prefill([5, 6, 7, 8, 9, 10])
    child = parent.fork()
    assert child.runner.attention == "torch" and child.table.blocks == parent.table.blocks
    assert child.prefill([5, 6, 7, 8, 9, 10]) is logits  # already holds exactly this prompt: nothing to run
    assert torch.equal(child.decode(11), parent.decode(11))  # both copy the shared tail on write
    assert child.table.blocks[0] == parent.table.blocks[0] and child.table.blocks[1] != parent.table.blocks[1]
    child.free()
    parent.free()
    cache.pool.check()


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


def test_decode_before_prefill_is_refused(tiny_model):
    session = paged_session(tiny_model, 16, block_size=4)
    with pytest.raises(RuntimeError, match="decode\\(\\) before prefill\\(\\)"):
        session.decode(5)
    assert session.cache.pool.num_free == session.cache.num_blocks
