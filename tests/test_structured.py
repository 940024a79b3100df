"""Structured outputs: the parameters refused by name, the bitmask arithmetic, the library's refusals turned
into errors naming the field, and on the real model every constrained output parsing and validating against
its schema (many schemas, many seeds) while free requests share its steps with their own tokens."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from nanoserve import kernels
from nanoserve.engine import LLMEngine
from nanoserve.generate import generate
from nanoserve.sampling import INVALID, RowSampler, SamplingParams, sample
from nanoserve.structured import (
    GrammarCompiler,
    GrammarError,
    StructuredOutputsParams,
    allowed,
    apply_bitmask_,
    words,
)


@pytest.mark.parametrize("kw, match", [
    ({}, "exactly one of"),
    ({"regex": "a", "choice": ["a"]}, "exactly one of"),
    ({"choice": []}, "non-empty list of strings"),
    ({"choice": ["a", 3]}, "non-empty list of strings"),
    ({"regex": 5}, "regex=5 must be a string"),
    ({"json": 5}, "JSON schema"),
])
def test_bad_params_are_refused_naming_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(**kw)


def test_params_from_a_dict_in_sampling_params():
    p = SamplingParams(structured_outputs={"choice": ["yes", "no"]})
    assert p.structured_outputs.kind == "choice" and not p.plain_greedy


def test_the_bitmask_is_bit_t_of_word_t_over_32():
    V = 70
    mask = torch.zeros(2, words(V), dtype=torch.int32)
    mask[0, 0] = 1 | (1 << 5)  # tokens 0 and 5
    mask[0, 2] = 1 << 3  # token 67
    mask[1] = -1  # everything
    ok = allowed(mask, V)
    assert ok[0].nonzero().flatten().tolist() == [0, 5, 67] and bool(ok[1].all())
    logits = torch.randn(2, V)
    before = logits.clone()
    apply_bitmask_(logits, mask)
    assert torch.isinf(logits[0]).sum() == V - 3 and torch.equal(logits[0, [0, 5, 67]], before[0, [0, 5, 67]])
    assert torch.equal(logits[1], before[1])


@pytest.mark.parametrize("V", [1, 31, 33, 70, 49152])
def test_the_kernel_applies_a_bitmask_as_masked_fill_does(compiled, V):
    g = torch.Generator().manual_seed(V)
    mask = torch.randint(-2**31, 2**31 - 1, (6, words(V)), dtype=torch.int32, generator=g)
    mask[1], mask[2], mask[3, ::2] = -1, 0, -1  # every token, none, and whole words of each beside random ones
    logits = torch.randn(6, V, generator=g)
    logits[4, ::7] = float("nan")  # forbidden NaNs become -inf, allowed ones stay
    with torch.inference_mode():  # as the engine samples (the kernels take no tensor that wants a gradient)
        by_torch = apply_bitmask_(logits.clone(), mask, compiled=False)
        by_kernel = kernels.apply_bitmask_(logits.clone(), mask)
        assert torch.equal(by_kernel.view(torch.int32), by_torch.view(torch.int32))  # bit for bit, NaNs too
        assert torch.equal(apply_bitmask_(logits.clone(), mask).view(torch.int32), by_torch.view(torch.int32))
        with pytest.raises(RuntimeError, match=r"bitmask: expected contiguous int32 \(6, "):
            kernels.apply_bitmask_(logits.clone(), mask[:, :-1].contiguous() if V > 32 else mask[:1])


def test_a_mask_in_the_batched_sampler_confines_its_row_alone():
    V = 64
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(words(V), dtype=torch.int32)
    mask[1] = 1 << 4  # only token 36
    greedy = SamplingParams(temperature=0)
    rows = [RowSampler(greedy), RowSampler(SamplingParams(temperature=0.9, seed=1)), RowSampler(greedy)]
    out = sample(logits, rows, masks={0: mask, 1: mask})
    assert out[:2] == [36, 36] and out[2] == int(logits[2].argmax())
    nothing = torch.zeros(words(V), dtype=torch.int32)
    assert sample(logits, rows, masks={1: nothing})[1] == INVALID  # no token allowed: this row fails alone
    fresh = lambda: [RowSampler(greedy), RowSampler(SamplingParams(temperature=0.9, seed=1)), RowSampler(greedy)]
    alone, beside = sample(logits, fresh()), sample(logits, fresh(), masks={0: mask})
    assert beside[0] == 36 and beside[1:] == alone[1:]  # a sampled row beside a masked one draws as it would alone


@pytest.fixture(scope="module")
def compiler(tok, model):
    return GrammarCompiler(tok, model.cfg.eos_token_id)


def test_a_grammar_that_fails_in_a_step_ends_its_request_alone(model, tok, compiler):
    """Where a grammar fails at a step's mask (past the checks `add_request` makes), that request ends with
    finish_reason "error" and the grammar's reason; the constrained request filled beside it gets the tokens it
    gets alone, and every block comes back."""
    ids = tok.encode_chat([{"role": "user", "content": "Is the sky blue? Answer yes or no."}])
    yes_no = SamplingParams(temperature=0, max_tokens=4,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))

    def run(doom: bool) -> tuple[object, object]:
        engine = LLMEngine(model, tok, num_blocks=64)
        ok = engine.add_request(ids, yes_no)
        doomed = engine.add_request(ids, yes_no) if doom else None
        if doom:  # an empty language, found at its first mask
            empty = StructuredOutputsParams(regex=r"[^\s\S]")
            engine.requests[doomed].matcher = compiler.matcher(empty, "guided_regex")
        while engine.has_unfinished_requests():
            engine.step()
        engine.check_idle()
        return engine.requests[ok], engine.requests[doomed] if doom else None

    beside, failed = run(doom=True)
    assert beside.output_token_ids == run(doom=False)[0].output_token_ids and beside.text in ("yes", "no")
    assert failed.finish_reason.value == "error" and failed.output_token_ids == []
    assert "guided_regex: no output can satisfy this regex" in failed.error


@pytest.mark.parametrize("kw, match", [
    ({"regex": "(abc"}, "unclosed group"),
    ({"json": {"type": "array", "uniqueItems": True}}, "uniqueItems"),
    ({"json": "{not json"}, "response_format"),
    ({"json": {"type": "integer", "minimum": 5, "maximum": 1}}, "minimum"),
    ({"grammar": "start: (("}, "response_format"),
])
def test_what_the_library_refuses_is_an_error_naming_the_field(compiler, kw, match):
    with pytest.raises(GrammarError, match=match) as e:
        compiler.matcher(StructuredOutputsParams(**kw), "response_format")
    assert e.value.field == "response_format"


def test_a_grammar_nothing_can_match_is_refused_up_front(model, tok):
    """A regex whose language is empty shows at its first mask: the engine takes that step when it checks the
    request, so it is refused with the field named, and the request beside it gets its tokens."""
    engine = LLMEngine(model, tok, num_blocks=64)
    ids = tok.encode("Hello")
    ok = engine.add_request(ids, SamplingParams(temperature=0, max_tokens=4))
    empty = SamplingParams(temperature=0, max_tokens=4, structured_outputs=StructuredOutputsParams(regex=r"[^\s\S]"))
    with pytest.raises(GrammarError, match="guided_regex: no output can satisfy this regex"):
        engine.check_request(ids, empty, "guided_regex")
    with pytest.raises(GrammarError):
        engine.add_request(ids, empty)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.requests[ok].output_token_ids == generate(model, ids, SamplingParams(temperature=0,
                                                                                     max_tokens=4)).token_ids
    engine.check_idle()


def test_a_grammar_past_the_librarys_limits_is_refused_before_its_prefill(model, tok):
    """10,000 choices pass llguidance's compiler and its first mask, and break its parser's limit (2,000 items a
    row) at the first token it consumes: `check_request` takes that token, so the request is refused naming the
    field it came from, before any step spends its prefill."""
    engine = LLMEngine(model, tok, num_blocks=64)
    many = SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(
        choice=[f"item number {i} of the list" for i in range(10_000)]))
    with pytest.raises(GrammarError, match="guided_choice: the grammar library cannot follow this choice: .*items"):
        engine.check_request(tok.encode("Pick one: "), many, "guided_choice")
    assert engine.steps == 0 and not engine.has_unfinished_requests()


def test_a_token_a_grammar_refuses_mid_output_is_named_with_its_reason(model, tok, compiler):
    """Past the admission checks, a token the grammar cannot take ends its request with the library's reason and
    the constraint's kind, not a request field (the engine does not know which one a server's client sent)."""
    engine = LLMEngine(model, tok, num_blocks=64)
    rid = engine.add_request(tok.encode("Pick one: "), SamplingParams(temperature=0, max_tokens=8))
    engine.requests[rid].matcher = compiler.matcher(StructuredOutputsParams(
        choice=[f"item number {i} of the list" for i in range(10_000)]), "guided_choice")
    while engine.has_unfinished_requests():
        engine.step()
    failed = engine.requests[rid]
    assert failed.finish_reason.value == "error" and failed.output_token_ids == []
    assert "broke the output's choice constraint" in failed.error and "items" in failed.error
    assert "guided_choice" not in failed.error
    engine.check_idle()


SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                      "sunny": {"type": "boolean"},
                                      "temps": {"type": "array", "items": {"type": "number"}, "maxItems": 4}},
     "required": ["city", "sunny", "temps"], "additionalProperties": False},
    {"type": "object", "properties": {"mood": {"enum": ["happy", "sad", "calm"]},
                                      "note": {"type": ["string", "null"], "maxLength": 12}},
     "required": ["mood", "note"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object",
                                                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                                                "required": ["x", "y"], "additionalProperties": False}},
     "required": ["point"], "additionalProperties": False},
    {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,6}$"}, "minItems": 1, "maxItems": 3},
]
REGEX = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"


def test_every_constrained_output_parses_and_validates(model, tok):
    """Five schemas, a date regex, a choice and json_object, each sampled with several seeds in one engine beside a
    free greedy request: every finished constrained output is valid, and the free one gets its solo tokens."""
    engine = LLMEngine(model, tok, max_num_seqs=32, num_blocks=512)
    ask = tok.encode_chat([{"role": "user", "content": "Answer with data about a city, a person or a day."}])
    cases = [(StructuredOutputsParams(json=s), lambda text, s=s: jsonschema.validate(json.loads(text), s))
             for s in SCHEMAS]
    cases += [(StructuredOutputsParams(regex=REGEX), lambda text: re.fullmatch(REGEX, text) or pytest.fail(text)),
              (StructuredOutputsParams(choice=["red", "green", "blue"]),
               lambda text: text in ("red", "green", "blue") or pytest.fail(text)),
              (StructuredOutputsParams(json_object=True), lambda text: isinstance(json.loads(text), dict)
               or pytest.fail(text))]
    ids = {}
    for params, check in cases:
        for seed in range(3):
            sp = SamplingParams(temperature=1.0, seed=seed, max_tokens=96, structured_outputs=params)
            ids[engine.add_request(ask, sp)] = check
    free = engine.add_request(ask, SamplingParams(temperature=0, max_tokens=24))
    while engine.has_unfinished_requests():
        engine.step()
    finished = 0
    for rid, check in ids.items():
        req = engine.requests[rid]
        assert req.finish_reason.value in ("stop", "length"), req.error
        if req.finish_reason.value == "stop":  # the grammar ended it; a length cut may leave it open
            check(req.text)
            finished += 1
    assert finished >= len(ids) - 2  # nearly every one completes within max_tokens
    assert engine.requests[free].output_token_ids == generate(model, ask, SamplingParams(temperature=0,
                                                                                       max_tokens=24)).token_ids
    engine.check_idle()
