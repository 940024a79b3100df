"""`python -m nanoserve bench attention`: one decode step's attention on every road (IMPLS), Days 23-24: one
layer, `batch` requests of `context` keys in blocks over a shuffled pool, checked to agree, then timed interleaved
on cold caches, in an order shuffled each round; GB/s is the ideal bytes (every key and value read once) over
the median time."""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import Tensor

from .. import kernels
from ..attention import reference, torch_ops
from ..attention.causal import causal_attention
from ..attention.metadata import Chunk, prepare
from . import csvio
from .command import common_arguments, csv_header, report, start
from .roofline import measure_bandwidth
from .timing import Summary, interleaved, summarize, time_callable

CSV_PATH = "data/bench-attention.csv"
IMPLS = ("gather", "torch", "sdpa", "kernel", "split-k")
KV_PASSES = {"gather": 3, "torch": 2, "sdpa": 1, "kernel": 1, "split-k": 1}  # K/V bytes moved over the ideal
FLUSH_BYTES = 64 * 2**20  # read before every timed call: several times any CPU's last-level cache
FIELDS = ("impl", "threads", "batch", "context", "block_size", "ms", "p10_ms", "p90_ms", "n", "kv_ideal_mb",
          "kv_moved_mb", "moved_over_ideal", "gb_s", "of_read_bw", "x_kernel", "x_kernel_p10")


@dataclass(frozen=True)
class Point:
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
        return self.kv_ideal_bytes / self.time.median / 1e9

    def row(self, kernel: Summary) -> dict[str, object]:
        """The CSV row; x_kernel over the unsplit kernel's median in the same run, x_kernel_p10 over its p10."""
        t, ms, passes = self.time, lambda s: round(s * 1e3, 4), KV_PASSES[self.impl]
        return dict(zip(FIELDS, (self.impl, self.threads, self.batch, self.context, self.block_size, ms(t.median),
                                 ms(t.p10), ms(t.p90), t.n, round(self.kv_ideal_bytes / 1e6, 3),
                                 round(self.kv_ideal_bytes * passes / 1e6, 3), passes, round(self.gb_s, 3),
                                 round(self.gb_s * 1e9 / self.read_bw, 4), round(t.median / kernel.median, 4),
                                 round(t.p10 / kernel.p10, 4))))


def kv_ideal_bytes(batch: int, context: int, n_kv_heads: int, head_dim: int, itemsize: int = 4) -> int:
    """The K and V bytes a decode step's attention must read: every key and value once."""
    return 2 * batch * context * n_kv_heads * head_dim * itemsize


def decode_step(batch: int, context: int, n_heads: int, n_kv_heads: int, head_dim: int, block_size: int,
                seed: int = 0) -> dict[str, Callable[[], Tensor]]:
    """One layer's decode attention, a callable per road: random K/V in blocks from a shuffled free list (a pool
    that has served many requests), the same numbers contiguous for sdpa."""
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


def measure(batch: int, context: int, n_heads: int = 9, n_kv_heads: int = 3, head_dim: int = 64,
            block_size: int = 16, repeats: int = 30, budget_s: float = 4.0, read_bw: float = 1.0,
            impls: Sequence[str] = IMPLS, flush_bytes: int = FLUSH_BYTES) -> list[Point]:
    """Every road at one (batch, context), checked to agree, timed interleaved on cold caches, in an order shuffled
    each round: `repeats` rounds, fewer (at least 5) where a round takes longer than budget_s / repeats."""
    flush = torch.ones(flush_bytes // 4) if flush_bytes else None
    roads = decode_step(batch, context, n_heads, n_kv_heads, head_dim, block_size)
    roads = {name: fn for name, fn in roads.items() if name in impls}
    with torch.inference_mode():
        outs = {name: fn() for name, fn in roads.items()}
        first = next(iter(outs))
        for name, out in outs.items():
            if (err := (out - outs[first]).abs().max().item()) > 1e-5:
                raise AssertionError(f"{name} disagrees with {first} by {err} at batch {batch}, context {context}")
        one_round = time_callable(lambda: [fn() for fn in roads.values()], 1, warmup=0)[0]
        n = max(5, min(repeats, int(budget_s / max(one_round, 1e-9))))
        cold = None if flush is None else lambda _: flush.sum()  # the second road to read a pool finds it cold too
        samples = interleaved(list(roads.values()), n, warmup=0, before=cold, shuffle=0)
    ideal = kv_ideal_bytes(batch, context, n_kv_heads, head_dim)
    threads = torch.get_num_threads()
    return [Point(name, threads, batch, context, block_size, summarize(s), ideal, read_bw)
            for name, s in zip(roads, samples)]


def run_sweep(batches: Sequence[int] = (1, 32), contexts: Sequence[int] = (128, 512, 2048, 8192),
              block_size: int = 16, repeats: int = 30, budget_s: float = 4.0, shapes: tuple[int, int, int] = (9, 3, 64),
              thread_counts: Sequence[int] = (1,), log: Callable[[str], None] | None = print,
              ) -> tuple[list[Point], list[float]]:
    """The sweep at each of `thread_counts`, and the read bandwidth at the start and after each batch size."""
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
    return [replace(p, read_bw=statistics.median(bws)) for p in points], bws


def write_csv(path: str | Path, points: Sequence[Point], meta: dict) -> Path:
    kernel = {(p.threads, p.batch, p.context): p.time for p in points if p.impl == "kernel"}
    return csvio.write_csv(path, [p.row(kernel[(p.threads, p.batch, p.context)]) for p in points], meta, FIELDS)


def read_csv(path: str | Path) -> tuple[dict[str, str], list[dict[str, object]]]:
    return csvio.read_csv(path, parse=True)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--budget", type=float, default=4.0, help="seconds of timing per point, roughly (fewer repeats)")
    ap.add_argument("--thread-counts", type=int, nargs="+", default=None,
                    help="torch threads to sweep (default: 1 and torch's own count)")
    common_arguments(ap, CSV_PATH, contexts=[128, 512, 2048, 8192], repeats=30)


def run(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    if kernels.load() is None:
        print(f"nanoserve bench attention: error: the compiled kernels are unavailable: {kernels.unavailable_reason()}")
        return 1
    cfg = start(args)[0].cfg
    counts = args.thread_counts or sorted({1, torch.get_num_threads()})
    points, bws = run_sweep(args.batches, args.contexts, args.block_size, args.repeats, args.budget,
                            (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim), counts)
    bw = statistics.median(bws)
    meta = csv_header(argv, read_bandwidth=f"{bw:.4g}", split_keys=kernels.SPLIT_KEYS,
                      shapes=f"H={cfg.n_heads} K={cfg.n_kv_heads} D={cfg.head_dim}")
    print(f"\nread bandwidth {bw / 1e9:.1f} GB/s (median of {len(bws)})")
    return report(write_csv(args.out, points, meta), meta, read_csv(args.out)[1], [
        "impl", "threads", "batch", "context", "ms", "x_kernel", "moved_over_ideal", "gb_s", "of_read_bw"])
