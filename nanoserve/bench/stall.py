"""`python -m nanoserve bench stall`: how long everything else waits while the engine computes.

Two probes, each through the same loads (nothing, one long prompt's prefill, `--batch-sizes` requests decoding):
in this process a thread that sleeps 5 ms at a time records how late each wake-up is while the engine steps; against
a `serve` subprocess a client asks /health every 20 ms, each on a new connection as a liveness probe does. A step
that held Python's GIL would hold both for its whole length; the idle rows are the same run's baseline. The server
also takes four bodies of 1.3M token ids at once (2.6 MB each, refused once parsed): parsing them on the event
loop would hold /health for each in turn.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from .. import loader
from ..engine import LLMEngine
from .clients import free_port, start_server
from .command import common_arguments, csv_header, engine_argv, engine_config, report, start
from .csvio import write_csv
from .harness import greedy, prose

TIMER_S = 0.005
PROBE_EVERY_S = 0.02
HOSTILE_IDS, HOSTILE_BODIES = 1_300_000, 4


def probed(work: Callable[[], object], probe: Callable[[], float], every_s: float) -> tuple[list[float], float]:
    """Run `work` while a thread calls `probe` (a delay in s) every `every_s`: the delays, and the work's seconds."""
    delays: list[float] = []
    done = threading.Event()

    def loop() -> None:
        while not done.is_set():
            delays.append(probe())
            done.wait(every_s)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    t0 = time.perf_counter()
    work()
    elapsed = time.perf_counter() - t0
    done.set()
    thread.join()
    return delays, elapsed


def timer_lateness(period_s: float = TIMER_S) -> float:
    """How much later than asked a `period_s` sleep wakes up."""
    t0 = time.perf_counter()
    time.sleep(period_s)
    return max(0.0, time.perf_counter() - t0 - period_s)


def health_latency(port: int, timeout_s: float = 30.0) -> float:
    """One GET /health on a new connection, request to answer (s)."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("GET", "/health")
        conn.getresponse().read()
    finally:
        conn.close()
    return time.perf_counter() - t0


def post_body(port: int, body: bytes | str, expect: int = 200) -> None:
    """POST `body` to /v1/completions; anything but the `expect`ed status is an error."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
        response = conn.getresponse()
        answer = response.read()
        if response.status != expect:
            raise RuntimeError(f"serve answered {response.status}: {answer[:300]!r}")
    finally:
        conn.close()


def post_completion(port: int, prompt: list[int], max_tokens: int) -> None:
    post_body(port, json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}))


def row(probe: str, load: str, delays: Sequence[float], work_s: float) -> dict:
    ordered = sorted(delays)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else float("nan")
    return dict(probe=probe, load=load, probes=len(delays), work_s=work_s,
                p50_ms=statistics.median(ordered) * 1e3 if ordered else float("nan"), p99_ms=p99 * 1e3,
                max_ms=ordered[-1] * 1e3 if ordered else float("nan"))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    common_arguments(ap, "data/bench-stall.csv", engine=True, weights="gguf", prompt_tokens=4000,
                     batch_sizes=[32], steps=32)
    ap.add_argument("--decode-prompt-tokens", type=int, default=128, help="each decoding request's prompt")


def run(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    model, tok = start(args)
    long_prompt = prose(tok, args.prompt_tokens)
    short = [prose(tok, args.decode_prompt_tokens, offset=7 * i) for i in range(max(args.batch_sizes))]
    config = engine_config(args)
    rows = []

    def prefill() -> None:
        engine = LLMEngine(model, tok, config)
        engine.add_request(long_prompt, greedy(1))
        while engine.has_unfinished_requests():
            engine.step()

    def decode(batch: int) -> Callable[[], None]:
        engine = LLMEngine(model, tok, config)
        for prompt in short[:batch]:
            engine.add_request(prompt, greedy(args.steps + 1))
        while engine.scheduler.waiting or any(r.num_tokens_to_compute > 1 for r in engine.scheduler.running):
            engine.step()  # every prompt prefilled: what is timed below is decode steps alone

        def steps() -> None:
            for _ in range(args.steps):
                engine.step()
        return steps

    prefill()  # warm up: kernels, first allocations
    loads: list[tuple[str, Callable[[], Callable[[], object]]]] = [
        ("idle", lambda: lambda: time.sleep(1.0)), (f"prefill {args.prompt_tokens}", lambda: prefill)]
    loads += [(f"decode B={b}", lambda b=b: decode(b)) for b in args.batch_sizes]
    for name, make in loads:
        work = make()
        delays, work_s = probed(work, timer_lateness, 0.0)
        rows.append(row("timer 5 ms", name, delays, work_s))

    port = free_port()
    proc = start_server(port, loader.cli_argv(args) + engine_argv(args) + (
        ["--threads", str(args.threads)] if args.threads else []))
    try:
        post_completion(port, long_prompt[:256], 2)  # warm up
        with ThreadPoolExecutor(max(args.batch_sizes)) as pool:
            served: list[tuple[str, Callable[[], object]]] = [
                ("idle", lambda: time.sleep(1.0)),
                (f"prefill {args.prompt_tokens}", lambda: post_completion(port, long_prompt, 1))]
            served += [(f"decode B={b}", lambda b=b: list(pool.map(
                lambda p: post_completion(port, p, args.steps), short[:b]))) for b in args.batch_sizes]
            hostile = b'{"max_tokens": 1, "prompt": [' + b",".join([b"0"] * HOSTILE_IDS) + b"]}"
            served.append((f"{HOSTILE_BODIES} bodies of {HOSTILE_IDS:,} ids", lambda: list(pool.map(
                lambda _: post_body(port, hostile, 400), range(HOSTILE_BODIES)))))
            for name, work in served:
                delays, work_s = probed(work, lambda: health_latency(port), PROBE_EVERY_S)
                rows.append(row("GET /health", name, delays, work_s))
    finally:
        proc.terminate()
        proc.wait(60)
    meta = csv_header(argv, weights=args.weights, activations=args.activations, prompt_tokens=args.prompt_tokens,
                      decode_prompt_tokens=args.decode_prompt_tokens, steps=args.steps,
                      max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
                      note="decode rows: the requests' prompts prefilled first (in-process); served, they are sent "
                           "together, so the first steps hold their prefill")
    write_csv(args.out, rows, meta)
    return report(args.out, meta, rows)
