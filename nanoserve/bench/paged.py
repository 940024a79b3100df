"""Paged vs contiguous decode, measured (Day 20): what the reference gather costs.

The paged side runs the reference read (`attention.reference`): it gathers a
sequence's blocks into a contiguous copy before attention, while the contiguous
cache attends over a view of memory that is already in order. Everything else in
a decode step is the same model code, so a step differs by that copy, by the
paged step's metadata, and by the attention call (SDPA over the copy against the
contiguous cache's one-query read, `decode_attention`); the `read` measure
isolates the copy, SDPA on both sides. The compiled attention reads blocks where
they lie instead; this module says how big the debt it avoids is.

Two measurements, each paged vs contiguous in the same run, interleaved sample
by sample so that drift on a shared machine lands on both sides:

- `step`: one whole decode step of the real model through each path's Session
  (weights streamed, 30 layers of write + read), at a given context.
- `read`: one layer's attention read alone (gather + attention vs attention over
  the view), the part of the step the gather lives in.

The caches are filled with random K/V of the right shape rather than by a
prefill: a step's cost does not depend on the values, and a 4096-token prefill
would dominate the run. The paged copy is written through the write path from
the contiguous one into a shuffled free list (blocks scattered as in a pool that
has served many requests), and the first step's logits of both paths are
checked to agree, so both sides do the same work on the same numbers.

    python -m nanoserve bench paged          # writes data/day-20-paged-vs-contiguous.csv
"""

from __future__ import annotations

import argparse
import csv
import random
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..attention.causal import causal_attention
from ..attention.reference import gather_blocks
from ..kv import BlockPool
from ..model import Llama
from ..stages import CachedSession, PagedSession, paged_session
from .machine import add_common_arguments, command_line, csv_header, use_threads
from .timing import DEFAULT_CLOCK, Clock, Summary, summarize, time_callable

CSV_PATH = "data/day-20-paged-vs-contiguous.csv"
FIELDS = ["measure", "context", "block_size", "contiguous_ms", "paged_ms", "ratio",
          "contiguous_p10_ms", "contiguous_p90_ms", "paged_p10_ms", "paged_p90_ms", "n"]


@dataclass(frozen=True)
class Comparison:
    """One context and block size: the contiguous and paged samples of one measure, taken interleaved."""

    measure: str  # "step" or "read"
    context: int
    block_size: int
    contiguous: Summary  # seconds
    paged: Summary

    @property
    def ratio(self) -> float:
        """Median paged / median contiguous: 1.0 means the gather is free."""
        return self.paged.median / self.contiguous.median

    def row(self) -> dict[str, object]:
        c, p = self.contiguous, self.paged
        return dict(measure=self.measure, context=self.context, block_size=self.block_size,
                    contiguous_ms=round(c.median * 1e3, 4), paged_ms=round(p.median * 1e3, 4),
                    ratio=round(self.ratio, 4), contiguous_p10_ms=round(c.p10 * 1e3, 4),
                    contiguous_p90_ms=round(c.p90 * 1e3, 4), paged_p10_ms=round(p.p10 * 1e3, 4),
                    paged_p90_ms=round(p.p90 * 1e3, 4), n=p.n)


def interleaved(fns: Sequence[Callable[[], object]], repeats: int, warmup: int = 2,
                clock: Clock = DEFAULT_CLOCK) -> list[list[float]]:
    """Time each fn `repeats` times, round-robin (a, b, c, a, b, c, ...), after `warmup` untimed rounds."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            samples[i].extend(time_callable(fn, repeats=1, warmup=0, clock=clock))
    return samples


def contiguous_at(model: Llama, context: int, room: int, seed: int = 0) -> CachedSession:
    """A contiguous session holding `context` positions of random K/V, with `room` more to decode into."""
    session = CachedSession(model, context + room)
    g = torch.Generator().manual_seed(seed)
    session.cache.k.copy_(torch.randn(session.cache.k.shape, generator=g))
    session.cache.v.copy_(torch.randn(session.cache.v.shape, generator=g))
    session.cache.length = context
    return session


def paged_like(model: Llama, contiguous: CachedSession, block_size: int, room: int, seed: int = 0) -> PagedSession:
    """A paged session holding the same K/V as `contiguous`, written through the write path into
    blocks drawn from a shuffled free list."""
    n = contiguous.cache.length
    session = paged_session(model, n + room, block_size, attention="reference")  # the gather is what is measured
    pool = session.manager.pool
    free = list(pool.free_list)
    random.Random(seed).shuffle(free)
    pool.free_list.clear()
    pool.free_list.extend(free)
    slots, _ = session.manager.append_slots(session.table, [0] * n)
    slots = torch.tensor(slots)
    for layer in range(model.cfg.n_layers):
        kc, vc = contiguous.cache.k[layer, 0, :, :n], contiguous.cache.v[layer, 0, :, :n]  # (K, n, D)
        session.runner.storage.write(layer, slots, kc.transpose(0, 1), vc.transpose(0, 1))  # (n, K, D) into the slots
    session.manager.commit(session.table)
    return session


def measure_context(model: Llama, context: int, block_sizes: Sequence[int], step_repeats: int,
                    read_repeats: int, token: int = 42, clock: Clock = DEFAULT_CLOCK) -> list[Comparison]:
    """Both measures at one context, every block size, each paged path interleaved with the contiguous one."""
    room = step_repeats + 4
    contiguous = contiguous_at(model, context, room)
    paged = [paged_like(model, contiguous, bs, room) for bs in block_sizes]
    with torch.inference_mode():
        first = [s.decode(token) for s in [contiguous, *paged]]  # also the first warmup step
    # random K/V make 30 layers chaotic, so two fp32 roads drift further apart than on real text; a wrong
    # read would still be off by the logits' own size
    bound = 1e-3 * float(first[0].abs().max())
    for bs, logits in zip(block_sizes, first[1:]):
        err = (logits - first[0]).abs().max().item()
        if err > bound:
            raise AssertionError(f"paged (block {bs}) and contiguous logits differ by {err} at context {context}")
    steps = interleaved([lambda s=s: s.decode(token) for s in [contiguous, *paged]], step_repeats, 1, clock)

    # one layer's read: q of one new token over the first `context` keys
    D, H = model.cfg.head_dim, model.cfg.n_heads
    q = torch.randn(1, 1, H, D, generator=torch.Generator().manual_seed(1))  # (1, 1, H, D)
    kc, vc = contiguous.cache.k[0, :, :, :context], contiguous.cache.v[0, :, :, :context]  # (1, K, n, D)
    reads = [lambda: causal_attention(q, kc.transpose(1, 2), vc.transpose(1, 2))]
    def paged_read(s: PagedSession) -> Tensor:
        kc, vc = gather_blocks(s.runner.storage.k[0], s.runner.storage.v[0], s.table.blocks, context)  # (context, K, D)
        return causal_attention(q, kc[None], vc[None])

    reads += [lambda s=s: paged_read(s) for s in paged]
    assert all(torch.allclose(r(), reads[0]().view_as(r()), atol=1e-5) for r in reads[1:])
    read_samples = interleaved(reads, read_repeats, 2, clock)

    out = []
    for i, bs in enumerate(block_sizes):
        out.append(Comparison("step", context, bs, summarize(steps[0]), summarize(steps[i + 1])))
        out.append(Comparison("read", context, bs, summarize(read_samples[0]), summarize(read_samples[i + 1])))
    return out


def run_sweep(model: Llama, contexts: Sequence[int] = (128, 256, 512, 1024, 2048, 4096),
        block_sizes: Sequence[int] = (16, 256), step_repeats: int = 15, read_repeats: int = 60,
        log: Callable[[str], None] | None = print, clock: Clock = DEFAULT_CLOCK) -> list[Comparison]:
    """The whole sweep; logs one `[time]` line per comparison as it goes."""
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
    """Memory at one decode step of a served workload: tokens held vs slots each cache has set aside."""

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
    """Serve (prompt, output) length pairs first come first served, at most `max_running` at once, every
    running request gaining one token per step; a request leaves when its output is done. The paged side
    is a real BlockPool: a block is allocated when a request crosses into it and freed when it leaves."""
    if any(p < 1 or o < 0 or p + o > max_len for p, o in requests):
        raise ValueError(f"every request needs a prompt >= 1 token and prompt + output <= max_len={max_len}")
    pool = BlockPool(max_running * -(-max_len // block_size), block_size, prefix_caching=False)
    waiting = deque(requests)
    running: list[list] = []  # [tokens held, final length, blocks]
    points = []
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


def write_csv(path: str | Path, rows: Sequence[Comparison], header: Sequence[str]) -> None:
    """CSV with `header`'s `#` lines (the command, the machine) above the column names."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        f.write("".join(f"{line}\n" for line in header))
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow(r.row())


def read_csv(path: str | Path) -> tuple[dict[str, str], list[dict[str, float | int | str]]]:
    """The `# key: value` lines and the rows of a CSV written by `write_csv`, numbers parsed."""
    meta, lines = {}, []
    for line in Path(path).read_text().splitlines():
        if line.startswith("# "):
            key, _, value = line[2:].partition(": ")
            meta[key] = value
        elif line:
            lines.append(line)
    rows = []
    for r in csv.DictReader(lines):
        rows.append({k: (v if k == "measure" else int(v) if k in ("context", "block_size", "n") else float(v))
                     for k, v in r.items()})
    return meta, rows


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096])
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[16, 256])
    ap.add_argument("--step-repeats", type=int, default=15)
    ap.add_argument("--read-repeats", type=int, default=60)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="wall: time.perf_counter; cpu: this thread's CPU time (needs --threads 1), which other "
                         "processes on a shared machine do not inflate")
    add_common_arguments(ap, CSV_PATH)


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """`python -m nanoserve bench paged`: the sweep, a table, and the CSV."""
    use_threads(args)
    if args.clock == "cpu" and torch.get_num_threads() != 1:
        print("nanoserve bench paged: error: --clock cpu counts one thread's CPU time, so it needs --threads 1",
              file=sys.stderr)
        return 2
    clock = time.thread_time if args.clock == "cpu" else DEFAULT_CLOCK
    from ..loader import load

    model, _ = load()
    rows = run_sweep(model, args.contexts, args.block_sizes, args.step_repeats, args.read_repeats, clock=clock)
    write_csv(args.out, rows, csv_header(command_line(argv), clock=args.clock))
    print(f"\n{'measure':8s}{'context':>8s}{'block':>6s}{'contig ms':>11s}{'paged ms':>10s}{'ratio':>7s}")
    for r in rows:
        print(f"{r.measure:8s}{r.context:8d}{r.block_size:6d}{r.contiguous.median * 1e3:11.3f}"
              f"{r.paged.median * 1e3:10.3f}{r.ratio:7.3f}")
    print(f"-> {args.out}")
    return 0
