"""Requests that arrive over time, and vLLM's serving metrics for them (stdlib only): arrivals as in vLLM's
`benchmark_serving.py`, gamma gaps of mean 1/rate and shape `burstiness` (1: Poisson; rate inf: all at once)."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from .timing import RequestTiming, percentile

PERCENTILES = (50, 90, 99)


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """When each of n requests is sent (seconds): the first at 0, then gamma gaps of mean 1/rate, shape `burstiness`."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s (inf for all at once), got {rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a finite number > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    rng, times = random.Random(seed), [0.0] * min(n, 1)
    while len(times) < n:
        times.append(times[-1] + rng.gammavariate(burstiness, 1.0 / (rate * burstiness)))
    return times


@dataclass(frozen=True)
class SLO:
    """A service-level objective every request must meet to count toward goodput."""

    ttft_s: float = 3.0
    tpot_s: float = 0.25

    def met(self, ttft: float, tpot: float | None) -> bool:
        """TTFT within bound, and TPOT within bound where there is one (a one-token answer has none)."""
        return ttft <= self.ttft_s and (tpot is None or tpot <= self.tpot_s)


def _stats(values: Sequence[float]) -> dict[str, float]:  # the mean and PERCENTILES
    return {"mean": sum(values) / len(values) if values else math.nan,
            **{f"p{p}": percentile(values, p) for p in PERCENTILES}}


@dataclass(frozen=True)
class ServingMetrics:
    """One run, first arrival to last completion: counts, throughputs, goodput, latency distributions (s)."""

    completed: int
    duration_s: float
    output_tokens: int
    good: int
    ttft: dict[str, float] = field(default_factory=dict)
    tpot: dict[str, float] = field(default_factory=dict)
    itl: dict[str, float] = field(default_factory=dict)
    e2e: dict[str, float] = field(default_factory=dict)

    @property
    def request_throughput(self) -> float:
        return self.completed / self.duration_s

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.duration_s

    @property
    def goodput(self) -> float:  # requests per second that met every SLO
        return self.good / self.duration_s

    def row(self) -> dict[str, float]:
        """A flat dict for a CSV: completed, ..., ttft_p50, tpot_p99, ..."""
        out: dict[str, float] = dict(completed=self.completed, duration_s=self.duration_s,
                                     output_tokens=self.output_tokens, good=self.good,
                                     request_throughput=self.request_throughput,
                                     output_throughput=self.output_throughput, goodput=self.goodput)
        for name in ("ttft", "tpot", "itl", "e2e"):
            out.update({f"{name}_{k}": v for k, v in getattr(self, name).items()})
        return out


def serving_metrics(timings: Sequence[RequestTiming], slo: SLO = SLO()) -> ServingMetrics:
    """vLLM's summary of a run from each request's clock readings (start = its arrival)."""
    if not timings:
        raise ValueError("no completed requests to summarize")
    start = min(t.start for t in timings)
    duration = max(t.end for t in timings) - start
    if duration <= 0:
        raise ValueError("a run's duration must be > 0 (the last completion after the first arrival)")
    return ServingMetrics(
        completed=len(timings), duration_s=duration, output_tokens=sum(t.output_len for t in timings),
        good=sum(slo.met(t.ttft, t.tpot) for t in timings),
        ttft=_stats([t.ttft for t in timings]),
        tpot=_stats([t.tpot for t in timings if t.tpot is not None]),
        itl=_stats([gap for t in timings for gap in t.itl]),
        e2e=_stats([t.latency for t in timings]))


def goodput_knee(rates: Sequence[float], met: Sequence[float], fraction: float = 0.9) -> float | None:
    """Where a system saturates: the highest finite offered rate at which at least `fraction` of the requests still
    met the SLO (`met`: each rate's good / completed), None if none did; past it, requests outrun the service."""
    ok = [r for r, m in zip(rates, met) if math.isfinite(r) and m >= fraction]
    return max(ok) if ok else None
