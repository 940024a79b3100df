"""The two generating endpoints, one class each over what they share (vLLM's `serving_completion` /
`serving_chat` shape): `ServingCompletion` answers POST /v1/completions, `ServingChat` POST /v1/chat/completions.

A request goes through one path: its prompts are tokenized and checked in the prepare threads (`prepare`: the
tokenizer lets go of the GIL, so several requests are prepared at once and the event loop keeps answering), each
failure a 400 naming the field it came from, found before anything is queued; then its jobs run in the engine and
come back streamed (server-sent events) or collected (`RequestOutput`s), through one error path (`respond`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from ..kv.blocks import RequestTooLarge
from ..sampling import SamplingParams
from ..structured import GrammarError, StructuredOutputsParams
from ..tokenizer import Tokenizer, TooManyTokens
from .async_engine import AsyncEngine, EngineDraining, EngineStopped
from .limits import Admission, Busy, ServerConfig
from .protocol import BadRequest, ChatCompletionRequest, CompletionRequest, error_body, field_of
from .responses import TokenText, chat_logprobs, completion_logprobs, joined, sse, usage_of
from .streams import RequestFailed, Streamed, collect, merged

Jobs = list[tuple[list[int], SamplingParams]]


class OpenAIServing:
    """What both endpoints share: the model's name and context, the tokenizer, the admission count, the prepare
    threads, and one path each for checking a request (`prepare`) and for answering it (`respond`)."""

    def __init__(self, async_engine: AsyncEngine, tokenizer: Tokenizer, model_name: str, config: ServerConfig,
                 defaults: dict[str, Any], admission: Admission, prepare_pool: ThreadPoolExecutor):
        self.async_engine, self.tokenizer, self.model_name = async_engine, tokenizer, model_name
        self.config, self.defaults, self.admission, self.pool = config, defaults, admission, prepare_pool
        self.max_context = async_engine.engine.model.cfg.max_position_embeddings
        self.token_text = TokenText(tokenizer)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise BadRequest(f"the model {name!r} does not exist; this server serves {self.model_name!r}", "model",
                             404)

    def tokenize(self, text: str, where: str, at: str, special: bool) -> list[int]:
        """A prompt's ids, refused once more tokens than the context holds are seen (not after encoding it all)."""
        try:
            ids = self.tokenizer.encode(text, add_special_tokens=special, limit=self.max_context)
        except TooManyTokens as e:
            raise BadRequest(f"{at}{where} {e}: more than the model's context of {self.max_context} tokens", where) \
                from None
        if not ids:
            raise BadRequest(f"{at}{where} encodes to no tokens", where)
        return ids

    def plan(self, prompts: Sequence[str | list[int]], body: CompletionRequest | ChatCompletionRequest, where: str,
             wanted: int | None, default_max: int | None, structured: tuple[StructuredOutputsParams, str] | None,
             prompt_logprobs: int | None, special: bool, wanted_field: str) -> Jobs:
        """One (prompt ids, params) per prompt, each checked as the engine will (`LLMEngine.check_request`: the
        prompt, the parameters, the pool, the grammar's first token) before any is queued. `wanted`: the request's
        max_tokens (None: what fits, at most `default_max`); `special`: add the tokenizer's BOS (a rendered chat
        template has its own). Runs in a prepare thread."""
        so, field = structured if structured is not None else (None, None)
        jobs = []
        for p, prompt in enumerate(prompts):
            at = f"prompt {p}: " if len(prompts) > 1 else ""
            ids = self.tokenize(prompt, where, at, special) if isinstance(prompt, str) else prompt
            room = self.max_context - len(ids)
            max_tokens = max(1, wanted if wanted is not None else min(room, default_max or room))
            params = body.sampling_params(max_tokens, self.defaults, so, prompt_logprobs)
            try:
                self.async_engine.check(ids, params, field or "structured_outputs")
            except GrammarError as e:
                raise BadRequest(str(e), e.field) from None
            except RequestTooLarge as e:
                raise BadRequest(f"{at}{e}", wanted_field if wanted is not None else where) from None
            except ValueError as e:
                message = str(e).replace("SamplingParams.", "")
                raise BadRequest(f"{at}{where}{message[len('prompt'):]}" if message.startswith("prompt") else
                                 f"{at}{message}", where if message.startswith("prompt") else field_of(str(e))) \
                    from None
            if wanted is not None and wanted > room:  # vLLM's choice: an explicit max_tokens that does not fit
                raise BadRequest(f"{at}this model's context is {self.max_context} tokens: {len(ids)} in the {where} "
                                 f"and {wanted} asked for in {wanted_field} do not fit; ask for at most {room}",
                                 wanted_field)
            jobs.append((ids, params))
        return jobs

    async def prepare(self, *args: Any) -> Jobs:
        """`plan` in a prepare thread, so the event loop keeps answering while prompts are tokenized."""
        jobs = await asyncio.get_running_loop().run_in_executor(self.pool, self.plan, *args)
        if self.async_engine.draining:
            raise EngineDraining("the server is shutting down and takes no new requests")
        return jobs

    async def respond(self, prompts: int, n: int, field: str | None, answer: Callable[[], Awaitable[Any]]) -> Any:
        """Admit `prompts` x `n` sequences, run `answer`, and turn what failed once running into OpenAI's error
        shape. A stream returned by `answer` takes the admission with it (let go when the stream ends, however it
        ends)."""
        release = self.admission.take(prompts, n)
        try:
            result = await answer()
            if isinstance(result, Streamed):
                result.release, release = release, None
            return result
        except (Busy, EngineDraining):
            raise
        except (RequestFailed, EngineStopped, RuntimeError) as e:
            status, body = failure(e, field)
            return JSONResponse(body, status_code=status)
        finally:
            if release is not None:
                release()

    async def events(self, jobs: Jobs, rid: str, field: str | None,
                     chunks: Callable[[int, Any], list[dict]], last: Callable[[], list[dict]]) -> AsyncIterator[str]:
        """Server-sent events: each step's chunks, then `last`'s, then [DONE]; a failure once running is an error
        event before [DONE]."""
        try:
            async for index, d in merged(self.async_engine, jobs, rid):
                for chunk in chunks(index, d):
                    yield sse(chunk)
            for chunk in last():
                yield sse(chunk)
        except Exception as e:
            yield sse(failure(e, field)[1])
        yield "data: [DONE]\n\n"


def failure(e: BaseException, field: str | None) -> tuple[int, dict]:
    """A request that failed once running, as (status, OpenAI error body)."""
    if isinstance(e, RequestFailed) and field is not None:
        return 400, error_body(str(e), "invalid_request_error", field)
    if isinstance(e, (EngineStopped, EngineDraining)):
        return 503, error_body(str(e), "service_unavailable")
    return 500, error_body(f"{type(e).__name__}: {e}" if not isinstance(e, RequestFailed) else str(e), "server_error")


def closed() -> JSONResponse:
    return JSONResponse(error_body("client closed the request"), status_code=499)


class ServingCompletion(OpenAIServing):
    """POST /v1/completions: a prompt (text or ids, or a list of either), n samples each; echo and the legacy
    logprobs shape."""

    async def create(self, body: CompletionRequest, request: Request) -> Any:
        self.check_model(body.model)
        body.refuse_unsupported()
        prompts, structured = body.prompts(), body.structured()
        field = structured[1] if structured else None
        return await self.respond(len(prompts), body.n, field,
                                  lambda: self._answer(body, request, prompts, structured, field))

    async def _answer(self, body: CompletionRequest, request: Request, prompts: list[str | list[int]],
                      structured: tuple[StructuredOutputsParams, str] | None, field: str | None) -> Any:
        k, n, echo = body.logprobs, body.n, body.echo
        jobs = await self.prepare(prompts, body, "prompt", 1 if body.echo_only else body.max_tokens,
                                  self.defaults.get("max_tokens", 16), structured, k if echo else None, True,
                                  "max_tokens")
        rid = f"cmpl-{uuid.uuid4().hex[:24]}"
        head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.model_name}

        def choice(index: int, first: bool, text: str, ids: list[int], entries: list, prompt_entries,
                   offset: int, finish: str | None) -> tuple[dict, int]:
            """One choice (or one chunk of it): echo puts the prompt before the first piece of each choice."""
            if body.echo_only:
                text, ids, entries = "", [], []
            lp = None
            if first and echo:
                prompt = prompts[index // n]
                prompt_ids = jobs[index // n][0]
                text = (prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)) + text
                if k is not None:
                    lp = completion_logprobs(prompt_ids, prompt_entries or [None] * len(prompt_ids), k,
                                             self.token_text, offset)
                    offset += sum(map(len, lp["tokens"]))
            if k is not None and (ids or lp is None):  # a whole choice always has its block
                block = completion_logprobs(ids, entries, k, self.token_text, offset)
                offset += sum(map(len, block["tokens"]))
                lp = joined(lp, block)
            c = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
            if body.return_token_ids:
                c["token_ids"] = ids
            return c, offset

        if body.stream:
            usage, offsets, started = [0, 0, 0], [0] * (len(jobs) * n), set()

            def chunks(index: int, d) -> list[dict]:
                first = index not in started
                started.add(index)
                c, offsets[index] = choice(index, first, d.new_text, d.new_token_ids, d.logprobs or [],
                                           d.prompt_logprobs, offsets[index], d.finish_reason)
                if d.finished:
                    usage[0] += d.num_prompt_tokens if d.index == 0 else 0
                    usage[1] += 0 if body.echo_only else d.num_output_tokens
                    usage[2] += d.num_cached_tokens if d.index == 0 else 0
                if c["text"] or (d.new_token_ids and not body.echo_only) or d.finished:
                    return [{**head, "choices": [c]}]
                return []

            def last() -> list[dict]:
                return [{**head, "choices": [], "usage": usage_of(*usage)}] if body.include_usage else []

            return Streamed(self.events(jobs, rid, field, chunks, last))
        results = await collect(self.async_engine, jobs, rid, request)
        if results is None:
            return closed()
        outputs = [(r, o) for r in results for o in r.outputs]
        choices = [choice(i, True, o.text, o.token_ids, o.logprobs or [], r.prompt_logprobs, 0, o.finish_reason)[0]
                   for i, (r, o) in enumerate(outputs)]
        return {**head, "choices": choices,
                "usage": usage_of(sum(len(r.prompt_token_ids) for r in results),
                                  0 if body.echo_only else sum(len(o.token_ids) for _, o in outputs),
                                  sum(r.num_cached_tokens for r in results))}


class ServingChat(OpenAIServing):
    """POST /v1/chat/completions: messages rendered with the model's chat template, n samples of the one prompt."""

    async def create(self, body: ChatCompletionRequest, request: Request) -> Any:
        self.check_model(body.model)
        body.refuse_unsupported()
        conversation = body.conversation()
        structured = body.structured()
        field = structured[1] if structured else None
        return await self.respond(1, body.n, field,
                                  lambda: self._answer(body, request, conversation, structured, field))

    async def _answer(self, body: ChatCompletionRequest, request: Request, conversation: list[dict[str, str]],
                      structured: tuple[StructuredOutputsParams, str] | None, field: str | None) -> Any:
        k = body.logprobs_wanted()
        try:
            text = await asyncio.get_running_loop().run_in_executor(self.pool, self.tokenizer.apply_chat_template,
                                                                    conversation)
        except Exception as e:  # the template refuses the conversation (roles out of order, ...)
            raise BadRequest(f"the chat template refused these messages: {e}", "messages") from None
        jobs = await self.prepare([text], body, "messages", body.wanted_tokens, self.defaults.get("max_tokens"),
                                  structured, None, False,
                                  "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens")
        ids = jobs[0][0]
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        head = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": self.model_name}

        def logprobs(tokens: list[int], entries: list | None) -> dict | None:
            return None if k is None else chat_logprobs(tokens, entries or [], k, self.token_text)

        if body.stream:
            counts = [0, 0]  # output tokens, cached prompt tokens

            def chunks(index: int, d) -> list[dict]:
                out = []
                if d.new_text or (k is not None and d.new_token_ids):
                    c = {"index": index, "delta": {"content": d.new_text}, "finish_reason": None,
                         "logprobs": logprobs(d.new_token_ids, d.logprobs)}
                    if body.return_token_ids:
                        c["token_ids"] = d.new_token_ids
                    out.append({**head, "choices": [c]})
                if d.finished:
                    counts[0] += d.num_output_tokens
                    counts[1] = d.num_cached_tokens
                    out.append({**head, "choices": [{"index": index, "delta": {}, "logprobs": None,
                                                     "finish_reason": d.finish_reason}]})
                return out

            def last() -> list[dict]:
                return [{**head, "choices": [], "usage": usage_of(len(ids), *counts)}] if body.include_usage else []

            async def with_roles() -> AsyncIterator[str]:
                for i in range(body.n):
                    yield sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                    "logprobs": None, "finish_reason": None}]})
                async for event in self.events(jobs, rid, field, chunks, last):
                    yield event

            return Streamed(with_roles())
        results = await collect(self.async_engine, jobs, rid, request)
        if results is None:
            return closed()
        outputs = results[0].outputs
        choices = []
        for o in outputs:
            c = {"index": o.index, "message": {"role": "assistant", "content": o.text},
                 "finish_reason": o.finish_reason, "logprobs": logprobs(o.token_ids, o.logprobs)}
            if body.return_token_ids:
                c["token_ids"] = o.token_ids
            choices.append(c)
        return {**head, "object": "chat.completion", "choices": choices,
                "usage": usage_of(len(ids), sum(len(o.token_ids) for o in outputs), results[0].num_cached_tokens)}
