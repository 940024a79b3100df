"""`bench spec`'s parts: the summary's ratios and counts per concurrency, the CSV round trip, plain and
speculative runs through the engine on a tiny model, the step timer."""

from __future__ import annotations

import itertools

import pytest

from nanoserve.bench.spec import (
    ForwardTiming,
    RunRecord,
    read_csv,
    run_group,
    run_once,
    step_costs,
    summarize,
    time_steps,
    with_drafts,
    write_csv,
)
from nanoserve.config import EngineConfig, SpeculativeConfig


def record(rd, task, prompt, method, k, new, fwd, prop, acc, dt, toks="1 2 3", c=1):
    return RunRecord(rd, task, prompt, method, k, 10, new, fwd, prop, acc, dt, toks, c)


RUNS = [
    record(0, "copy", 0, "plain", 0, 11, 10, 0, 0, 1.0), record(0, "copy", 0, "spec-k5", 5, 11, 4, 10, 7, 0.5),
    record(1, "copy", 0, "plain", 0, 11, 10, 0, 0, 2.0), record(1, "copy", 0, "spec-k5", 5, 11, 4, 10, 7, 0.5),
    record(2, "copy", 0, "plain", 0, 11, 10, 0, 0, 1.0), record(2, "copy", 0, "spec-k5", 5, 11, 4, 10, 7, 0.25,
                                                                "1 2 4"),
]


def test_summary_counts_and_same_round_ratios():
    plain, spec = summarize(RUNS)
    assert (plain.method, plain.concurrency, plain.speedup, plain.tokens_per_forward, plain.acceptance) == (
        "plain", 1, 1.0, 1.0, 0.0)
    assert spec.acceptance == 0.7 and spec.tokens_per_forward == 2.5 and spec.new_tokens == 11
    assert spec.tok_s == 20.0  # 10 tokens in 0.5 s, the median round
    assert spec.speedup == 4.0  # per round 20/10, 20/5, 40/10: the median of 2, 4, 4
    assert not spec.same_as_plain  # round 2 differs


def test_summary_per_concurrency_divides_by_plain_at_the_same_concurrency_and_checks_tokens_against_one():
    runs = [record(0, "chat", 0, "plain", 0, 11, 10, 0, 0, 1.0), record(0, "chat", 0, "spec-k3", 3, 11, 5, 6, 5, 0.5)]
    # two requests together, each slower than alone; the same prompt twice; plain's tokens differ from alone's
    runs += [record(0, "chat", p, m, k, 11, f, 6 * (k > 0), 5 * (k > 0), dt, "1 2 3" if m != "plain" else "9", 2)
             for p in (0, 0) for m, k, f, dt in (("plain", 0, 10, 2.0), ("spec-k3", 3, 5, 1.25))]
    by = {(s.concurrency, s.method): s for s in summarize(runs)}
    assert by[(2, "plain")].tok_s == 5.0 and by[(2, "spec-k3")].tok_s == 8.0 and by[(2, "spec-k3")].speedup == 1.6
    assert by[(1, "spec-k3")].speedup == 2.0 and by[(2, "spec-k3")].new_tokens == 22
    assert by[(2, "spec-k3")].same_as_plain and not by[(2, "plain")].same_as_plain  # against plain alone


def test_step_costs_divide_within_a_round():
    steps = [ForwardTiming(0, 1, 8, 0.010), ForwardTiming(0, 4, 8, 0.015), ForwardTiming(1, 1, 8, 0.020),
             ForwardTiming(1, 4, 8, 0.020), ForwardTiming(2, 1, 8, 0.010), ForwardTiming(2, 4, 8, 0.012)]
    assert step_costs(steps) == pytest.approx({1: 1.0, 4: 1.2})


def test_csv_round_trip(tmp_path):
    steps = [ForwardTiming(0, 1, 8, 0.01), ForwardTiming(0, 3, 8, 0.0125)]
    runs = RUNS + [record(0, "chat", 1, "plain", 0, 5, 4, 0, 0, 0.5, "4 5", 8)]
    path = tmp_path / "spec.csv"
    write_csv(path, runs, steps, {"command": "test"})
    meta, back, back_steps = read_csv(path)
    assert meta == {"command": "test"} and back == runs and back_steps == steps


def test_with_drafts_sets_the_draft_length_and_keeps_the_rest():
    config = EngineConfig(speculative=SpeculativeConfig(num_speculative_tokens=8, prompt_lookup_max=4))
    assert with_drafts(config, 0).speculative is None and with_drafts(config, 0).scheduler == config.scheduler
    assert with_drafts(config, 3).speculative == SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=4)
    assert with_drafts(None, 2).speculative == SpeculativeConfig(num_speculative_tokens=2)


def test_speculative_runs_equal_plain_greedy_alone_and_together(tiny_model):
    copy = [(5 * i) % 40 + 3 for i in range(24)] * 2  # repeats: prompt lookup finds drafts
    prompts, clock = [copy, [7, 8, 9, 10, 11]], itertools.count(0.0, 0.25).__next__
    alone = [run_once(tiny_model, p, 8, 0, clock=clock) for p in prompts]
    assert all(fwd == 7 and prop == acc == 0 and dt > 0 for _, fwd, prop, acc, dt in alone)  # a token a forward
    plain, spec = (run_group(tiny_model, prompts, 8, k, clock=clock) for k in (0, 3))
    assert [t[0] for t in plain] == [t[0] for t in spec] == [t[0] for t in alone]
    assert spec[0][2] > 0 and all(acc <= prop and fwd == 7 - acc for _, fwd, prop, acc, _ in spec)


def test_time_steps_leaves_the_pool_as_it_found_it(tiny_model):
    clock = itertools.count(0.0, 0.5).__next__
    assert time_steps(tiny_model, context=5, rows=[1, 3], reps=2, clock=clock) == {1: 0.5, 3: 0.5}


def test_the_command_is_registered_with_its_defaults():
    from nanoserve.cli import build_parser

    args = build_parser().parse_args(["bench", "spec"])
    assert (args.what, args.k, args.concurrency, args.out, args.lookup_min, args.lookup_max) == (
        "spec", [3, 5, 8], [1, 8], "data/bench-spec.csv", 2, 3)
