"""`python -m nanoserve serve` as a user starts it: a process whose main thread steps the engine while uvicorn
answers HTTP from another. It serves; on SIGTERM it answers new requests 503 (not a refused connection), lets the
streams in flight finish within --shutdown-timeout, ends those that outlive it with an error event, and exits 0;
a second signal stops it at once with 128 + the signal's number and no traceback."""

import json
import signal
import subprocess
import sys
import threading
import time

import httpx

from nanoserve.bench.arrivals import free_port, start_server


def read_stream(url: str, body: dict, events: list, first: threading.Event) -> None:
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                first.set()


def test_serve_answers_then_drains_on_sigterm_and_exits_cleanly(model_dir):
    port = free_port()
    # a grace no machine could outrun: the stream in flight must end whole, however loaded the cores are
    proc = start_server(port, ["--model", str(model_dir), "--kv-cache-gib", "0.1", "--threads", "1",
                               "--shutdown-timeout", "600"])
    url = f"http://127.0.0.1:{port}"
    try:
        body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
        whole = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        assert whole["usage"]["completion_tokens"] == 8

        events, first = [], threading.Event()
        body = {"prompt": [1, 2, 3, 4], "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if not first.is_set():
                        first.set()
                        proc.send_signal(signal.SIGTERM)  # mid-stream: the stream must still end whole
        assert events[-1] == "[DONE]"
        texts = [json.loads(e) for e in events[:-1]]
        assert [c["choices"][0]["finish_reason"] for c in texts][-1] == "length"
        assert len(texts) == 24 and proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_answers_503_and_ends_a_stream_that_outlives_the_grace_on_the_gguf_weights(model_dir):
    """`--weights gguf` serves the GGUF's blocks; a 2000-token stream cannot finish in a 3 s grace."""
    port = free_port()
    proc = start_server(port, ["--model", str(model_dir), "--weights", "gguf", "--kv-cache-gib", "0.1",
                               "--threads", "1", "--shutdown-timeout", "3"])
    url = f"http://127.0.0.1:{port}"
    try:
        events, first = [], threading.Event()
        body = {"prompt": [1, 2, 3, 4], "max_tokens": 2000, "temperature": 0, "ignore_eos": True, "stream": True}
        reader = threading.Thread(target=read_stream, args=(url, body, events, first))
        reader.start()
        assert first.wait(120)
        proc.send_signal(signal.SIGTERM)
        refused = None
        while refused is None and reader.is_alive():  # a new request while draining: 503, not a refused connection
            r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=60)
            if r.status_code == 503:
                refused = r
        assert refused is not None and refused.headers["retry-after"].isdigit()
        assert refused.json()["error"]["type"] == "service_unavailable"
        assert httpx.get(url + "/health", timeout=60).status_code == 503
        reader.join(120)
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert "shut down" in err["message"] and set(err) == {"message", "type", "param", "code"}
        assert all("error" not in json.loads(e) for e in events[:-2])
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_second_sigterm_stops_at_once_exits_143_and_prints_no_traceback(model_dir, tmp_path):
    """The first SIGTERM drains (a 2000-token stream would hold it for minutes); the second is a forced stop: it
    used to exit 0, as if all had finished, after uvicorn's traceback of the lifespan it cancelled."""
    port = free_port()
    log = open(tmp_path / "stderr.txt", "w+")  # start_server keeps its stderr to itself: this test reads it
    proc = subprocess.Popen([sys.executable, "-m", "nanoserve", "serve", "--port", str(port), "--model",
                             str(model_dir), "--kv-cache-gib", "0.1", "--threads", "1", "--shutdown-timeout", "600"],
                            stdout=subprocess.DEVNULL, stderr=log, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while not up(url) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.25)
        events, first = [], threading.Event()
        body = {"prompt": [1, 2, 3, 4], "max_tokens": 2000, "temperature": 0, "ignore_eos": True, "stream": True}
        reader = threading.Thread(target=read_stream, args=(url, body, events, first), daemon=True)
        reader.start()
        assert first.wait(120)
        proc.send_signal(signal.SIGTERM)
        while httpx.get(url + "/health", timeout=60).status_code == 200:  # draining
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        log.seek(0)
        err = log.read()
        assert "Traceback" not in err and "warning" not in err, err  # loopback: no warning either
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_serve_takes_a_model_by_name(gemma_dir):
    """`serve --model gemma3-270m`: the second family by its name, served under its folder's name, its greedy text
    the same as `LLM`'s on the same model."""
    from nanoserve import LLM, SamplingParams

    port = free_port()
    proc = start_server(port, ["--model", "gemma3-270m", "--kv-cache-gib", "0.1", "--threads", "1"])
    url = f"http://127.0.0.1:{port}"
    try:
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == [gemma_dir.name]
        body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "return_token_ids": True}
        served = httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    out = LLM("gemma3-270m").generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8),
                                      use_tqdm=False)[0].outputs[0]
    assert served["token_ids"] == out.token_ids and served["text"] == out.text
