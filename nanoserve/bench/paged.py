"""`python -m nanoserve bench paged`: paged vs contiguous decode (Day 20), interleaved: `step`, a whole decode
step of the real model, and `read`, one layer's attention read, on random K/V (a step's cost does not depend on
values), the paged copy in blocks from a shuffled free list."""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..attention.causal import causal_attention
from ..attention.reference import gather_blocks
from ..kv import BlockPool
from ..model import Llama
from ..stages import CachedSession, PagedSession, paged_session
from . import csvio
from .command import common_arguments, csv_header, report, start
from .timing import DEFAULT_CLOCK, Clock, Summary, interleaved, summarize

CSV_PATH = "data/day-20-paged-vs-contiguous.csv"
FIELDS = ["measure", "context", "block_size", "contiguous_ms", "paged_ms", "ratio",
          "contiguous_p10_ms", "contiguous_p90_ms", "paged_p10_ms", "paged_p90_ms", "n"]


@dataclass(frozen=True)
class Comparison:
    measure: str
    context: int
    block_size: int
    contiguous: Summary
    paged: Summary

    @property
    def ratio(self) -> float:
        return self.paged.median / self.contiguous.median

    def row(self) -> dict[str, object]:
        c, p, ms = self.contiguous, self.paged, lambda s: round(s * 1e3, 4)
        return dict(zip(FIELDS, (self.measure, self.context, self.block_size, ms(c.median), ms(p.median),
                                 round(self.ratio, 4), ms(c.p10), ms(c.p90), ms(p.p10), ms(p.p90), p.n)))


def contiguous_at(model: Llama, context: int, room: int, seed: int = 0) -> CachedSession:
    """A contiguous session holding `context` positions of random K/V, `room` more to decode into."""
    session, g = CachedSession(model, context + room), torch.Generator().manual_seed(seed)
    for t in (session.cache.k, session.cache.v):
        t.copy_(torch.randn(t.shape, generator=g))
    session.cache.length = context
    return session


def paged_like(model: Llama, contiguous: CachedSession, block_size: int, room: int, seed: int = 0) -> PagedSession:
    """A paged session (reading through the gather) holding `contiguous`'s K/V in blocks from a shuffled list."""
    n = contiguous.cache.length
    session = paged_session(model, n + room, block_size, attention="reference")
    random.Random(seed).shuffle(session.manager.pool.free_list)
    slots = torch.tensor(session.manager.append_slots(session.table, [0] * n)[0])
    for layer in range(model.cfg.n_layers):
        k, v = (t[layer, 0, :, :n].transpose(0, 1) for t in (contiguous.cache.k, contiguous.cache.v))  # (n, K, D)
        session.runner.storage.write(layer, slots, k, v)
    session.manager.commit(session.table)
    return session


def measure_context(model: Llama, context: int, block_sizes: Sequence[int], step_repeats: int,
                    read_repeats: int, token: int = 42, clock: Clock = DEFAULT_CLOCK) -> list[Comparison]:
    """Both measures at one context, every block size, each paged road interleaved with the contiguous one."""
    contiguous = contiguous_at(model, context, step_repeats + 4)
    sessions = [contiguous] + [paged_like(model, contiguous, bs, step_repeats + 4) for bs in block_sizes]
    with torch.inference_mode():
        first = [s.decode(token) for s in sessions]  # also the first warmup step
    # random K/V make 30 layers chaotic, so two fp32 roads drift apart more than on text; a wrong read would
    # still be off by the logits' own size
    for bs, logits in zip(block_sizes, first[1:]):
        if (err := (logits - first[0]).abs().max().item()) > 1e-3 * float(first[0].abs().max()):
            raise AssertionError(f"paged (block {bs}) and contiguous logits differ by {err} at context {context}")
    steps = interleaved([lambda s=s: s.decode(token) for s in sessions], step_repeats, 1, clock)
    q = torch.randn(1, 1, model.cfg.n_heads, model.cfg.head_dim, generator=torch.Generator().manual_seed(1))
    kc, vc = (t[0, :, :, :context].transpose(1, 2) for t in (contiguous.cache.k, contiguous.cache.v))  # (1, n, K, D)
    reads = [lambda: causal_attention(q, kc, vc)] + [  # one layer: q of one new token over `context` keys
        lambda s=s: causal_attention(q, *(t[None] for t in gather_blocks(s.runner.storage.k[0], s.runner.storage.v[0],
                                                                          s.table.blocks, context)))
        for s in sessions[1:]]
    assert all(torch.allclose(r(), reads[0](), atol=1e-5) for r in reads[1:])
    read_samples = interleaved(reads, read_repeats, 2, clock)
    return [Comparison(m, context, bs, summarize(samples[0]), summarize(samples[i + 1]))
            for i, bs in enumerate(block_sizes) for m, samples in (("step", steps), ("read", read_samples))]


def run_sweep(model: Llama, contexts: Sequence[int] = (128, 256, 512, 1024, 2048, 4096),
              block_sizes: Sequence[int] = (16, 256), step_repeats: int = 15, read_repeats: int = 60,
              log: Callable[[str], None] | None = print, clock: Clock = DEFAULT_CLOCK) -> list[Comparison]:
    rows = []
    for context in contexts:
        for c in measure_context(model, context, block_sizes, step_repeats, read_repeats, clock=clock):
            rows.append(c)
            if log:
                log(f"[time] {c.measure:4s} ctx {c.context:5d} block {c.block_size:3d}: contiguous "
                    f"{c.contiguous.median * 1e3:8.3f} ms  paged {c.paged.median * 1e3:8.3f} ms  ratio {c.ratio:.3f}")
    return rows


@dataclass(frozen=True)
class UsagePoint:
    step: int
    running: int
    tokens: int  # K/V positions the running requests actually hold
    paged_slots: int  # slots in the blocks they hold (a real BlockPool's count)
    contiguous_slots: int  # running x max_len: what a contiguous cache reserves

    @property
    def paged_utilisation(self) -> float:
        return self.tokens / self.paged_slots if self.paged_slots else 1.0

    @property
    def contiguous_utilisation(self) -> float:
        return self.tokens / self.contiguous_slots if self.contiguous_slots else 1.0


def utilisation_trace(requests: Sequence[tuple[int, int]], block_size: int, max_len: int,
                      max_running: int) -> list[UsagePoint]:
    """Serve (prompt, output) length pairs first come first served, at most `max_running` at once, each gaining a
    token per step until its output is done; the paged side is a real BlockPool (a block allocated when a request
    crosses into it, freed when the request leaves)."""
    if any(p < 1 or o < 0 or p + o > max_len for p, o in requests):
        raise ValueError(f"every request needs a prompt >= 1 token and prompt + output <= max_len={max_len}")
    pool = BlockPool(max_running * -(-max_len // block_size), block_size, prefix_caching=False)
    waiting, running, points = deque(requests), [], []  # running: [tokens held, final length, blocks]
    while waiting or running:
        while waiting and len(running) < max_running:
            p, o = waiting.popleft()
            running.append([p, p + o, pool.allocate(-(-p // block_size))])
        points.append(UsagePoint(len(points), len(running), sum(r[0] for r in running),
                                 pool.num_used * block_size, len(running) * max_len))
        for r in list(running):
            if r[0] == r[1]:
                for b in r[2]:
                    pool.free(b)
                running.remove(r)
                continue
            r[0] += 1
            if r[0] > len(r[2]) * block_size:
                r[2] += pool.allocate(1)
    pool.check()
    assert pool.num_free == pool.num_blocks, "the trace leaked blocks"
    return points


def write_csv(path: str | Path, rows: Sequence[Comparison], meta: dict[str, object]) -> Path:
    return csvio.write_csv(path, [r.row() for r in rows], meta, FIELDS)


def read_csv(path: str | Path) -> tuple[dict[str, str], list[dict[str, float | int | str]]]:
    return csvio.read_csv(path, parse=True)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[16, 256])
    ap.add_argument("--step-repeats", type=int, default=15)
    ap.add_argument("--read-repeats", type=int, default=60)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="wall: time.perf_counter; cpu: this thread's CPU time (needs --threads 1), which other "
                         "processes on a shared machine do not inflate")
    common_arguments(ap, CSV_PATH, contexts=[128, 256, 512, 1024, 2048, 4096])


def run(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    if args.clock == "cpu" and (args.threads or torch.get_num_threads()) != 1:
        print("nanoserve bench paged: error: --clock cpu counts one thread's CPU time, so it needs --threads 1",
              file=sys.stderr)
        return 2
    model, _ = start(args)
    clock = time.thread_time if args.clock == "cpu" else DEFAULT_CLOCK
    rows = run_sweep(model, args.contexts, args.block_sizes, args.step_repeats, args.read_repeats, clock=clock)
    meta = csv_header(argv, clock=args.clock)
    return report(write_csv(args.out, rows, meta), meta, [r.row() for r in rows], FIELDS[:6])
