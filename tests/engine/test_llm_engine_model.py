"""The engine on the real model: a fixed mixed workload (prompts of 1 to 500 tokens arriving at
different steps, a budget that chunks the long ones, chat prompts sharing the template's prefix)
gives every request transformers' greedy tokens for its prompt alone, up to a genuine near-tie."""

import pytest
from prompts import MAX_NEW, near_tie_horizon, prompt_ids

from nanoserve.engine import LLMEngine, SchedulerConfig
from nanoserve.sampling import SamplingParams

ARRIVALS = {"long_500": 0, "plain": 0, "chat": 1, "code": 3, "one_token": 3, "chat_cjk": 6}


@pytest.fixture(scope="module")
def served(model, tok):
    """Run the workload once: the engine, and name -> (request, tokens streamed). The pool (44 blocks of 16)
    holds the long prompt's request (36 blocks) but not everyone at once."""
    engine = LLMEngine(model, config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=96), num_blocks=44)
    ids, tokens, step = {}, {}, 0
    while step <= max(ARRIVALS.values()) or engine.has_unfinished_requests():
        for name, at in ARRIVALS.items():
            if at == step:
                ids[name] = engine.add_request(prompt_ids(tok, name), SamplingParams(temperature=0, max_tokens=MAX_NEW))
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        step += 1
    return engine, {name: (engine.requests[rid], tokens[rid]) for name, rid in ids.items()}


@pytest.mark.parametrize("name", ARRIVALS)
def test_each_request_gets_transformers_tokens_for_its_prompt_alone(served, hf_greedy, name):
    _, ref_tokens, ref_logits = hf_greedy[name]
    req, mine = served[1][name]
    assert mine == req.output_token_ids
    h = near_tie_horizon(ref_logits)
    assert mine[:h] == ref_tokens[:h]
    if h == len(ref_tokens):  # no near-tie: the whole completion, and where it ended, agree
        assert mine == ref_tokens
        assert req.finish_reason.value == ("length" if len(mine) == MAX_NEW else "stop")
    assert h >= min(16, len(ref_tokens))  # never vacuous


def test_the_workload_chunked_preempted_and_shared_as_intended(served):
    """The workload exercises what it claims to: chunked prompts, a full pool, prefix hits; nothing leaks."""
    engine, reqs = served
    assert max(r.num_prefill_tokens for r in engine.history) == 96  # the long prompt went in chunks
    assert max(r.num_requests for r in engine.history) == 4  # max_num_seqs held
    assert engine.scheduler.num_preemptions > 0
    assert reqs["chat_cjk"][0].num_cached_tokens > 0  # the chat template's blocks were found
    engine.check_idle()
