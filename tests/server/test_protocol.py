"""OpenAI's request bodies, validated without a server: what is accepted, what is refused and why."""

import pytest
from pydantic import ValidationError

from nanoserve.server.metrics import EngineMetrics, Histogram
from nanoserve.server.protocol import BadRequest, ChatCompletionRequest, CompletionRequest


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
                                          ("max_tokens", 0), ("max_tokens", "many"), ("min_p", 2.0),
                                          ("top_k", -3), ("stop", 5)])
def test_out_of_range_or_mistyped_fields_are_refused(field, value):
    with pytest.raises(ValidationError, match=field):
        CompletionRequest(prompt="x", **{field: value})


@pytest.mark.parametrize("field, value", [("logprobs", 2), ("echo", True), ("presence_penalty", 0.5),
                                          ("frequency_penalty", 1.0), ("suffix", "end")])
def test_options_the_engine_lacks_are_refused_not_ignored(field, value):
    with pytest.raises(BadRequest, match=field) as e:
        CompletionRequest(prompt="x", **{field: value}).refuse_unsupported()
    assert e.value.param == field


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
