"""This machine's roofline (Day 11): a kernel is limited by compute or by memory reads, whichever runs out first;
its arithmetic intensity (FLOPs per byte read) says which. Batch-1 decode's floor is reading every weight once."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..config import ModelConfig, kv_bytes_per_token
from ..kernels import huge_pages
from ..model import Llama
from ..model.matmul import ONEDNN, onednn_linear, pack
from .timing import time_callable


def decode_limit_tok_s(weight_bytes: float, bandwidth: float) -> float:
    """Best possible batch-1 decode rate: each token must stream every weight once."""
    if weight_bytes <= 0 or bandwidth <= 0:
        raise ValueError(f"weight_bytes and bandwidth must be positive, got {weight_bytes}, {bandwidth}")
    return bandwidth / weight_bytes


def decode_intensity(n_params: float, batch: int = 1, bytes_per_param: float = 4.0,
                     kv_bytes: float = 0.0) -> float:
    """FLOPs per byte of one decode step: 2 per weight per row, the weights read once for all rows, plus `kv_bytes`."""
    if n_params <= 0 or batch < 1 or bytes_per_param <= 0 or kv_bytes < 0:
        raise ValueError(f"bad decode step: n_params={n_params}, batch={batch}, bytes={bytes_per_param}")
    return 2.0 * n_params * batch / (n_params * bytes_per_param + kv_bytes)


def attainable_flops(intensity: float, peak: float, bandwidth: float) -> float:
    """The roofline: min(peak, intensity x bandwidth) FLOP/s."""
    if intensity < 0 or peak <= 0 or bandwidth <= 0:
        raise ValueError(f"intensity >= 0, peak > 0 and bandwidth > 0 expected, got {intensity}, {peak}, {bandwidth}")
    return min(peak, intensity * bandwidth)


def ridge_point(peak: float, bandwidth: float) -> float:
    """Intensity (FLOP/byte) where a kernel stops being memory-bound."""
    return peak / bandwidth


def forward_flops_by_group(cfg: ModelConfig, n_tokens: int, context: int = 0, last_only: bool = True,
                           ) -> dict[str, int]:
    """FLOPs of one forward of `n_tokens` after `context` cached ones, by op group: 2 per weight per token (the
    head's only the last with `last_only`), 4 x H x D per (query, visible key) pair for attention."""
    T, C, D, L = n_tokens, cfg.hidden_size, cfg.head_dim, cfg.n_layers
    pairs = T * context + T * (T + 1) // 2  # causal
    return {"qkv": 2 * T * C * (cfg.n_heads + 2 * cfg.n_kv_heads) * D * L, "o_proj": 2 * T * cfg.n_heads * D * C * L,
            "mlp": 2 * T * 3 * C * cfg.intermediate_size * L, "attention": 4 * cfg.n_heads * D * pairs * L,
            "lm_head": 2 * cfg.vocab_size * C * (1 if last_only else T)}


def forward_flops(cfg: ModelConfig, n_tokens: int, context: int = 0, last_only: bool = True) -> float:
    return float(sum(forward_flops_by_group(cfg, n_tokens, context, last_only).values()))


def forward_sweep(model: Llama, lengths: list[int], repeats: int = 3) -> list[dict]:
    """One forward of T prompt tokens per T: prefill's cost curve, its FLOP/s and weight GB/s (which roof)."""
    rows, g = [], torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for T in lengths:
            ids = torch.randint(0, model.cfg.vocab_size, (1, T), generator=g)
            sec = statistics.median(time_callable(lambda ids=ids: model(ids, last_only=True), repeats))
            flops = forward_flops(model.cfg, T)
            rows.append(dict(tokens=T, seconds=sec, ms_per_token=sec / T * 1e3, gflop_s=flops / sec / 1e9,
                             intensity=flops / model.weight_bytes(), weight_gb_s=model.weight_bytes() / sec / 1e9))
    return rows


@dataclass(frozen=True)
class Roofline:
    """Measured peaks (medians of repeats), in FLOP/s and bytes/s, and how they were measured."""

    matmul_flops: float  # fp32 square torch.matmul (MKL)
    onednn_flops: float | None  # the same product through oneDNN; None without it
    read_bandwidth: float  # streaming sum of a buffer far larger than the caches
    copy_bandwidth: float  # read + write counted, buffer to buffer
    threads: int
    gemm_n: int
    buffer_bytes: int

    @property
    def peak_flops(self) -> float:  # the faster product: a kernel is not the machine's limit
        return max(self.matmul_flops, self.onednn_flops or 0.0)

    @property
    def peak_kernel(self) -> str:
        return "oneDNN" if (self.onednn_flops or 0.0) > self.matmul_flops else "torch.matmul"

    def describe(self) -> str:
        other = "" if self.onednn_flops is None else f"; torch.matmul {self.matmul_flops / 1e9:.0f}, " \
            f"oneDNN {self.onednn_flops / 1e9:.0f}"
        return (f"peak fp32 GEMM {self.peak_flops / 1e9:.0f} GFLOP/s (n={self.gemm_n}{other}), "
                f"read {self.read_bandwidth / 1e9:.1f} GB/s, copy {self.copy_bandwidth / 1e9:.1f} GB/s "
                f"({self.buffer_bytes / 2**30:.2f} GiB buffer), {self.threads} threads")


def _median_seconds(fn, repeats: int) -> float:
    return statistics.median(time_callable(fn, repeats))


def measure_gemm_flops(n: int = 2048, repeats: int = 7) -> float:
    """fp32 FLOP/s of an n x n x n torch.matmul, median of `repeats`."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    return 2 * n**3 / _median_seconds(lambda: torch.matmul(a, b, out=out), repeats)


def measure_onednn_gemm_flops(n: int = 2048, repeats: int = 7) -> float | None:
    """The same through oneDNN (None without it), the weight packed as nanoserve's are."""
    if not ONEDNN:
        return None
    with torch.inference_mode(False):  # a weight `pack` can version (and packed, as nanoserve's are)
        a, w = torch.randn(n, n), torch.randn(n, n)
        pack(w, rows=n, tiles=False)
    with torch.inference_mode():
        return 2 * n**3 / _median_seconds(lambda: onednn_linear(a, w), repeats)


def measure_bandwidth(nbytes: int = 2**30, repeats: int = 7) -> tuple[float, float]:
    """(read, copy) bytes/s on a buffer far larger than the caches: a sum, and a copy counting read + write. The
    buffers lie on 2 MB pages where the OS gives them, as the packed weights a decode step streams do."""
    src = huge_pages(nbytes // 4 * 4).view(torch.float32).fill_(1.0)
    dst, half = huge_pages(src.numel() // 2 * 4).view(torch.float32), src[: src.numel() // 2]
    return (nbytes / _median_seconds(src.sum, repeats),
            2 * half.numel() * 4 / _median_seconds(lambda: dst.copy_(half), repeats))


def measure_roofline(gemm_n: int = 2048, buffer_bytes: int = 2**30, repeats: int = 7) -> Roofline:
    """Measure this machine with torch's current thread count."""
    with torch.inference_mode():
        flops, onednn = measure_gemm_flops(gemm_n, repeats), measure_onednn_gemm_flops(gemm_n, repeats)
        read, copy = measure_bandwidth(buffer_bytes, repeats)
    return Roofline(flops, onednn, read, copy, torch.get_num_threads(), gemm_n, buffer_bytes)


@dataclass(frozen=True)
class ComputePeak:
    """A number format's multiply-add peak on this CPU (`csrc/peak.cpp`): operations per second of one instruction's
    loop on registers, in cache by construction, on `threads` threads at once."""

    format: str  # fp32, int8, bf16
    road: str  # the instructions: avx512, avx2, avx512-vnni, avx-vnni, avx512-bf16
    threads: int
    ops_s: float


def peak_roads() -> list[tuple[str, str]]:
    """(format, road) of each peak loop this CPU runs, best road of a format first; none without the kernels."""
    from .. import kernels

    module = kernels.load()
    return [] if module is None else [tuple(r) for r in module.peak_roads()]


def measure_compute_peak(fmt: str, road: str, threads: int, seconds: float = 0.1, repeats: int = 5) -> ComputePeak:
    """One format's peak on `threads` threads: the median of `repeats` runs of about `seconds` each."""
    from .. import kernels

    module = kernels.load()
    if module is None:
        raise RuntimeError(f"the compute peaks need the compiled kernels: {kernels.unavailable_reason()}")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        iters, took = 1 << 12, 0.0
        while took < seconds / 4:  # size a run to about `seconds`
            iters *= 4
            t = time.perf_counter()
            module.peak_ops(fmt, road, iters)
            took = time.perf_counter() - t
        iters = max(1, int(iters * seconds / took))
        ops = module.peak_ops(fmt, road, iters)
        return ComputePeak(fmt, road, threads, ops / _median_seconds(lambda: module.peak_ops(fmt, road, iters),
                                                                        repeats))
    finally:
        torch.set_num_threads(before)


def measure_compute_peaks(threads: Sequence[int] = (1, 2), best_only: bool = False) -> list[ComputePeak]:
    """Each format's peak on each road this CPU has (only its best road with `best_only`), at each thread count."""
    roads = peak_roads()
    if best_only:
        roads = [r for i, r in enumerate(roads) if r[0] not in {f for f, _ in roads[:i]}]
    return [measure_compute_peak(fmt, road, t) for fmt, road in roads for t in threads]


def best_peaks(*runs: Sequence[ComputePeak]) -> list[ComputePeak]:
    """Each (format, road, threads)'s fastest over several runs of `measure_compute_peaks`: a peak read while
    another process held a core comes out halved, and every fraction of peak divided by it doubled."""
    best: dict[tuple[str, str, int], ComputePeak] = {}
    for p in (p for run in runs for p in run):
        key = (p.format, p.road, p.threads)
        if key not in best or p.ops_s > best[key].ops_s:
            best[key] = p
    return list(best.values())


def matching_peak(peaks: Sequence[ComputePeak], activations: str, threads: int) -> ComputePeak | None:
    """The peak a product on `activations` (fp32, int8, bf16) is held to: that format's best road at `threads`
    (bf16 without AVX512_BF16 is widened to fp32, so fp32's); None where none was measured."""
    for fmt in ([activations, "fp32"] if activations == "bf16" else [activations]):
        found = [p for p in peaks if p.format == fmt and p.threads == threads]
        if found:
            return max(found, key=lambda p: p.ops_s)
    return None


@dataclass(frozen=True)
class StepRoofline:
    """A decode step of B rows on the roofline: its FLOPs, its bytes, the best time the machine allows."""

    batch_size: int
    flops: float
    bytes: float  # every weight once, plus each row's K/V
    peak_flops: float
    bandwidth: float

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes

    @property
    def attainable_flops(self) -> float:
        return min(self.peak_flops, self.intensity * self.bandwidth)

    @property
    def best_step_s(self) -> float:
        return self.flops / self.attainable_flops


def step_roofline(model: Llama, batch_size: int, context: int, peak_flops: float, bandwidth: float) -> StepRoofline:
    cfg = model.cfg
    kv_bytes = kv_bytes_per_token(cfg, model.dtype.itemsize) * context
    return StepRoofline(batch_size, batch_size * forward_flops(cfg, 1, context - 1),
                        model.weight_bytes() + batch_size * kv_bytes, peak_flops, bandwidth)


CSV_PATH = "data/bench-roofline.csv"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    from .command import common_arguments

    ap.add_argument("--thread-counts", type=int, nargs="+", default=[1, 2], help="threads to measure each peak on")
    common_arguments(ap, CSV_PATH)


def run(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    """`python -m nanoserve bench roofline`: every format's multiply-add peak on every road this CPU has, torch's fp32
    GEMM and the read bandwidth, at each of --thread-counts; a row each."""
    from . import csvio
    from .command import csv_header, report, start

    start(args, model=False)
    rows, before = [], torch.get_num_threads()
    for t in args.thread_counts:
        rows += [dict(what="peak", format=p.format, road=p.road, threads=t, gops=round(p.ops_s / 1e9, 2), gb_s="")
                 for p in measure_compute_peaks([t])]
        torch.set_num_threads(t)
        with torch.inference_mode():
            gemm, (read, _) = measure_gemm_flops(1024), measure_bandwidth(2**28)
        torch.set_num_threads(before)
        rows += [dict(what="gemm", format="fp32", road="torch.matmul n=1024", threads=t, gops=round(gemm / 1e9, 2),
                      gb_s=""),
                 dict(what="read", format="", road="sum of 256 MiB", threads=t, gops="", gb_s=round(read / 1e9, 2))]
    meta = csv_header(argv)
    csvio.write_csv(args.out, rows, meta)
    return report(args.out, meta, rows)
