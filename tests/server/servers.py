"""Helpers for the server's tests: a server in this process, and a gate that holds its engine's work in place."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

from nanoserve.engine import LLMEngine
from nanoserve.server import AsyncEngine
from nanoserve.server.app import build_app
from nanoserve.server.limits import ServerConfig
from nanoserve.server.serve import ServerThread

KEY = "test-key"
AUTH = {"authorization": f"Bearer {KEY}"}


class Gate:
    """Holds an engine's requests where they are: while closed, a step does nothing (commands, aborts and
    `fail_all` still go through between steps), so a test decides when work in flight may finish."""

    def __init__(self, engine: LLMEngine):
        self.is_open = threading.Event()
        self.is_open.set()
        step = engine.step
        engine.step = lambda: step() if self.is_open.is_set() else (time.sleep(0.005), [])[1]

    def close(self) -> None:
        self.is_open.clear()

    def open(self) -> None:
        self.is_open.set()


@contextmanager
def tiny_server(model, tok, config: ServerConfig | None = None, defaults: dict | None = None, **engine_options):
    """A server on `model` in this process; yields (ServerThread, AsyncEngine, Gate)."""
    options = dict(max_num_seqs=4, max_num_batched_tokens=256, num_blocks=256) | engine_options
    engine = LLMEngine(model, tok, **options)
    gate = Gate(engine)
    ae = AsyncEngine(engine)
    with ServerThread(build_app(ae, tok, "tiny", config or ServerConfig(api_key=KEY), defaults)) as srv:
        try:
            yield srv, ae, gate
        finally:
            gate.open()  # what is still in flight may finish as the server drains
