"""Generation on the real model against transformers on the same checkpoint folder.

- 64 greedy tokens identical to `transformers.generate(do_sample=False)`, chat and plain, on prompts of
  1 to 500 tokens, compared up to the first genuine near-tie (reference top1 - top2 < 1e-3: there two
  fp32 paths may rightly differ);
- stopping (EOS, stop strings, stop ids, max tokens), streaming text, and clear errors for bad prompts.

Two prompts that finish early run on the no-cache path (Day 08); the others on `generate`'s own road
(a paged session sized for the request, the compiled kernels where they build), since 64 no-cache steps
cost a full forward each (over 500 tokens for the long prompt). Both roads must give transformers'
tokens. How close the logits are is tests/model/test_llama.py's business.
"""

from __future__ import annotations

import pytest
import torch
from prompts import MAX_NEW, PROMPTS, near_tie_horizon, prompt_ids

from nanoserve.engine import NoCacheSession, check_prompt
from nanoserve.generate import StepOutput, generate, stream_generate
from nanoserve.sampling import SamplingParams

NO_CACHE = {"plain", "chat"}  # prompts whose greedy completions end early: cheap enough without a cache


def session_for(model, name: str):
    """The no-cache session for the NO_CACHE prompts, else None: generate's own road."""
    return NoCacheSession(model) if name in NO_CACHE else None


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
        out[name] = list(stream_generate(model, ids, params, tok, session_for(model, name)))
    return out


def test_prompt_lengths_span_1_to_500(tok):
    lengths = sorted(len(prompt_ids(tok, n)) for n in PROMPTS)
    assert lengths[0] == 1 and lengths[-1] == 500 and len(lengths) >= 5


@pytest.mark.parametrize("name", PROMPTS)
def test_greedy_tokens_match_transformers_generate(reference, ours, name):
    _, ref_tokens, ref_logits = reference[name]
    mine = [s.token_id for s in ours[name]]
    h = near_tie_horizon(ref_logits)
    assert mine[:h] == ref_tokens[:h], f"{name}: first difference at step " + str(
        next(i for i, (a, b) in enumerate(zip(mine, ref_tokens)) if a != b))
    if h == len(ref_tokens):  # no near-tie: the whole completion, and where it ended, agree
        assert mine == ref_tokens
    # these fixed prompts have no near-tie early on: the comparison is never vacuous
    assert h >= min(16, len(ref_tokens))


def test_streamed_text_is_the_decoded_completion(ours, tok):
    for name, steps in ours.items():
        ids = [s.token_id for s in steps]
        if steps[-1].finish_reason == "stop":
            ids = ids[:-1]  # the EOS token itself is not text
        assert "".join(s.text for s in steps) == tok.decode(ids), name


def test_streaming_never_emits_a_broken_character(ours, tok):
    steps = ours["chat_cjk"]
    ids = [s.token_id for s in steps]
    text = "".join(s.text for s in steps)
    assert any(len(ch.encode()) >= 3 for ch in text)  # the completion has CJK characters
    # some generated tokens were halves of a character: decoded alone they are broken ...
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    # ... yet no streamed piece ever is, and those tokens emitted nothing until the character completed
    assert all("\ufffd" not in s.text for s in steps)
    assert any(s.text == "" and s.finish_reason is None for s in steps)


def test_streaming_emoji_to_the_length_limit(model, tok):
    """Emoji are 4 UTF-8 bytes, often two tokens each. A stream cut by max_tokens may end inside one: only
    the final flush may then carry U+FFFD, and only because the decoded completion itself ends broken."""
    ids = tok.encode_chat([{"role": "user", "content": "Give me three emoji for happiness."}])
    steps = list(stream_generate(model, ids, SamplingParams(temperature=0, max_tokens=MAX_NEW), tok,
                                 session_for(model, "emoji")))
    text = "".join(s.text for s in steps)
    assert text == tok.decode([s.token_id for s in steps])
    assert any(len(ch.encode()) == 4 for ch in text)  # emoji were generated
    assert any(s.text == "" and s.finish_reason is None for s in steps)  # and some were split across tokens
    assert all("\ufffd" not in s.text for s in steps[:-1])
    if "\ufffd" in steps[-1].text:
        assert steps[-1].finish_reason == "length" and text.endswith("\ufffd")


def test_stops_on_eos(ours, tok, model):
    steps = ours["chat"]
    assert steps[-1].finish_reason == "stop" and steps[-1].token_id in model.cfg.eos_token_id
    assert len(steps) < MAX_NEW and "<|im_end|>" not in "".join(s.text for s in steps)
    # with ignore_eos the same request runs on past the EOS to max_tokens
    ids = prompt_ids(tok, "chat")
    params = SamplingParams(temperature=0, max_tokens=len(steps) + 2, ignore_eos=True)
    cont = generate(model, ids, params, tok, session_for(model, ""))
    assert cont.finish_reason == "length" and len(cont.token_ids) == len(steps) + 2
    assert cont.token_ids[: len(steps)] == [s.token_id for s in steps]


def test_stops_at_max_tokens(model, tok):
    out = generate(model, prompt_ids(tok, "code"), SamplingParams(temperature=0, max_tokens=5), tok)
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    assert out.text == tok.decode(out.token_ids)


def test_stop_strings_truncate_before_the_stop_string(model, tok, ours):
    steps = ours["code"]  # 64 tokens of code: plenty of text to stop in
    ids = prompt_ids(tok, "code")
    full = "".join(s.text for s in steps)
    # (a) a stop string inside one piece; (b) one that spans two pieces
    inside = "return"
    k = next(i for i in range(1, len(steps)) if len(steps[i - 1].text) >= 2 and len(steps[i].text) >= 2
             and steps[i - 1].text.strip() and steps[i].text.strip())
    across = steps[k - 1].text[-2:] + steps[k].text[:2]
    for stop in (inside, across):
        assert stop in full
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, stop=[stop])
        out = generate(model, ids, params, tok, session_for(model, "code"))
        assert out.finish_reason == "stop"
        assert out.text == full[: full.index(stop)], stop
        assert stop not in out.text
        # generation stopped at the token that completed the stop string, not later
        n = len(out.token_ids)
        assert out.token_ids == [s.token_id for s in steps[:n]]
        assert stop in tok.decode(out.token_ids) and stop not in tok.decode(out.token_ids[:-1])


def test_stop_token_ids(model, tok, ours):
    steps = ours["plain"]
    target = steps[3].token_id
    first = next(i for i, s in enumerate(steps) if s.token_id == target)
    out = generate(model, prompt_ids(tok, "plain"), SamplingParams(temperature=0, stop_token_ids=[target]), tok)
    assert out.finish_reason == "stop" and out.token_ids == [s.token_id for s in steps[: first + 1]]


def test_empty_prompt_is_a_clear_error(model, tok):
    with pytest.raises(ValueError, match="prompt is empty"):
        generate(model, [], SamplingParams(temperature=0), tok)


def test_prompt_longer_than_context_is_a_clear_error(model, tok):
    ctx = model.cfg.max_position_embeddings
    for n in (ctx, ctx + 100):
        with pytest.raises(ValueError, match=rf"prompt has {n} tokens; the model's context is {ctx}"):
            generate(model, [1] * n, SamplingParams(temperature=0), tok)


def test_bad_prompt_is_refused_before_any_work(model, tok):
    class Exploding:
        def prefill(self, ids):
            raise AssertionError("prefill ran on a prompt that should have been refused")

        decode = prefill

    cfg = model.cfg
    for bad, match in [([], "empty"), ([5, cfg.vocab_size, -1], "outside the vocabulary"),
                       ("Hello", "prompt is text .* encode it with the tokenizer"),
                       ([5, 6.0], r"not token ids \(integers\): \[6\.0\]")]:
        with pytest.raises(ValueError, match=match):
            list(stream_generate(model, bad, SamplingParams(temperature=0), tok, session=Exploding()))
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        list(stream_generate(model, [1, 2], SamplingParams(temperature=0, stop=["x"]), None, session=Exploding()))
    check_prompt([1] * (cfg.max_position_embeddings - 1), cfg.max_position_embeddings, cfg.vocab_size)  # fits
