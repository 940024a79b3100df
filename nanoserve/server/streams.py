"""A request's outputs as they come back from the engine thread: its jobs' streams merged into one (`merged`),
collected whole while the client is watched (`collect`), or sent as server-sent events (`Streamed`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi.responses import StreamingResponse

from ..engine import StepOutput
from ..engine.outputs import CompletionOutput, RequestOutput
from .async_engine import AsyncEngine
from .responses import finish_reason

DISCONNECT_POLL_S = 0.25


class RequestFailed(RuntimeError):
    """A sequence of the request failed in the engine (its grammar, or logits that could not be sampled)."""


class Streamed(StreamingResponse):
    """A streaming response that lets its admitted sequences go (`release`) when it ends, however it ends
    (finished, the client gone, or never started)."""

    def __init__(self, content, release: Callable[[], None] | None = None):
        super().__init__(content, media_type="text/event-stream")
        self.release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.release is not None:
                self.release()


async def merged(async_engine: AsyncEngine, jobs: Sequence[tuple[list[int], Any]],
                 rid: str) -> AsyncIterator[tuple[int, StepOutput]]:
    """Every job's StepOutputs as they come, tagged with their choice index (job * n + sample); a sequence that
    failed in the engine raises RequestFailed. Leaving early aborts whatever is unfinished."""
    def checked(d: StepOutput) -> StepOutput:
        if d.finish_reason == "error":
            raise RequestFailed(d.error or "the request failed in the engine")
        d.finish_reason = finish_reason(d.finish_reason)
        return d

    if len(jobs) == 1:
        stream = async_engine.generate(jobs[0][0], jobs[0][1], f"{rid}-0")
        try:
            async for d in stream:
                yield d.index, checked(d)
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
            yield i, checked(d)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(async_engine: AsyncEngine, jobs: Sequence[tuple[list[int], Any]], rid: str,
                  request) -> list[RequestOutput] | None:
    """Run every job to its end: one RequestOutput per job, its samples in `outputs`; None if the client
    disconnected first (its requests are then aborted)."""
    results = [RequestOutput(f"{rid}-{j}", None, list(ids), [CompletionOutput(i, "", []) for i in range(p.n)])
               for j, (ids, p) in enumerate(jobs)]
    n = jobs[0][1].n

    async def run() -> None:
        async for i, d in merged(async_engine, jobs, rid):
            r = results[i // n]
            r.outputs[i % n].add(d)
            if d.prompt_logprobs is not None:
                r.prompt_logprobs = d.prompt_logprobs
            if d.finished and d.index == 0:
                r.num_cached_tokens = d.num_cached_tokens

    task = asyncio.create_task(run())
    while not task.done():
        await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return None
    task.result()
    return results
