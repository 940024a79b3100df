"""`bench spec`'s pure parts: the summary's ratios and counts, the CSV round trip, the step timer on a tiny model."""

from __future__ import annotations

import itertools

import pytest

from nanoserve.bench.spec import RunRecord, StepRecord, read_csv, step_costs, summarize, time_steps, write_csv


def record(rd, task, prompt, method, k, new, fwd, prop, acc, dt, toks="1 2 3"):
    return RunRecord(rd, task, prompt, method, k, 10, new, fwd, prop, acc, dt, toks)


RUNS = [
    record(0, "copy", 0, "plain", 0, 11, 10, 0, 0, 1.0), record(0, "copy", 0, "spec-k5", 5, 11, 4, 10, 7, 0.5),
    record(1, "copy", 0, "plain", 0, 11, 10, 0, 0, 2.0), record(1, "copy", 0, "spec-k5", 5, 11, 4, 10, 7, 0.5),
    record(2, "copy", 0, "plain", 0, 11, 10, 0, 0, 1.0), record(2, "copy", 0, "spec-k5", 5, 11, 4, 10, 7, 0.25,
                                                                "1 2 4"),
]


def test_summary_counts_and_same_round_ratios():
    plain, spec = summarize(RUNS)
    assert (plain.method, plain.speedup, plain.tokens_per_forward, plain.acceptance) == ("plain", 1.0, 1.0, 0.0)
    assert spec.acceptance == 0.7 and spec.tokens_per_forward == 2.5 and spec.new_tokens == 11
    assert spec.tok_s == 20.0  # 10 tokens in 0.5 s, the median round
    assert spec.speedup == 4.0  # per round 20/10, 20/5, 40/10: the median of 2, 4, 4
    assert not spec.same_as_plain  # round 2 differs


def test_step_costs_divide_within_a_round():
    steps = [StepRecord(0, 1, 8, 0.010), StepRecord(0, 4, 8, 0.015), StepRecord(1, 1, 8, 0.020),
             StepRecord(1, 4, 8, 0.020), StepRecord(2, 1, 8, 0.010), StepRecord(2, 4, 8, 0.012)]
    assert step_costs(steps) == pytest.approx({1: 1.0, 4: 1.2})


def test_csv_round_trip(tmp_path):
    steps = [StepRecord(0, 1, 8, 0.01), StepRecord(0, 3, 8, 0.0125)]
    path = tmp_path / "spec.csv"
    write_csv(path, RUNS, steps, ["# command: test"])
    meta, runs, back = read_csv(path)
    assert meta == {"command": "test"} and runs == RUNS and back == steps


def test_time_steps_leaves_the_pool_as_it_found_it(tiny_model):
    clock = itertools.count(0.0, 0.5).__next__
    out = time_steps(tiny_model, context=5, rows=[1, 3], reps=2, clock=clock)
    assert out == {1: 0.5, 3: 0.5}


def test_the_command_is_registered_with_its_defaults():
    from nanoserve.cli import build_parser

    args = build_parser().parse_args(["bench", "spec"])
    assert (args.what, args.k, args.out, args.lookup_min, args.lookup_max) == ("spec", [3, 5, 8], "data/bench-spec.csv",
                                                                                2, 3)
