"""What stands between a socket and the engine: the server's limits, each refused in OpenAI's error shape.

    a request's headers        must arrive within header_timeout_s (uvicorn has no such deadline: a client
                               sending a byte a minute would hold its connection forever); then closed
    its Host (on loopback)     localhost / 127.0.0.1 / [::1] / the bound host / --allowed-hosts, else 400:
                               a web page that rebinds its own domain to 127.0.0.1 cannot reach the server
    its Origin (if sent)       a browser names the page's origin: only loopback / the bound host / --allowed-hosts
                               are served, else 403, so a web page elsewhere cannot make a user's browser call in
    its API key                `Authorization: Bearer <key>` on every route when the server has one, else 401;
                               open: /health and /metrics (probes and scrapers), /openapi.json (the public shape
                               of the API, which clients and fuzzers read first) and, with --docs, its pages
    a POST's Content-Type      application/json (what OpenAI's clients send), else 415: the bodies a page may
                               send cross-origin without asking (text/plain, forms) never reach a handler
    its body                   at most max_body_bytes (413), all of it within body_timeout_s (408)
    a server draining          new /v1 requests get 503 while those in flight finish
    the work in flight         at most max_num_seqs sequences run and max_queued_requests more wait; past
                               that a 503 with Retry-After (`Admission`), so memory never grows unbounded

`Guard` is a plain ASGI middleware: it answers before FastAPI parses anything, and it hands the app a body
it has already read in full (so the app never waits on a slow client).
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .protocol import BadRequest, error_body


@dataclass
class ServerConfig:
    """The HTTP server's own options, beside the engine's (`EngineConfig`)."""

    host: str = "127.0.0.1"  # where it is bound: loopback turns the Host allow-list on
    api_key: str | None = None  # every route but /health, /metrics, /openapi.json needs `Authorization: Bearer <key>`
    allowed_hosts: tuple[str, ...] = ()  # Host and Origin names accepted besides loopback's and the bound host
    max_queued_requests: int = 128  # sequences waiting beyond the engine's max_num_seqs running ones
    max_prompts_per_request: int = 128  # prompts x n of one request
    max_body_bytes: int = 4 << 20
    header_timeout_s: float = 30.0
    body_timeout_s: float = 30.0
    keep_alive_timeout_s: float = 5.0  # an idle keep-alive connection is closed after this
    shutdown_timeout_s: float = 30.0  # on SIGTERM, how long requests in flight may take to finish
    retry_after_s: int = 5  # what a 503 asks the client to wait
    docs: bool = False  # FastAPI's /docs and /redoc pages (they load their scripts from a CDN)

    @staticmethod
    def add_cli_arguments(ap: argparse.ArgumentParser) -> None:
        d = ServerConfig()
        ap.add_argument("--api-key", default=os.environ.get("NANOSERVE_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on every route but /health, /metrics and "
                             "/openapi.json (default: $NANOSERVE_API_KEY; none)")
        ap.add_argument("--allowed-hosts", nargs="*", default=[],
                        help="Host and Origin names accepted besides localhost/127.0.0.1/[::1] and --host "
                             "(DNS-rebinding and cross-origin guard)")
        ap.add_argument("--max-queued-requests", type=int, default=d.max_queued_requests,
                        help="sequences that may wait beyond the running ones; past it a 503 with Retry-After")
        ap.add_argument("--max-prompts-per-request", type=int, default=d.max_prompts_per_request,
                        help="prompts x n one request may ask for (more is a 400)")
        ap.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, help="a larger body is a 413")
        ap.add_argument("--header-timeout", type=float, default=d.header_timeout_s,
                        help="seconds a request's headers may take to arrive")
        ap.add_argument("--body-timeout", type=float, default=d.body_timeout_s,
                        help="seconds a request's body may take to arrive (then 408)")
        ap.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout_s,
                        help="on SIGTERM, seconds requests in flight may take to finish (then they end with an error)")
        ap.add_argument("--docs", action="store_true",
                        help="serve FastAPI's /docs and /redoc pages (off by default: they load unpinned scripts "
                             "and fonts from a CDN); /openapi.json is always served")

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> ServerConfig:
        return cls(host=args.host, api_key=args.api_key or None, allowed_hosts=tuple(args.allowed_hosts),
                   max_queued_requests=args.max_queued_requests, max_prompts_per_request=args.max_prompts_per_request,
                   max_body_bytes=args.max_body_bytes, header_timeout_s=args.header_timeout,
                   body_timeout_s=args.body_timeout, shutdown_timeout_s=args.shutdown_timeout,
                   docs=args.docs)


class Busy(RuntimeError):
    """The server holds as much work as it may: a 503 with Retry-After."""


class Admission:
    """Sequences admitted (prompts x n of each request being answered): at most `capacity` at once.
    Touched only on the event loop, so it needs no lock."""

    def __init__(self, capacity: int, per_request: int):
        self.capacity, self.per_request, self.held = capacity, per_request, 0

    def take(self, prompts: int, n: int = 1) -> Callable[[], None]:
        """Admit prompts x n sequences; returns the function that lets them go (calling it twice is harmless).
        Past the per-request limit the 400 names `n` when n alone is too many, else `prompt`."""
        limit = min(self.capacity, self.per_request)
        if n > limit:
            raise BadRequest(f"n={n} samples are more than the {limit} sequences one request may ask for", "n")
        n *= prompts
        if n > limit:
            raise BadRequest(f"this request asks for {n} sequences (prompts x n); at most {limit} per request",
                             "prompt")
        if self.held + n > self.capacity:
            raise Busy(f"the server is at capacity ({self.held} of {self.capacity} sequences in flight); "
                       f"retry later")
        self.held += n
        done = False

        def release() -> None:
            nonlocal done
            if not done:
                done = True
                self.held -= n

        return release


LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1", "[::1]"}


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name in a Host header, without its port: "127.0.0.1:8000" -> "127.0.0.1", "[::1]:80" -> "[::1]"."""
    header = header.strip().lower()
    if header.startswith("["):
        return header.split("]", 1)[0] + "]"
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


async def send_error(send, status: int, message: str, kind: str, param: str | None = None, code: str | None = None,
                     headers: dict[str, str] | None = None) -> None:
    body = json.dumps(error_body(message, kind, param, code)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def origin_name(origin: str) -> str | None:
    """The host an Origin header names ("http://[::1]:8000" -> "::1"); None for "null" or no host."""
    try:
        return urlsplit(origin.strip()).hostname
    except ValueError:
        return None


def is_json(content_type: str) -> bool:
    """application/json or application/*+json, parameters aside (what FastAPI parses as JSON)."""
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


class Guard:
    """ASGI middleware: the Host and Origin allow-lists, the API key, a POST's Content-Type, draining, and the
    body's size and deadline."""

    OPEN = ("/health", "/metrics", "/openapi.json")  # never need the key
    DOCS = ("/docs", "/docs/oauth2-redirect", "/redoc")  # FastAPI's pages, open too when served (--docs)

    def __init__(self, app, config: ServerConfig, draining: Callable[[], bool] = lambda: False):
        self.app, self.config, self.draining = app, config, draining
        names = {h.lower() for h in config.allowed_hosts}
        if is_loopback(config.host):
            names |= LOOPBACK_NAMES | {config.host.lower()}
        self.hosts = names  # empty: no check (bound beyond loopback, no --allowed-hosts)
        self.origins = {h.lower().strip("[]") for h in (*LOOPBACK_NAMES, config.host, *config.allowed_hosts)}
        self.open = self.OPEN + (self.DOCS if config.docs else ())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        path = scope["path"]
        if self.hosts and "host" in headers and host_name(headers["host"]) not in self.hosts \
                and not is_loopback(host_name(headers["host"])):
            return await send_error(send, 400, f"Host {headers['host']!r} is not served here (a loopback server "
                                               f"answers its own names; see --allowed-hosts)", "invalid_request_error",
                                    "host", "host_not_allowed")
        if "origin" in headers:
            name = origin_name(headers["origin"])
            if name is None or (name not in self.origins and not is_loopback(name)):
                return await send_error(send, 403, f"Origin {headers['origin']!r} is not served here: a web page "
                                                   f"elsewhere may not call this server (see --allowed-hosts)",
                                        "invalid_request_error", None, "origin_not_allowed")
        if self.config.api_key is not None and path not in self.open:
            given = headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {self.config.api_key}".encode()):
                return await send_error(send, 401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                                        "invalid_request_error", None, "invalid_api_key",
                                        {"www-authenticate": "Bearer"})
        if scope["method"] == "POST":
            kind = headers.get("content-type")
            has_body = "transfer-encoding" in headers or headers.get("content-length", "0").strip() != "0"
            if (kind is not None and not is_json(kind)) or (kind is None and has_body):
                return await send_error(send, 415, f"a POST body must be JSON sent as Content-Type: application/json"
                                                   f" (got {kind!r})", "invalid_request_error", None,
                                        "unsupported_media_type", {"connection": "close"})
        if self.draining() and path.startswith("/v1") and scope["method"] == "POST":
            return await send_error(send, 503, "the server is shutting down and takes no new requests",
                                    "service_unavailable", headers={"retry-after": str(self.config.retry_after_s),
                                                                    "connection": "close"})
        body = await self._read_body(scope, receive, send, headers)
        if body is None:
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then only http.disconnect, when the client leaves

        await self.app(scope, replay, send)

    async def _read_body(self, scope, receive, send, headers: dict[str, str]) -> bytes | None:
        """The whole body, or None after answering 413 (too large) or 408 (too slow)."""
        limit = self.config.max_body_bytes
        too_large = lambda: send_error(send, 413, f"the body is larger than {limit} bytes (--max-body-bytes)",  # noqa: E731
                                       "invalid_request_error", None, "body_too_large", {"connection": "close"})
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            await too_large()
            return None
        chunks, size = [], 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.body_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                await send_error(send, 408, f"the body did not arrive within {self.config.body_timeout_s} s",
                                 "invalid_request_error", None, "request_timeout", {"connection": "close"})
                return None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await too_large()
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's headers (from the connection's start, or from
    the first byte after a response). An idle keep-alive connection is uvicorn's own timeout's to close."""

    header_timeout_s = 30.0

    @classmethod
    def with_timeout(cls, seconds: float) -> type[TimedH11Protocol]:
        return type("TimedH11Protocol", (cls,), {"header_timeout_s": seconds})

    def connection_made(self, transport) -> None:
        self._header_timer = None
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # a request's headers are still incomplete
            self._arm()
        else:
            self._disarm()

    def on_response_complete(self) -> None:
        self._disarm()
        super().on_response_complete()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._header_timer is None and not self.transport.is_closing():
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expire(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()
