"""The Day-29 core: pure arithmetic and a fake clock, no torch."""

import csv
import doctest
import math
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nanoserve.bench import batchbench
from nanoserve.bench.batchbench import (
    BatchScaling,
    BatchTiming,
    fit_batch_scaling,
    read_csv,
    static_batch_costs,
    static_batch_timing,
    time_static_batch,
    write_csv,
)

BLOCKING_LENS = [4] * 7 + [32]  # the seed's blocking run: seven rows of 4 behind one of 32
SEED_SIZES = [1, 2, 4, 8]
SEED_STEPS = [0.279, 0.474, 0.940, 2.092]  # the seed's median decode step per batch size


class FakeClock:
    """Reads 0.0 first, then advances by the next scripted step on each later read."""

    def __init__(self, *steps: float) -> None:
        self.steps, self.now, self.reads = list(steps), 0.0, 0

    def __call__(self) -> float:
        if self.reads:
            self.now += self.steps[self.reads - 1]
        self.reads += 1
        return self.now


def seed_blocking_timing() -> BatchTiming:
    """The blocking run with the seed's wall times: short rows done at 10.5s, all at 69.4s."""
    step = (69.4 - 10.5) / (31 - 3)
    return static_batch_timing(BLOCKING_LENS, step_s=step, prefill_s=10.5 - 3 * step)


def test_blocking_run_counts_match_the_seed():
    t = static_batch_timing(BLOCKING_LENS)
    assert (t.batch_size, t.n_steps) == (8, 31)
    assert t.issued_tokens == 248  # 8 * 31
    assert t.useful_tokens == 52  # 7 * 3 + 31
    assert round(t.waste_fraction, 2) == 0.79


def test_blocking_run_times_match_the_seed():
    t = seed_blocking_timing()
    assert round(t.row_done_s[0], 1) == 10.5
    assert round(t.batch_done_s, 1) == 69.4
    assert round(t.hol_delay_s[0], 1) == 58.9
    assert round(t.max_hol_inflation, 1) == 6.6
    assert round(t.issued_tok_per_s, 1) == 3.8
    assert round(t.goodput_tok_per_s, 1) == 0.8


def test_uniform_batch_has_no_waste_and_no_blocking():
    t = static_batch_timing([16] * 4, step_s=0.5, prefill_s=2.0)
    assert t.waste_fraction == 0.0
    assert t.useful_tokens == t.issued_tokens == 60
    assert t.hol_delay_s == [0.0] * 4
    assert t.hol_inflation == [1.0] * 4
    assert t.goodput_tok_per_s == t.issued_tok_per_s == 8.0


def test_per_row_times_with_uneven_steps():
    t = BatchTiming(prefill_s=1.0, step_s=[0.5, 0.25, 0.125], row_steps=[0, 1, 3, 2])
    assert t.decode_s == 0.875
    assert t.median_step_s == 0.25
    assert t.row_done_s == [1.0, 1.5, 1.875, 1.75]
    assert t.batch_done_s == 1.875
    assert t.hol_delay_s == [0.875, 0.375, 0.0, 0.125]
    assert t.hol_inflation == [1.875, 1.25, 1.0, 1.875 / 1.75]
    assert t.max_hol_inflation == 1.875
    assert (t.issued_tokens, t.useful_tokens) == (12, 6)
    assert t.waste_fraction == 0.5


def test_row_with_no_own_time_is_infinitely_inflated():
    # a one-token row with a free prefill earned nothing yet waited for the batch
    t = BatchTiming(prefill_s=0.0, step_s=[1.0], row_steps=[0, 1])
    assert t.row_done_s == [0.0, 1.0]
    assert t.hol_inflation == [math.inf, 1.0]


@pytest.mark.parametrize("kwargs, match", [
    (dict(prefill_s=0.0, step_s=[1.0], row_steps=[]), "empty batch"),
    (dict(prefill_s=0.0, step_s=[], row_steps=[0]), "no decode steps"),
    (dict(prefill_s=-1.0, step_s=[1.0], row_steps=[1]), "prefill_s"),
    (dict(prefill_s=math.nan, step_s=[1.0], row_steps=[1]), "prefill_s"),
    (dict(prefill_s=0.0, step_s=[1.0, 0.0], row_steps=[2]), "step duration"),
    (dict(prefill_s=0.0, step_s=[1.0, -0.5], row_steps=[2]), "step duration"),
    (dict(prefill_s=0.0, step_s=[math.inf], row_steps=[1]), "step duration"),
    (dict(prefill_s=0.0, step_s=[1.0], row_steps=[1, -1]), "ints >= 0"),
    (dict(prefill_s=0.0, step_s=[1.0], row_steps=[1.0]), "ints >= 0"),
    (dict(prefill_s=0.0, step_s=[1.0], row_steps=[True]), "ints >= 0"),
    (dict(prefill_s=0.0, step_s=[1.0], row_steps=[2, 1]), "slowest row"),  # more steps than timed
    (dict(prefill_s=0.0, step_s=[1.0, 1.0], row_steps=[1, 1]), "slowest row"),  # an unneeded step
    (dict(prefill_s=0.0, step_s=[1.0, 1.0], row_steps=[1, 2], step_rows=[2]), "one count"),
    (dict(prefill_s=0.0, step_s=[1.0, 1.0], row_steps=[1, 2], step_rows=[3, 1]), "one count"),
    (dict(prefill_s=0.0, step_s=[1.0, 1.0], row_steps=[1, 2], step_rows=[1, 1]), "fewer than the 3"),
])
def test_batch_timing_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BatchTiming(**kwargs)


def test_a_scheduled_run_is_billed_for_the_rows_it_computed_and_hands_rows_back_when_done():
    """The blocking run as the engine runs it: 8 rows for 3 steps, then the long row alone for 28."""
    t = BatchTiming(prefill_s=1.0, step_s=[1.0] * 31, row_steps=[3] * 7 + [31], step_rows=[8] * 3 + [1] * 28,
                    returns_rows_when_done=True)
    assert (t.issued_tokens, t.useful_tokens, t.waste_fraction) == (52, 52, 0.0)
    assert t.row_returned_s == t.row_done_s == [4.0] * 7 + [32.0]
    assert t.hol_delay_s == [0.0] * 8 and t.max_hol_inflation == 1.0
    static = BatchTiming(prefill_s=1.0, step_s=[1.0] * 31, row_steps=[3] * 7 + [31])
    assert (static.issued_tokens, static.max_hol_inflation) == (248, 8.0)


def test_time_static_batch_reads_the_clock_around_each_closure():
    clock = FakeClock(2.0, 0.0, 0.5, 0.0, 0.25, 0.0, 0.125)  # prefill, gap, step, gap, step, gap, step
    calls = []
    t = time_static_batch(lambda: calls.append("prefill"), lambda: calls.append("step"),
                          row_steps=[1, 3], clock=clock)
    assert calls == ["prefill", "step", "step", "step"]
    assert t == BatchTiming(prefill_s=2.0, step_s=[0.5, 0.25, 0.125], row_steps=[1, 3])


def test_time_static_batch_rejects_an_empty_batch():
    with pytest.raises(ValueError, match="empty batch"):
        time_static_batch(lambda: None, lambda: None, row_steps=[])


def test_static_batch_timing_counts_the_prefill_token():
    t = static_batch_timing([1, 2, 5])
    assert t.row_steps == [0, 1, 4]
    assert t.step_s == [1.0] * 4


@pytest.mark.parametrize("lens", [[], [0, 3], [1, 1]])
def test_static_batch_timing_rejects_rows_without_decode(lens):
    with pytest.raises(ValueError):
        static_batch_timing(lens)


def test_slider_reproduces_the_blocking_run():
    t = static_batch_costs(8, short_share=7 / 8, long_short_ratio=8)
    assert t.row_steps == [3] * 7 + [31]
    assert (t.issued_tokens, t.useful_tokens, round(t.waste_fraction, 2)) == (248, 52, 0.79)


@pytest.mark.parametrize("short_share, ratio", [(0.0, 8), (1.0, 8), (0.5, 1)])
def test_slider_uniform_batches_waste_nothing(short_share, ratio):
    t = static_batch_costs(8, short_share=short_share, long_short_ratio=ratio)
    assert t.waste_fraction == 0.0
    assert t.max_hol_inflation == 1.0


def test_slider_waste_and_inflation_are_counts_not_seconds():
    a = static_batch_costs(6, 0.5, 4, step_s=1.0)
    b = static_batch_costs(6, 0.5, 4, step_s=0.3)
    assert a.waste_fraction == b.waste_fraction
    assert a.hol_inflation == pytest.approx(b.hol_inflation)


def test_slider_rounds_halves_up():
    t = static_batch_costs(4, short_share=0.625, long_short_ratio=2.5, short_len=3)  # 2.5 rows, 7.5 tokens
    assert t.row_steps == [2, 2, 2, 7]


@pytest.mark.parametrize("args", [(0, 0.5, 2), (4, -0.1, 2), (4, 1.5, 2), (4, 0.5, 0.5), (4, 0.5, 2, 0)])
def test_slider_validation(args):
    with pytest.raises(ValueError):
        static_batch_costs(*args)


def test_scaling_on_the_seed_sweep():
    s = fit_batch_scaling(SEED_SIZES, SEED_STEPS)
    assert [round(e, 2) for e in s.efficiency] == [1.00, 0.59, 0.30, 0.13]
    assert s.knee == 1
    assert s.peak_batch_size == 4
    assert round(s.peak_tok_per_s, 1) == 4.3
    assert round(max(s.speedup), 2) == 1.19
    assert [round(x, 2) for x in s.tok_per_s] == [3.58, 4.22, 4.26, 3.82]


def test_knee_follows_the_threshold():
    assert fit_batch_scaling(SEED_SIZES, SEED_STEPS, min_efficiency=0.5).knee == 2
    near_linear = fit_batch_scaling(SEED_SIZES, [1.0, 1.0, 1.2, 3.0])  # efficiency 1, 1, 0.83, 0.33
    assert near_linear.knee == 4
    assert near_linear.peak_batch_size == 4


def test_knee_stops_at_the_first_size_that_does_not_pay():
    s = fit_batch_scaling([1, 2, 4], [1.0, 4.0, 5.0])  # efficiency 1, 0.25, 0.8
    assert s.knee == 1


def test_scaling_baseline_is_the_smallest_batch():
    s = fit_batch_scaling([4, 2], [2.0, 1.0])
    assert s.batch_sizes == [2, 4]
    assert s.speedup == [1.0, 1.0]
    assert s.efficiency == [1.0, 0.5]


@pytest.mark.parametrize("sizes, steps, kw", [
    ([1, 2], [1.0], {}),
    ([], [], {}),
    ([1, 1], [1.0, 1.0], {}),
    ([0, 1], [1.0, 1.0], {}),
    ([1, 2], [1.0, 0.0], {}),
    ([1, 2], [1.0, 2.0], {"min_efficiency": 0.0}),
    ([1, 2], [1.0, 2.0], {"min_efficiency": 1.5}),
])
def test_scaling_validation(sizes, steps, kw):
    with pytest.raises(ValueError):
        fit_batch_scaling(sizes, steps, **kw)


def test_scaling_direct_construction_is_checked():
    with pytest.raises(ValueError, match="strictly increasing"):
        BatchScaling(batch_sizes=[2, 1], step_s=[1.0, 1.0])


def test_csv_round_trip(tmp_path):
    runs = [("blocking", seed_blocking_timing()),
            ("uniform", BatchTiming(prefill_s=0.1, step_s=[0.279, 0.281], row_steps=[2]))]
    path = tmp_path / "day-29-batchbench.csv"
    write_csv(path, runs, {"command": "python -m nanoserve bench batch", "machine": "a box"})
    assert read_csv(path) == ({"command": "python -m nanoserve bench batch", "machine": "a box"}, runs)
    lines = path.read_text().splitlines()
    assert lines[:2] == ["# command: python -m nanoserve bench batch", "# machine: a box"]
    with open(path, newline="") as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    assert tuple(rows[0]) == batchbench.CSV_FIELDS
    assert (rows[0]["issued_tokens"], rows[0]["useful_tokens"], rows[0]["waste_fraction"]) == ("248", "52", "0.7903")


@given(row_steps=st.lists(st.integers(0, 40), min_size=1, max_size=16).filter(lambda r: max(r) > 0),
       step=st.floats(1e-4, 10.0), prefill=st.floats(0.0, 10.0), data=st.data())
def test_static_batch_invariants(row_steps, step, prefill, data):
    jitter = data.draw(st.lists(st.floats(0.5, 2.0), min_size=max(row_steps), max_size=max(row_steps)))
    t = BatchTiming(prefill_s=prefill, step_s=[step * j for j in jitter], row_steps=row_steps)
    assert 0.0 <= t.waste_fraction < 1.0
    assert t.useful_tokens <= t.issued_tokens
    assert t.goodput_tok_per_s <= t.issued_tok_per_s
    assert all(x >= 1.0 for x in t.hol_inflation)
    assert all(d >= 0.0 for d in t.hol_delay_s)
    assert max(t.row_done_s) == t.batch_done_s


@given(batch=st.integers(1, 32), share=st.floats(0.0, 1.0), ratio=st.floats(1.0, 16.0),
       short_len=st.integers(2, 16))
def test_slider_invariants(batch, share, ratio, short_len):
    t = static_batch_costs(batch, share, ratio, short_len=short_len)
    assert t.batch_size == batch
    assert 0.0 <= t.waste_fraction < 1.0
    assert t.max_hol_inflation >= 1.0


def test_docstring_examples():
    assert doctest.testmod(batchbench).failed == 0


def test_batchbench_does_not_import_torch():
    # import in a fresh interpreter, bypassing the package __init__ (the engine uses torch)
    pkg_dir = str(Path(batchbench.__file__).resolve().parent.parent)
    code = ("import importlib, sys, types\n"
            f"pkg = types.ModuleType('nanoserve'); pkg.__path__ = [{pkg_dir!r}]\n"
            "sys.modules['nanoserve'] = pkg\n"
            "importlib.import_module('nanoserve.bench.batchbench')\n"
            "print(' '.join(m for m in ('torch', 'numpy') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == []
