"""No request stalls the others: a prompt of a million tokens is refused having encoded about a context's worth of
them, requests are prepared on several threads, and a body of a million token ids is checked at C speed, so an
unrelated request and /health keep answering. On a random model with SmolLM2's vocabulary and an 8,192-token
context (the fetched model's), where such prompts fit the character bound a context allows."""

from __future__ import annotations

import http.client
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from servers import AUTH, tiny_server

from nanoserve.bench.stall import health_latency, probed
from nanoserve.config import ModelConfig
from nanoserve.model import Llama
from nanoserve.server.limits import ServerConfig
from nanoserve.tokenizer import TooManyTokens


@pytest.fixture(scope="module")
def server(tok):
    model = Llama.random(ModelConfig.tiny(vocab_size=tok.vocab_size, max_position_embeddings=8192), seed=0)
    config = ServerConfig(api_key="test-key", max_body_bytes=4 << 20)
    with tiny_server(model, tok, config, max_num_batched_tokens=512) as (srv, ae, gate):
        yield srv


def post(url: str, body: dict | bytes) -> tuple[httpx.Response, float]:
    t0 = time.perf_counter()
    kwargs = {"content": body, "headers": {**AUTH, "content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body, "headers": AUTH}
    r = httpx.post(url + "/v1/completions", timeout=120, **kwargs)
    return r, time.perf_counter() - t0


def test_encoding_stops_once_the_context_is_passed(tok):
    emoji = "\U0001F600" * 600_000  # three tokens a character: 1.8M tokens if encoded whole
    t0 = time.perf_counter()
    with pytest.raises(TooManyTokens) as e:
        tok.encode(emoji, limit=8192)
    assert e.value.count > 8192 and e.value.chars < 50_000, e.value
    assert time.perf_counter() - t0 < 1.0  # the whole text takes seconds
    prose = "The quick brown fox jumps over the lazy dog. " * 2000  # 20k tokens, in pieces cut before spaces
    whole = tok.encode(prose)
    assert tok.encode(prose, limit=len(whole)) == whole
    with pytest.raises(TooManyTokens):
        tok.encode(prose, limit=len(whole) - 2)  # the pieces' counts add up to the whole's (its BOS aside)


def test_hostile_prompts_do_not_hold_up_an_unrelated_request(server):
    """Four requests of 600,000 emoji (each under the character bound an 8,192-token context allows, each 1.8M
    tokens) are refused naming the prompt, and a 4-token request sent after them answers at once."""
    hostile = {"prompt": "\U0001F600" * 600_000, "max_tokens": 1}
    with ThreadPoolExecutor(4) as pool:
        refused = [pool.submit(post, server.url, hostile) for _ in range(4)]
        time.sleep(0.5)  # their bodies have arrived: they are being prepared
        r, took = post(server.url, {"prompt": "Hello there", "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert took < 2.0, f"the small request waited {took:.2f} s behind the hostile ones"
        for f in refused:
            bad, _ = f.result()
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt", bad.text
            assert "more than the model's context of 8192 tokens" in bad.json()["error"]["message"]


def test_bodies_of_a_million_token_ids_do_not_stall_the_event_loop(server):
    """Eight bodies of 1.3M token ids (2.6 MB each) sent at once are refused naming the prompt, having been weighed
    in the weighing process, never parsed by the server's; /health keeps answering meanwhile. Parsed on the event
    loop, each would hold /health for its whole parse and check (~0.12 s), one after another; on a thread, for one
    C call each time the loop waits for I/O. Both sides speak plain http.client: an httpx client's setup holds
    this process's GIL for tens of ms."""
    body = b'{"max_tokens": 1, "prompt": [' + b",".join([b"0"] * 1_300_000) + b"]}"
    port = int(server.url.rsplit(":", 1)[1])

    def post_raw(_: int) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        try:
            conn.request("POST", "/v1/completions", body, {**AUTH, "content-type": "application/json"})
            response = conn.getresponse()
            return response.status, json.loads(response.read())
        finally:
            conn.close()

    health_latency(port)  # a first connection, before the clock matters
    answers: list[tuple[int, dict]] = []
    with ThreadPoolExecutor(8) as pool:
        delays, _ = probed(lambda: answers.extend(pool.map(post_raw, range(8))), lambda: health_latency(port), 0.02)
    for status, answer in answers:
        assert status == 400 and answer["error"]["param"] == "prompt", answer
        assert "prompt has 1300000 tokens; the model's context is 8192" in answer["error"]["message"]
    assert len(delays) > 4 and max(delays) < 0.35, sorted(delays)[-5:]
