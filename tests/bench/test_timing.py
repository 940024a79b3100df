"""The timing core against a fake clock: every number is pinned exactly."""

import doctest
import subprocess
import sys
from pathlib import Path

import pytest

from nanoserve.bench import timing
from nanoserve.bench.timing import (
    RequestTiming,
    StreamTimer,
    Summary,
    interleaved,
    rounds,
    summarize,
    time_callable,
)

PKG_DIR = Path(timing.__file__).resolve().parent.parent  # the nanoserve package folder


class FakeClock:
    """Reads 0.0 first, then advances by the next scripted step on each later read.

    Steps are binary fractions in these tests, so sums and differences are exact.
    """

    def __init__(self, *steps: float) -> None:
        self.steps = list(steps)
        self.now = 0.0
        self.reads = 0

    def __call__(self) -> float:
        if self.reads:
            self.now += self.steps[self.reads - 1]
        self.reads += 1
        return self.now


def imports_of(module: str) -> list[str]:
    """Import nanoserve.<module> in a fresh interpreter, bypassing the package __init__
    (which imports torch for the engine), and list which heavy libraries loaded."""
    code = (
        "import importlib, sys, types\n"
        f"pkg = types.ModuleType('nanoserve'); pkg.__path__ = [{str(PKG_DIR)!r}]\n"
        "sys.modules['nanoserve'] = pkg\n"
        f"importlib.import_module('nanoserve.{module}')\n"
        "print(' '.join(m for m in ('torch', 'numpy') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_fake_clock_reads_are_cumulative():
    clock = FakeClock(0.5, 0.25)
    assert [clock(), clock(), clock()] == [0.0, 0.5, 0.75]


def test_request_timing_metrics_exact():
    t = RequestTiming(start=0.0, token_times=(0.5, 0.75, 1.0, 1.25, 1.5), end=1.5)
    assert t.output_len == 5
    assert t.ttft == 0.5
    assert t.latency == 1.5
    assert t.tpot == 0.25  # (1.5 - 0.5) / (5 - 1)
    assert t.itl == [0.25, 0.25, 0.25, 0.25]


def test_tpot_charges_work_after_the_last_token():
    # vLLM's TPOT uses the end of the request, so it differs from the mean ITL.
    t = RequestTiming(start=1.0, token_times=(1.5, 1.75, 2.0), end=2.5)
    assert t.tpot == 0.5  # (1.5 - 0.5) / 2
    assert sum(t.itl) / len(t.itl) == 0.25


def test_one_token_request_has_no_tpot_and_no_itl():
    t = RequestTiming(start=0.0, token_times=(0.75,), end=1.0)
    assert t.ttft == 0.75
    assert t.latency == 1.0
    assert t.tpot is None
    assert t.itl == []


def test_zero_tokens_is_a_clear_error():
    with pytest.raises(ValueError, match="no tokens"):
        RequestTiming(start=0.0, token_times=(), end=1.0)


@pytest.mark.parametrize("start, tokens, end", [
    (1.0, (0.5,), 2.0),             # token before start
    (0.0, (0.5, 0.25), 1.0),        # tokens out of order
    (0.0, (0.5,), 0.25),            # end before last token
    (0.0, (float("nan"),), 1.0),    # not a reading
])
def test_readings_must_not_go_backwards(start, tokens, end):
    with pytest.raises(ValueError):
        RequestTiming(start=start, token_times=tokens, end=end)


def test_token_times_list_is_stored_as_tuple():
    t = RequestTiming(start=0.0, token_times=[0.5, 1.0], end=1.0)
    assert t.token_times == (0.5, 1.0)


def test_stream_timer_wraps_a_generation_loop():
    clock = FakeClock(0.5, 0.25, 0.25, 0.125)  # prefill 0.5, two decode steps, 0.125 teardown
    timer = StreamTimer(clock=clock)

    def generate():
        yield from (11, 12, 13)

    timer.start()
    out = []
    for tok in generate():
        timer.token()
        out.append(tok)
    t = timer.finish()
    assert out == [11, 12, 13]
    assert t == RequestTiming(start=0.0, token_times=(0.5, 0.75, 1.0), end=1.125)
    assert (t.ttft, t.tpot, t.itl) == (0.5, 0.3125, [0.25, 0.25])


def test_stream_timer_misuse_is_reported():
    timer = StreamTimer(clock=FakeClock(*[1.0] * 5))
    with pytest.raises(RuntimeError, match="before start"):
        timer.token()
    with pytest.raises(RuntimeError, match="before start"):
        timer.finish()
    timer.start()
    with pytest.raises(RuntimeError, match="twice"):
        timer.start()
    with pytest.raises(ValueError, match="no token"):
        timer.finish()


def test_stream_timer_defaults_to_perf_counter():
    assert StreamTimer().clock is timing.DEFAULT_CLOCK
    t = StreamTimer()
    t.start()
    t.token()
    assert t.finish().latency >= 0


def test_time_callable_times_only_the_repeats():
    clock = FakeClock(0.5, 0.25, 0.125)
    calls = []
    # the warmup call reads no clock; each timed call is bracketed by two reads
    durations = time_callable(lambda: calls.append(1), repeats=2, warmup=3, clock=clock)
    assert len(calls) == 5
    assert durations == [0.5, 0.125]
    assert clock.reads == 4


def test_interleaved_takes_turns_after_warmup_rounds_and_runs_before_untimed():
    calls = []
    clock = FakeClock(*[0.5, 0.25] * 6)
    samples = interleaved([lambda: calls.append("a"), lambda: calls.append("b")], repeats=3, warmup=1, clock=clock,
                          before=lambda fn: calls.append("flush"))
    assert "".join(c[0] for c in calls) == "ab" + "fafb" * 3  # warm round, then before + timed call, in turns
    assert samples == [[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]] and clock.reads == 12  # two reads per timed call only


def test_interleaved_shuffle_varies_the_order_per_round_and_files_each_duration_under_its_fn():
    calls = []
    fns = [lambda name=name: calls.append(name) for name in "abc"]
    durations = {"a": 0.5, "b": 0.25, "c": 0.125}

    readings = []

    def clock() -> float:  # the reading after a call is the one before it plus that fn's duration
        readings.append(readings[-1] + durations[calls[-1]] if len(readings) % 2 else (readings or [0.0])[-1])
        return readings[-1]

    samples = interleaved(fns, repeats=12, warmup=0, clock=clock, shuffle=0)
    rounds_ = ["".join(calls[3 * r:3 * r + 3]) for r in range(12)]
    assert all(sorted(r) == ["a", "b", "c"] for r in rounds_)  # every fn once a round
    assert len(set(rounds_)) > 1 and len({r[0] for r in rounds_}) == 3  # the order moves: each fn goes first
    assert samples == [[0.5] * 12, [0.25] * 12, [0.125] * 12]  # each call's time under its own fn
    calls.clear()
    interleaved(fns, repeats=12, warmup=0, clock=FakeClock(*[0.0] * 72), shuffle=0)
    assert ["".join(calls[3 * r:3 * r + 3]) for r in range(12)] == rounds_  # a seed gives the same orders


def test_interleaved_before_gets_the_fn_so_a_call_can_be_timed_warm():
    calls = []
    interleaved([lambda: calls.append("a")], repeats=2, warmup=0, before=lambda fn: fn())
    assert calls == ["a"] * 4


def test_rounds_run_every_job_once_per_round_in_order():
    calls, log = [], []
    out = rounds({"x": lambda: calls.append("x") or len(calls), "y": lambda: calls.append("y") or len(calls)}, 2,
                 clock=FakeClock(0.5, 0.25, 0.5), log=log.append)
    assert calls == ["x", "y", "x", "y"] and out == {"x": [1, 3], "y": [2, 4]}
    assert log == ["round 0: 0.5 s", "round 1: 0.5 s"]


@pytest.mark.parametrize("repeats, warmup", [(0, 1), (-1, 0), (3, -1)])
def test_time_callable_rejects_bad_counts(repeats, warmup):
    with pytest.raises(ValueError):
        time_callable(lambda: None, repeats=repeats, warmup=warmup)


def test_summarize_exact():
    s = summarize([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s.n, s.median, s.mean, s.min, s.max) == (5, 3.0, 3.0, 1.0, 5.0)
    assert s.p10 == pytest.approx(1.4)  # linear interpolation, numpy's default
    assert s.p90 == pytest.approx(4.6)


def test_summarize_two_values_interpolates_within_range():
    s = summarize([0.0, 10.0])
    assert (s.median, s.p10, s.p90) == (5.0, 1.0, 9.0)


def test_summarize_single_value():
    assert summarize([0.25]) == Summary(n=1, median=0.25, mean=0.25, p10=0.25, p90=0.25, min=0.25, max=0.25)


def test_summarize_empty_is_an_error():
    with pytest.raises(ValueError, match="zero measurements"):
        summarize([])


def test_summary_describe_for_time_lines():
    s = summarize([0.25, 0.5, 0.75])
    assert s.describe() == "median 500.0 ms (p10 300.0, p90 700.0, n=3)"
    assert s.describe(scale=1.0, unit="s") == "median 0.5 s (p10 0.3, p90 0.7, n=3)"


def test_docstring_examples():
    assert doctest.testmod(timing).failed == 0


@pytest.mark.parametrize("module", ["bench.timing", "bench.serving", "bench.csvio", "bench.batchbench"])
def test_the_stdlib_cores_do_not_import_torch(module):
    assert imports_of(module) == []
