"""Arrival traces and vLLM's serving metrics, pinned on hand-made clock readings."""

import math
import statistics

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from nanoserve.bench.serving import SLO, arrival_times, goodput_knee, percentile, serving_metrics
from nanoserve.bench.timing import RequestTiming


def test_arrivals_start_at_zero_rise_and_repeat_with_the_seed():
    t = arrival_times(50, 2.0, seed=3)
    assert t[0] == 0.0 and len(t) == 50
    assert all(b >= a for a, b in zip(t, t[1:]))
    assert t == arrival_times(50, 2.0, seed=3) and t != arrival_times(50, 2.0, seed=4)


def test_poisson_gaps_have_mean_one_over_rate_and_burstiness_sets_their_spread():
    rate = 4.0
    poisson = np.diff(arrival_times(20000, rate, 1.0, seed=0))
    bursty = np.diff(arrival_times(20000, rate, 0.25, seed=0))
    even = np.diff(arrival_times(20000, rate, 8.0, seed=0))
    for gaps in (poisson, bursty, even):
        assert gaps.mean() == pytest.approx(1 / rate, rel=0.05)
    # gamma with shape k: coefficient of variation 1/sqrt(k)
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.05)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.08)
    assert even.std() / even.mean() == pytest.approx(1 / math.sqrt(8), rel=0.05)


def test_infinite_rate_sends_everything_at_once():
    assert arrival_times(5, math.inf) == [0.0] * 5


@pytest.mark.parametrize("kwargs, word", [(dict(n=-1, rate=1.0), "n"), (dict(n=3, rate=0.0), "rate"),
                                          (dict(n=3, rate=-2.0), "rate"), (dict(n=3, rate=math.nan), "rate"),
                                          (dict(n=3, rate=1.0, burstiness=0.0), "burstiness"),
                                          (dict(n=3, rate=1.0, burstiness=math.inf), "burstiness")])
def test_bad_trace_arguments_are_refused_by_name(kwargs, word):
    with pytest.raises(ValueError, match=word):
        arrival_times(**kwargs)


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50), st.floats(0, 100))
def test_percentile_is_numpys_linear_percentile(values, p):
    assert percentile(values, p) == pytest.approx(float(np.percentile(values, p)), rel=1e-9, abs=1e-6)


def test_metrics_follow_vllms_definitions():
    timings = [
        RequestTiming(start=0.0, token_times=(1.0, 1.2, 1.4), end=1.4),   # TTFT 1, TPOT 0.2
        RequestTiming(start=1.0, token_times=(5.0, 5.5), end=5.5),        # TTFT 4 (misses the TTFT SLO)
        RequestTiming(start=2.0, token_times=(2.5,), end=2.5),            # one token: no TPOT, no ITL
        RequestTiming(start=3.0, token_times=(3.5, 4.0, 4.5, 5.0), end=6.0),  # TPOT (3 - 0.5) / 3 = 0.833
    ]
    m = serving_metrics(timings, SLO(ttft_s=3.0, tpot_s=0.25))
    assert m.completed == 4 and m.output_tokens == 10
    assert m.duration_s == pytest.approx(6.0)  # first arrival to last completion
    assert m.good == 2  # the first, and the one-token answer (it has no TPOT to miss)
    assert m.goodput == pytest.approx(2 / 6) and m.request_throughput == pytest.approx(4 / 6)
    assert m.output_throughput == pytest.approx(10 / 6)
    assert m.ttft["mean"] == pytest.approx(statistics.mean([1.0, 4.0, 0.5, 0.5]))
    assert m.ttft["p50"] == pytest.approx(0.75)
    assert m.tpot["p50"] == pytest.approx(statistics.median([0.2, 0.5, 2.5 / 3]))
    assert m.itl["mean"] == pytest.approx(statistics.mean([0.2, 0.2, 0.5, 0.5, 0.5, 0.5]))
    assert m.e2e["p99"] == pytest.approx(float(np.percentile([1.4, 4.5, 0.5, 3.0], 99)))
    row = m.row()
    assert row["goodput"] == m.goodput and row["tpot_p90"] == m.tpot["p90"]


def test_slo_counts_a_request_only_if_it_meets_every_bound():
    slo = SLO(ttft_s=1.0, tpot_s=0.1)
    met = [slo.met(t.ttft, t.tpot) for t in (RequestTiming(0.0, (1.0, 1.05), 1.05),
                                             RequestTiming(0.0, (1.01, 1.05), 1.05),
                                             RequestTiming(0.0, (0.5, 0.7), 0.7),
                                             RequestTiming(0.0, (0.5,), 0.5))]
    assert met == [True, False, False, True]  # the last has one token: no TPOT to miss


def test_no_requests_or_no_time_is_refused():
    with pytest.raises(ValueError, match="no completed"):
        serving_metrics([])
    with pytest.raises(ValueError, match="duration"):
        serving_metrics([RequestTiming(1.0, (1.0,), 1.0)])


def test_the_knee_is_the_highest_rate_still_served_within_the_slo():
    rates = [0.5, 1.0, 2.0, 3.0, math.inf]
    assert goodput_knee(rates, [1.0, 0.95, 0.92, 0.4, 0.1]) == 2.0
    assert goodput_knee(rates, [0.5, 0.5, 0.1, 0.0, 1.0]) is None  # all at once is not a rate
    assert goodput_knee(rates, [1.0, 0.95, 0.92, 0.4, 0.1], fraction=0.95) == 1.0
