"""`python -m nanoserve serve` as a user starts it: a process whose main thread steps the engine while uvicorn
answers HTTP from another. It serves, and on SIGTERM it finishes the stream in flight, refuses new work and exits 0."""

import json
import signal
import threading

import httpx

from nanoserve.bench.arrivals import free_port, start_server


def test_serve_answers_then_drains_on_sigterm_and_exits_cleanly(model_dir):
    port = free_port()
    proc = start_server(port, ["--model", str(model_dir), "--kv-cache-gib", "0.1"])
    url = f"http://127.0.0.1:{port}"
    try:
        body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
        whole = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        assert whole["usage"]["completion_tokens"] == 8

        events, first = [], threading.Event()
        body = {"prompt": [1, 2, 3, 4], "max_tokens": 48, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if not first.is_set():
                        first.set()
                        proc.send_signal(signal.SIGTERM)  # mid-stream: the stream must still end whole
        assert events[-1] == "[DONE]"
        texts = [json.loads(e) for e in events[:-1]]
        assert [c["choices"][0]["finish_reason"] for c in texts][-1] == "length"
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
