"""`python -m nanoserve bench shared`: one request's decode under each thread setting (SETTINGS, "auto" the engine's
`ThreadPolicy`) on a quiet machine and beside a process keeping one core busy, interleaved round by round."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

import torch

from ..engine import LLMEngine
from ..model import Llama
from .command import common_arguments, csv_header, report, start
from .csvio import write_csv
from .harness import greedy, median_decode_step, prose

SETTINGS = {"2 threads": 2, "1 thread": 1, "auto": "auto"}


def decode_step_s(model: Llama, prompt: list[int], threads: int | str, steps: int) -> float:
    """The median decode step (s) of one greedy request alone in an engine on `threads`."""
    engine = LLMEngine(model, threads=threads)
    time.sleep(0.6)  # auto's policy looks every 0.5 s: its first look sees the machine as a long-lived server would
    return median_decode_step(engine, [prompt], [greedy(steps + 1)])[0]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    common_arguments(ap, "data/bench-shared.csv", prompt_tokens=300, weights="gguf", steps=48, rounds=3)


def run(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    model, tok = start(args)
    prompt = prose(tok, args.prompt_tokens)
    default_threads = torch.get_num_threads()
    decode_step_s(model, prompt[:32], default_threads, 4)  # warm up: kernels, first allocations
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for busy in (False, True):
            neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
            try:
                for name, threads in SETTINGS.items():
                    times.setdefault((name, "busy" if busy else "quiet"), []).append(
                        decode_step_s(model, prompt, threads, args.steps))
            finally:
                if neighbour is not None:
                    neighbour.kill()
                    neighbour.wait()
        torch.set_num_threads(default_threads)
    rows = []
    for name in SETTINGS:
        quiet, busy = times[(name, "quiet")], times[(name, "busy")]
        rows.append(dict(threads=name, quiet_step_ms=statistics.median(quiet) * 1e3,
                         busy_step_ms=statistics.median(busy) * 1e3,
                         slowdown=statistics.median(b / q for q, b in zip(quiet, busy))))
    meta = csv_header(argv, weights=args.weights, prompt_tokens=args.prompt_tokens, steps=args.steps,
                      rounds=args.rounds, neighbour="one Python process spinning on one core")
    write_csv(args.out, rows, meta)
    return report(args.out, meta, rows)
