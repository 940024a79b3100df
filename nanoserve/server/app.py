"""The OpenAI-compatible HTTP server: FastAPI routes over the AsyncEngine (Day 38).

    python -m nanoserve serve [--model DIR] [--weights fp32|gguf] [--host 127.0.0.1] [--port 8000] [--api-key K]

    POST /v1/completions        text completion; "stream": true sends server-sent events
    POST /v1/chat/completions   the model's chat template; streamed the same way
    GET  /v1/models             the one model served
    GET  /health                200 while the engine thread runs (503 while draining)
    GET  /metrics               Prometheus text (see `metrics`)
    POST /reset_prefix_cache    forget every cached prefix (vLLM's endpoint): {"reset": false} while requests run

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
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException

from ..kv.blocks import RequestTooLarge
from ..sampling import SamplingParams
from ..structured import GrammarError, StructuredOutputsParams
from ..tokenizer import Tokenizer
from .async_engine import AsyncEngine, EngineDraining, EngineStopped
from .limits import Admission, Busy, Guard, ServerConfig
from .protocol import (
    OPENAI_DEFAULTS,
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    error_body,
    field_of,
)
from .responses import TokenText, chat_logprobs, completion_logprobs, joined, sse, usage_of
from .streams import RequestFailed, Streamed, collect, merged

ERRORS = {status: {"model": ErrorResponse, "description": why} for status, why in (
    (400, "bad input (the field is named in error.param), or a Host this server does not answer"),
    (401, "a missing or wrong API key"), (404, "an unknown model"), (408, "the body arrived too slowly"),
    (413, "the body is too large"), (503, "the server is full or shutting down (see Retry-After)"))}
STREAM = {200: {"content": {"application/json": {}, "text/event-stream": {}},
                "description": "the completion, or with stream: true its server-sent events"}}


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
    token_text = TokenText(tokenizer)
    # no token is longer than this many characters, so a longer text cannot fit the context: refused untokenized
    max_chars = max_context * max(len(tokenizer.decode([i])) for i in range(tokenizer.vocab_size))
    admission = Admission(engine.config.scheduler.max_num_seqs + config.max_queued_requests,
                          config.max_prompts_per_request)
    prepare_pool = ThreadPoolExecutor(1, thread_name_prefix="nanoserve-prepare")  # tokenize + check, off the loop
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
        async_engine.start()
        yield
        await drain()
        async_engine.stop()
        prepare_pool.shutdown(wait=False, cancel_futures=True)

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

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise BadRequest(f"the model {name!r} does not exist; this server serves {model_name!r}", "model", 404)

    def plan(prompts: Sequence[str | list[int]], body, where: str, wanted: int | None, default_max: int | None,
             structured: tuple[StructuredOutputsParams, str] | None, prompt_logprobs: int | None,
             special: bool = True, wanted_field: str = "max_tokens") -> list[tuple[list[int], SamplingParams]]:
        """One (prompt ids, params) per prompt, each checked before any is queued (in the prepare thread:
        tokenizing and compiling a grammar take time the event loop must not lose). `wanted`: the request's
        max_tokens (None: what fits, at most `default_max`); `special`: add the tokenizer's BOS (a rendered chat
        template has its own)."""
        so, field = structured if structured is not None else (None, None)
        many = len(prompts) > 1
        jobs = []
        for p, prompt in enumerate(prompts):
            at = f"prompt {p}: " if many else ""
            if isinstance(prompt, str):
                if len(prompt) > max_chars:
                    raise BadRequest(f"{at}{where} has {len(prompt)} characters, more than the model's context of "
                                     f"{max_context} tokens can hold", where)
                ids = tokenizer.encode(prompt, add_special_tokens=special)
                if not ids:
                    raise BadRequest(f"{at}{where} encodes to no tokens", where)
            else:
                ids = list(prompt)
            if any(t < 0 or t >= tokenizer.vocab_size for t in ids):
                raise BadRequest(f"{at}{where} holds token ids outside the vocabulary [0, {tokenizer.vocab_size})",
                                 where)
            room = max_context - len(ids)
            if room < 1:
                raise BadRequest(f"{at}{where} has {len(ids)} tokens; the model's context is {max_context}, leaving "
                                 f"no room to generate", where)
            if wanted is not None and wanted > room:
                raise BadRequest(f"{at}this model's context is {max_context} tokens: {len(ids)} in the {where} and "
                                 f"{wanted} asked for in {wanted_field} do not fit; ask for at most {room}",
                                 wanted_field)
            max_tokens = max(1, wanted if wanted is not None else min(room, default_max or room))
            params = body.sampling_params(max_tokens, defaults, so, prompt_logprobs)
            try:
                engine.check_request(ids, params, field or "structured_outputs")
            except GrammarError as e:
                raise BadRequest(f"{field}: {str(e).split(': ', 1)[-1]}", field) from None
            except RequestTooLarge as e:
                raise BadRequest(f"{at}{e}", wanted_field if wanted is not None else where) from None
            except ValueError as e:
                param = field_of(str(e)) or (where if str(e).startswith("prompt") else None)
                raise BadRequest(f"{at}{str(e).replace('SamplingParams.', '')}", param) from None
            jobs.append((ids, params))
        return jobs

    async def prepared(*args) -> list[tuple[list[int], SamplingParams]]:
        jobs = await asyncio.get_running_loop().run_in_executor(prepare_pool, plan, *args)
        if async_engine.draining:
            raise EngineDraining("the server is shutting down and takes no new requests")
        return jobs

    def failure(e: BaseException, field: str | None) -> tuple[int, dict]:
        """A request that failed once running, as (status, OpenAI error body)."""
        if isinstance(e, RequestFailed) and field is not None:
            return 400, error_body(str(e), "invalid_request_error", field)
        if isinstance(e, (EngineStopped, EngineDraining)):
            return 503, error_body(str(e), "service_unavailable")
        return 500, error_body(f"{type(e).__name__}: {e}" if not isinstance(e, RequestFailed) else str(e),
                               "server_error")

    @app.post("/v1/completions", responses={**STREAM, **ERRORS})
    async def completions(body: CompletionRequest, request: Request) -> Any:
        check_model(body.model)
        body.refuse_unsupported()
        prompts = body.prompts()
        structured = body.structured()
        k, n, echo = body.logprobs, body.n, body.echo
        release = admission.take(len(prompts), n)
        try:
            jobs = await prepared(prompts, body, "prompt", 1 if body.echo_only else body.max_tokens,
                                  defaults.get("max_tokens", 16), structured, k if echo else None)
            field = structured[1] if structured else None
            texts = [p if isinstance(p, str) else tokenizer.decode(p) for p in prompts]  # what echo prepends
            rid = f"cmpl-{uuid.uuid4().hex[:24]}"
            head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name}

            def choice(index: int, first: bool, text: str, ids: list[int], entries: list, prompt_entries,
                       offset: int, finish: str | None) -> tuple[dict, int]:
                """One choice (or one chunk of it): echo puts the prompt before the first piece of each choice."""
                if body.echo_only:
                    text, ids, entries = "", [], []
                lp = None
                if first and echo:
                    prompt_ids = jobs[index // n][0]
                    text = texts[index // n] + text
                    if k is not None:
                        lp = completion_logprobs(prompt_ids, prompt_entries or [None] * len(prompt_ids), k,
                                                 token_text, offset)
                        offset += sum(map(len, lp["tokens"]))
                if k is not None and (ids or lp is None):  # a whole choice always has its block
                    block = completion_logprobs(ids, entries, k, token_text, offset)
                    offset += sum(map(len, block["tokens"]))
                    lp = joined(lp, block)
                c = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
                if body.return_token_ids:
                    c["token_ids"] = ids
                return c, offset

            if body.stream:
                async def events() -> AsyncIterator[str]:
                    usage, offsets, started = [0, 0, 0], [0] * (len(jobs) * n), set()
                    try:
                        async for index, d in merged(async_engine, jobs, rid):
                            first = index not in started
                            started.add(index)
                            c, offsets[index] = choice(index, first, d.new_text, d.new_token_ids, d.logprobs or [],
                                                       d.prompt_logprobs, offsets[index], d.finish_reason)
                            if c["text"] or (d.new_token_ids and not body.echo_only) or d.finished:
                                yield sse({**head, "choices": [c]})
                            if d.finished:
                                usage[0] += d.num_prompt_tokens if d.index == 0 else 0
                                usage[1] += 0 if body.echo_only else d.num_output_tokens
                                usage[2] += d.num_cached_tokens if d.index == 0 else 0
                        if body.include_usage:
                            yield sse({**head, "choices": [], "usage": usage_of(*usage)})
                    except Exception as e:
                        yield sse(failure(e, field)[1])
                    yield "data: [DONE]\n\n"

                response = Streamed(events(), release)
                release = None
                return response

            results = await collect(async_engine, jobs, rid, request)
        except (RequestFailed, EngineStopped, RuntimeError) as e:
            if isinstance(e, (Busy, EngineDraining)):
                raise
            status, err = failure(e, structured[1] if structured else None)
            return JSONResponse(err, status_code=status)
        finally:
            if release is not None:
                release()
        if results is None:
            return error(499, "client closed the request")
        choices = [choice(i, True, r["text"], r["ids"], r["logprobs"], r["prompt_logprobs"], 0, r["finish"])[0]
                   for i, r in enumerate(results)]
        return {**head, "choices": choices,
                "usage": usage_of(sum(len(ids) for ids, _ in jobs),
                                  0 if body.echo_only else sum(r["output"] for r in results),
                                  sum(r["cached"] for r in results[::n]))}

    @app.post("/v1/chat/completions", responses={**STREAM, **ERRORS})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        check_model(body.model)
        body.refuse_unsupported()
        conversation = body.conversation()
        if sum(len(m["content"]) for m in conversation) > max_chars:
            raise BadRequest(f"the messages are longer than the model's context of {max_context} tokens can hold",
                             "messages")
        structured = body.structured()
        k = body.logprobs_wanted()
        release = admission.take(1, body.n)
        try:
            try:
                text = await asyncio.get_running_loop().run_in_executor(prepare_pool, tokenizer.apply_chat_template,
                                                                        conversation)
            except Exception as e:  # the template refuses the conversation (roles out of order, ...)
                raise BadRequest(f"the chat template refused these messages: {e}", "messages") from None
            jobs = await prepared([text], body, "messages", body.wanted_tokens, defaults.get("max_tokens"),
                                  structured, None, False,
                                  "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens")
            ids = jobs[0][0]
            rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
            head = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model_name}
            field = structured[1] if structured else None

            if body.stream:
                async def events() -> AsyncIterator[str]:
                    for i in range(body.n):
                        yield sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                        "logprobs": None, "finish_reason": None}]})
                    out_tokens, cached = 0, 0
                    try:
                        async for index, d in merged(async_engine, jobs, rid):
                            if d.new_text or (k is not None and d.new_token_ids):
                                c = {"index": index, "delta": {"content": d.new_text}, "finish_reason": None,
                                     "logprobs": None if k is None else
                                     chat_logprobs(d.new_token_ids, d.logprobs or [], k, token_text)}
                                if body.return_token_ids:
                                    c["token_ids"] = d.new_token_ids
                                yield sse({**head, "choices": [c]})
                            if d.finished:
                                out_tokens += d.num_output_tokens
                                cached = d.num_cached_tokens
                                yield sse({**head, "choices": [{"index": index, "delta": {}, "logprobs": None,
                                                                "finish_reason": d.finish_reason}]})
                        if body.include_usage:
                            yield sse({**head, "choices": [], "usage": usage_of(len(ids), out_tokens, cached)})
                    except Exception as e:
                        yield sse(failure(e, field)[1])
                    yield "data: [DONE]\n\n"

                response = Streamed(events(), release)
                release = None
                return response

            results = await collect(async_engine, jobs, rid, request)
        except (RequestFailed, EngineStopped, RuntimeError) as e:
            if isinstance(e, (Busy, EngineDraining)):
                raise
            status, err = failure(e, structured[1] if structured else None)
            return JSONResponse(err, status_code=status)
        finally:
            if release is not None:
                release()
        if results is None:
            return error(499, "client closed the request")
        choices = []
        for i, r in enumerate(results):
            c = {"index": i, "message": {"role": "assistant", "content": r["text"]}, "finish_reason": r["finish"],
                 "logprobs": None if k is None else chat_logprobs(r["ids"], r["logprobs"], k, token_text)}
            if body.return_token_ids:
                c["token_ids"] = r["ids"]
            choices.append(c)
        return {**head, "object": "chat.completion", "choices": choices,
                "usage": usage_of(len(ids), sum(r["output"] for r in results), results[0]["cached"])}

    return app
