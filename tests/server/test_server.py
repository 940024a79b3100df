"""The OpenAI-compatible server on loopback, called by the real `openai` client and by raw HTTP: the same text
as generating alone, streams well-formed to [DONE], every bad request answered in OpenAI's error shape while
everyone else is still served, and a load of 32 streaming clients (some leaving early) that loses nothing and
leaves the pool whole."""

import asyncio
import json
import re
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from nanoserve import LLM, SamplingParams, generate
from nanoserve.bench.engine import ragged_workload
from nanoserve.engine import LLMEngine
from nanoserve.server import AsyncEngine
from nanoserve.server.app import ServerThread, build_app

NAME = "smollm2-test"


@pytest.fixture(scope="module")
def server(model, tok):
    engine = LLMEngine(model, tok, max_num_seqs=32, max_num_batched_tokens=256, num_blocks=600)
    ae = AsyncEngine(engine)
    with ServerThread(build_app(ae, tok, NAME)) as srv:
        yield SimpleNamespace(url=srv.url, engine=ae, client=openai.OpenAI(base_url=srv.url + "/v1", api_key="none",
                                                                            max_retries=0))
    assert not ae.is_running  # shutting down stopped the engine thread


def wait_idle(ae: AsyncEngine, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = ae.snapshot
        if s["running"] == 0 and s["waiting"] == 0 and not ae._sinks:
            return
        time.sleep(0.05)
    raise AssertionError(f"the engine did not go idle: {ae.snapshot}")


def metric(text: str, name: str, default: float | None = None, **labels: str) -> float:
    """One sample's value from Prometheus text (the labels given must match); `default` if there is none."""
    total = None
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            got = dict(re.findall(r'(\w+)="([^"]*)"', line.split(" ")[0]))
            if all(got.get(k) == v for k, v in labels.items()):
                total = (total or 0.0) + float(line.rsplit(" ", 1)[1])
    if total is None:
        assert default is not None, f"no sample {name} {labels}"
        return default
    return total


def test_models_and_health(server):
    models = server.client.models.list()
    assert [m.id for m in models.data] == [NAME]
    assert httpx.get(server.url + "/health").status_code == 200


def test_completion_is_the_text_llm_generate_gives(server, model_dir, tok):
    prompt = "The capital of France is"
    offline = LLM(model_dir, num_blocks=64).generate(prompt, SamplingParams(temperature=0, max_tokens=16),
                                                     use_tqdm=False)[0].outputs[0]
    r = server.client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0)
    assert r.choices[0].text == offline.text and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(tok.encode(prompt)), 16)
    chunks = list(server.client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0,
                                                   stream=True))
    assert "".join(c.choices[0].text for c in chunks) == offline.text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_chat_with_and_without_streaming_matches_generate(server, model, tok):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    alone = generate(model, tok.encode_chat(messages), SamplingParams(temperature=0, max_tokens=40), tok)
    r = server.client.chat.completions.create(model=NAME, messages=messages, max_tokens=40, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == alone.text
    assert r.choices[0].finish_reason == ("stop" if alone.finish_reason == "eos" else alone.finish_reason)
    stream = server.client.chat.completions.create(model=NAME, messages=messages, max_tokens=40, temperature=0,
                                                   stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == alone.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(alone.token_ids)
    assert chunks[-2].choices[0].finish_reason == r.choices[0].finish_reason


def test_stop_strings_n_samples_and_prompt_lists(server, model, tok):
    r = server.client.completions.create(model=NAME, prompt=["Once upon a time", "def add(a, b):"], max_tokens=12,
                                         temperature=0.8, seed=5, n=2)
    assert len(r.choices) == 4 and [c.index for c in r.choices] == [0, 1, 2, 3]
    for k, c in enumerate(r.choices):
        prompt = ["Once upon a time", "def add(a, b):"][k // 2]
        alone = generate(model, tok.encode(prompt), SamplingParams(temperature=0.8, seed=5 + k % 2, max_tokens=12),
                         tok)
        assert c.text == alone.text
    stop = server.client.completions.create(model=NAME, prompt="Count: 1, 2, 3,", max_tokens=30, temperature=0,
                                            stop=[" 6"])
    assert stop.choices[0].finish_reason == "stop" and " 6" not in stop.choices[0].text


BAD = [
    ("/v1/completions", '{"prompt": "hi", ', 400, "not valid JSON"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": "many"}', 400, "max_tokens"),
    ("/v1/completions", '{"prompt": "hi", "temperature": -1}', 400, "temperature"),
    ("/v1/completions", '{"prompt": "hi", "top_p": 0}', 400, "top_p"),
    ("/v1/completions", '{"prompt": ""}', 400, "empty"),
    ("/v1/completions", '{"max_tokens": 3}', 400, "prompt"),
    ("/v1/completions", '{"prompt": [1, 2, 99999999]}', 400, "vocabulary"),
    ("/v1/completions", '{"prompt": "hi", "logprobs": 3}', 400, "logprobs"),
    ("/v1/completions", '{"prompt": "hi", "stop": [""]}', 400, "stop"),
    ("/v1/completions", '[1, 2]', 400, "body"),
    ("/v1/completions", '{"prompt": "hi", "model": "gpt-4o"}', 404, "does not exist"),
    ("/v1/chat/completions", '{"messages": []}', 400, "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "robot", "content": "x"}]}', 400, "role"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "model": "nope"}', 404, "nope"),
]


@pytest.mark.parametrize("path, body, status, word", BAD)
def test_bad_requests_get_openai_errors_and_the_server_goes_on(server, path, body, status, word):
    r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert word in err["message"] and {"message", "type", "param", "code"} <= set(err)
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_a_prompt_over_the_context_is_a_400_naming_it(server, model):
    n = model.cfg.max_position_embeddings + 1
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [5] * n, "max_tokens": 2}, timeout=30)
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        server.client.completions.create(model=NAME, prompt="hi", max_tokens=4, temperature=3.0, top_p=2.0)


def test_draining_refuses_new_requests_with_503(server):
    server.engine.draining = True
    try:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    finally:
        server.engine.draining = False
    assert httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


async def _stream(client: httpx.AsyncClient, url: str, body: dict, leave_after: int | None) -> dict:
    """One streaming completion; with leave_after, hang up after that many chunks."""
    events, text, ids = [], "", []
    async with client.stream("POST", url, json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            events.append(line[6:])
            if line == "data: [DONE]":
                break
            chunk = json.loads(line[6:])
            text += chunk["choices"][0]["text"]
            ids += chunk["choices"][0]["token_ids"]
            if leave_after is not None and len(events) >= leave_after:
                return dict(left=True, events=events, ids=ids)
    finish = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]]
    return dict(left=False, events=events, text=text, ids=ids, finish=finish)


def test_32_streaming_clients_some_leaving_lose_nothing_and_leave_the_pool_whole(server, model, tok):
    wait_idle(server.engine)
    before = httpx.get(server.url + "/metrics").text
    w = ragged_workload(tok, 32, prompt_range=(20, 200), output_range=(4, 48), seed=11)
    leave = {i: 3 for i in range(0, 32, 4)}  # every fourth client hangs up after 3 chunks
    url = server.url + "/v1/completions"

    async def main():
        async with httpx.AsyncClient(timeout=httpx.Timeout(300)) as client:
            return await asyncio.gather(*[
                _stream(client, url, dict(model=NAME, prompt=p, max_tokens=n, temperature=0, ignore_eos=True,
                                          stream=True, return_token_ids=True), leave.get(i))
                for i, (p, n) in enumerate(zip(w.prompts, w.max_tokens))])

    results = asyncio.run(main())
    wait_idle(server.engine)
    done = [(i, r) for i, r in enumerate(results) if not r["left"]]
    assert len(done) == 32 - len(leave)
    for i, r in done:  # complete and well-formed: every token asked for, one finish reason, then [DONE]
        assert r["events"][-1] == "[DONE]" and len(r["ids"]) == w.max_tokens[i]
        assert r["finish"][-1] == "length" and all(f is None for f in r["finish"][:-1])
        assert r["text"] == tok.decode(r["ids"])
    for i in (1, 2, 3):  # and the same tokens as the request alone
        alone = generate(model, w.prompts[i], SamplingParams(temperature=0, max_tokens=w.max_tokens[i],
                                                             ignore_eos=True), tok)
        assert results[i]["ids"] == alone.token_ids
    engine = server.engine.engine
    assert engine.manager.pool.num_used == 0 and all(r.finished for r in engine.requests.values())
    engine.check_idle()
    after = httpx.get(server.url + "/metrics").text
    grew = lambda name, **labels: metric(after, name, 0.0, **labels) - metric(before, name, 0.0, **labels)  # noqa: E731
    assert metric(after, "nanoserve:num_requests_running") == 0 == metric(after, "nanoserve:num_requests_waiting")
    assert metric(after, "nanoserve:kv_cache_blocks_used") == 0
    finished = grew("nanoserve:request_success_total", finished_reason="length")
    aborted = grew("nanoserve:request_success_total", finished_reason="abort")
    assert finished + aborted == 32  # every request accounted for, once
    assert len(done) <= finished and 0 < aborted <= len(leave)  # a client may leave after its request ended
    assert grew("nanoserve:prompt_tokens_total") == sum(map(len, w.prompts[:32]))
    assert grew("nanoserve:generation_tokens_total") >= sum(len(r["ids"]) for r in results)
    assert grew("nanoserve:time_to_first_token_seconds_count") == 32
