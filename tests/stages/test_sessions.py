"""The course's session stages on the tiny model: the paged session (every attention implementation, every
block size) gives the no-cache session's tokens, and both give the engine's; prefix hits change the work, not
the numbers; forks share blocks."""

from __future__ import annotations

import pytest
import torch

from nanoserve.attention import Chunk
from nanoserve.engine import ModelRunner
from nanoserve.generate import greedy_ids
from nanoserve.kv import BlockManager, KVStorage
from nanoserve.sampling import SamplingParams
from nanoserve.stages import NoCacheSession, PagedSession, paged_session, run_session
from nanoserve.stages import greedy_session_ids as session_ids

KERNELS = {"compiled": None, "torch-ops": False}  # the `road` fixture's name -> compiled=
PROMPT = list(range(3, 23))


def pool(model, num_blocks: int, block_size: int, prefix_caching: bool = True, compiled=None,
         attention=None) -> tuple[BlockManager, ModelRunner]:
    """A shared paged pool: its bookkeeping and a runner owning its tensors; sessions on it share both."""
    storage = KVStorage(model.cfg, num_blocks, block_size)
    return BlockManager(num_blocks, block_size, prefix_caching), ModelRunner(model, storage, compiled, attention)


@pytest.fixture(scope="module")
def no_cache_tokens(tiny_model):
    return session_ids(tiny_model, NoCacheSession(tiny_model), PROMPT, 12)


def test_the_no_cache_stage_gives_the_engines_tokens(tiny_model, no_cache_tokens):
    assert greedy_ids(tiny_model, PROMPT, 12) == no_cache_tokens


@pytest.mark.parametrize("bs", [1, 3, 16, 256])
def test_tiny_greedy_matches_no_cache(tiny_model, no_cache_tokens, road, bs):
    assert session_ids(tiny_model, paged_session(tiny_model, 64, bs, compiled=KERNELS[road]), PROMPT, 12) == \
        no_cache_tokens


@pytest.mark.parametrize("attention", ["reference", "torch", "compiled"])
def test_every_attention_implementation_gives_the_no_cache_tokens(request, tiny_model, no_cache_tokens, attention):
    if attention == "compiled":
        request.getfixturevalue("compiled")
    session = paged_session(tiny_model, 64, 4, attention=attention)
    assert session.runner.attention == attention
    assert session_ids(tiny_model, session, PROMPT, 12) == no_cache_tokens


def test_the_paged_prefill_logits_are_the_no_cache_ones(tiny_model, road):
    with torch.inference_mode():
        want = tiny_model(torch.tensor([PROMPT]), last_only=True)[0]
    got = paged_session(tiny_model, 32, 4, compiled=KERNELS[road]).prefill(PROMPT)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


def test_tiny_prefix_hit_gives_same_tokens(tiny_model):
    cache = pool(tiny_model, 16, 4)
    shared = list(range(3, 14))
    first = PagedSession(*cache)
    session_ids(tiny_model, first, shared + [20, 21], 6)
    first.free()
    second = PagedSession(*cache)
    prompt = shared + [30, 31, 32]
    got = session_ids(tiny_model, second, prompt, 6)
    assert second.prompt_computed == len(prompt) - 8  # two full blocks of the shared part were found
    assert got == session_ids(tiny_model, NoCacheSession(tiny_model), prompt, 6)


def test_tiny_prefix_hit_kv_is_what_computing_gives(tiny_model):
    """The K/V a hit hands over equals, bit for bit, what a cache without prefix caching computes for it."""
    shared = list(range(3, 20))
    cache = pool(tiny_model, 32, 4)
    first = PagedSession(*cache)
    first.prefill(shared + [40, 41, 42])
    first.free()
    hit_session = PagedSession(*cache)
    prompt = shared + [50, 51]
    hit_session.prefill(prompt)
    hit = len(prompt) - hit_session.prompt_computed
    assert hit == 16
    plain = pool(tiny_model, 32, 4, prefix_caching=False)
    fresh = PagedSession(*plain)
    fresh.prefill(prompt)
    for layer in range(tiny_model.cfg.n_layers):
        kh, vh = cache[1].storage.gather(layer, hit_session.table.blocks, len(prompt))
        kf, vf = plain[1].storage.gather(layer, fresh.table.blocks, len(prompt))
        assert torch.equal(kh[:hit], kf[:hit]) and torch.equal(vh[:hit], vf[:hit])
        torch.testing.assert_close(kh, kf, rtol=0, atol=1e-5)  # the computed tail: same math, other step shape


def test_tiny_batched_decode_rows_match_solo(tiny_model, road):
    """One runner step of two sessions' decode tokens in a shared pool: each row's logits equal its solo run."""
    manager, runner = pool(tiny_model, 12, 4, compiled=KERNELS[road])
    prompts = [list(range(5, 12)), list(range(40, 53))]
    sessions = [PagedSession(manager, runner) for _ in prompts]
    nxt = [int(s.prefill(p).argmax()) for s, p in zip(sessions, prompts)]
    chunks = []
    for s, tok in zip(sessions, nxt):
        manager.append_slots(s.table, [tok])
        chunks.append(Chunk([tok], s.table.num_tokens - 1, s.table.blocks))
    batched = runner.execute(chunks)  # (2, V)
    for row, p in enumerate(prompts):
        solo = paged_session(tiny_model, 32, 4, compiled=KERNELS[road])
        solo.prefill(p)
        torch.testing.assert_close(batched[row], solo.decode(nxt[row]), rtol=0, atol=1e-5)


def test_a_new_prefill_starts_a_new_sequence_and_free_gives_blocks_back(tiny_model):
    manager, runner = pool(tiny_model, 8, 4, prefix_caching=False)
    s = PagedSession(manager, runner)
    s.prefill([5, 6, 7, 8, 9])
    s.decode(10)
    other = s.prefill([11, 12])
    assert s.table.token_ids == [11, 12] and manager.pool.num_used == 1
    fresh = PagedSession(manager, runner)
    assert torch.equal(other, fresh.prefill([11, 12]))
    fresh.free()
    s.free()
    assert s.last_logits is None and manager.pool.num_used == 0
    manager.pool.check()
    with pytest.raises(ValueError, match="different pools"):
        PagedSession(BlockManager(9, 4), runner)


def test_a_fork_holds_its_parents_history_and_logits(tiny_model):
    manager, runner = pool(tiny_model, 8, 4, attention="torch")
    parent = PagedSession(manager, runner)
    logits = parent.prefill([5, 6, 7, 8, 9, 10])
    child = parent.fork()
    assert child.runner.attention == "torch" and child.table.blocks == parent.table.blocks
    assert child.prefill([5, 6, 7, 8, 9, 10]) is logits  # already holds exactly this prompt: nothing to run
    assert torch.equal(child.decode(11), parent.decode(11))  # both copy the shared tail on write
    assert child.table.blocks[0] == parent.table.blocks[0] and child.table.blocks[1] != parent.table.blocks[1]
    child.free()
    parent.free()
    manager.pool.check()


def test_a_seeded_sample_on_a_session_is_the_engines(tiny_model):
    """The stage loop draws from the same sampler as the engine: a seed gives the same tokens on both roads."""
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    from nanoserve.generate import generate

    assert run_session(tiny_model, paged_session(tiny_model, 32, 4), PROMPT, params).token_ids == \
        generate(tiny_model, PROMPT, params).token_ids


def test_decode_before_prefill_is_refused(tiny_model):
    session = paged_session(tiny_model, 16, block_size=4)
    with pytest.raises(RuntimeError, match="decode\\(\\) before prefill\\(\\)"):
        session.decode(5)
    assert session.manager.pool.num_free == session.manager.num_blocks
