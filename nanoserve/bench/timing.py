"""Timing a generation the way serving benchmarks do, with the clock injected.

This module is stdlib-only on purpose: it never imports torch, so every number
it derives can be pinned in a unit test with a fake clock, and the runner that
stands up the real model only has to call `start()`, `token()` and `finish()`.

The vocabulary is vLLM's (`benchmarks/benchmark_serving.py`):

- TTFT, time to first token: from the request starting to its first token.
- TPOT, time per output token: (latency - TTFT) / (output_len - 1), the
  decode-phase pace once the prefill is paid.
- ITL, inter-token latency: the gaps between consecutive tokens.

>>> t = RequestTiming(start=0.0, token_times=(0.5, 0.7, 0.9), end=1.0)
>>> t.ttft, t.latency, t.tpot
(0.5, 1.0, 0.25)
>>> [round(gap, 6) for gap in t.itl]
[0.2, 0.2]
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

Clock = Callable[[], float]
"""Anything that returns seconds as a float: `time.perf_counter` or a fake in tests."""

DEFAULT_CLOCK: Clock = time.perf_counter


@dataclass(frozen=True)
class RequestTiming:
    """Absolute clock readings for one request: when it started, each token, when it ended.

    Readings are kept raw and every metric is derived, so TTFT, TPOT and ITL can
    never disagree about what they were computed from. A request that emitted no
    token has no TTFT, so it is rejected here rather than reported as zero.
    """

    start: float
    token_times: tuple[float, ...]
    end: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_times", tuple(self.token_times))
        if not self.token_times:
            raise ValueError("a request that emitted no tokens has no TTFT, TPOT or ITL to report")
        readings = (self.start, *self.token_times, self.end)
        if not all(math.isfinite(r) for r in readings):
            raise ValueError(f"clock readings must be finite, got {readings}")
        if any(later < earlier for earlier, later in zip(readings, readings[1:])):
            raise ValueError(f"clock readings must not go backwards: start, tokens, end = {readings}")

    @property
    def first_token(self) -> float:
        """Clock reading when the first token was emitted."""
        return self.token_times[0]

    @property
    def output_len(self) -> int:
        return len(self.token_times)

    @property
    def ttft(self) -> float:
        """Time to first token: the wait a user sees before anything streams."""
        return self.first_token - self.start

    @property
    def latency(self) -> float:
        """End-to-end time, start to finish."""
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """vLLM's time per output token, (latency - ttft) / (output_len - 1).

        None for a one-token request: there is no decode phase to average over,
        and vLLM leaves such requests out of its TPOT statistics instead of
        counting them as zero. Uses `end`, not the last token, so any work after
        the last token (detokenizing, freeing) is charged to the decode pace.
        """
        if self.output_len == 1:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies: output_len - 1 gaps, empty for a one-token request."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


class StreamTimer:
    """Records a `RequestTiming` around a real generation loop.

    >>> ticks = iter([0.0, 0.3, 0.4, 0.6])
    >>> timer = StreamTimer(clock=lambda: next(ticks))
    >>> timer.start()
    >>> timer.token(); timer.token()
    >>> timer.finish().ttft
    0.3
    """

    def __init__(self, clock: Clock = DEFAULT_CLOCK) -> None:
        self.clock = clock
        self._start: float | None = None
        self._tokens: list[float] = []

    def start(self) -> None:
        """Call just before the request's work begins (before the prefill)."""
        if self._start is not None:
            raise RuntimeError("StreamTimer.start() called twice; use a new timer per request")
        self._start = self.clock()

    def token(self) -> None:
        """Call once per emitted token, as soon as it exists."""
        if self._start is None:
            raise RuntimeError("StreamTimer.token() before start()")
        self._tokens.append(self.clock())

    def finish(self) -> RequestTiming:
        """Read the clock one last time and return the request's timing."""
        if self._start is None:
            raise RuntimeError("StreamTimer.finish() before start()")
        if not self._tokens:
            raise ValueError("StreamTimer.finish() with no token() calls: nothing was generated")
        return RequestTiming(start=self._start, token_times=tuple(self._tokens), end=self.clock())


def time_callable(fn: Callable[[], object], repeats: int, warmup: int = 1,
                  clock: Clock = DEFAULT_CLOCK) -> list[float]:
    """Call `fn` `warmup` times untimed, then `repeats` times timed; return each duration.

    Warmup runs absorb one-off costs (allocator growth, lazy init) that would
    otherwise land in the first sample. Summarize the result with `summarize`.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    for _ in range(warmup):
        fn()
    durations = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        durations.append(clock() - t0)
    return durations


@dataclass(frozen=True)
class Summary:
    """Robust summary of repeated measurements. Report the median; p10..p90 shows the spread.

    Percentiles interpolate linearly between order statistics (numpy's default),
    so they always lie within [min, max].
    """

    n: int
    median: float
    mean: float
    p10: float
    p90: float
    min: float
    max: float

    def describe(self, scale: float = 1e3, unit: str = "ms") -> str:
        """One line for a `[time]` print, e.g. 'median 279.0 ms (p10 270.1, p90 290.2, n=5)'."""
        return (f"median {self.median * scale:.1f} {unit} "
                f"(p10 {self.p10 * scale:.1f}, p90 {self.p90 * scale:.1f}, n={self.n})")


def summarize(values: Sequence[float]) -> Summary:
    """Summarize samples with stdlib `statistics`.

    >>> s = summarize([5.0, 1.0, 3.0, 2.0, 4.0])
    >>> s.median, s.p10, s.p90
    (3.0, 1.4, 4.6)
    """
    values = [float(v) for v in values]
    if not values:
        raise ValueError("cannot summarize zero measurements")
    if len(values) == 1:
        p10 = p90 = values[0]
    else:
        deciles = statistics.quantiles(values, n=10, method="inclusive")
        p10, p90 = deciles[0], deciles[-1]
    return Summary(n=len(values), median=statistics.median(values), mean=statistics.fmean(values),
                   p10=p10, p90=p90, min=min(values), max=max(values))
