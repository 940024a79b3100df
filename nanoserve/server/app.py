"""The OpenAI-compatible HTTP server: FastAPI routes over the AsyncEngine (Day 38).

    python -m nanoserve serve [--model DIR] [--weights fp32|gguf] [--host 127.0.0.1] [--port 8000] [--api-key K]

    POST /v1/completions        text completion; "stream": true sends server-sent events
    POST /v1/chat/completions   the model's chat template; streamed the same way
    GET  /v1/models             the one model served
    GET  /health                200 while the engine thread runs (503 while draining)
    GET  /metrics               Prometheus text (see `metrics`)
    POST /reset_prefix_cache    forget every cached prefix (vLLM's endpoint): {"reset": false} while requests run

The two generating routes hand their bodies to `serving` (one class per endpoint); this file holds the app:
its middleware, error handlers, lifespan and the small routes. A body of LARGE_BODY bytes or more is weighed in a
child process first (`weigh`) and parsed on a worker thread, so a megabyte of token ids never holds the event loop.

Every prompt of an HTTP request becomes one engine request (its n samples computed from one prefill), and
the engine's one thread batches them with everything else in flight. Every answer other than a 200 is in
OpenAI's error shape: bad input a 400 naming the field (never a 500: each step that could fail on input is
checked first), an unknown model or path a 404, a wrong key a 401, a body too large a 413, a server full or
draining a 503 with Retry-After (`limits`). A request that fails once running (its grammar, logits that could
not be sampled, the shutdown deadline) ends alone: a stream with an error event, then [DONE]. A client that
disconnects aborts its requests, and their blocks return to the pool at the next step.

Decisions, vLLM's unless said: an explicit max_tokens that does not fit after the prompt is a 400 (omitted, it
is what fits, at most 16 for completions); a structured output no string can satisfy (a regex such as
`[^\\s\\S]`) is a 400, found by computing its first mask before the request is queued; sampling fields left
out take the checkpoint's generation_config.json, else OpenAI's defaults.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import typing
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from ..engine.checks import check_prompt_length
from ..sampling import SamplingParams
from ..tokenizer import Tokenizer
from .async_engine import AsyncEngine, EngineDraining
from .limits import Admission, Busy, Guard, ServerConfig
from .protocol import (
    OPENAI_DEFAULTS,
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    error_body,
)
from .serving import ServingChat, ServingCompletion
from .weigh import Weigher

ERRORS = {status: {"model": ErrorResponse, "description": why} for status, why in (
    (400, "bad input (the field is named in error.param), or a Host this server does not answer"),
    (401, "a missing or wrong API key"), (403, "a request from a web page of another origin"),
    (404, "an unknown model"), (408, "the body arrived too slowly"), (413, "the body is too large"),
    (415, "a body that is not application/json"), (503, "the server is full or shutting down (see Retry-After)"))}
PREPARE_THREADS = 4  # requests tokenized and checked at once (the tokenizer lets go of the GIL)
LARGE_BODY = 64 << 10  # bytes: a body this large is weighed in a child process (`weigh`) before it is parsed
OTHER_VALUES = 1 << 17  # JSON values a body may hold outside `prompt` (a 262k-entry logit_bias is refused)
STREAM = {200: {"content": {"application/json": {}, "text/event-stream": {}},
                "description": "the completion, or with stream: true its server-sent events"}}


def invalid_json(why: str) -> RequestValidationError:
    """A body that is not JSON, as FastAPI words it (`on_invalid` turns it into a 400)."""
    return RequestValidationError([{"type": "json_invalid", "loc": ("body",), "msg": "JSON decode error",
                                    "input": {}, "ctx": {"error": why}}])


def parse_body(model: type[BaseModel], raw: bytes) -> BaseModel:
    """`raw` as `model`, errors as FastAPI words them."""
    if not raw:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, or nested past the parser's depth
        raise invalid_json(e.msg if isinstance(e, json.JSONDecodeError) else str(e)) from None
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])}
                                      for err in e.errors(include_url=False)]) from None


def check_weight(weight: dict, max_context: int, max_prompts: int) -> None:
    """Refuse, naming the field, a body heavier than any request can use: one prompt longer than the context, more
    prompts than a request may ask for, or more than OTHER_VALUES values in another field."""
    if "invalid" in weight:
        raise invalid_json(weight["invalid"])
    shape = weight.get("prompt") or [None]
    try:
        if shape[0] == "ids":
            check_prompt_length(shape[1], max_context)
        elif shape[0] == "batch":
            if shape[1] > max_prompts:
                raise BadRequest(f"this request asks for {shape[1]} prompts; at most {max_prompts} per request",
                                 "prompt")
            check_prompt_length(shape[3], max_context)
    except ValueError as e:
        at = f"prompt {shape[2]}: " if shape[0] == "batch" else ""
        raise BadRequest(f"{at}{e}", "prompt") from None
    for field, values in weight["values"].items():
        if field != "prompt" and values > OTHER_VALUES:
            raise BadRequest(f"{field or 'the body'} holds {values} JSON values; at most {OTHER_VALUES} outside "
                             f"the prompt", field or None)


class BodyOffLoop(APIRoute):
    """A POST route whose JSON body (its endpoint's `body` parameter), once large, is weighed in a child process
    (`weigh`) and refused there if no request could use it, else parsed on `pool`, not on the event loop. The
    schema FastAPI documents is unchanged."""

    pool: ThreadPoolExecutor
    screen: Callable[[bytes], Awaitable[None]]

    def get_route_handler(self):
        model, endpoint, pool, screen = typing.get_type_hints(self.endpoint)["body"], self.endpoint, self.pool, \
            self.screen

        async def handler(request: Request) -> Response:
            raw = await request.body()
            if len(raw) < LARGE_BODY:
                body = parse_body(model, raw)
            else:
                await screen(raw)
                body = await asyncio.get_running_loop().run_in_executor(pool, parse_body, model, raw)
            result = await endpoint(body, request)
            return result if isinstance(result, Response) else JSONResponse(result)

        return handler


def build_app(async_engine: AsyncEngine, tokenizer: Tokenizer, model_name: str, config: ServerConfig | None = None,
              defaults: dict[str, Any] | None = None):
    """The FastAPI app serving `async_engine` under the name `model_name`, within `config`'s limits. Sampling
    fields a request omits take `defaults` (a checkpoint's `generation_defaults`). Starts the engine thread on
    startup; `app.state.drain(grace)` refuses new work and lets what is in flight finish (`ServerThread`)."""
    config = config or ServerConfig()
    engine = async_engine.engine
    max_context = engine.model.cfg.max_position_embeddings
    defaults = dict(defaults or {})
    SamplingParams(**{k: v for k, v in defaults.items() if k in OPENAI_DEFAULTS})  # bad defaults fail at startup
    admission = Admission(engine.config.scheduler.max_num_seqs + config.max_queued_requests,
                          config.max_prompts_per_request)
    # tokenize + check off the loop; several, so a request with long prompts does not hold up the others
    prepare_pool = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="nanoserve-prepare")
    parse_pool = ThreadPoolExecutor(1, thread_name_prefix="nanoserve-parse")  # large bodies, once weighed
    weigher = Weigher()

    async def screen(raw: bytes) -> None:
        try:
            weight = await weigher.weigh(raw)
        except (OSError, ValueError) as e:
            raise BadRequest(f"the body could not be weighed before parsing: {e}") from None
        check_weight(weight, max_context, config.max_prompts_per_request)
    created = int(time.time())

    async def drain(grace: float | None = None) -> None:
        """Refuse new requests (503) while those in flight finish; after `grace` seconds end them with an error."""
        async_engine.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (config.shutdown_timeout_s if grace is None else grace)
        while (admission.held or async_engine.busy) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if admission.held or async_engine.busy:
            async_engine.fail_all("the server shut down before this request finished (--shutdown-timeout)")
            end = loop.time() + 5
            while admission.held and loop.time() < end:  # let each handler write its error event
                await asyncio.sleep(0.02)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        app.state.loop = asyncio.get_running_loop()
        await weigher.start()
        async_engine.start()
        yield
        await drain()
        async_engine.stop()
        prepare_pool.shutdown(wait=False, cancel_futures=True)
        parse_pool.shutdown(wait=False, cancel_futures=True)
        await weigher.aclose()

    app = FastAPI(title="nanoserve", lifespan=lifespan, docs_url="/docs" if config.docs else None,
                  redoc_url="/redoc" if config.docs else None)  # their pages load scripts from a CDN: --docs
    app.state.server_config, app.state.drain, app.state.loop = config, drain, None
    app.add_middleware(Guard, config=config, draining=lambda: async_engine.draining)

    def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
              code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(error_body(message, kind, param, code), status_code=status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        cause = (first.get("ctx") or {}).get("error")
        if isinstance(cause, BadRequest):  # raised inside a validator (`protocol.check_json`)
            return error(cause.status, str(cause), param=cause.param)
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            return error(400, f"the body is not valid JSON: {(first.get('ctx') or {}).get('error', first.get('msg'))}")
        where = ".".join(loc) or "body"
        return error(400, f"{where}: {first.get('msg', 'invalid')}", param=loc[0] if loc else None)

    @app.exception_handler(BadRequest)
    async def on_bad(request: Request, exc: BadRequest) -> JSONResponse:
        return error(exc.status, str(exc), param=exc.param, code="model_not_found" if exc.status == 404 else None)

    @app.exception_handler(Busy)
    async def on_busy(request: Request, exc: Busy) -> JSONResponse:
        return error(503, str(exc), "service_unavailable", headers={"retry-after": str(config.retry_after_s)})

    @app.exception_handler(EngineDraining)
    async def on_draining(request: Request, exc: EngineDraining) -> JSONResponse:
        return error(503, str(exc), "service_unavailable",
                     headers={"retry-after": str(config.retry_after_s), "connection": "close"})

    @app.exception_handler(HTTPException)
    async def on_http(request: Request, exc: HTTPException) -> JSONResponse:  # 404, 405, an unparsable body
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"{request.method} {request.url.path}: no such route"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        return error(exc.status_code, message, "invalid_request_error" if exc.status_code < 500 else "server_error",
                     headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def on_bug(request: Request, exc: Exception) -> JSONResponse:
        return error(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

    def openapi() -> dict:
        """FastAPI's schema less the 422 it documents for every body: this server answers bad bodies with 400."""
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for ops in schema.get("paths", {}).values():
                for op in ops.values():
                    op.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi

    @app.get("/health", responses={503: ERRORS[503]})
    async def health() -> Any:
        if async_engine.draining:
            return error(503, "the server is shutting down", "service_unavailable")
        if not async_engine.is_running:
            return error(503, "the engine thread is not running", "service_unavailable")
        return PlainTextResponse("ok")

    @app.get("/v1/models", responses={k: ERRORS[k] for k in (400, 401)})
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "nanoserve", "max_model_len": max_context}]}

    @app.post("/reset_prefix_cache", responses={503: ERRORS[503]})
    async def reset_prefix_cache() -> Any:
        if not async_engine.is_running:
            return error(503, "the engine thread is not running", "service_unavailable")
        return {"reset": await async_engine.reset_prefix_cache()}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        text = async_engine.metrics.render(async_engine.snapshot, model_name)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    shared = (async_engine, tokenizer, model_name, config, defaults, admission, prepare_pool)
    completion, chat = ServingCompletion(*shared), ServingChat(*shared)

    route = type("Route", (BodyOffLoop,), {"pool": parse_pool, "screen": staticmethod(screen)})

    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await completion.create(body, request)

    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        return await chat.create(body, request)

    for path, endpoint in (("/v1/completions", completions), ("/v1/chat/completions", chat_completions)):
        app.router.add_api_route(path, endpoint, methods=["POST"], responses={**STREAM, **ERRORS},
                                 route_class_override=route)

    return app
