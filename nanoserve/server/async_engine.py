"""The engine in one thread of its own, with requests coming from asyncio handlers (Day 38).

The engine's step is blocking work (a forward of the whole batch), so it cannot run on the event loop
that answers HTTP: one thread owns the engine and does nothing but step it. Handlers talk to that
thread through a queue of commands (add, abort, reset); each request's outputs come back through its own
asyncio.Queue, fed from the thread with `call_soon_threadsafe`. Only the engine thread touches the
engine after startup, so the engine needs no locks.

    stream = async_engine.generate(prompt_ids, params)   # an async iterator of the request's StepOutputs
    async for out in stream: ...                         # closing it early aborts the request

A handler that stops reading (its client went away) closes the iterator, which sends an abort: the
request's blocks go back to the pool at the next step.

What runs where, and what waits for what: the engine's thread runs each step, its forward on torch's threads
(one per core the engine is given); the compiled step and the large products let go of Python's GIL while they
compute, as torch's own ops do. uvicorn's event loop (another thread) answers /health, reads bodies, validates them
and streams tokens meanwhile: on a machine with no core to spare it takes its turn on the forward's cores, and it
waits for the GIL only while the engine thread runs Python between forwards (scheduling, sampling, bookkeeping).
Prompts are tokenized and requests checked in a few prepare threads (`serving`), the tokenizer also without the
GIL; a large body is weighed in a child process and parsed on a thread of its own (`app`, `weigh`).
`python -m nanoserve bench stall` measures how late a 5 ms timer and /health are through a long prefill and a full
batch's steps.

`python -m nanoserve serve` steps the engine in the process's main thread (`run`) and answers HTTP from
another. torch's OpenMP workers belong to the thread that first ran parallel work, and the main thread
has (loading the model); a second stepping thread would start a second set of workers, and with more
workers than cores they stop spinning between operations, so every one of a step's many parallel
operations would wait for its workers to wake.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable, Sequence

from ..engine import LLMEngine, StepOutput
from ..sampling import SamplingParams
from .metrics import EngineMetrics


class EngineDraining(RuntimeError):
    """The server is shutting down: it finishes what it has but takes nothing new."""


class EngineStopped(RuntimeError):
    """The engine stopped (shut down, or its step failed) before this request finished."""


class AsyncEngine:
    """An LLMEngine stepped by its own thread; `generate` is the asyncio side of one request."""

    def __init__(self, engine: LLMEngine, clock: Callable[[], float] = time.monotonic, own_thread: bool = True):
        self.engine = engine
        self.own_thread = own_thread  # False: the caller steps the engine in its own thread (`run`)
        self.metrics = EngineMetrics()
        self.clock = clock
        self.draining = False
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._sinks: dict[str, Callable[[StepOutput | BaseException], None]] = {}
        self._left: dict[str, int] = {}  # request id -> its samples not yet finished
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._stepping = threading.Event()  # set while a thread runs the loop
        self._thread: threading.Thread | None = None
        self.snapshot = self._snapshot()

    # ---- lifecycle -----------------------------------------------------------------------------------

    def start(self) -> None:
        """Start stepping in a thread of the engine's own (with `own_thread=False`, the caller's `run` steps)."""
        if self.own_thread and self._thread is None:
            self._stepping.set()  # running from now on: requests may be queued before the thread's first step
            self._thread = threading.Thread(target=self._run, name="nanoserve-engine", daemon=True)
            self._thread.start()

    def run(self, keep_going: Callable[[], bool] = lambda: True) -> None:
        """Step the engine in the calling thread until `stop()` is called (from another thread) or
        `keep_going()` turns False (checked at least once a second)."""
        self._run(keep_going)

    def stop(self, timeout: float = 30) -> None:
        """Stop stepping; requests still in flight end with an error."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        elif self._stepping.is_set():  # stepped by `run` in another thread: wait for its loop to end
            deadline = time.monotonic() + timeout
            while self._stepping.is_set() and time.monotonic() < deadline:
                time.sleep(0.01)

    @property
    def is_running(self) -> bool:
        return self._stepping.is_set() and not self._stop.is_set()

    @property
    def busy(self) -> bool:
        """Some request has not yet delivered its last output."""
        return bool(self._sinks)

    def fail_all(self, message: str) -> None:
        """End every request in flight now, each with EngineStopped(message) (the engine thread does it, between
        steps; called from any thread)."""
        if self._stepping.is_set():
            self._send(("fail", message))
        else:
            self._fail_all(EngineStopped(message))

    async def drain(self, timeout: float = 60) -> None:
        """Refuse new requests, then wait (up to `timeout`) for those in flight to finish."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self._sinks and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    # ---- the asyncio side ----------------------------------------------------------------------------

    def check(self, prompt_ids: Sequence[int], params: SamplingParams, field: str = "structured_outputs") -> None:
        """Refuse (ValueError) what no step could ever serve, before anything is queued (`LLMEngine.check_request`;
        a grammar's error names `field`). Safe from any thread: it reads the engine's configuration only."""
        if self.draining:
            raise EngineDraining("the server is shutting down and takes no new requests")
        self.engine.check_request(prompt_ids, params, field)

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[StepOutput]:
        """Queue one request and yield its StepOutputs (every sample's, `index` telling them apart) as the engine
        thread produces them, until all its samples are finished."""
        self.check(prompt_ids, params)
        if not self.is_running:
            raise RuntimeError("the engine thread is not running")
        rid = request_id or f"req-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        self._sinks[rid] = lambda item: loop.call_soon_threadsafe(q.put_nowait, item)
        self._send(("add", rid, list(prompt_ids), params))
        finished, left = False, params.n
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                left -= item.finished
                finished = left == 0
                yield item
                if finished:
                    return
        finally:
            if not finished:  # the reader went away (client disconnect, cancelled task): free its blocks
                self._send(("abort", rid))

    async def reset_prefix_cache(self) -> bool:
        """`LLMEngine.reset_prefix_cache` on the engine thread, between steps: False while requests hold blocks."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        self._send(("reset", lambda ok: loop.call_soon_threadsafe(done.set_result, ok)))
        return await done

    def _send(self, command: tuple) -> None:
        self._inbox.put(command)
        self._wake.set()

    # ---- the engine thread ---------------------------------------------------------------------------

    def _run(self, keep_going: Callable[[], bool] = lambda: True) -> None:
        self._stepping.set()
        try:
            self._loop(keep_going)
        finally:
            self._fail_all(EngineStopped("the server stopped before this request finished"))
            self._stepping.clear()

    def _loop(self, keep_going: Callable[[], bool]) -> None:
        engine = self.engine
        while not self._stop.is_set() and keep_going():
            if not engine.has_unfinished_requests():
                self._wake.wait(timeout=1.0)
            self._wake.clear()
            self._take_commands()
            if not engine.has_unfinished_requests():
                self.snapshot = self._snapshot()
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # a bug, not bad input: fail what is in flight, keep serving
                traceback.print_exc()
                self._fail_all(EngineStopped(f"the engine failed a step: {type(e).__name__}: {e}"))
                continue
            now = self.clock()
            for out in outputs:
                self._deliver(out, now)
            self.metrics.steps += 1
            self.snapshot = self._snapshot()

    def _take_commands(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _, rid, ids, params = command
                if rid not in self._sinks:  # failed (`fail_all`) before the engine saw it
                    continue
                try:
                    self.engine.add_request(ids, params, rid)
                    self._left[rid] = params.n
                except Exception as e:  # checked before queueing, so rare: a race with another's id
                    self._emit(rid, e)
                    self._sinks.pop(rid, None)
                continue
            if command[0] == "reset":
                command[1](self.engine.reset_prefix_cache())
            elif command[0] == "fail":
                self._fail_all(EngineStopped(command[1]))
            else:
                _, rid = command
                if rid not in self._left:
                    continue
                seqs = [r for r in self.engine.sequences(rid) if not r.finished]
                self.engine.abort(rid)
                for seq in seqs:
                    self.metrics.on_finish(seq, "abort", self.clock())
                self._left.pop(rid, None)
                self._sinks.pop(rid, None)

    def _deliver(self, out: StepOutput, now: float) -> None:
        rid = out.request_id
        if out.finished:
            self.metrics.on_finish(self.engine.sequence(rid, out.index), out.finish_reason, now)
            self._left[rid] -= 1
        self._emit(rid, out)
        if out.finished and self._left[rid] == 0:
            del self._left[rid]
            self._sinks.pop(rid, None)

    def _emit(self, rid: str, item: StepOutput | BaseException) -> None:
        sink = self._sinks.get(rid)
        if sink is not None:
            try:
                sink(item)
            except RuntimeError:  # the handler's event loop is gone
                self._sinks.pop(rid, None)

    def _fail_all(self, error: Exception) -> None:
        """End every request with `error`: their sequences are aborted (and counted so) and their readers told."""
        for rid in list(self._sinks):
            if rid in self._left:
                try:
                    seqs = [r for r in self.engine.sequences(rid) if not r.finished]
                    self.engine.abort(rid)
                    for seq in seqs:
                        self.metrics.on_finish(seq, "abort", self.clock())
                except Exception:
                    pass
                del self._left[rid]
            self._emit(rid, error)
            self._sinks.pop(rid, None)

    def _snapshot(self) -> dict[str, float]:
        """The gauges /metrics reports, read in the engine thread between steps (a consistent view)."""
        e = self.engine
        s = e.scheduler
        return dict(running=len(s.running), waiting=len(s.waiting), blocks_used=e.manager.pool.num_used,
                    blocks_total=e.manager.num_blocks, prefix_queried_tokens=s.prefix_queried_tokens,
                    prefix_hit_tokens=s.prefix_hit_tokens, preemptions=s.num_preemptions)
