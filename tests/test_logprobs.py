"""Log-probabilities on the real model against transformers on the same checkpoint: the log-softmax of the logits
a step produced, before any sampling filter, for generated tokens and for every prompt token, within 1e-4 of
transformers' fp32 forward; ranks and top tokens as the reference orders them; chunked prompts and prefix-cache
hits scored the same as a prompt computed whole."""

from __future__ import annotations

import pytest
import torch
from prompts import prompt_ids

from nanoserve.engine import LLMEngine
from nanoserve.sampling import SamplingParams

TOL = 1e-4


@pytest.fixture(scope="module")
def reference(hf_model, tok):
    """transformers' log-softmax at every position of a prompt and its greedy continuation."""
    ids = prompt_ids(tok, "chat")

    def of(tokens):
        with torch.inference_mode():
            return torch.log_softmax(hf_model(torch.tensor([tokens])).logits[0].float(), -1)  # (T, V)

    return ids, of


def run(model, tok, ids, params, **engine_options):
    engine = LLMEngine(model, tok, num_blocks=64, **engine_options)
    outs = []
    rid = engine.add_request(ids, params)
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == rid]
    engine.check_idle()
    return outs


def check_position(entry: dict, want_token: int, lp: torch.Tensor, top: int) -> None:
    """One position's entry against the reference row lp (V,): the token's logprob and rank, then the top ones."""
    (token, (value, rank)), *others = entry.items()
    assert token == want_token
    assert abs(value - float(lp[token])) < TOL
    assert rank == int((lp > lp[token]).sum()) + 1
    best = set(lp.topk(top).indices.tolist()) if top else set()
    assert best <= set(entry) and len(entry) <= top + 1
    for t, (v, r) in others:
        assert t in best and abs(v - float(lp[t])) < TOL and r == int((lp > lp[t]).sum()) + 1


def test_generated_tokens_logprobs_equal_transformers(model, tok, reference):
    ids, of = reference
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=5, ignore_eos=True)
    outs = run(model, tok, ids, params)
    tokens = [t for o in outs for t in o.new_token_ids]
    entries = [e for o in outs for e in o.logprobs]
    assert len(entries) == len(tokens) == 12
    lp = of(ids + tokens)
    for i, (t, e) in enumerate(zip(tokens, entries)):
        check_position(e, t, lp[len(ids) - 1 + i], 5)
        assert e[t][1] == 1  # greedy: the chosen token is the likeliest


@pytest.mark.parametrize("budget", [512, 16], ids=["whole", "chunked"])
def test_prompt_logprobs_equal_transformers(model, tok, reference, budget):
    ids, of = reference
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    outs = run(model, tok, ids, params, max_num_batched_tokens=budget)
    prompt = outs[0].prompt_logprobs
    assert prompt is not None and all(o.prompt_logprobs is None for o in outs[1:])  # sent once
    assert len(prompt) == len(ids) and prompt[0] is None
    lp = of(ids)
    for p in range(1, len(ids)):
        check_position(prompt[p], ids[p], lp[p - 1], 3)
    assert outs[0].logprobs is None  # not asked for


def test_a_prefix_cache_hit_does_not_skip_the_scoring(model, tok, reference):
    """The prompt's blocks are cached by an earlier request; a request asking for prompt logprobs computes it
    anyway, and gets every position."""
    ids, _ = reference
    engine = LLMEngine(model, tok, num_blocks=64)
    engine.add_request(ids, SamplingParams(temperature=0, max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    rid = engine.add_request(ids, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert engine.requests[rid].num_cached_tokens == 0
    assert len(outs[0].prompt_logprobs) == len(ids) and all(len(e) == 1 for e in outs[0].prompt_logprobs[1:])
