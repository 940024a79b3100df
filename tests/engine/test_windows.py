"""Sliding windows on the paged road: a Gemma 3 layer of window W reads only its queries' last W keys out of the
pool, on every attention implementation, for whole prompts, chunks that cross the window's edge and decode rows
far past it; the engine then gives each request the no-cache forward's greedy tokens, whatever shares its steps,
however its prompt is chunked, through preemption and prefix hits. A tiny random Gemma 3 (window 8)."""

from __future__ import annotations

import pytest
import torch

from nanoserve.attention import Chunk
from nanoserve.config import ModelConfig
from nanoserve.engine import LLMEngine
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.kv import BlockManager, KVStorage
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


@pytest.mark.parametrize("budget, num_blocks", [(512, 256), (7, 256), (16, 16)])
def test_the_engine_gives_each_request_the_no_cache_greedy_tokens(gemma, budget, num_blocks):
    """Ragged prompts (3 to 33 tokens; the window is 8) decoding 16 tokens each, all at once: with whole prompts,
    with every prompt cut into chunks of at most 7, and in a pool so small that requests are preempted and
    recomputed. A shared prefix of 12 tokens is found in the cache by the later requests."""
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, 256, (12,), generator=g).tolist()
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (3, 9, 20, 33)]
    prompts += [prefix + torch.randint(3, 256, (n,), generator=g).tolist() for n in (2, 15)]
    engine = LLMEngine(gemma, max_num_batched_tokens=budget, num_blocks=num_blocks, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished_requests():
        engine.step()
    for rid, p in zip(ids, prompts):
        assert engine.requests[rid].output_token_ids == no_cache_greedy(gemma, p, 16), (rid, len(p))
    if num_blocks == 16:
        assert engine.scheduler.num_preemptions > 0
    engine.check_idle()
