"""The engine on the real model: a fixed mixed workload (prompts of 1 to 500 tokens arriving at
different steps, a budget that chunks the long ones, chat prompts sharing the template's prefix), with one
decode forward per step and with up to eight, gives every request transformers' greedy tokens for its prompt
alone, up to a genuine near-tie."""

import pytest
from prompts import MAX_NEW, near_tie_horizon, prompt_ids

from nanoserve.engine import LLMEngine
from nanoserve.sampling import SamplingParams

ARRIVALS = {"long_500": 0, "plain": 0, "chat": 1, "code": 3, "one_token": 3, "chat_cjk": 6}


@pytest.fixture(scope="module", params=[1, 8], ids=["one forward per step", "up to 8 forwards per step"])
def served(request, model, tok):
    """Run the workload once per setting of num_scheduler_steps: the engine, and name -> (request, tokens
    streamed). The pool (44 blocks of 16) holds the long prompt's request (36 blocks) but not everyone at once."""
    engine = LLMEngine(model, max_num_seqs=4, max_num_batched_tokens=96, num_blocks=44,
                       num_scheduler_steps=request.param)
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
    k = engine.config.scheduler.num_scheduler_steps
    assert max(r.num_steps for r in engine.history) == k  # with k > 1, once no one waited, k forwards a step
    engine.check_idle()


def test_stop_strings_end_a_request_as_they_end_generate(model, tok):
    """A stop string cuts the engine's text where it cuts generate's, beside a request that does not stop."""
    from nanoserve.generate import generate

    ids = tok.encode_chat([{"role": "user", "content": "Count from one to ten."}])
    params = SamplingParams(temperature=0, max_tokens=40, stop=["4."])
    alone = generate(model, ids, params, tok)
    engine = LLMEngine(model, tok, num_blocks=64)
    rid = engine.add_request(ids, params)
    other = engine.add_request(tok.encode("The capital of France is"), SamplingParams(temperature=0, max_tokens=8))
    streamed = ""
    while engine.has_unfinished_requests():
        streamed += "".join(o.new_text for o in engine.step() if o.request_id == rid)
    req = engine.requests[rid]
    assert alone.finish_reason == "stop" and "4." not in alone.text  # the prompt does reach a "4."
    assert (req.text, streamed, req.output_token_ids) == (alone.text, alone.text, alone.token_ids)
    assert req.finish_reason.value == "stop" and req.stop_reason == "4."
    assert engine.requests[other].finish_reason.value == "length"
    engine.check_idle()
