"""Generation on the real model against transformers on the same checkpoint folder.

- 64 greedy tokens identical to `transformers.generate(do_sample=False)`, chat and plain, on prompts of
  1 to 500 tokens, compared up to the first genuine near-tie (reference top1 - top2 < 1e-3: there two
  fp32 paths may rightly differ);
- stopping (EOS, stop strings, stop ids, max tokens), streaming text, and clear errors for bad prompts.

Every prompt runs on `generate`'s road: one request in an engine sized for it (the compiled kernels
where they build). The course's stages are held to the same tokens in tests/stages. How close the
logits are is tests/model/test_llama.py's business.
"""

from __future__ import annotations

import pytest
import torch
from prompts import MAX_NEW, PROMPTS, near_tie_horizon, prompt_ids

from nanoserve.engine import ModelRunner, StepOutput, check_prompt
from nanoserve.generate import generate, one_request_engine, stream_generate
from nanoserve.sampling import SamplingParams


def one_per_token(steps: list[StepOutput]) -> list[StepOutput]:
    """Plain decoding makes one token a step: the stream as (token, text) steps, checked to be so."""
    assert all(len(s.new_token_ids) == 1 for s in steps)
    return steps


def token_ids(steps) -> list[int]:
    return [t for s in steps for t in s.new_token_ids]


def test_near_tie_horizon():
    clear, tie = torch.tensor([3.0, 1.0, 0.0]), torch.tensor([2.0, 2.0005, 0.0])
    assert near_tie_horizon([clear, clear, tie, clear]) == 2
    assert near_tie_horizon([clear] * 3) == 3
    assert near_tie_horizon([tie]) == 0


@pytest.fixture(scope="module")
def reference(hf_greedy):
    """transformers' greedy generation per prompt: (ids, new tokens, per-step logits)."""
    return hf_greedy


@pytest.fixture(scope="module")
def ours(model, tok, reference):
    """nanoserve's greedy streamed generation per prompt, computed once: the list of StepOutputs."""
    out: dict[str, list[StepOutput]] = {}
    for name, (ids, _, _) in reference.items():
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
        out[name] = one_per_token(list(stream_generate(model, ids, params, tok)))
    return out


def test_prompt_lengths_span_1_to_500(tok):
    lengths = sorted(len(prompt_ids(tok, n)) for n in PROMPTS)
    assert lengths[0] == 1 and lengths[-1] == 500 and len(lengths) >= 5


@pytest.mark.parametrize("name", PROMPTS)
def test_greedy_tokens_match_transformers_generate(reference, ours, name):
    _, ref_tokens, ref_logits = reference[name]
    mine = token_ids(ours[name])
    h = near_tie_horizon(ref_logits)
    assert mine[:h] == ref_tokens[:h], f"{name}: first difference at step " + str(
        next(i for i, (a, b) in enumerate(zip(mine, ref_tokens)) if a != b))
    if h == len(ref_tokens):  # no near-tie: the whole completion, and where it ended, agree
        assert mine == ref_tokens
    # these fixed prompts have no near-tie early on: the comparison is never vacuous
    assert h >= min(16, len(ref_tokens))


def test_streamed_text_is_the_decoded_completion(ours, tok):
    for name, steps in ours.items():
        ids = token_ids(steps)
        if steps[-1].finish_reason == "stop":
            ids = ids[:-1]  # the EOS token itself is not text
        assert "".join(s.new_text for s in steps) == tok.decode(ids), name


def test_streaming_never_emits_a_broken_character(ours, tok):
    steps = ours["chat_cjk"]
    ids = token_ids(steps)
    text = "".join(s.new_text for s in steps)
    assert any(len(ch.encode()) >= 3 for ch in text)  # the completion has CJK characters
    # some generated tokens were halves of a character: decoded alone they are broken ...
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    # ... yet no streamed piece ever is, and those tokens emitted nothing until the character completed
    assert all("\ufffd" not in s.new_text for s in steps)
    assert any(s.new_text == "" and s.finish_reason is None for s in steps)


def test_streaming_emoji_to_the_length_limit(model, tok):
    """Emoji are 4 UTF-8 bytes, often two tokens each. A stream cut by max_tokens may end inside one: only
    the final flush may then carry U+FFFD, and only because the decoded completion itself ends broken."""
    ids = tok.encode_chat([{"role": "user", "content": "Give me three emoji for happiness."}])
    steps = one_per_token(list(stream_generate(model, ids, SamplingParams(temperature=0, max_tokens=MAX_NEW), tok)))
    text = "".join(s.new_text for s in steps)
    assert text == tok.decode(token_ids(steps))
    assert any(len(ch.encode()) == 4 for ch in text)  # emoji were generated
    assert any(s.new_text == "" and s.finish_reason is None for s in steps)  # and some were split across tokens
    assert all("\ufffd" not in s.new_text for s in steps[:-1])
    if "\ufffd" in steps[-1].new_text:
        assert steps[-1].finish_reason == "length" and text.endswith("\ufffd")


def test_stops_on_eos(ours, tok, model):
    steps = ours["chat"]
    assert steps[-1].finish_reason == "stop" and steps[-1].new_token_ids[0] in model.cfg.eos_token_id
    assert steps[-1].stop_reason == steps[-1].new_token_ids[0]
    assert len(steps) < MAX_NEW and "<|im_end|>" not in "".join(s.new_text for s in steps)
    # with ignore_eos the same request runs on past the EOS to max_tokens
    ids = prompt_ids(tok, "chat")
    params = SamplingParams(temperature=0, max_tokens=len(steps) + 2, ignore_eos=True)
    cont = generate(model, ids, params, tok)
    assert cont.finish_reason == "length" and len(cont.token_ids) == len(steps) + 2
    assert cont.token_ids[: len(steps)] == token_ids(steps)


def test_stops_at_max_tokens(model, tok):
    out = generate(model, prompt_ids(tok, "code"), SamplingParams(temperature=0, max_tokens=5), tok)
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    assert out.text == tok.decode(out.token_ids)


def test_stop_strings_truncate_before_the_stop_string(model, tok, ours):
    steps = ours["code"]  # 64 tokens of code: plenty of text to stop in
    ids = prompt_ids(tok, "code")
    full = "".join(s.new_text for s in steps)
    # (a) a stop string inside one piece; (b) one that spans two pieces
    inside = "return"
    text = [s.new_text for s in steps]
    k = next(i for i in range(1, len(steps)) if len(text[i - 1]) >= 2 and len(text[i]) >= 2
             and text[i - 1].strip() and text[i].strip())
    across = text[k - 1][-2:] + text[k][:2]
    for stop in (inside, across):
        assert stop in full
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, stop=[stop])
        out = generate(model, ids, params, tok)
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == full[: full.index(stop)], stop
        assert stop not in out.text
        # generation stopped at the token that completed the stop string, not later
        n = len(out.token_ids)
        assert out.token_ids == token_ids(steps[:n])
        assert stop in tok.decode(out.token_ids) and stop not in tok.decode(out.token_ids[:-1])


def test_stop_token_ids(model, tok, ours):
    steps = ours["plain"]
    target = steps[3].new_token_ids[0]
    first = token_ids(steps).index(target)
    out = generate(model, prompt_ids(tok, "plain"), SamplingParams(temperature=0, stop_token_ids=[target]), tok)
    assert out.finish_reason == "stop" and out.token_ids == token_ids(steps[: first + 1])


def test_empty_prompt_is_a_clear_error(model, tok):
    with pytest.raises(ValueError, match="prompt is empty"):
        generate(model, [], SamplingParams(temperature=0), tok)


def test_prompt_longer_than_context_is_a_clear_error(model, tok):
    ctx = model.cfg.max_position_embeddings
    for n in (ctx, ctx + 100):
        with pytest.raises(ValueError, match=rf"prompt has {n} tokens; the model's context is {ctx}"):
            generate(model, [1] * n, SamplingParams(temperature=0), tok)


def test_bad_prompt_is_refused_before_any_work(model, tok, monkeypatch):
    def exploding(*args, **kwargs):
        raise AssertionError("a step ran for a prompt that should have been refused")

    monkeypatch.setattr(ModelRunner, "execute", exploding)
    cfg = model.cfg
    for bad, match in [([], "empty"), ([5, cfg.vocab_size, -1], "outside the vocabulary"),
                       ("Hello", "prompt is text .* encode it with the tokenizer"),
                       ([5, 6.0], r"not token ids \(integers\): \[6\.0\]")]:
        with pytest.raises(ValueError, match=match):
            list(stream_generate(model, bad, SamplingParams(temperature=0), tok))
    with pytest.raises(ValueError, match="stop strings need the engine's tokenizer"):
        list(stream_generate(model, [1, 2], SamplingParams(temperature=0, stop=["x"]), None))
    with pytest.raises(ValueError, match="n=2: generate returns one completion"):
        generate(model, [1, 2], SamplingParams(n=2), tok)
    check_prompt([1] * (cfg.max_position_embeddings - 1), cfg.max_position_embeddings, cfg.vocab_size)  # fits


def test_one_request_gets_an_engine_sized_for_it(model):
    """A pool just big enough for the prompt and every token it may generate, a budget for the whole prompt in
    one step, and the engine's batch-invariant steps (so it samples alone as it would beside others)."""
    params = SamplingParams(temperature=0, max_tokens=40)
    engine = one_request_engine(model, None, 700, params)
    assert engine.manager.num_blocks == -(-740 // 16) + 1
    assert engine.config.scheduler.max_num_batched_tokens >= 701 and engine.config.batch_invariant
    rid = engine.add_request([5] * 700, params)
    engine.step()
    assert engine.history[0].num_prefill_tokens == 700 and not engine.requests[rid].finished
    engine.abort(rid)
    engine.check_idle()
