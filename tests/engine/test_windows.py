"""Sliding windows on the paged road: a Gemma 3 layer of window W reads only its queries' last W keys out of the
pool, on every attention implementation, for whole prompts, chunks that cross the window's edge and decode rows
far past it; the engine then gives each request the no-cache forward's greedy tokens, whatever shares its steps,
however its prompt is chunked, through preemption and prefix hits. A tiny random Gemma 3 (window 8)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanoserve.attention import Chunk
from nanoserve.config import ModelConfig
from nanoserve.engine import LLMEngine
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.kv import BlockManager, KVStorage
from nanoserve.kv.hybrid import NULL_BLOCK
from nanoserve.model.gemma3 import Gemma3
from nanoserve.sampling import SamplingParams

TOL = 1e-4
"""Max abs logit difference between the paged step and the no-cache forward (both fp32, logits of magnitude ~5)."""


@pytest.fixture(scope="module")
def gemma() -> Gemma3:
    return Gemma3.random(ModelConfig.tiny_gemma3(), seed=3)


def no_cache_greedy(model: Gemma3, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("attention", ["reference", "torch", "compiled"])
def test_a_paged_step_reads_each_sliding_layers_window(gemma, attention, compiled):
    """A 20-token prompt in chunks of 7 (the second and third cross the window of 8), then decode rows at 20..29
    beside a whole 5-token prompt: each row's logits are the no-cache forward's at that position."""
    manager = BlockManager(64, 4, prefix_caching=False)
    runner = ModelRunner(gemma, KVStorage(gemma.cfg, 64, 4, gemma.kv_dtype), attention=attention)
    g = torch.Generator().manual_seed(0)
    seq, short = torch.randint(3, 256, (30,), generator=g).tolist(), torch.randint(3, 256, (5,), generator=g).tolist()
    with torch.inference_mode():
        full, full_short = gemma(torch.tensor([seq]))[0], gemma(torch.tensor([short]))[0]
    t = manager.new_table()
    for s, e in [(0, 7), (7, 14), (14, 20)]:
        manager.append_slots(t, seq[s:e])
        got = runner.execute([Chunk(seq[s:e], s, t.blocks)], num_logits=[e - s])
        assert (got - full[s:e]).abs().max() < TOL, (s, e)
    u = manager.new_table()
    manager.append_slots(u, short)
    for p in range(20, 30):
        manager.append_slots(t, [seq[p]])
        chunks = [Chunk([seq[p]], p, t.blocks)] + ([Chunk(short, 0, u.blocks)] if p == 20 else [])
        got = runner.execute(chunks)
        assert (got[0] - full[p]).abs().max() < TOL, p
        if p == 20:
            assert (got[1] - full_short[-1]).abs().max() < TOL


@pytest.mark.parametrize("budget, num_blocks, hybrid", [(512, 256, True), (7, 256, True), (16, 16, False),
                                                         (16, 48, True)])
def test_the_engine_gives_each_request_the_no_cache_greedy_tokens(gemma, budget, num_blocks, hybrid):
    """Ragged prompts (3 to 33 tokens; the window is 8) decoding 16 tokens each, all at once: with whole prompts,
    with every prompt cut into chunks of at most 7, and in a pool so small that requests are preempted and
    recomputed, with a block table per KV cache group (the sliding layers give back what their window left; a
    block holds one layer, so 48 of them are the 16 three-layer blocks of one table for all layers) and without.
    A shared prefix of 12 tokens is found in the cache by the later requests."""
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, 256, (12,), generator=g).tolist()
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (3, 9, 20, 33)]
    prompts += [prefix + torch.randint(3, 256, (n,), generator=g).tolist() for n in (2, 15)]
    engine = LLMEngine(gemma, max_num_batched_tokens=budget, num_blocks=num_blocks, block_size=4,
                       disable_hybrid_kv_cache_manager=not hybrid)
    assert engine.runner.storage.num_groups == (3 if hybrid else 1)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished_requests():
        engine.step()
    for rid, p in zip(ids, prompts):
        assert engine.requests[rid].output_token_ids == no_cache_greedy(gemma, p, 16), (rid, len(p))
    if budget == 16:
        assert engine.scheduler.num_preemptions > 0
    engine.check_idle()


def drain(engine: LLMEngine, on_step=None, max_steps: int = 5000) -> None:
    for step in range(max_steps):
        if on_step:
            on_step(step)
        if not engine.has_unfinished_requests():
            return
        engine.step()
        engine.manager.pool.check()
    raise AssertionError("the engine did not finish")


def test_a_long_request_gives_back_its_sliding_blocks_while_it_runs(gemma):
    """A 60-token prompt in chunks of 8, then 40 decode steps (window 8, blocks of 4): the sliding groups hold at
    most their window and a chunk while the full group holds every block, so the request never holds more than
    max_blocks_held, far less than one table for all layers would; its tokens are the no-cache forward's, and
    every block is back in the pool after it ends."""
    prompt = torch.randint(3, 256, (60,), generator=torch.Generator().manual_seed(5)).tolist()
    engine = LLMEngine(gemma, num_blocks=64, block_size=4, max_num_batched_tokens=8)
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    held = []
    drain(engine, lambda step: held.append(engine.manager.pool.num_used))
    assert max(held) <= engine.manager.max_blocks_held(100, 8) == 25 + 2 * 5 < 3 * 25
    assert held[-2] == 25 + 2 * 3  # before its last step: 98 tokens in, the window of position 98 in blocks 22-24
    assert engine.requests[rid].output_token_ids == no_cache_greedy(gemma, prompt, 40)
    engine.check_idle()


def test_an_abort_gives_back_every_group_at_once(gemma):
    engine = LLMEngine(gemma, num_blocks=64, block_size=4)
    rid = engine.add_request(list(range(3, 40)), SamplingParams(temperature=0, max_tokens=30))
    for _ in range(12):
        engine.step()
    assert engine.manager.pool.num_used > 0 and NULL_BLOCK in engine.requests[rid].table.groups[1]
    engine.abort(rid)
    engine.check_idle()


@st.composite
def workloads(draw):
    prefix = draw(st.lists(st.integers(3, 255), max_size=14))
    reqs = [dict(prompt=(prefix if draw(st.booleans()) else []) + draw(st.lists(st.integers(3, 255), min_size=1,
                                                                                 max_size=24)),
                 max_tokens=draw(st.integers(1, 12)), n=draw(st.sampled_from([1, 1, 2])),
                 seed=draw(st.integers(0, 9)), arrival=draw(st.integers(0, 4)),
                 abort=draw(st.one_of(st.none(), st.integers(0, 15)))) for _ in range(draw(st.integers(1, 4)))]
    options = dict(block_size=draw(st.sampled_from([1, 2, 4])), max_num_batched_tokens=draw(st.integers(4, 40)),
                   enable_prefix_caching=draw(st.booleans()), max_num_seqs=draw(st.integers(2, 6)))
    if draw(st.booleans()):
        options["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    else:
        options["num_scheduler_steps"] = draw(st.sampled_from([1, 4]))
    return options, draw(st.floats(1.0, 3.0)), reqs


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workloads())
def test_property_windows_change_no_token(gemma, workload):
    """Random arrivals, aborts, shared prefixes, n = 2 seeded samples (forks), speculative drafts or several
    decode forwards per step, and pools from barely one request up (preemption): with a block table per KV cache
    group every sequence gets the same tokens as with one table for all layers, the pool's invariants hold after
    every step, and it is whole at the end."""
    options, room, reqs = workload

    def run(hybrid: bool) -> dict:
        probe = LLMEngine(gemma, num_blocks=1 << 16, disable_hybrid_kv_cache_manager=not hybrid, **options)
        need = max(probe.manager.max_blocks_held(len(r["prompt"]) + r["max_tokens"] + 4,
                                                 options["max_num_batched_tokens"]) for r in reqs)
        engine = LLMEngine(gemma, num_blocks=int(need * room), disable_hybrid_kv_cache_manager=not hybrid, **options)
        ids: dict[int, str] = {}

        def on_step(step):
            for i, r in enumerate(reqs):
                if r["arrival"] == step:
                    params = SamplingParams(temperature=0.8 if r["n"] > 1 else 0, n=r["n"], seed=r["seed"],
                                            max_tokens=r["max_tokens"], ignore_eos=True)
                    ids[i] = engine.add_request(r["prompt"], params)
                if r["abort"] == step and i in ids:
                    engine.abort(ids[i])

        drain(engine, on_step)
        engine.check_idle()
        return {(i, s.index): (s.output_token_ids, s.finish_reason.value) for i, rid in ids.items()
                for s in engine.sequences(rid)}

    outs = [run(True), run(False)]
    assert outs[0].keys() == outs[1].keys()
    for key, ((a, why_a), (b, why_b)) in ((k, (outs[0][k], outs[1][k])) for k in outs[0]):
        if why_a == why_b == "length":
            assert a == b, key
        else:  # an abort lands at a step, and the two pools preempt at different steps: one stops sooner
            assert a[:len(b)] == b[:len(a)], key
