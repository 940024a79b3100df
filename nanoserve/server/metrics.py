"""The server's /metrics, in Prometheus' text format, named after vLLM's (`vllm:` becomes `nanoserve:`).

Counters and histograms are updated by the engine thread when a request ends; gauges are read from
the engine between steps (`AsyncEngine.snapshot`). The exposition is written by hand: a few lines of
text per metric, no client library needed.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)


@dataclass
class Histogram:
    """Cumulative buckets as Prometheus wants them: counts of observations <= each bound, then +Inf."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, x: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, x)] += 1
        self.total += x
        self.n += 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, c in zip((*self.bounds, float("inf")), self.counts):
            running += c
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{name}_bucket{{le="{le}"}} {running}')
        return out + [f"{name}_sum {self.total!r}", f"{name}_count {self.n}"]


class EngineMetrics:
    """What the engine thread counts as requests end."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.finished: dict[str, int] = {}  # finish reason -> requests
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.steps = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)

    def on_finish(self, req, reason: str | None, now: float) -> None:
        """Count a request that ended (done or aborted), with its latencies from the engine's own clock."""
        times = req.token_times
        with self.lock:
            key = reason or "abort"
            self.finished[key] = self.finished.get(key, 0) + 1
            self.prompt_tokens += req.num_prompt_tokens
            self.generation_tokens += len(req.output_token_ids)
            if times:
                self.ttft.observe(times[0] - req.arrival_time)
                end = req.finish_time if req.finish_time is not None else times[-1]
                self.e2e.observe(end - req.arrival_time)
                if len(times) > 1:
                    self.tpot.observe((end - times[0]) / (len(times) - 1))

    def render(self, gauges: dict[str, float], model_name: str) -> str:
        """The Prometheus text exposition of every metric."""
        label = f'model_name="{model_name}"'
        g = gauges
        blocks_total = max(1, int(g["blocks_total"]))
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[str]) -> None:
            lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *samples])

        metric("nanoserve:num_requests_running", "gauge", "Requests in the running batch.",
               [f"nanoserve:num_requests_running{{{label}}} {int(g['running'])}"])
        metric("nanoserve:num_requests_waiting", "gauge", "Requests waiting to be admitted.",
               [f"nanoserve:num_requests_waiting{{{label}}} {int(g['waiting'])}"])
        metric("nanoserve:kv_cache_blocks_used", "gauge", "KV cache blocks held by requests.",
               [f"nanoserve:kv_cache_blocks_used{{{label}}} {int(g['blocks_used'])}"])
        metric("nanoserve:kv_cache_blocks_total", "gauge", "KV cache blocks in the pool.",
               [f"nanoserve:kv_cache_blocks_total{{{label}}} {int(g['blocks_total'])}"])
        metric("nanoserve:kv_cache_usage_perc", "gauge", "Fraction of the pool's blocks held (0 to 1).",
               [f"nanoserve:kv_cache_usage_perc{{{label}}} {g['blocks_used'] / blocks_total!r}"])
        metric("nanoserve:prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
               [f"nanoserve:prefix_cache_queries_total{{{label}}} {int(g['prefix_queried_tokens'])}"])
        metric("nanoserve:prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.",
               [f"nanoserve:prefix_cache_hits_total{{{label}}} {int(g['prefix_hit_tokens'])}"])
        metric("nanoserve:num_preemptions_total", "counter", "Requests preempted to free blocks.",
               [f"nanoserve:num_preemptions_total{{{label}}} {int(g['preemptions'])}"])
        with self.lock:
            metric("nanoserve:prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
                   [f"nanoserve:prompt_tokens_total{{{label}}} {self.prompt_tokens}"])
            metric("nanoserve:generation_tokens_total", "counter", "Tokens generated for finished requests.",
                   [f"nanoserve:generation_tokens_total{{{label}}} {self.generation_tokens}"])
            metric("nanoserve:request_success_total", "counter", "Finished requests, by finish reason.",
                   [f'nanoserve:request_success_total{{{label},finished_reason="{k}"}} {v}'
                    for k, v in sorted(self.finished.items())])
            for name, hist, help_ in (
                    ("nanoserve:time_to_first_token_seconds", self.ttft, "Time to first token, from arrival."),
                    ("nanoserve:time_per_output_token_seconds", self.tpot, "Time per output token after the first."),
                    ("nanoserve:e2e_request_latency_seconds", self.e2e, "Arrival to the last token.")):
                metric(name, "histogram", help_, [ln.replace("{", "{" + label + ",", 1) if "{" in ln.split()[0]
                                                  else ln.replace(" ", "{" + label + "} ", 1)
                                                  for ln in hist.lines(name)])
        return "\n".join(lines) + "\n"
