"""The offline API (vLLM's shapes) on the real model: the same text as `generate` on each prompt alone,
prompts in every form, n samples, streaming, and bad input refused before anything runs."""

import pytest

from nanoserve import LLM, SamplingParams, generate
from nanoserve.generate import stream_generate

GREEDY = SamplingParams(temperature=0, max_tokens=16)
QUESTIONS = ["What is the capital of France?", "Name three colors.", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, num_blocks=256)


def test_generate_gives_each_prompt_its_solo_text(llm, model, tok):
    prompts = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time"]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts and len({o.request_id for o in outs}) == 3
    for p, o in zip(prompts, outs):
        alone = generate(model, tok.encode(p), GREEDY, tok)
        (c,) = o.outputs
        assert (c.index, c.text, c.token_ids, c.finish_reason) == (0, alone.text, alone.token_ids, alone.finish_reason)
        assert o.prompt_token_ids == tok.encode(p) and o.finished
    llm.engine.check_idle()


def test_chat_token_ids_and_one_params_per_prompt(llm, model, tok):
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (4, 8, 12)]
    outs = llm.chat(convs, params, use_tqdm=False)
    by_ids = llm.generate([{"prompt_token_ids": tok.encode_chat(c)} for c in convs], params, use_tqdm=False)
    for c, p, o, o2 in zip(convs, params, outs, by_ids):
        alone = generate(model, tok.encode_chat(c), p, tok)
        assert o.outputs[0].token_ids == o2.outputs[0].token_ids == alone.token_ids
        assert o.prompt is None and o.prompt_token_ids == tok.encode_chat(c)
    one = llm.chat([{"role": "user", "content": QUESTIONS[0]}], params[0], use_tqdm=False)
    assert len(one) == 1 and one[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_logprobs_reach_the_outputs_of_generate_and_llm(llm, model, tok):
    """What the engine computes for `logprobs` and `prompt_logprobs` is what the API hands back, per token."""
    prompt = "The capital of France is"
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=2)
    steps = list(stream_generate(model, tok.encode(prompt), params, tok))
    want = [e for s in steps for e in s.logprobs]
    (out,) = llm.generate(prompt, params, use_tqdm=False)
    alone = generate(model, tok.encode(prompt), params, tok)
    for c in (out.outputs[0], alone):
        assert c.token_ids == [t for s in steps for t in s.new_token_ids]
        assert len(c.logprobs) == len(c.token_ids) == 6
        for t, got, ref in zip(c.token_ids, c.logprobs, want):
            assert next(iter(got)) == t and len(got) <= 4 and set(got) == set(ref)
            assert all(abs(got[k][0] - ref[k][0]) < 1e-5 for k in got)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(tok.encode(prompt))
    assert [list(e) for e in out.prompt_logprobs[1:]] == [list(e) for e in steps[0].prompt_logprobs[1:]]
    (plain,) = llm.generate(prompt, GREEDY, use_tqdm=False)
    assert plain.outputs[0].logprobs is None and plain.prompt_logprobs is None
    llm.engine.check_idle()


def test_n_samples_are_seeded_one_by_one_and_share_one_prefill(llm, tok):
    prompt = "Write a short poem about the moon and the stars, in the style of an old sea shanty:"
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=12, n=3)
    first_step = llm.engine.steps
    (out,) = llm.generate(prompt, params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    steps = [r for r in llm.engine.history if r.step >= first_step]
    assert sum(r.num_prefill_tokens for r in steps) == len(tok.encode(prompt))  # the prompt, computed once
    for i, c in enumerate(out.outputs):
        (single,) = llm.generate(prompt, SamplingParams(temperature=1.0, top_p=0.9, seed=11 + i, max_tokens=12),
                                 use_tqdm=False)
        assert c.token_ids == single.outputs[0].token_ids
    llm.engine.check_idle()


def test_stream_yields_the_text_and_a_closed_stream_frees_its_blocks(llm, model, tok):
    params = SamplingParams(temperature=0, max_tokens=24)
    pieces = list(llm.stream("The capital of France is", params))
    assert "".join(pieces) == generate(model, tok.encode("The capital of France is"), params, tok).text
    stream = llm.stream("Tell me a long story.", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    next(stream)
    stream.close()
    llm.engine.check_idle()


def test_bad_prompts_are_refused_before_anything_runs(llm):
    with pytest.raises(ValueError, match="prompt 1: empty text"):
        llm.generate(["fine", ""], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt 1: prompt has 9000 tokens"):
        llm.generate(["fine", {"prompt_token_ids": [5] * 9000}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="needs 'prompt' or 'prompt_token_ids'"):
        llm.generate([{"text": "x"}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate(["x"], [GREEDY, GREEDY], use_tqdm=False)
    with pytest.raises(ValueError, match="max_tokens=0"):
        llm.generate(["x"], SamplingParams(max_tokens=0), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate("still serving", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
