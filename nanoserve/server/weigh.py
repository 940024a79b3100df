"""Large request bodies weighed in a child process before the server parses them (Day 38).

Parsing a body of a million token ids costs ~0.12 s of json.loads and pydantic, all of it holding Python's GIL: on
the event loop, or on any thread of the server's process, /health and every other request wait, and a thread only
cuts the wait into one C call at a time (each time the loop lets go of the GIL to wait for I/O, the parser takes it
back for a whole call). So a body of at least `app.LARGE_BODY` bytes goes first to a child process that knows only
`json`: it parses the body on the other core and answers with its weight, the number of JSON values under each
top-level field and the shape of `prompt`. The server refuses, by field, a body heavier than any request can use,
and parses only what it would serve.

This file is also the child: `python -I -S weigh.py` reads frames (8-byte length, then the body) on stdin and writes
one JSON line per frame. It imports nothing but the standard library.
"""

from __future__ import annotations

import asyncio
import json
import struct
import sys
from pathlib import Path
from typing import Any

FRAME = struct.Struct("<Q")


def count(value: Any) -> int:
    """The JSON values in `value`, itself included (a list of n numbers is n + 1)."""
    n, stack = 0, [value]
    while stack:
        v = stack.pop()
        n += 1
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(e for e in v if isinstance(e, (list, dict)))
            n += sum(1 for e in v if not isinstance(e, (list, dict)))
    return n


def weigh(raw: bytes) -> dict:
    """{"invalid": why} for a body that is not JSON; else {"values": {field: count}, "prompt": shape}, the shape
    ["ids", n] for one prompt of token ids, ["batch", prompts, index of the longest, its length] for a list, and
    the key "" for a body that is not an object."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        return {"invalid": e.msg if isinstance(e, json.JSONDecodeError) else str(e)}
    if not isinstance(body, dict):
        return {"values": {"": count(body)}}
    weight: dict[str, Any] = {"values": {key: count(v) for key, v in body.items()}}
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], (list, str)):
        weight["prompt"] = ["ids", len(prompt)]
    elif isinstance(prompt, list) and prompt:
        lengths = [len(p) if isinstance(p, list) else 0 for p in prompt]
        longest = max(range(len(lengths)), key=lengths.__getitem__)
        weight["prompt"] = ["batch", len(prompt), longest, lengths[longest]]
    return weight


def main() -> None:
    """The child: weigh each framed body from stdin, one JSON line each to stdout."""
    source, sink = sys.stdin.buffer, sys.stdout
    while (head := source.read(FRAME.size)) and len(head) == FRAME.size:
        raw = source.read(FRAME.unpack(head)[0])
        sink.write(json.dumps(weigh(raw)) + "\n")
        sink.flush()


class Weigher:
    """The child process, started with the server and again if it dies; bodies weighed one at a time."""

    def __init__(self) -> None:
        self.proc: asyncio.subprocess.Process | None = None
        self.lock = asyncio.Lock()

    async def start(self) -> None:
        """Start the child now (a fork of a process this size takes the event loop ~0.1 s: better at startup)."""
        if self.proc is None or self.proc.returncode is not None:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-I", "-S", str(Path(__file__)), stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)

    async def weigh(self, raw: bytes) -> dict:
        async with self.lock:
            try:
                await self.start()
                assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
                self.proc.stdin.write(FRAME.pack(len(raw)) + raw)
                await self.proc.stdin.drain()
                line = await self.proc.stdout.readline()
                if not line:
                    raise ConnectionError("the weighing process ended")
                return json.loads(line)
            except BaseException:  # a dead or cancelled exchange leaves the pipe mid-frame: start afresh next time
                self.close()
                raise

    def close(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
        self.proc = None

    async def aclose(self) -> None:
        """Stop the child and reap it while the event loop still runs."""
        proc = self.proc
        self.close()
        if proc is not None:
            await proc.wait()


if __name__ == "__main__":
    main()
