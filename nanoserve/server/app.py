"""The OpenAI-compatible HTTP server: FastAPI routes over the AsyncEngine (Day 38).

    python -m nanoserve serve [--model DIR] [--host 127.0.0.1] [--port 8000]

    POST /v1/completions        text completion; "stream": true sends server-sent events
    POST /v1/chat/completions   the model's chat template; streamed the same way
    GET  /v1/models             the one model served
    GET  /health                200 while the engine thread runs
    GET  /metrics               Prometheus text (see `metrics`)

Every prompt of an HTTP request becomes one engine request (its n samples computed from one prefill), and
the engine's one thread batches them with everything else in flight. Bad input is a 400 in OpenAI's
error shape naming the field; an unknown model a 404; a server draining for shutdown a 503. A client
that disconnects aborts its requests, and their blocks return to the pool at the next step.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from ..config import EngineConfig
from ..engine import LLMEngine, StepOutput
from ..tokenizer import Tokenizer
from .async_engine import AsyncEngine, EngineDraining
from .protocol import BadRequest, ChatCompletionRequest, CompletionRequest, error_body

DISCONNECT_POLL_S = 0.25


def build_app(async_engine: AsyncEngine, tokenizer: Tokenizer, model_name: str):
    """The FastAPI app serving `async_engine` under the name `model_name`. Starts the engine thread on startup
    and drains it on shutdown."""
    max_context = async_engine.engine.model.cfg.max_position_embeddings
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        async_engine.start()
        yield
        await async_engine.drain(timeout=30)
        async_engine.stop()

    app = FastAPI(title="nanoserve", lifespan=lifespan)

    def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
              code: str | None = None) -> JSONResponse:
        return JSONResponse(error_body(message, kind, param, code), status_code=status)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            return error(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}")
        where = ".".join(loc) or "body"
        return error(400, f"{where}: {first.get('msg', 'invalid')}", param=where)

    @app.exception_handler(BadRequest)
    async def on_bad(request: Request, exc: BadRequest) -> JSONResponse:
        return error(400, str(exc), param=exc.param)

    @app.exception_handler(EngineDraining)
    async def on_draining(request: Request, exc: EngineDraining) -> JSONResponse:
        return error(503, str(exc), kind="service_unavailable")

    @app.get("/health")
    async def health() -> Any:
        if not async_engine.is_running:
            return error(503, "the engine thread is not running", kind="service_unavailable")
        return PlainTextResponse("ok")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "nanoserve", "max_model_len": max_context}]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        text = async_engine.metrics.render(async_engine.snapshot, model_name)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    def check_model(name: str | None) -> JSONResponse | None:
        if name is not None and name != model_name:
            return error(404, f"the model {name!r} does not exist; this server serves {model_name!r}",
                         param="model", code="model_not_found")
        return None

    def jobs_for(body, prompts: Sequence[Sequence[int]], wanted: int | None) -> list[tuple[list[int], Any]]:
        """One (prompt ids, params) per prompt (its n samples one engine request), each checked before any is
        queued. Choice p * n + i is prompt p's sample i."""
        body.refuse_unsupported()
        jobs = []
        for p, ids in enumerate(prompts):
            max_tokens = wanted if wanted is not None else max(1, max_context - len(ids))
            params = body.sampling_params(max_tokens)
            try:
                async_engine.check(ids, params)
            except EngineDraining:
                raise
            except ValueError as e:
                where = f"prompt {p}: " if len(prompts) > 1 else ""
                raise BadRequest(f"{where}{e}", "prompt" if "prompt" in str(e) or "token" in str(e)
                                 else None) from None
            jobs.append((list(ids), params))
        return jobs

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        if (resp := check_model(body.model)) is not None:
            return resp
        prompts = [tokenizer.encode(p) if isinstance(p, str) else p for p in body.prompts()]
        for i, ids in enumerate(prompts):
            if not ids:
                raise BadRequest(f"prompt {i} encodes to no tokens", "prompt")
            if any(t < 0 or t >= tokenizer.vocab_size for t in ids):
                raise BadRequest(f"prompt {i} holds token ids outside the vocabulary [0, {tokenizer.vocab_size})",
                                 "prompt")
        jobs = jobs_for(body, prompts, body.max_tokens if body.max_tokens is not None else 16)
        rid = f"cmpl-{uuid.uuid4().hex[:24]}"
        head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name}

        def choice(index: int, text: str, finish: str | None, ids: list[int] | None = None) -> dict:
            c = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
            if body.return_token_ids and ids is not None:
                c["token_ids"] = ids
            return c

        if body.stream:
            async def events() -> AsyncIterator[str]:
                usage = [0, 0]
                async for index, d in merged(async_engine, jobs, rid):
                    if d.new_text or d.new_token_ids or d.finished:
                        yield sse({**head, "choices": [choice(index, d.new_text, d.finish_reason, d.new_token_ids)]})
                    if d.finished:
                        usage[0] += d.num_prompt_tokens if d.index == 0 else 0
                        usage[1] += d.num_output_tokens
                if body.include_usage:
                    yield sse({**head, "choices": [], "usage": usage_of(*usage)})
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        results = await collect(async_engine, jobs, rid, request)
        if results is None:
            return error(499, "client closed the request")
        return {**head, "choices": [choice(i, r["text"], r["finish"], r["ids"]) for i, r in enumerate(results)],
                "usage": usage_of(sum(len(ids) for ids, _ in jobs), sum(r["output"] for r in results))}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        if (resp := check_model(body.model)) is not None:
            return resp
        try:
            ids = tokenizer.encode_chat(body.conversation())
        except BadRequest:
            raise
        except Exception as e:  # the template refuses the conversation (roles out of order, ...)
            raise BadRequest(f"the chat template refused these messages: {e}", "messages") from None
        jobs = jobs_for(body, [ids], body.wanted_tokens)
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        head = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model_name}

        if body.stream:
            async def events() -> AsyncIterator[str]:
                for i in range(body.n):
                    yield sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                    "logprobs": None, "finish_reason": None}]})
                out_tokens = 0
                async for index, d in merged(async_engine, jobs, rid):
                    if d.new_text:
                        c = {"index": index, "delta": {"content": d.new_text}, "logprobs": None, "finish_reason": None}
                        if body.return_token_ids:
                            c["token_ids"] = d.new_token_ids
                        yield sse({**head, "choices": [c]})
                    if d.finished:
                        out_tokens += d.num_output_tokens
                        yield sse({**head, "choices": [{"index": index, "delta": {}, "logprobs": None,
                                                        "finish_reason": d.finish_reason}]})
                if body.include_usage:
                    yield sse({**head, "choices": [], "usage": usage_of(len(ids), out_tokens)})
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        results = await collect(async_engine, jobs, rid, request)
        if results is None:
            return error(499, "client closed the request")
        choices = []
        for i, r in enumerate(results):
            c = {"index": i, "message": {"role": "assistant", "content": r["text"]}, "logprobs": None,
                 "finish_reason": r["finish"]}
            if body.return_token_ids:
                c["token_ids"] = r["ids"]
            choices.append(c)
        return {**head, "object": "chat.completion", "choices": choices,
                "usage": usage_of(len(ids), sum(r["output"] for r in results))}

    return app


def sse(obj: dict) -> str:
    """One server-sent event carrying a JSON chunk."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def usage_of(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finish_reason(reason: str | None) -> str | None:
    """The engine's reasons in OpenAI's words: eos and stop strings are "stop", the token limit is "length"."""
    return None if reason is None else ("length" if reason == "length" else "stop")


async def merged(async_engine: AsyncEngine, jobs: Sequence[tuple[list[int], Any]],
                 rid: str) -> AsyncIterator[tuple[int, StepOutput]]:
    """Every job's StepOutputs as they come, tagged with their choice index (job * n + sample). Leaving early
    aborts whatever is unfinished."""
    if len(jobs) == 1:
        stream = async_engine.generate(jobs[0][0], jobs[0][1], f"{rid}-0")
        try:
            async for d in stream:
                d.finish_reason = finish_reason(d.finish_reason)
                yield d.index, d
        finally:
            await stream.aclose()
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, ids: list[int], params) -> None:
        try:
            async for d in async_engine.generate(ids, params, f"{rid}-{i}"):
                await q.put((i * params.n + d.index, d))
        except Exception as e:
            await q.put((i, e))

    tasks = [asyncio.create_task(pump(i, ids, p)) for i, (ids, p) in enumerate(jobs)]
    try:
        done, total = 0, sum(p.n for _, p in jobs)
        while done < total:
            i, d = await q.get()
            if isinstance(d, BaseException):
                raise d
            if d.finished:
                done += 1
            d.finish_reason = finish_reason(d.finish_reason)
            yield i, d
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(async_engine: AsyncEngine, jobs: Sequence[tuple[list[int], Any]], rid: str,
                  request) -> list[dict] | None:
    """Run every job to its end; None if the client disconnected first (its requests are then aborted)."""
    results = [{"text": "", "ids": [], "finish": None, "output": 0} for _, p in jobs for _ in range(p.n)]

    async def run() -> None:
        async for i, d in merged(async_engine, jobs, rid):
            results[i]["text"] += d.new_text
            results[i]["ids"] += d.new_token_ids
            if d.finished:
                results[i]["finish"] = d.finish_reason
                results[i]["output"] = d.num_output_tokens

    task = asyncio.create_task(run())
    while not task.done():
        await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return None
    task.result()
    return results


# ---- the command ---------------------------------------------------------------------------------------


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", help="HF Llama checkpoint folder (default: the fetched SmolLM2)")
    ap.add_argument("--served-model-name", help="the name clients use (default: the folder's name)")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    ap.add_argument("--port", type=int, default=8000)
    EngineConfig.add_cli_arguments(ap)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    ap.add_argument("--log-level", default="warning")


def make_engine(model, tok: Tokenizer, args: argparse.Namespace) -> LLMEngine:
    """The engine `serve` steps, configured from its command line (`EngineConfig.from_cli`)."""
    return LLMEngine(model, tok, EngineConfig.from_cli(args))


def run(args: argparse.Namespace) -> int:
    """Load the model, build the app, serve until interrupted: uvicorn answers HTTP in a thread while this
    (the main) thread steps the engine (`AsyncEngine` says why). SIGINT or SIGTERM drains, then exits."""
    import signal

    import torch

    from ..loader import load
    from ..model.fetch import default_model_dir

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load(args.model)
    name = args.served_model_name or (str(args.model).rstrip("/").split("/")[-1] if args.model
                                      else default_model_dir().name)
    engine = make_engine(model, tok, args)
    async_engine = AsyncEngine(engine, own_thread=False)
    server = ServerThread(build_app(async_engine, tok, name), args.host, args.port, args.log_level)

    def on_signal(signum, frame) -> None:  # as uvicorn's own handler: a second signal stops without draining
        if server.server.should_exit:
            server.server.force_exit = True
        server.server.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    server.thread.start()
    print(f"nanoserve: serving {name} on http://{args.host}:{args.port}/v1 ({engine.manager.num_blocks} KV blocks)",
          flush=True)
    async_engine.run(keep_going=server.thread.is_alive)  # until the app's shutdown stops it, or uvicorn exits
    server.thread.join()
    return 0 if server.server.started else 1


class ServerThread:
    """A server on loopback in a background thread of this process, for notebooks and tests:

        with ServerThread(build_app(...)) as srv:
            openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int | None = None, log_level: str = "warning"):
        import socket
        import threading

        import uvicorn

        if port is None:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        self.url = f"http://{host}:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level))
        self.thread = threading.Thread(target=self.server.run, name="nanoserve-http", daemon=True)

    def start(self, timeout: float = 60) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 60) -> None:
        """Shut down as uvicorn does on a signal: stop accepting, drain, stop the engine thread."""
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
