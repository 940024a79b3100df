"""What a static batch costs (Day 29; stdlib only, the clock injected): a batch runs until its slowest row is
done, so it bills throughput (issued vs useful tokens) and latency (head-of-line blocking), never averaged into one.

>>> t = static_batch_timing([4] * 7 + [32])  # the prefill emits each row's first token: n tokens, n - 1 steps
>>> t.issued_tokens, t.useful_tokens, round(t.waste_fraction, 2)
(248, 52, 0.79)
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import csvio
from .timing import DEFAULT_CLOCK, Clock, time_callable


@dataclass(frozen=True)
class BatchTiming:
    """One run: the prefill, each decode step, each row's steps. A static batch computes every row every step and
    hands all back at the end; a scheduled run (Day 31) gives `step_rows` and hands each row back when done."""

    prefill_s: float
    step_s: list[float]
    row_steps: list[int]
    step_rows: list[int] | None = None  # rows each decode step computed; None: all of them (static)
    returns_rows_when_done: bool = False

    def __post_init__(self) -> None:
        if not self.row_steps or not self.step_s:
            raise ValueError(f"empty batch or no decode steps timed: row_steps {self.row_steps}, step_s {self.step_s}")
        if not (math.isfinite(self.prefill_s) and self.prefill_s >= 0):
            raise ValueError(f"prefill_s must be finite and >= 0, got {self.prefill_s}")
        if not all(math.isfinite(s) and s > 0 for s in self.step_s):
            raise ValueError(f"every step duration must be finite and > 0, got {self.step_s}")
        if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in self.row_steps):
            raise ValueError(f"row_steps must be ints >= 0, got {self.row_steps}")
        if max(self.row_steps) != self.n_steps:
            raise ValueError(f"a batch runs until its slowest row is done: max(row_steps) = "
                             f"{max(self.row_steps)} but {self.n_steps} steps were timed")
        if self.step_rows is not None:
            if len(self.step_rows) != self.n_steps or not all(0 <= r <= self.batch_size for r in self.step_rows):
                raise ValueError(f"step_rows needs one count in [0, {self.batch_size}] per step, got {self.step_rows}")
            if sum(self.step_rows) < self.useful_tokens:
                raise ValueError(f"the steps computed {sum(self.step_rows)} rows, fewer than the {self.useful_tokens} "
                                 f"decode tokens the rows collected")

    @property
    def batch_size(self) -> int:
        return len(self.row_steps)

    @property
    def n_steps(self) -> int:
        return len(self.step_s)

    @property
    def decode_s(self) -> float:
        return math.fsum(self.step_s)

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.step_s)

    @property
    def issued_tokens(self) -> int:
        """Decode tokens the forward computed: in a static batch every row, every step, finished or not."""
        return self.batch_size * self.n_steps if self.step_rows is None else sum(self.step_rows)

    @property
    def useful_tokens(self) -> int:
        """Decode tokens some row actually needed."""
        return sum(self.row_steps)

    @property
    def waste_fraction(self) -> float:
        """Share of the decode spent on rows that were already done; 0.0 for a uniform batch."""
        return 1 - self.useful_tokens / self.issued_tokens

    def _elapsed(self) -> list[float]:
        return list(itertools.accumulate(self.step_s, initial=self.prefill_s))

    @property
    def row_done_s(self) -> list[float]:
        return [self._elapsed()[r] for r in self.row_steps]

    @property
    def batch_done_s(self) -> float:
        return self._elapsed()[-1]

    @property
    def row_returned_s(self) -> list[float]:
        """Per row, when its answer is handed back: with the batch (static), or as soon as it is done."""
        return list(self.row_done_s) if self.returns_rows_when_done else [self.batch_done_s] * self.batch_size

    @property
    def hol_delay_s(self) -> list[float]:
        return [back - done for back, done in zip(self.row_returned_s, self.row_done_s)]

    @property
    def hol_inflation(self) -> list[float]:
        """Per row, latency as returned over latency as earned: row_returned_s / row_done_s (>= 1)."""
        # a row that earned 0s (free prefill, no steps) but waited is inf
        return [back / done if done > 0 else (1.0 if back == done else math.inf)
                for back, done in zip(self.row_returned_s, self.row_done_s)]

    @property
    def max_hol_inflation(self) -> float:
        return max(self.hol_inflation)

    @property
    def issued_tok_per_s(self) -> float:
        return self.issued_tokens / self.decode_s

    @property
    def goodput_tok_per_s(self) -> float:
        return self.useful_tokens / self.decode_s


def time_static_batch(prefill: Callable[[], object], step: Callable[[], object],
                      row_steps: Sequence[int], clock: Clock = DEFAULT_CLOCK) -> BatchTiming:
    """Time `prefill()` once, then `step()` max(row_steps) times: the closures do the real work (the harness builds
    them around the model and the cache), this only reads the clock around each call."""
    row_steps = list(row_steps)
    if not row_steps:
        raise ValueError("empty batch: row_steps needs one entry per row")
    (prefill_s,), step_s = time_callable(prefill, 1, 0, clock), time_callable(step, max(row_steps), 0, clock)
    return BatchTiming(prefill_s=prefill_s, step_s=step_s, row_steps=row_steps)


def static_batch_timing(output_lens: Sequence[int], step_s: float = 1.0,
                        prefill_s: float = 0.0) -> BatchTiming:
    """A modelled run: rows of `output_lens` tokens (each >= 1), every step `step_s`."""
    row_steps = [n - 1 for n in output_lens]
    return BatchTiming(prefill_s=prefill_s, step_s=[step_s] * max(row_steps, default=0), row_steps=row_steps)


def static_batch_costs(batch_size: int, short_share: float, long_short_ratio: float,
                       short_len: int = 4, step_s: float = 1.0, prefill_s: float = 0.0) -> BatchTiming:
    """The Day-29 slider: round(short_share * batch_size) rows of `short_len` tokens (halves round up), the rest
    round(short_len * long_short_ratio), modelled. Waste and inflation are counts, whatever `step_s` is.

    >>> t = static_batch_costs(8, short_share=7 / 8, long_short_ratio=8)
    >>> t.row_steps, round(t.max_hol_inflation, 2)
    ([3, 3, 3, 3, 3, 3, 3, 31], 10.33)
    """
    if batch_size < 1 or not 0.0 <= short_share <= 1.0 or long_short_ratio < 1 or short_len < 1:
        raise ValueError(f"need batch_size >= 1, short_share in [0, 1], long_short_ratio >= 1, short_len >= 1; got "
                         f"{batch_size}, {short_share}, {long_short_ratio}, {short_len}")
    n_short = math.floor(short_share * batch_size + 0.5)
    long_len = math.floor(short_len * long_short_ratio + 0.5)
    lens = [short_len] * n_short + [long_len] * (batch_size - n_short)
    return static_batch_timing(lens, step_s=step_s, prefill_s=prefill_s)


@dataclass(frozen=True)
class BatchScaling:
    """Throughput against batch size on uniform batches; `knee`: the largest size that, with every smaller one,
    keeps efficiency (speedup over the ideal B / B0) >= `min_efficiency`."""

    batch_sizes: list[int]
    step_s: list[float]
    min_efficiency: float = 0.75

    def __post_init__(self) -> None:
        sizes = self.batch_sizes
        if not sizes or len(sizes) != len(self.step_s):
            raise ValueError(f"need one step time per batch size, got {sizes} and {self.step_s}")
        if sizes[0] < 1 or any(b <= a for a, b in zip(sizes, sizes[1:])):
            raise ValueError(f"batch sizes must be >= 1 and strictly increasing, got {sizes}")
        if not all(math.isfinite(s) and s > 0 for s in self.step_s):
            raise ValueError(f"step times must be finite and > 0, got {self.step_s}")
        if not 0 < self.min_efficiency <= 1:
            raise ValueError(f"min_efficiency must be in (0, 1], got {self.min_efficiency}")

    @property
    def tok_per_s(self) -> list[float]:
        return [b / s for b, s in zip(self.batch_sizes, self.step_s)]

    @property
    def speedup(self) -> list[float]:
        base = self.tok_per_s[0]
        return [tp / base for tp in self.tok_per_s]

    @property
    def efficiency(self) -> list[float]:
        b0 = self.batch_sizes[0]
        return [sp / (b / b0) for sp, b in zip(self.speedup, self.batch_sizes)]

    @property
    def knee(self) -> int:
        paying = list(itertools.takewhile(lambda e: e >= self.min_efficiency, self.efficiency))
        return self.batch_sizes[max(len(paying) - 1, 0)]

    @property
    def peak_batch_size(self) -> int:
        return self.batch_sizes[self.tok_per_s.index(max(self.tok_per_s))]

    @property
    def peak_tok_per_s(self) -> float:
        return max(self.tok_per_s)


def fit_batch_scaling(batch_sizes: Sequence[int], median_step_s: Sequence[float],
                      min_efficiency: float = 0.75) -> BatchScaling:
    """One sweep's (batch size, median decode step) pairs, sorted, as a checked `BatchScaling`."""
    pairs = sorted(zip(batch_sizes, median_step_s, strict=True))
    return BatchScaling([int(b) for b, _ in pairs], [float(s) for _, s in pairs], min_efficiency)


# prefill_s, step_s and row_steps are the raw record (floats exact, lists space-joined); the rest is derived
CSV_FIELDS = ("label", "batch_size", "n_steps", "prefill_s", "decode_s", "issued_tokens", "useful_tokens",
              "waste_fraction", "max_hol_inflation", "issued_tok_per_s", "goodput_tok_per_s", "step_s", "row_steps")


def write_csv(path: str | Path, runs: Iterable[tuple[str, BatchTiming]], meta: Mapping[str, object] | None = None,
              ) -> Path:
    rows = [dict(zip(CSV_FIELDS, (label, t.batch_size, t.n_steps, repr(t.prefill_s), f"{t.decode_s:.6g}",
                                  t.issued_tokens, t.useful_tokens, f"{t.waste_fraction:.4f}",
                                  f"{t.max_hol_inflation:.4f}", f"{t.issued_tok_per_s:.4g}",
                                  f"{t.goodput_tok_per_s:.4g}", " ".join(map(repr, t.step_s)),
                                  " ".join(map(str, t.row_steps))))) for label, t in runs]
    return csvio.write_csv(path, rows, meta, CSV_FIELDS)


def read_csv(path: str | Path) -> tuple[dict[str, Any], list[tuple[str, BatchTiming]]]:
    """The header (values JSON-decoded) and the labelled runs."""
    meta, rows = csvio.read_csv(path)
    return csvio.decoded(meta), [(row["label"], BatchTiming(prefill_s=float(row["prefill_s"]),
                                                            step_s=[float(x) for x in row["step_s"].split()],
                                                            row_steps=[int(x) for x in row["row_steps"].split()]))
                                 for row in rows]
