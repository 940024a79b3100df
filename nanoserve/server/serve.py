"""`python -m nanoserve serve`: the command, and the server thread it (and the notebooks and tests) run.

The process's main thread steps the engine (`AsyncEngine` says why) while uvicorn answers HTTP from a thread of
its own. SIGTERM or SIGINT drains: new requests are answered 503 while those in flight get --shutdown-timeout
to finish (then end with an error event), and the process exits 0; a second signal stops at once and exits
128 + its number (130 for SIGINT, 143 for SIGTERM), as a shell reports a process a signal ended.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time

from .. import loader
from ..config import EngineConfig, generation_defaults
from ..engine import LLMEngine
from ..tokenizer import Tokenizer
from .async_engine import AsyncEngine
from .limits import ServerConfig, TimedH11Protocol, is_loopback


def add_arguments(ap: argparse.ArgumentParser) -> None:
    loader.add_cli_arguments(ap, gguf=True)  # as LLM(weights=..., dtype=..., activations=..., kv_cache_dtype=...)
    ap.add_argument("--served-model-name", help="the name clients use (default: the folder's name)")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    ap.add_argument("--port", type=int, default=8000)
    EngineConfig.add_cli_arguments(ap)
    ServerConfig.add_cli_arguments(ap)
    ap.add_argument("--threads", type=threads_arg, default="auto",
                    help="torch threads: a number, or auto (default): the cores other programs leave free")
    ap.add_argument("--log-level", default="warning")


def threads_arg(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a number of threads >= 1, or auto")
    return n


def exposure_warning(config: ServerConfig) -> str | None:
    """The line `serve` prints to stderr when it answers beyond this machine and anyone who reaches it may use
    it (no --api-key); None when bound to loopback or given a key."""
    if is_loopback(config.host) or config.api_key is not None:
        return None
    return (f"nanoserve: warning: bound to {config.host} without --api-key: anyone who can reach this address "
            f"may use the model and its admin routes")


def make_engine(model, tok: Tokenizer, args: argparse.Namespace) -> LLMEngine:
    """The engine `serve` steps, configured from its command line (`EngineConfig.from_cli`, and --threads)."""
    config = EngineConfig.from_cli(args)
    config.threads = args.threads
    return LLMEngine(model, tok, config)


def run(args: argparse.Namespace) -> int:
    """Load the model, build the app, serve until a signal: uvicorn answers HTTP in a thread while this (the
    main) thread steps the engine (`AsyncEngine` says why). SIGTERM or SIGINT drains (new requests 503, those
    in flight get --shutdown-timeout to finish), then exits 0; a second signal stops at once and exits
    128 + its number, with no traceback."""
    import signal

    from ..model.fetch import model_folder
    from .app import build_app

    folder = model_folder(args.model)  # a folder, or a model's name (fetched and converted on first use)
    model, tok = loader.from_cli(args)
    name = args.served_model_name or folder.name
    engine = make_engine(model, tok, args)
    async_engine = AsyncEngine(engine, own_thread=False)
    config = ServerConfig.from_cli(args)
    app = build_app(async_engine, tok, name, config, generation_defaults(folder))
    server = ServerThread(app, args.host, args.port, args.log_level)
    forced: list[int] = []  # the signal that forced the stop

    def on_signal(signum, frame) -> None:
        if server.stopping:  # as uvicorn's own handler: a second signal stops without waiting
            forced.append(signum)
            # uvicorn then cancels the tasks it no longer waits for (the app's lifespan, streams): not errors
            for logger in ("uvicorn.error", "asyncio"):
                logging.getLogger(logger).setLevel(logging.CRITICAL + 1)
            async_engine.fail_all("the server was stopped")
            server.server.should_exit = server.server.force_exit = True
        else:
            server.begin_shutdown()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    if (warning := exposure_warning(config)) is not None:
        print(warning, file=sys.stderr, flush=True)
    server.thread.start()
    print(f"nanoserve: serving {name} on http://{args.host}:{args.port}/v1 ({args.weights} weights, "
          f"{engine.manager.num_blocks} KV blocks)", flush=True)
    async_engine.run(keep_going=server.thread.is_alive)  # until the app's shutdown stops it, or uvicorn exits
    server.thread.join()
    if forced:
        return 128 + forced[0]
    return 0 if server.server.started else 1


class ServerThread:
    """A server in a background thread of this process (notebooks, tests, and `serve` itself):

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
        self.app, self.url, self.stopping = app, f"http://{host}:{port}", False
        config: ServerConfig = getattr(app.state, "server_config", None) or ServerConfig()
        self.server = uvicorn.Server(uvicorn.Config(
            app, host=host, port=port, log_level=log_level, http=TimedH11Protocol.with_timeout(config.header_timeout_s),
            timeout_keep_alive=config.keep_alive_timeout_s, timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, name="nanoserve-http", daemon=True)

    def start(self, timeout: float = 60) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def begin_shutdown(self, grace: float | None = None) -> None:
        """Drain (`app.state.drain`: new requests 503, those in flight finish within `grace`), then stop
        uvicorn. Returns at once (a signal handler calls it)."""
        self.stopping = True
        loop = getattr(self.app.state, "loop", None)
        if loop is None or loop.is_closed() or not self.thread.is_alive():  # not started, or already stopped
            self.server.should_exit = True
            return
        drain = self.app.state.drain(grace)
        try:
            future = asyncio.run_coroutine_threadsafe(drain, loop)
        except RuntimeError:  # the loop closed just now
            drain.close()
            self.server.should_exit = True
            return
        future.add_done_callback(lambda _: setattr(self.server, "should_exit", True))

    def stop(self, timeout: float = 60) -> None:
        """Shut down as `serve` does on SIGTERM: drain, stop accepting, stop the engine thread."""
        self.begin_shutdown()
        self.thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
