"""OpenAI's request bodies, validated without a server: what is accepted, what is refused and why; and the
shapes sent back (usage, OpenAI's two logprobs shapes)."""

import pytest
from pydantic import ValidationError

from nanoserve.server.limits import Admission, Busy
from nanoserve.server.metrics import EngineMetrics, Histogram
from nanoserve.server.protocol import MAX_DEPTH, BadRequest, ChatCompletionRequest, CompletionRequest, check_json
from nanoserve.server.responses import TokenText, chat_logprobs, completion_logprobs, joined, top_of, usage_of


def test_prompt_forms_become_a_list_of_prompts():
    assert CompletionRequest(prompt="hi").prompts() == ["hi"]
    assert CompletionRequest(prompt=[1, 2, 3]).prompts() == [[1, 2, 3]]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]


@pytest.mark.parametrize("prompt", ["", [], [""], [[1], []]])
def test_empty_prompts_are_refused(prompt):
    with pytest.raises(BadRequest, match="empty"):
        CompletionRequest(prompt=prompt).prompts()


def test_sampling_params_carry_openai_and_vllm_fields():
    body = CompletionRequest(prompt="x", temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, seed=7, stop="\n",
                             stop_token_ids=[2], ignore_eos=True, n=3)
    p = body.sampling_params(max_tokens=10)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.max_tokens, p.n) == (0.5, 0.9, 5, 0.1, 7, 10, 3)
    assert p.stop == ["\n"] and p.stop_token_ids == [2] and p.ignore_eos


@pytest.mark.parametrize("field, value", [("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("n", 0),
                                          ("max_tokens", -1), ("max_tokens", "many"), ("min_p", 2.0),
                                          ("top_k", -3), ("stop", 5), ("seed", 2 ** 64), ("seed", -2 ** 63 - 1),
                                          ("repetition_penalty", 1e-300), ("repetition_penalty", 11),
                                          ("presence_penalty", 2.5), ("frequency_penalty", -3), ("logprobs", 21),
                                          ("temperature", float("inf")), ("top_p", float("nan")),
                                          ("stop", ["x"] * 65)])
def test_out_of_range_or_mistyped_fields_are_refused(field, value):
    with pytest.raises(ValidationError, match=field):
        CompletionRequest(prompt="x", **{field: value})


@pytest.mark.parametrize("field, value", [("suffix", "end"), ("best_of", 3), ("logit_bias", {"5": 1.0}),
                                          ("max_tokens", 0)])
def test_options_the_engine_lacks_are_refused_not_ignored(field, value):
    with pytest.raises(BadRequest, match=field) as e:
        CompletionRequest(prompt="x", **{field: value}).refuse_unsupported()
    assert e.value.param == field


LOOSE = [("stream", "yes"), ("stream", 1), ("echo", "true"), ("ignore_eos", 1), ("return_token_ids", "on"),
         ("stream_options", {"include_usage": "yes"}), ("prompt", [[False]]), ("prompt", [True, 2]),
         ("prompt", [1.0, 2]), ("n", 2.0), ("n", True), ("max_tokens", 1.0), ("max_tokens", "16"), ("seed", 1.5),
         ("seed", False), ("top_k", 5.0), ("logprobs", 1.0), ("logprobs", True), ("stop_token_ids", [2.0]),
         ("temperature", "0.5"), ("temperature", True), ("top_p", False)]


@pytest.mark.parametrize("field, value", LOOSE)
def test_loose_types_are_refused_as_openai_refuses_them(field, value):
    """Lax coercion would change the request's meaning: [[false]] became token 0, "yes" streamed, 1.0 tokens."""
    with pytest.raises(ValidationError) as e:
        CompletionRequest(**{"prompt": "x", field: value})
    assert e.value.errors()[0]["loc"][0] == field


@pytest.mark.parametrize("field, value", [("logprobs", 1), ("logprobs", "true"), ("top_logprobs", 2.0),
                                          ("max_completion_tokens", 8.0)])
def test_loose_types_in_chat_are_refused(field, value):
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **{field: value})
    assert e.value.errors()[0]["loc"][0] == field


def test_strict_types_still_take_every_valid_form():
    body = CompletionRequest(prompt=[[1, 2]], temperature=1, top_p=1, min_p=0, repetition_penalty=1,
                             presence_penalty=0, frequency_penalty=1, n=2, max_tokens=4, seed=2 ** 64 - 1, top_k=5,
                             logprobs=0, stream=True, echo=False, stream_options={"include_usage": True})
    assert body.prompts() == [[1, 2]] and body.temperature == 1.0 and body.include_usage
    assert body.sampling_params(4).seed == 2 ** 64 - 1


def test_a_too_large_n_is_blamed_on_n_and_too_many_prompts_on_prompt():
    a = Admission(capacity=8, per_request=4)
    with pytest.raises(BadRequest) as e:
        a.take(1, 5)
    assert e.value.param == "n" and "n=5" in str(e.value)
    with pytest.raises(BadRequest) as e:
        a.take(3, 2)
    assert e.value.param == "prompt"
    a.take(2, 2)()
    assert a.held == 0


def test_max_tokens_zero_is_for_echo_alone():
    body = CompletionRequest(prompt="x", max_tokens=0, echo=True, logprobs=1)
    body.refuse_unsupported()
    assert body.echo_only and body.logprobs_wanted() == 1


def test_chat_logprobs_is_a_switch_and_top_logprobs_a_count():
    chat = lambda **kw: ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **kw)  # noqa: E731
    assert chat().logprobs_wanted() is None
    assert chat(logprobs=True).logprobs_wanted() == 0
    assert chat(logprobs=True, top_logprobs=5).sampling_params(4).logprobs == 5
    with pytest.raises(BadRequest, match="logprobs: true") as e:
        chat(top_logprobs=2).refuse_unsupported()
    assert e.value.param == "top_logprobs"
    with pytest.raises(ValidationError, match="top_logprobs"):
        chat(logprobs=True, top_logprobs=21)


def test_sampling_left_out_takes_the_models_defaults_then_openais():
    body = CompletionRequest(prompt="x", top_p=0.5)
    p = body.sampling_params(4, {"temperature": 0.3, "top_k": 20, "top_p": 0.9})
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty) == (0.3, 20, 0.5, 0.0, 1.0)
    p = body.sampling_params(4)
    assert (p.temperature, p.top_k, p.top_p) == (1.0, -1, 0.5)
    assert CompletionRequest(prompt="x", temperature=1e-300).sampling_params(1).greedy
    assert CompletionRequest(prompt="x", top_p=5e-324).sampling_params(1).top_p > 0  # kept above float32's zero


@pytest.mark.parametrize("fields, field, kind", [
    ({"response_format": {"type": "json_object"}}, "response_format", "json_object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "string"}}}},
     "response_format", "json"),
    ({"guided_json": {"type": "integer"}}, "guided_json", "json"),
    ({"guided_regex": "a+"}, "guided_regex", "regex"),
    ({"guided_choice": ["a", "b"]}, "guided_choice", "choice"),
    ({"guided_grammar": 'start: "a"'}, "guided_grammar", "grammar"),
    ({"structured_outputs": {"choice": ["a"]}}, "structured_outputs", "choice"),
    ({"structured_outputs": {"json": {"type": "object"}}}, "structured_outputs", "json"),
])
def test_each_structured_output_field_names_itself(fields, field, kind):
    so, named = CompletionRequest(prompt="x", **fields).structured()
    assert (named, so.kind) == (field, kind)
    assert CompletionRequest(prompt="x", **fields).sampling_params(4, structured=so).structured_outputs is so


@pytest.mark.parametrize("fields, param", [
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
])
def test_structured_outputs_given_twice_or_empty_are_400s_naming_the_field(fields, param):
    with pytest.raises(BadRequest) as e:
        CompletionRequest(prompt="x", **fields).structured()
    assert e.value.param == param
    assert CompletionRequest(prompt="x", response_format={"type": "text"}).structured() is None


def test_a_body_with_a_lone_surrogate_or_deep_nesting_is_refused_naming_where():
    with pytest.raises(BadRequest, match="surrogate") as e:
        check_json({"messages": [{"role": "user", "content": "a\ud800b"}]})
    assert e.value.param == "messages" and "messages[0].content" in str(e.value)
    with pytest.raises(BadRequest, match="surrogate"):
        check_json({"stop": {"\udfff": 1}})
    nested = []
    for _ in range(MAX_DEPTH + 1):
        nested = [nested]
    with pytest.raises(BadRequest, match="nests deeper") as e:
        check_json({"guided_json": nested})
    assert e.value.param == "guided_json"
    check_json({"prompt": "ok é 日本 🙂", "guided_json": {"a": [[[{"b": 1}]]]}})
    with pytest.raises(ValidationError, match="surrogate"):
        CompletionRequest(prompt="a\ud800")


def test_bad_stop_string_is_named():
    with pytest.raises(BadRequest, match="stop") as e:
        CompletionRequest(prompt="x", stop=[""]).sampling_params(4)
    assert e.value.param == "stop"


def test_unknown_fields_are_ignored_as_openai_compatible_servers_do():
    assert CompletionRequest(prompt="x", some_future_option=True).prompt == "x"


def test_chat_messages_text_parts_and_roles():
    body = ChatCompletionRequest(messages=[{"role": "developer", "content": "be brief"},
                                           {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                        {"type": "text", "text": "b"}]}],
                                 max_completion_tokens=5, max_tokens=9)
    assert body.conversation() == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]
    assert body.wanted_tokens == 5
    with pytest.raises(BadRequest, match="text content"):
        ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "image_url"}]}]).conversation()
    with pytest.raises(ValidationError, match="role"):
        ChatCompletionRequest(messages=[{"role": "robot", "content": "hi"}])
    with pytest.raises(ValidationError, match="messages"):
        ChatCompletionRequest(messages=[])


def test_histogram_lines_are_cumulative_prometheus_buckets():
    h = Histogram((0.1, 1.0))
    for x in (0.05, 0.1, 0.5, 3.0):
        h.observe(x)
    assert h.lines("t") == ['t_bucket{le="0.1"} 2', 't_bucket{le="1.0"} 3', 't_bucket{le="+Inf"} 4',
                            't_sum 3.65', 't_count 4']


def test_metrics_render_every_family_with_its_type():
    text = EngineMetrics().render(dict(running=1, waiting=2, blocks_used=3, blocks_total=4, prefix_queried_tokens=5,
                                       prefix_hit_tokens=6, preemptions=0), "m")
    assert 'nanoserve:num_requests_waiting{model_name="m"} 2' in text
    assert 'nanoserve:kv_cache_usage_perc{model_name="m"} 0.75' in text
    assert '# TYPE nanoserve:time_to_first_token_seconds histogram' in text
    assert 'nanoserve:time_to_first_token_seconds_bucket{model_name="m",le="+Inf"} 0' in text
    assert 'nanoserve:time_to_first_token_seconds_count{model_name="m"} 0' in text


def test_admission_bounds_the_sequences_in_flight():
    a = Admission(capacity=4, per_request=3)
    release = a.take(3)
    with pytest.raises(Busy):
        a.take(2)
    with pytest.raises(BadRequest, match="at most 3"):
        a.take(4)
    release()
    release()  # twice is once
    assert a.held == 0 and a.take(3) is not None


def test_usage_carries_cached_tokens_where_openai_puts_them():
    assert usage_of(10, 3, 8) == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                                  "prompt_tokens_details": {"cached_tokens": 8}}


def test_top_of_gives_the_k_likeliest_whether_or_not_the_chosen_token_is_among_them():
    inside = {7: (-0.5, 1), 3: (-1.0, 2)}  # chosen 7 is the likeliest: top 2 = {7, 3}
    assert top_of(inside, 2) == [(7, -0.5), (3, -1.0)]
    outside = {9: (-4.0, 5), 7: (-0.5, 1), 3: (-1.0, 2)}  # chosen 9 is 5th
    assert top_of(outside, 2) == [(7, -0.5), (3, -1.0)]
    assert top_of(outside, 0) == [] and top_of({1: (float("-inf"), 9)}, 1) == [(1, -9999.0)]


def test_logprobs_in_openais_chat_and_legacy_shapes(tok):
    text = TokenText(tok)
    ids = tok.encode("Hi é")
    assert bytes(b for t in ids for b in text(t)[1]).decode() == "Hi é"  # a split character's bytes join
    entries = [{t: (-1.0, 2), 5: (-0.5, 1)} for t in ids]
    chat = chat_logprobs(ids, entries, 1, text)
    assert chat["content"][0] == {"token": tok.decode([ids[0]]), "logprob": -1.0, "bytes": text(ids[0])[1],
                                  "top_logprobs": [{"token": tok.decode([5]), "logprob": -0.5,
                                                    "bytes": text(5)[1]}]}
    legacy = completion_logprobs(ids, [None, *entries[1:]], 1, text, offset=3)
    assert legacy["token_logprobs"][0] is None and legacy["top_logprobs"][0] is None
    assert legacy["token_logprobs"][1:] == [-1.0] * (len(ids) - 1)
    assert legacy["top_logprobs"][1] == {tok.decode([ids[1]]): -1.0, tok.decode([5]): -0.5}
    assert legacy["text_offset"][:2] == [3, 3 + len(tok.decode([ids[0]]))]
    both = joined(legacy, completion_logprobs(ids[:1], entries[:1], 1, text))
    assert len(both["tokens"]) == len(ids) + 1 and joined(None, legacy) is legacy
