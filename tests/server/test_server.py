"""The OpenAI-compatible server on loopback, called by the real `openai` client and by raw HTTP: the same text
as generating alone, streams well-formed to [DONE], every bad request answered in OpenAI's error shape while
everyone else is still served, and a load of 32 streaming clients (some leaving early) that loses nothing and
leaves the pool whole. The server has an API key, as a deployment would; every call here sends it."""

import asyncio
import json
import re
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
from servers import AUTH, KEY

from nanoserve import LLM, SamplingParams, generate
from nanoserve.bench.engine import ragged_workload
from nanoserve.engine import LLMEngine
from nanoserve.server import AsyncEngine
from nanoserve.server.app import build_app
from nanoserve.server.limits import ServerConfig
from nanoserve.server.serve import ServerThread

NAME = "smollm2-test"


@pytest.fixture(scope="module")
def server(model, tok):
    engine = LLMEngine(model, tok, max_num_seqs=32, max_num_batched_tokens=256, num_blocks=600)
    ae = AsyncEngine(engine)
    with ServerThread(build_app(ae, tok, NAME, ServerConfig(api_key=KEY))) as srv:
        with httpx.Client(base_url=srv.url, headers=AUTH, timeout=300) as http:
            yield SimpleNamespace(url=srv.url, engine=ae, http=http,
                                  client=openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0))
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
    assert httpx.get(server.url + "/health").status_code == 200  # open: no key needed


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
    ("/v1/completions", '{"prompt": "hi", "logprobs": 21}', 400, "logprobs"),
    ("/v1/completions", '{"prompt": "hi", "suffix": "x"}', 400, "suffix"),
    ("/v1/completions", '{"prompt": "hi", "stop": [""]}', 400, "stop"),
    ("/v1/completions", '[1, 2]', 400, "body"),
    ("/v1/completions", '{"prompt": "hi", "model": "gpt-4o"}', 404, "does not exist"),
    ("/v1/chat/completions", '{"messages": []}', 400, "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "robot", "content": "x"}]}', 400, "role"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "model": "nope"}', 404, "nope"),
]


@pytest.mark.parametrize("path, body, status, word", BAD)
def test_bad_requests_get_openai_errors_and_the_server_goes_on(server, path, body, status, word):
    r = server.http.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert word in err["message"] and {"message", "type", "param", "code"} <= set(err)
    ok = server.http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_a_prompt_over_the_context_is_a_400_naming_it(server, model):
    n = model.cfg.max_position_embeddings + 1
    r = server.http.post("/v1/completions", json={"prompt": [5] * n, "max_tokens": 2})
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        server.client.completions.create(model=NAME, prompt="hi", max_tokens=4, temperature=3.0, top_p=2.0)


def test_draining_refuses_new_requests_with_503(server):
    server.engine.draining = True
    try:
        r = server.http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        assert r.headers["retry-after"].isdigit()
    finally:
        server.engine.draining = False
    assert server.http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


async def _stream(client: httpx.AsyncClient, url: str, body: dict, leave_after: int | None) -> dict:
    """One streaming completion; with leave_after, hang up after that many chunks."""
    events, text, ids = [], "", []
    async with client.stream("POST", url, json=body, headers=AUTH) as resp:
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


# ---- logprobs ------------------------------------------------------------------------------------------


def run_engine(model, tok, ids: list[int], params: SamplingParams) -> list:
    """The engine alone, no server: what the HTTP answers must carry."""
    engine = LLMEngine(model, tok, num_blocks=128)
    engine.add_request(ids, params, "alone")
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


def test_chat_logprobs_are_the_engines_in_openais_shape(server, model, tok):
    messages = [{"role": "user", "content": "Name a fruit that is yellow."}]
    ref = run_engine(model, tok, tok.encode_chat(messages),
                     SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3))
    tokens = [t for o in ref for t in o.new_token_ids]
    entries = [e for o in ref for e in o.logprobs]
    whole = server.client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0,
                                                  logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    chunks = list(server.client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0,
                                                        logprobs=True, top_logprobs=3, stream=True,
                                                        extra_body={"ignore_eos": True}))
    streamed = [item for c in chunks if c.choices and c.choices[0].logprobs for item in c.choices[0].logprobs.content]
    for content in (whole.choices[0].logprobs.content, streamed):
        assert len(content) == len(tokens) == 10
        for item, t, entry in zip(content, tokens, entries):
            assert item.token == tok.decode([t]) and abs(item.logprob - entry[t][0]) < 1e-4
            best = sorted(lp for lp, _ in entry.values())[::-1][:3]
            assert [x.logprob for x in item.top_logprobs] == pytest.approx(best, abs=1e-4)
            assert item.top_logprobs[0].token == item.token  # greedy: the chosen token is the likeliest
    assert b"".join(bytes(x.bytes) for x in whole.choices[0].logprobs.content).decode() == \
        whole.choices[0].message.content  # the bytes of the tokens are the text's
    plain = server.client.chat.completions.create(model=NAME, messages=messages, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_with_echo_score_the_prompt_as_lm_eval_asks(server, model, tok):
    """lm-eval's local-completions: echo=True, logprobs=1, max_tokens 0 (or 1, the last token then dropped)."""
    prompt = "The capital of France is Paris"
    ids = tok.encode(prompt)
    ref = run_engine(model, tok, ids, SamplingParams(temperature=0, max_tokens=4, logprobs=2, prompt_logprobs=2))
    scored, gen = ref[0].prompt_logprobs, [t for o in ref for t in o.new_token_ids]
    gen_lps = [e for o in ref for e in o.logprobs]

    only = server.client.completions.create(model=NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                                            temperature=0)
    c = only.choices[0]
    assert c.text == prompt and only.usage.completion_tokens == 0 and only.usage.prompt_tokens == len(ids)
    assert c.logprobs.tokens == [tok.decode([t]) for t in ids]
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    assert c.logprobs.token_logprobs[1:] == pytest.approx([scored[i][t][0] for i, t in enumerate(ids) if i],
                                                          abs=1e-4)
    assert c.logprobs.text_offset == [len("".join(c.logprobs.tokens[:i])) for i in range(len(ids))]
    for i, t in enumerate(ids[1:], 1):  # the chosen token, and the likeliest one beside it
        top = c.logprobs.top_logprobs[i]
        assert top[tok.decode([t])] == pytest.approx(scored[i][t][0], abs=1e-4)
        assert max(top.values()) == pytest.approx(max(lp for lp, _ in scored[i].values()), abs=1e-4)

    both = server.client.completions.create(model=NAME, prompt=prompt, max_tokens=4, echo=True, logprobs=2,
                                            temperature=0)
    lp = both.choices[0].logprobs
    assert both.choices[0].text == prompt + tok.decode(gen) and len(lp.tokens) == len(ids) + 4
    assert lp.token_logprobs[len(ids):] == pytest.approx([e[t][0] for e, t in zip(gen_lps, gen)], abs=1e-4)
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(c.logprobs.token_logprobs[1:], abs=1e-4)
    chunks = list(server.client.completions.create(model=NAME, prompt=prompt, max_tokens=4, echo=True, logprobs=2,
                                                   temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == both.choices[0].text
    joined = [x for ch in chunks if ch.choices[0].logprobs for x in ch.choices[0].logprobs.tokens]
    offsets = [x for ch in chunks if ch.choices[0].logprobs for x in ch.choices[0].logprobs.text_offset]
    assert joined == lp.tokens and offsets == lp.text_offset
    no_echo = server.client.completions.create(model=NAME, prompt=prompt, max_tokens=4, logprobs=0, temperature=0)
    assert no_echo.choices[0].logprobs.tokens == [tok.decode([t]) for t in gen]
    assert [list(d) for d in no_echo.choices[0].logprobs.top_logprobs] == [[tok.decode([t])] for t in gen]


# ---- structured outputs --------------------------------------------------------------------------------

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def test_json_schema_outputs_parse_and_validate_on_both_endpoints(server):
    import jsonschema

    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    texts = []
    for seed in range(3):
        r = server.client.chat.completions.create(model=NAME, messages=messages, max_tokens=80, temperature=0.8,
                                                  seed=seed, response_format=fmt)
        assert r.choices[0].finish_reason == "stop"
        texts.append(r.choices[0].message.content)
        r = server.client.completions.create(model=NAME, prompt="A person, as JSON:", max_tokens=80, temperature=0.8,
                                             seed=seed, extra_body={"guided_json": PERSON})
        texts.append(r.choices[0].text)
    chunks = list(server.client.chat.completions.create(model=NAME, messages=messages, max_tokens=80, seed=7,
                                                        response_format=fmt, stream=True))
    texts.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)


def test_json_object_choice_regex_and_grammar(server):
    r = server.client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": 'Reply with a JSON object with one key, "ok".'}],
        max_tokens=100, temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = server.client.completions.create(model=NAME, prompt="A JSON object for a point: ", max_tokens=100,
                                         temperature=0, extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(r.choices[0].text), dict)
    for seed in range(3):
        r = server.client.completions.create(model=NAME, prompt="Is the sky blue?", max_tokens=8, temperature=1.0,
                                             seed=seed, extra_body={"guided_choice": ["yes", "no", "maybe"]})
        assert r.choices[0].text in ("yes", "no", "maybe")
        r = server.client.completions.create(model=NAME, prompt="Phone:", max_tokens=12, temperature=1.0, seed=seed,
                                             extra_body={"guided_regex": r"\d{3}-\d{4}"})
        assert re.fullmatch(r"\d{3}-\d{4}", r.choices[0].text)
        grammar = {"structured_outputs": {"grammar": 'start: "x" ("y" | "z")+ "."'}}
        r = server.client.completions.create(model=NAME, prompt="Say:", max_tokens=12, temperature=1.0, seed=seed,
                                             extra_body=grammar)
        assert re.fullmatch(r"x[yz]+\.", r.choices[0].text)


def test_constrained_and_free_requests_share_the_server(server, model, tok):
    """A constrained request beside a free one: the free one's text is what it is alone."""
    prompt = "Once upon a time"
    alone = generate(model, tok.encode(prompt), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), tok)

    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=300) as c:
            return await asyncio.gather(
                c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0,
                                                "ignore_eos": True}),
                c.post("/v1/completions", json={"prompt": "Is it?", "max_tokens": 4,
                                                "guided_choice": ["yes", "no"]}))

    free, constrained = asyncio.run(main())
    assert free.json()["choices"][0]["text"] == alone.text
    assert constrained.json()["choices"][0]["text"] in ("yes", "no")


# ---- usage ---------------------------------------------------------------------------------------------


def test_usage_reports_the_prompt_tokens_found_in_the_prefix_cache(server, tok):
    prompt = "Cached tokens are counted: " + " ".join(f"item {i}," for i in range(40))
    n = len(tok.encode(prompt))
    first = server.client.completions.create(model=NAME, prompt=prompt, max_tokens=1, temperature=0)
    again = server.client.completions.create(model=NAME, prompt=prompt, max_tokens=1, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < n and cached % 16 == 0  # whole blocks, the last token always computed
    chunks = list(server.client.completions.create(model=NAME, prompt=prompt, max_tokens=1, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    wait_idle(server.engine)
    assert server.http.post("/reset_prefix_cache").json() == {"reset": True}  # vLLM's endpoint: every prefix forgotten
    after = server.client.completions.create(model=NAME, prompt=prompt, max_tokens=1, temperature=0)
    assert after.usage.prompt_tokens_details.cached_tokens == 0 and after.choices[0].text == first.choices[0].text


# ---- bad input beside streams in flight ----------------------------------------------------------------

BESIDE = ["The history of the printing press", "def fibonacci(n):"]
BESIDE_TOKENS = 24


@pytest.fixture(scope="module")
def beside(model, tok):
    """The streams that run beside each bad request, and the tokens each must give (what it gives alone)."""
    return [generate(model, tok.encode(p), SamplingParams(temperature=0, max_tokens=BESIDE_TOKENS, ignore_eos=True),
                     tok).token_ids for p in BESIDE]


def stream_beside(url: str, prompt: str, events: list, started) -> None:
    body = {"prompt": prompt, "max_tokens": BESIDE_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=AUTH, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()


def deep(levels: int) -> str:
    return "[" * levels + "]" * levels


REGRESSIONS = [  # (name, path, body (text, or bytes as sent), headers, status, param: the field the 400 names)
    ("temperature 1e-300 is greedy", "/v1/completions",
     '{"prompt": "Hi", "max_tokens": 6, "temperature": 1e-300}', {}, 200, None),
    ("repetition_penalty 1e-300", "/v1/completions", '{"prompt": "Hi", "repetition_penalty": 1e-300}', {}, 400,
     "repetition_penalty"),
    ("presence_penalty 3", "/v1/completions", '{"prompt": "Hi", "presence_penalty": 3}', {}, 400, "presence_penalty"),
    ("seed 2**64", "/v1/completions", f'{{"prompt": "Hi", "seed": {2 ** 64}}}', {}, 400, "seed"),
    ("seed -2**63 - 1", "/v1/chat/completions",
     f'{{"messages": [{{"role": "user", "content": "Hi"}}], "seed": {-2 ** 63 - 1}}}', {}, 400, "seed"),
    ("lone surrogate", "/v1/completions", '{"prompt": "a\\ud800b"}', {}, 400, "prompt"),
    ("lone surrogate in a message", "/v1/chat/completions",
     '{"messages": [{"role": "user", "content": "a\\udfffb"}]}', {}, 400, "messages"),
    ("stop_token_ids 10**9", "/v1/completions", '{"prompt": "Hi", "stop_token_ids": [1000000000]}', {}, 400,
     "stop_token_ids"),
    ("prompt ids outside the vocabulary", "/v1/completions", '{"prompt": [1, -5]}', {}, 400, "prompt"),
    ("invalid UTF-8 body", "/v1/completions", b'{"prompt": "\xc3\x28"}', {}, 400, None),
    ("deeply nested JSON", "/v1/completions", deep(100_000), {}, 400, None),
    ("nesting within a field", "/v1/completions", f'{{"prompt": "Hi", "guided_json": {{"a": {deep(200)}}}}}',
     {}, 400, "guided_json"),
    ("no such path", "/v1/nothing", "{}", {}, 404, None),
    ("prompt: ['a'] * 100000", "/v1/completions", json.dumps({"prompt": ["a"] * 100_000}), {}, 400, "prompt"),
    ("n=16 x 500 prompts", "/v1/completions", json.dumps({"prompt": ["hi"] * 500, "n": 16}), {}, 400, "prompt"),
    ("a wrong API key", "/v1/completions", '{"prompt": "Hi"}', {"authorization": "Bearer wrong"}, 401, None),
    ("logprobs 21", "/v1/completions", '{"prompt": "Hi", "logprobs": 21}', {}, 400, "logprobs"),
    ("top_logprobs 21", "/v1/chat/completions",
     '{"messages": [{"role": "user", "content": "Hi"}], "logprobs": true, "top_logprobs": 21}', {}, 400,
     "top_logprobs"),
    ("a malformed schema", "/v1/chat/completions",
     json.dumps({"messages": [{"role": "user", "content": "Hi"}], "response_format": {
         "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}}), {}, 400,
     "response_format"),
    ("an unsatisfiable schema", "/v1/completions",
     json.dumps({"prompt": "Hi", "guided_json": {"type": "string", "minLength": 5, "maxLength": 2}}), {}, 400,
     "guided_json"),
    ("a regex that cannot match", "/v1/completions", json.dumps({"prompt": "Hi", "guided_regex": r"[^\s\S]"}),
     {}, 400, "guided_regex"),
    ("two constraints", "/v1/completions", json.dumps({"prompt": "Hi", "guided_regex": "a", "guided_choice": ["b"]}),
     {}, 400, "guided_choice"),
    ("max_tokens past the context", "/v1/completions", '{"prompt": "Hi", "max_tokens": 9000}', {}, 400,
     "max_tokens"),
    ("a 3 MB text prompt", "/v1/completions", json.dumps({"prompt": "word " * 600_000}), {}, 400, "prompt"),
    ("a 5 MB body", "/v1/completions", json.dumps({"prompt": "x" * (5 << 20)}), {}, 413, None),
]


@pytest.mark.parametrize("name, path, body, headers, status, param", REGRESSIONS, ids=[r[0] for r in REGRESSIONS])
def test_bad_input_is_answered_alone_while_streams_run_beside_it(server, beside, tok, name, path, body, headers,
                                                                 status, param):
    import threading

    events = [[] for _ in BESIDE]
    started = [threading.Event() for _ in BESIDE]
    threads = [threading.Thread(target=stream_beside, args=(server.url, p, e, s))
               for p, e, s in zip(BESIDE, events, started)]
    for t in threads:
        t.start()
    for s in started:
        assert s.wait(120)
    r = server.http.post(path, content=body, headers={"content-type": "application/json", **headers})
    for t in threads:
        t.join(300)

    assert r.status_code == status, r.text
    if status == 200:  # temperature 1e-300: the greedy text, nothing broken
        greedy = server.http.post(path, json={"prompt": "Hi", "max_tokens": 6, "temperature": 0}).json()
        assert r.json()["choices"][0]["text"] == greedy["choices"][0]["text"]
    else:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    for got, want in zip(events, beside):  # every stream beside it whole: each token, one finish, then [DONE]
        assert got[-1] == "[DONE]"
        chunks = [json.loads(x) for x in got[:-1]]
        assert all("error" not in c for c in chunks)
        assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == want
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_405_is_in_openai_shape(server):
    r = server.http.get("/v1/chat/completions")
    assert r.status_code == 405 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_several_decode_forwards_per_step_stream_the_text_generate_gives(model, tok):
    """A server whose engine runs up to 8 decode forwards per step (`serve --num-scheduler-steps 8`): streamed and
    whole, greedy chat gives generate's text, and a stop string cuts it where it cuts generate's."""
    engine = LLMEngine(model, tok, max_num_seqs=4, num_blocks=64, num_scheduler_steps=8)
    ae = AsyncEngine(engine)
    messages = [{"role": "user", "content": "Count from one to ten."}]
    with ServerThread(build_app(ae, tok, NAME, ServerConfig(api_key=KEY))) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
        for stop in (None, ["4."]):
            alone = generate(model, tok.encode_chat(messages),
                             SamplingParams(temperature=0, max_tokens=40, stop=stop or []), tok)
            r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=40, temperature=0, stop=stop)
            assert r.choices[0].message.content == alone.text
            chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=40, temperature=0,
                                                         stop=stop, stream=True))
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == alone.text
        wait_idle(ae)
    assert max(r.num_steps for r in engine.history) == 8
    engine.check_idle()
