"""Timing with the clock injected (stdlib only: a fake clock pins every number in the tests). vLLM's words:
TTFT, time to first token; TPOT, (latency - TTFT) / (output_len - 1); ITL, the gaps between tokens."""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

Clock = Callable[[], float]  # seconds as a float: time.perf_counter, or a fake in tests
DEFAULT_CLOCK: Clock = time.perf_counter
K, T = TypeVar("K"), TypeVar("T")


@dataclass(frozen=True)
class RequestTiming:
    """One request's clock readings (start, each token, end): every metric derives from them, so none disagree.

    >>> t = RequestTiming(start=0.0, token_times=(0.5, 0.7, 0.9), end=1.0)
    >>> t.ttft, t.latency, t.tpot
    (0.5, 1.0, 0.25)
    """

    start: float
    token_times: tuple[float, ...]
    end: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_times", tuple(self.token_times))
        if not self.token_times:
            raise ValueError("a request that emitted no tokens has no TTFT, TPOT or ITL to report")
        readings = (self.start, *self.token_times, self.end)
        if not all(math.isfinite(r) for r in readings) or any(b < a for a, b in zip(readings, readings[1:])):
            raise ValueError(f"clock readings must be finite and never go backwards: start, tokens, end = {readings}")

    @property
    def output_len(self) -> int:
        return len(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.start

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """vLLM's (latency - ttft) / (output_len - 1): `end` charges work after the last token to the decode
        pace. None for a one-token request, which vLLM leaves out of TPOT rather than counting as zero."""
        return None if self.output_len == 1 else (self.latency - self.ttft) / (self.output_len - 1)

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


class StreamTimer:
    """Records a `RequestTiming` around a real generation loop: `start()`, `token()` per token, `finish()`."""

    def __init__(self, clock: Clock = DEFAULT_CLOCK) -> None:
        self.clock, self._start, self._tokens = clock, None, []

    def start(self) -> None:
        if self._start is not None:
            raise RuntimeError("StreamTimer.start() called twice; use a new timer per request")
        self._start = self.clock()

    def token(self) -> None:
        if self._start is None:
            raise RuntimeError("StreamTimer.token() before start()")
        self._tokens.append(self.clock())

    def finish(self) -> RequestTiming:
        if self._start is None:
            raise RuntimeError("StreamTimer.finish() before start()")
        return RequestTiming(start=self._start, token_times=tuple(self._tokens), end=self.clock())


def interleaved(fns: Sequence[Callable[[], object]], repeats: int, warmup: int = 1, clock: Clock = DEFAULT_CLOCK,
                before: Callable[[Callable[[], object]], object] | None = None,
                shuffle: int | None = None) -> list[list[float]]:
    """Time each fn `repeats` times round-robin (a, b, c, a, b, c, ...) after `warmup` untimed rounds, so drift
    on a shared machine falls on every fn alike; `before(fn)` runs untimed ahead of each timed call of fn (a
    cache flush, or fn itself to time it warm). With a `shuffle` seed each round takes the fns in an order of
    its own: a call can leave the machine in a state a flush does not reset, and in a fixed order one fn would
    always pay for the same neighbour. One list of durations per fn (`summarize` each)."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    for _ in range(warmup):  # one-off costs (allocator growth, lazy init) stay out of the first sample
        for fn in fns:
            fn()
    samples: list[list[float]] = [[] for _ in fns]
    order, rng = list(range(len(fns))), random.Random(shuffle)
    for _ in range(repeats):
        if shuffle is not None:
            rng.shuffle(order)
        for i in order:
            if before is not None:
                before(fns[i])
            t0 = clock()
            fns[i]()
            samples[i].append(clock() - t0)
    return samples


def time_callable(fn: Callable[[], object], repeats: int, warmup: int = 1, clock: Clock = DEFAULT_CLOCK,
                  ) -> list[float]:
    """`interleaved` of one fn."""
    return interleaved([fn], repeats, warmup, clock)[0]


def rounds(jobs: Mapping[K, Callable[[], T]], n: int, clock: Clock = DEFAULT_CLOCK,
           log: Callable[[str], object] | None = None) -> dict[K, list[T]]:
    """Every job once per round, `n` rounds, so a slow minute falls on every job alike; results in round order."""
    out: dict[K, list[T]] = {key: [] for key in jobs}
    for r in range(n):
        t0 = clock()
        for key, job in jobs.items():
            out[key].append(job())
        if log is not None:
            log(f"round {r}: {clock() - t0:.1f} s")
    return out


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0-100), linear between order statistics (numpy's default, as vLLM reports)."""
    if not values:
        return math.nan
    s = sorted(values)
    x = p / 100 * (len(s) - 1)
    lo = int(x)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (x - lo)


@dataclass(frozen=True)
class Summary:
    """Repeated measurements: the median to report, p10..p90 (`percentile`) for the spread."""

    n: int
    median: float
    mean: float
    p10: float
    p90: float
    min: float
    max: float

    def describe(self, scale: float = 1e3, unit: str = "ms") -> str:
        return (f"median {self.median * scale:.1f} {unit} "
                f"(p10 {self.p10 * scale:.1f}, p90 {self.p90 * scale:.1f}, n={self.n})")


def summarize(values: Sequence[float]) -> Summary:
    """Samples' median, mean, p10, p90, min and max (stdlib `statistics`)."""
    values = [float(v) for v in values]
    if not values:
        raise ValueError("cannot summarize zero measurements")
    return Summary(n=len(values), median=statistics.median(values), mean=statistics.fmean(values),
                   p10=percentile(values, 10), p90=percentile(values, 90), min=min(values), max=max(values))
