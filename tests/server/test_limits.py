"""The server's limits, each answered in OpenAI's error shape while the rest is served: the API key, the Host
and Origin allow-lists, a POST's Content-Type, the body's size and deadline, the headers' deadline, the bound
on work in flight, draining, and the OpenAPI schema that documents them. On a random model with SmolLM2's
vocabulary (only HTTP matters here)."""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import threading
import time

import httpx
import openai
import pytest
from servers import AUTH, KEY, tiny_server

from nanoserve.server.limits import ServerConfig, host_name
from nanoserve.server.serve import add_arguments, exposure_warning


def is_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.fixture(scope="module")
def tiny(vocab_model, tok):
    config = ServerConfig(api_key=KEY, max_queued_requests=2, max_prompts_per_request=4, max_body_bytes=64 << 10,
                          header_timeout_s=0.5, body_timeout_s=0.5)
    with tiny_server(vocab_model, tok, config, max_num_seqs=2) as (srv, ae, gate):
        yield srv, ae, gate


def ok_completion(url: str) -> None:
    r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_the_api_key_guards_v1_and_leaves_health_and_metrics_open(tiny):
    srv, _, _ = tiny
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    err = is_openai_error(httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi"}), 401)
    assert err["code"] == "invalid_api_key"
    assert httpx.get(srv.url + "/health").status_code == 200
    assert httpx.get(srv.url + "/metrics").status_code == 200
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_a_too_large_n_is_blamed_on_n(tiny):
    srv, _, _ = tiny
    is_openai_error(httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi", "n": 5}, headers=AUTH), 400, "n")
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "n": 5},
                   headers=AUTH)
    is_openai_error(r, 400, "n")
    is_openai_error(httpx.post(srv.url + "/v1/completions", json={"prompt": ["a", "b", "c"], "n": 2},
                               headers=AUTH), 400, "prompt")


def test_fastapis_doc_pages_are_off_unless_asked_for(tiny, vocab_model, tok):
    """/docs and /redoc load unpinned scripts from a CDN: 404 by default, served with --docs (and open, as
    static pages a browser opens without a key)."""
    srv, _, _ = tiny
    for path in ("/docs", "/redoc"):
        is_openai_error(httpx.get(srv.url + path, headers=AUTH), 404)
    with tiny_server(vocab_model, tok, ServerConfig(api_key=KEY, docs=True)) as (docs, _, _):
        for path in ("/docs", "/redoc"):
            r = httpx.get(docs.url + path)
            assert r.status_code == 200 and "openapi.json" in r.text
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    assert not ServerConfig.from_cli(ap.parse_args([])).docs and ServerConfig.from_cli(ap.parse_args(["--docs"])).docs


def test_the_api_key_guards_every_route_but_health_metrics_and_the_schema(tiny):
    """/reset_prefix_cache is an admin route: under --api-key it needs the key like /v1/*, and so does a path
    that does not exist (a client without the key learns nothing of the routes)."""
    srv, _, _ = tiny
    for method, path in (("POST", "/reset_prefix_cache"), ("GET", "/v2/nothing")):
        assert is_openai_error(httpx.request(method, srv.url + path), 401)["code"] == "invalid_api_key"
    r = httpx.post(srv.url + "/reset_prefix_cache", headers=AUTH)  # no body, as vLLM's users send it
    assert r.status_code == 200 and r.json() == {"reset": True}
    assert httpx.get(srv.url + "/openapi.json").status_code == 200  # open: clients read it before they call


@pytest.mark.parametrize("origin, allowed", [("http://localhost:3000", True), ("http://127.0.0.1:8000", True),
                                             ("http://[::1]", True), ("https://evil.example", False),
                                             ("null", False), ("http://localhost.evil.example", False)])
def test_a_request_from_a_web_page_elsewhere_is_a_403(tiny, origin, allowed):
    """A page on evil.example can make the user's browser POST to a loopback server without asking (a simple
    request); the browser names the page in Origin, and only this server's own names are served."""
    srv, _, _ = tiny
    headers = {**AUTH, "origin": origin}
    for r in (httpx.post(srv.url + "/reset_prefix_cache", headers=headers),
              httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers=headers)):
        if allowed:
            assert r.status_code == 200, r.text
        else:
            assert is_openai_error(r, 403)["code"] == "origin_not_allowed"


@pytest.mark.parametrize("kind, content", [("text/plain", '{"prompt": "Hi", "max_tokens": 1}'),
                                           ("application/x-www-form-urlencoded", "prompt=Hi"),
                                           ("multipart/form-data; boundary=x", "--x--"),
                                           (None, '{"prompt": "Hi", "max_tokens": 1}')])
def test_a_post_body_that_is_not_json_is_a_415(tiny, kind, content):
    """text/plain and forms are what a page may send cross-origin without a preflight; OpenAI's clients send
    application/json. A JSON body sent as text/plain used to be served."""
    srv, _, _ = tiny
    headers = AUTH if kind is None else {**AUTH, "content-type": kind}
    for path in ("/v1/completions", "/reset_prefix_cache"):
        r = httpx.post(srv.url + path, content=content.encode(), headers=headers)
        assert is_openai_error(r, 415)["code"] == "unsupported_media_type"
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                   headers={**AUTH, "content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200


def test_serve_warns_when_it_binds_beyond_loopback_without_a_key():
    assert exposure_warning(ServerConfig(host="127.0.0.1")) is None
    assert exposure_warning(ServerConfig(host="::1")) is None
    assert exposure_warning(ServerConfig(host="0.0.0.0", api_key="k")) is None
    line = exposure_warning(ServerConfig(host="0.0.0.0"))
    assert line is not None and "0.0.0.0" in line and "--api-key" in line and "\n" not in line


@pytest.mark.parametrize("body, param", [({"prompt": [[False]]}, "prompt"),
                                         ({"prompt": "Hi", "stream": "yes"}, "stream"),
                                         ({"prompt": "Hi", "max_tokens": 1.0}, "max_tokens"),
                                         ({"prompt": "Hi", "n": True}, "n"),
                                         ({"prompt": "Hi", "stream_options": {"include_usage": 1}}, "stream_options")])
def test_loose_types_are_400s_naming_the_field(tiny, body, param):
    srv, _, _ = tiny
    is_openai_error(httpx.post(srv.url + "/v1/completions", json=body, headers=AUTH), 400, param)
    r = httpx.post(srv.url + "/v1/chat/completions", headers=AUTH,
                   json={"messages": [{"role": "user", "content": "Hi"}], "logprobs": 1})
    is_openai_error(r, 400, "logprobs")


def test_the_largest_seed_with_n_samples_is_served_and_the_connection_goes_on(vocab_model, tok):
    """seed 2**64 - 1 with n 4 seeded its samples past 64 bits: a 500, and a broken keep-alive connection."""
    with tiny_server(vocab_model, tok) as (srv, _, _):
        host, port = srv.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=120)
        headers = {**AUTH, "content-type": "application/json"}
        try:
            for body in ({"prompt": "Hi", "max_tokens": 3, "n": 4, "seed": 2 ** 64 - 1, "temperature": 1},
                         {"prompt": "Hi", "max_tokens": 2}):
                conn.request("POST", "/v1/completions", json.dumps(body), headers)
                r = conn.getresponse()
                got = json.loads(r.read())
                assert r.status == 200, got
                assert len(got["choices"]) == body.get("n", 1)
        finally:
            conn.close()


def test_the_api_key_comes_from_the_flag_or_the_environment(monkeypatch):
    monkeypatch.setenv("NANOSERVE_API_KEY", "from-env")
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    assert ServerConfig.from_cli(ap.parse_args([])).api_key == "from-env"
    assert ServerConfig.from_cli(ap.parse_args(["--api-key", "flag"])).api_key == "flag"
    monkeypatch.delenv("NANOSERVE_API_KEY")
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    args = ap.parse_args(["--weights", "gguf", "--max-queued-requests", "3", "--shutdown-timeout", "2"])
    config = ServerConfig.from_cli(args)
    assert args.weights == "gguf" and config.api_key is None
    assert (config.max_queued_requests, config.shutdown_timeout_s) == (3, 2.0)


@pytest.mark.parametrize("host, allowed", [("127.0.0.1:8000", True), ("localhost", True), ("[::1]:80", True),
                                           ("127.1.2.3", True), ("evil.example", False),
                                           ("attacker.localhost.example:8000", False)])
def test_a_loopback_server_answers_only_its_own_host_names(tiny, host, allowed):
    """DNS rebinding: a page on evil.example that rebinds its name to 127.0.0.1 sends Host: evil.example."""
    srv, _, _ = tiny
    r = httpx.get(srv.url + "/v1/models", headers={**AUTH, "host": host})
    if allowed:
        assert r.status_code == 200
    else:
        assert is_openai_error(r, 400, "host")["code"] == "host_not_allowed"


def test_host_names_lose_their_port():
    assert [host_name(h) for h in ("a:1", "[::1]:8", "B.example", "::1")] == ["a", "[::1]", "b.example", "::1"]


def test_a_body_over_the_limit_is_a_413_whether_announced_or_streamed(tiny):
    srv, _, _ = tiny
    big = json.dumps({"prompt": "x" * (70 << 10)})
    json_auth = {**AUTH, "content-type": "application/json"}
    err = is_openai_error(httpx.post(srv.url + "/v1/completions", content=big, headers=json_auth), 413)
    assert err["code"] == "body_too_large"

    def chunks():  # no Content-Length: the server counts as it reads
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192].encode()

    is_openai_error(httpx.post(srv.url + "/v1/completions", content=chunks(), headers=json_auth), 413)
    ok_completion(srv.url)


def raw(url: str, data: bytes, wait_s: float = 30) -> bytes:
    """Send bytes on a fresh connection and read until the server closes it."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait_s) as s:
        s.sendall(data)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
        return got


def test_a_client_that_never_finishes_its_headers_is_disconnected(tiny):
    srv, _, _ = tiny
    assert raw(srv.url, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ") == b""
    assert raw(srv.url, b"") == b""  # connected, silent
    ok_completion(srv.url)


def test_a_body_that_never_arrives_is_a_408(tiny):
    srv, _, _ = tiny
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n").encode()
    got = raw(srv.url, head + b'{"prompt": ')
    status, body = got.split(b"\r\n", 1)[0], got.split(b"\r\n\r\n", 1)[1]
    assert b" 408 " in status and json.loads(body)["error"]["code"] == "request_timeout"
    ok_completion(srv.url)


def stream_lines(url: str, body: dict, into: list, opened: threading.Event) -> None:
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=AUTH, timeout=120) as r:
        into.append(r.status_code)
        opened.set()
        into.extend(line[6:] for line in r.iter_lines() if line.startswith("data: "))


def test_work_past_the_queue_bound_is_a_503_with_retry_after_and_what_was_admitted_finishes(tiny):
    """max_num_seqs=2 running + max_queued_requests=2 waiting: two requests of n=2 fill it; a third waits its turn
    with a 503, and a request larger than the bound could ever hold is a 400."""
    srv, ae, gate = tiny
    gate.close()
    streams, threads = [], []
    try:
        for _ in range(2):
            lines, opened = [], threading.Event()
            t = threading.Thread(target=stream_lines, args=(srv.url, {"prompt": "Hi", "n": 2, "max_tokens": 4,
                                                                      "stream": True, "seed": 1}, lines, opened))
            t.start()
            assert opened.wait(60)
            streams.append(lines)
            threads.append(t)
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=AUTH)
        is_openai_error(r, 503)
        assert r.headers["retry-after"].isdigit()
        with pytest.raises(openai.APIStatusError) as e:  # the client sees it as a retryable error
            openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0).completions.create(
                model="tiny", prompt="Hi", max_tokens=2)
        assert e.value.status_code == 503
        is_openai_error(httpx.post(srv.url + "/v1/completions", json={"prompt": ["a", "b", "c"], "n": 2},
                                   headers=AUTH), 400, "prompt")
        assert httpx.get(srv.url + "/health").status_code == 200
    finally:
        gate.open()
    for t in threads:
        t.join(60)
    for lines in streams:
        assert lines[0] == 200 and lines[-1] == "[DONE]"
        finishes = [json.loads(x)["choices"][0]["finish_reason"] for x in lines[1:-1]]
        assert finishes.count("length") == 2
    ok_completion(srv.url)


def test_errors_have_openai_shape_for_paths_methods_and_unparsable_bodies(tiny):
    srv, _, _ = tiny
    is_openai_error(httpx.get(srv.url + "/v2/nothing", headers=AUTH), 404)
    r = httpx.get(srv.url + "/v1/completions", headers=AUTH)
    is_openai_error(r, 405)
    assert "POST" in r.headers["allow"]
    for content in (b'{"prompt": "\xff\xfe"}', b"[" * 50_000, b'{"prompt": "hi", "n": NaN}',
                    b'{"prompt": "hi", "temperature": Infinity}', b"", b"null"):
        is_openai_error(httpx.post(srv.url + "/v1/completions", content=content,
                                   headers={**AUTH, "content-type": "application/json"}), 400)


def test_the_openapi_schema_documents_what_the_server_returns(tiny):
    srv, _, _ = tiny
    schema = httpx.get(srv.url + "/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        codes = set(schema["paths"][path]["post"]["responses"])
        assert codes >= {"200", "400", "401", "404", "413", "503"} and "422" not in codes
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    err = schema["components"]["schemas"]["ErrorResponse"]
    assert err["required"] == ["error"]


def test_sampling_left_out_takes_the_checkpoints_defaults(vocab_model, tok):
    """A checkpoint that recommends greedy: a request without temperature is greedy (any seed gives the same
    text); one that names a temperature samples."""
    with tiny_server(vocab_model, tok, defaults={"temperature": 0.0}) as (srv, _, _):
        def text(**fields):
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Once", "max_tokens": 8, **fields},
                           headers=AUTH, timeout=60)
            return r.json()["choices"][0]["text"]

        assert text(seed=1) == text(seed=2) == text(temperature=0)
        assert len({text(temperature=1.0, seed=s) for s in range(4)}) > 1


def test_draining_answers_503_and_ends_what_outlives_the_grace_with_an_error_event(vocab_model, tok):
    """What SIGTERM does (`ServerThread.begin_shutdown`): new requests 503 (not connection refused), /health
    503, and a stream still running when the grace ends gets an error event, then [DONE]."""
    with tiny_server(vocab_model, tok) as (srv, ae, gate):
        gate.close()
        lines, opened = [], threading.Event()
        t = threading.Thread(target=stream_lines, args=(srv.url, {"prompt": "Hi", "max_tokens": 8, "stream": True},
                                                        lines, opened))
        t.start()
        assert opened.wait(60)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
        other = client.completions.create(model="tiny", prompt="Hi", max_tokens=8, stream=True)  # headers in
        srv.begin_shutdown(grace=2.0)
        while not ae.draining:
            time.sleep(0.01)
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi"}, headers=AUTH)
        is_openai_error(r, 503)
        assert r.headers["retry-after"].isdigit()
        is_openai_error(httpx.get(srv.url + "/health"), 503)
        t.join(60)
        assert lines[0] == 200 and lines[-1] == "[DONE]"
        err = json.loads(lines[-2])["error"]
        assert err["type"] == "service_unavailable" and "shut down" in err["message"]
        with pytest.raises(openai.APIError, match="shut down"):  # OpenAI's client raises on the error event
            list(other)
        srv.thread.join(60)
        assert not srv.thread.is_alive() and not ae.is_running


def test_a_request_the_engine_fails_ends_alone_with_an_error(vocab_model, tok, monkeypatch):
    """A row that cannot be sampled (the engine's "error" finish): its stream gets an error event and [DONE], the
    same request unstreamed a 500 in OpenAI's shape, and a request beside them finishes as usual."""
    import nanoserve.engine.model_runner as model_runner
    from nanoserve.sampling import INVALID

    sample = model_runner.sample

    def failing_seed_666(logits, rows, *args, **kwargs):
        picks = sample(logits, rows, *args, **kwargs)
        return [INVALID if r.params.seed == 666 else t for r, t in zip(rows, picks)]

    monkeypatch.setattr(model_runner, "sample", failing_seed_666)
    with tiny_server(vocab_model, tok) as (srv, _, gate):
        gate.close()  # all three in flight together
        lines, opened = [], threading.Event()
        bad = threading.Thread(target=stream_lines, args=(srv.url, {"prompt": "Hi", "max_tokens": 4, "stream": True,
                                                                    "seed": 666}, lines, opened))
        bad.start()
        assert opened.wait(60)
        results = {}
        threads = [threading.Thread(target=lambda k=k, s=s: results.__setitem__(k, httpx.post(
            srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "seed": s}, headers=AUTH, timeout=60)))
            for k, s in (("bad", 666), ("good", 1))]
        for t in threads:
            t.start()
        gate.open()
        for t in (bad, *threads):
            t.join(60)
        assert lines[-1] == "[DONE]" and "could not be sampled" in json.loads(lines[-2])["error"]["message"]
        with pytest.raises(openai.APIError, match="could not be sampled"):
            list(openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0).completions.create(
                model="tiny", prompt="Hi", max_tokens=4, seed=666, stream=True))
        is_openai_error(results["bad"], 500)
        good = results["good"].json()
        assert good["choices"][0]["finish_reason"] == "length" and good["usage"]["completion_tokens"] == 4
