"""`python -m nanoserve bench attention`: one decode step's attention, every road, side by side (Days 23, 24).

    gather   the reference read (Day 18): each request's blocks copied out of the pool, then SDPA over the copy
    torch    Day 28's batched torch ops: keys gathered into one rectangle, values summed by embedding_bag
    sdpa     contiguous SDPA: the same keys already in one contiguous (B, K, S, D) tensor, one fused call; what
             a cache without blocks would do
    kernel   the compiled kernel, reading each key where it lies in the pool, split-K off
    split-k  the same kernel with split-K: decode rows longer than `kernels.SPLIT_KEYS` keys read in pieces

One layer of one decode step, at each thread count asked for (1 and torch's own by default: split-K can
only pay where there is more than one core): `batch` requests, one query each, every request `context` keys in blocks
scattered over a shuffled pool, the model's shapes (heads, kv heads, head_dim). The roads are checked to
agree before anything is timed, then timed interleaved call by call, so a shared machine's slow moment falls
on all of them, and each call starts on cold caches (`cold_interleaved`), as a layer's attention does in a
real step.

Bytes are counted, not sampled: the ideal is the K/V bytes the step must read once (batch x context x kv
heads x head_dim x 4 bytes, for K and for V). `gather` and `torch` read the pool, write a copy and read the
copy again (3x the ideal; `torch` copies the keys only, 2x); `sdpa` and the kernel read each byte once. GB/s
is the ideal bytes over the median time; `of_read_bw` divides it by this machine's read bandwidth measured
in the same run (a sum over a large buffer, `bench.roofline.measure_bandwidth`).

    python -m nanoserve bench attention          # writes data/bench-attention.csv
"""

from __future__ import annotations

import argparse
import csv
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from .. import kernels
from ..attention import reference, torch_ops
from ..attention.causal import causal_attention
from ..attention.metadata import Chunk, prepare
from .machine import add_common_arguments, command_line, csv_header, use_threads
from .roofline import measure_bandwidth
from .timing import Summary, summarize

CSV_PATH = "data/bench-attention.csv"
IMPLS = ("gather", "torch", "sdpa", "kernel", "split-k")
KV_PASSES = {"gather": 3, "torch": 2, "sdpa": 1, "kernel": 1, "split-k": 1}
"""K/V bytes each road moves, in units of the ideal: the gathers read, write and re-read what they copy
(`torch` copies the keys, and reads the values in place)."""
FLUSH_BYTES = 64 * 2**20
"""Read before every timed call: several times any CPU's last-level cache."""
FIELDS = ("impl", "threads", "batch", "context", "block_size", "ms", "p10_ms", "p90_ms", "n", "kv_ideal_mb",
          "kv_moved_mb", "moved_over_ideal", "gb_s", "of_read_bw", "x_kernel", "x_kernel_p10")


@dataclass(frozen=True)
class Point:
    """One road at one (batch, context): its times, and the bytes the step needed."""

    impl: str
    threads: int
    batch: int
    context: int
    block_size: int
    time: Summary  # seconds per call
    kv_ideal_bytes: int
    read_bw: float  # bytes/s, this machine, this run

    @property
    def gb_s(self) -> float:
        """Ideal K/V bytes over the median time: the bandwidth the step behaves as if it had."""
        return self.kv_ideal_bytes / self.time.median / 1e9

    def row(self, kernel: Summary) -> dict[str, object]:
        """The CSV row; x_kernel divides by the unsplit kernel's median in the same run (x_kernel_p10: the
        10th percentiles, what each road costs when the machine's other work leaves it alone)."""
        t = self.time
        return dict(impl=self.impl, threads=self.threads, batch=self.batch, context=self.context,
                    block_size=self.block_size,
                    ms=round(t.median * 1e3, 4), p10_ms=round(t.p10 * 1e3, 4), p90_ms=round(t.p90 * 1e3, 4), n=t.n,
                    kv_ideal_mb=round(self.kv_ideal_bytes / 1e6, 3),
                    kv_moved_mb=round(self.kv_ideal_bytes * KV_PASSES[self.impl] / 1e6, 3),
                    moved_over_ideal=KV_PASSES[self.impl], gb_s=round(self.gb_s, 3),
                    of_read_bw=round(self.gb_s * 1e9 / self.read_bw, 4), x_kernel=round(t.median / kernel.median, 4),
                    x_kernel_p10=round(t.p10 / kernel.p10, 4))


def kv_ideal_bytes(batch: int, context: int, n_kv_heads: int, head_dim: int, itemsize: int = 4) -> int:
    """The K and V bytes a decode step's attention must read once: every request's every key and value."""
    return 2 * batch * context * n_kv_heads * head_dim * itemsize


def decode_step(batch: int, context: int, n_heads: int, n_kv_heads: int, head_dim: int, block_size: int,
                seed: int = 0) -> dict[str, Callable[[], Tensor]]:
    """One layer's decode attention for `batch` requests of `context` keys, as each road runs it: a callable
    per road. The pool holds random K/V in blocks drawn from a shuffled free list (a pool that has served
    many requests); the contiguous road holds the same numbers in order."""
    g = torch.Generator().manual_seed(seed)
    per = -(-context // block_size)
    n_blocks = batch * per
    k_pool, v_pool = torch.randn(2, n_blocks, block_size, n_kv_heads, head_dim, generator=g)
    order = list(range(n_blocks))
    random.Random(seed).shuffle(order)
    tables = [order[r * per:(r + 1) * per] for r in range(batch)]
    _, md = prepare([Chunk([0], context - 1, t) for t in tables], block_size)
    q = torch.randn(batch, n_heads, head_dim, generator=g)  # (N, H, D): one query per request
    kv_new = q.new_zeros(batch, n_kv_heads, head_dim)  # the step's own k/v: already in the pool, unused by decode
    idx = torch.tensor(tables).view(-1)
    k_cont = k_pool[idx].view(batch, per * block_size, n_kv_heads, head_dim)[:, :context].transpose(1, 2).contiguous()
    v_cont = v_pool[idx].view(batch, per * block_size, n_kv_heads, head_dim)[:, :context].transpose(1, 2).contiguous()
    scale = head_dim**-0.5
    torch_scratch: dict = {}
    torch_ops.attend(q, kv_new, kv_new, k_pool, v_pool, md, torch_scratch)  # the layout every layer reuses

    def paged(split_keys: int) -> Tensor:
        return kernels.paged_attention(q, k_pool, v_pool, md.query_start_loc, md.seq_lens, md.block_tables, scale,
                                       split_keys=split_keys)

    return {
        "gather": lambda: reference.attend(q, kv_new, kv_new, k_pool, v_pool, md, {}),
        "torch": lambda: torch_ops.attend(q, kv_new, kv_new, k_pool, v_pool, md, torch_scratch),
        "sdpa": lambda: causal_attention(q[:, None], k_cont.transpose(1, 2), v_cont.transpose(1, 2))[:, 0],
        "kernel": lambda: paged(0),
        "split-k": lambda: paged(kernels.SPLIT_KEYS),
    }


def cold_interleaved(fns: Sequence[Callable[[], object]], repeats: int, flush: Tensor | None = None,
                     clock: Callable[[], float] = time.perf_counter) -> list[list[float]]:
    """Time each fn `repeats` times, round-robin, each call after a sum over `flush` (untimed): the caches hold
    none of the call's K/V, as in a real step, where the layer's weight products have just streamed through
    them. Without it the second road to read a pool would find it warm from the first."""
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            if flush is not None:
                flush.sum()
            t0 = clock()
            fn()
            samples[i].append(clock() - t0)
    return samples


def measure(batch: int, context: int, n_heads: int = 9, n_kv_heads: int = 3, head_dim: int = 64,
            block_size: int = 16, repeats: int = 30, budget_s: float = 4.0, read_bw: float = 1.0,
            impls: Sequence[str] = IMPLS, flush_bytes: int = FLUSH_BYTES) -> list[Point]:
    """Every road at one (batch, context), checked to agree, then timed interleaved, each call on cold caches:
    `repeats` rounds, fewer (at least 5) where a round takes longer than budget_s / repeats."""
    flush = torch.ones(flush_bytes // 4) if flush_bytes else None
    roads = decode_step(batch, context, n_heads, n_kv_heads, head_dim, block_size)
    roads = {name: fn for name, fn in roads.items() if name in impls}
    with torch.inference_mode():
        outs = {name: fn() for name, fn in roads.items()}
        first = outs[next(iter(outs))]
        for name, out in outs.items():
            err = (out - first).abs().max().item()
            if err > 1e-5:
                raise AssertionError(f"{name} disagrees with {next(iter(outs))} by {err} at batch {batch}, {context}")
        t0 = time.perf_counter()
        for fn in roads.values():
            fn()
        one_round = time.perf_counter() - t0
        n = max(5, min(repeats, int(budget_s / max(one_round, 1e-9))))
        samples = cold_interleaved(list(roads.values()), n, flush)
    ideal = kv_ideal_bytes(batch, context, n_kv_heads, head_dim)
    threads = torch.get_num_threads()
    return [Point(name, threads, batch, context, block_size, summarize(s), ideal, read_bw)
            for name, s in zip(roads, samples)]


def run_sweep(batches: Sequence[int] = (1, 32), contexts: Sequence[int] = (128, 512, 2048, 8192),
              block_size: int = 16, repeats: int = 30, budget_s: float = 4.0, shapes: tuple[int, int, int] = (9, 3, 64),
              thread_counts: Sequence[int] = (1,), log: Callable[[str], None] | None = print,
              ) -> tuple[list[Point], list[float]]:
    """The sweep at each of `thread_counts` torch threads, and this machine's read bandwidth, measured at the
    start and after each batch size (their median is the one used)."""
    before = torch.get_num_threads()
    bws = [measure_bandwidth(2**28, 5)[0]]
    points: list[Point] = []
    try:
        for batch in batches:
            for context in contexts:
                for threads in thread_counts:
                    torch.set_num_threads(threads)
                    pts = measure(batch, context, *shapes, block_size, repeats, budget_s, statistics.median(bws))
                    points += pts
                    if log:
                        kernel = next(p for p in pts if p.impl == "kernel").time.median
                        log(f"[time] {threads} thr B={batch:2d} ctx {context:5d}: " + "  ".join(
                            f"{p.impl} {p.time.median * 1e3:.3f} ms ({p.time.median / kernel:.2f}x)" for p in pts))
            torch.set_num_threads(before)
            bws.append(measure_bandwidth(2**28, 5)[0])
    finally:
        torch.set_num_threads(before)
    bw = statistics.median(bws)
    points = [Point(p.impl, p.threads, p.batch, p.context, p.block_size, p.time, p.kv_ideal_bytes, bw) for p in points]
    return points, bws


def write_csv(path: str | Path, points: Sequence[Point], header: Sequence[str]) -> None:
    """The CSV: `header`'s `#` lines, then one row per (impl, batch, context), x_kernel against the kernel."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    kernel = {(p.threads, p.batch, p.context): p.time for p in points if p.impl == "kernel"}
    with path.open("w", newline="") as f:
        f.write("".join(f"{line}\n" for line in header))
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for p in points:
            w.writerow(p.row(kernel[(p.threads, p.batch, p.context)]))


def read_csv(path: str | Path) -> tuple[dict[str, str], list[dict[str, object]]]:
    """The `# key: value` lines and the rows of a CSV written by `write_csv`, numbers parsed."""
    meta, lines = {}, []
    for line in Path(path).read_text().splitlines():
        if line.startswith("# "):
            key, _, value = line[2:].partition(": ")
            meta[key] = value
        elif line:
            lines.append(line)
    ints = {"threads", "batch", "context", "block_size", "n"}
    return meta, [{k: v if k == "impl" else int(v) if k in ints else float(v) for k, v in r.items()}
                  for r in csv.DictReader(lines)]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048, 8192])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=30, help="interleaved rounds per point (fewer for slow points)")
    ap.add_argument("--budget", type=float, default=4.0, help="seconds of timing per point, roughly")
    ap.add_argument("--thread-counts", type=int, nargs="+", default=None,
                    help="torch threads to sweep (default: 1 and torch's own count)")
    add_common_arguments(ap, CSV_PATH)


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """`python -m nanoserve bench attention`: the sweep on the loaded model's shapes, a table, and the CSV."""
    use_threads(args)
    from ..loader import load

    if kernels.load() is None:
        print(f"nanoserve bench attention: error: the compiled kernels are unavailable: {kernels.unavailable_reason()}")
        return 1
    model, _ = load()
    cfg = model.cfg
    counts = args.thread_counts or sorted({1, torch.get_num_threads()})
    points, bws = run_sweep(args.batches, args.contexts, args.block_size, args.repeats, args.budget,
                            (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim), counts)
    bw = statistics.median(bws)
    write_csv(args.out, points, csv_header(command_line(argv), read_bandwidth=f"{bw:.4g}",
                                           split_keys=kernels.SPLIT_KEYS,
                                           shapes=f"H={cfg.n_heads} K={cfg.n_kv_heads} D={cfg.head_dim}"))
    kernel = {(p.threads, p.batch, p.context): p.time.median for p in points if p.impl == "kernel"}
    print(f"\nread bandwidth {bw / 1e9:.1f} GB/s (median of {len(bws)})")
    print(f"{'impl':8s}{'thr':>4s}{'B':>4s}{'context':>8s}{'ms':>10s}{'x kernel':>10s}{'moved/ideal':>12s}{'GB/s':>8s}"
          f"{'of read bw':>11s}")
    for p in points:
        print(f"{p.impl:8s}{p.threads:4d}{p.batch:4d}{p.context:8d}{p.time.median * 1e3:10.3f}"
              f"{p.time.median / kernel[(p.threads, p.batch, p.context)]:10.2f}{KV_PASSES[p.impl]:12.1f}{p.gb_s:8.2f}"
              f"{p.gb_s * 1e9 / bw:11.2f}")
    print(f"-> {args.out}")
    return 0
