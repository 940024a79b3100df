"""The chunked-prefill benchmark's counting: stall gaps, summaries and the CSV round trip (Day 32)."""

import pytest

from nanoserve.bench.chunked import (
    LONG,
    ScenarioRun,
    label_of,
    long_prompt,
    median_summaries,
    read_csv,
    run_scenario,
    short_prompts,
    stall_gaps,
    summarize_run,
    write_csv,
)
from nanoserve.cli import build_parser
from nanoserve.config import EngineConfig, SchedulerConfig


def fake_run(label="128", budget=128, chunked=True, round_=0, stall=1.0) -> ScenarioRun:
    """Two running requests ticking every 0.1 s; the long prompt arrives at t=0 and its first token comes at
    t=stall, in one step (the running requests wait that long too)."""
    before = [-0.3, -0.2, -0.1]
    short = before + [stall, stall + 0.1]
    return ScenarioRun(label, budget, chunked, round_,
               tokens={"0": [5, 6, 7, 8, 9], "1": [1, 2, 3, 4, 5], LONG: [7, 7]},
               steps={"0": [-3, -2, -1, 0, 1], "1": [-3, -2, -1, 0, 1], LONG: [0, 1]},
               times={"0": short, "1": list(short), LONG: [stall, stall + 0.1]})


def test_stall_gaps_are_the_gaps_that_end_during_the_long_prefill():
    run = fake_run(stall=1.0)
    assert [round(g, 6) for g in stall_gaps(run)] == [1.1, 1.1]
    s = summarize_run(run)
    assert s.prefill_steps == 1 and s.ttft_s == 1.0
    assert round(s.itl_before_s, 6) == 0.1 and round(s.itl_max_s, 6) == round(s.itl_p90_s, 6) == 1.1


def test_chunked_stall_spreads_over_steps():
    run = fake_run()
    run.steps = {"0": [-1, 0, 1, 2], LONG: [2, 3]}
    run.times = {"0": [-0.1, 0.3, 0.6, 0.9], LONG: [0.9, 1.0]}
    run.tokens = {"0": [1, 2, 3, 4], LONG: [7, 7]}
    s = summarize_run(run)
    assert s.prefill_steps == 3 and s.ttft_s == 0.9
    assert [round(g, 6) for g in stall_gaps(run)] == [0.4, 0.3, 0.3]
    assert round(s.itl_max_s, 6) == 0.4 and round(s.itl_median_s, 6) == 0.3


def test_median_summaries_take_medians_per_config_and_sort_no_chunk_first():
    runs = [fake_run("128", 128, True, r, stall) for r, stall in enumerate((1.0, 3.0, 2.0))]
    runs.append(fake_run("no-chunk", 2048, False, 0, 5.0))
    rows = median_summaries([summarize_run(r) for r in runs])
    assert [r.label for r in rows] == ["no-chunk", "128"]
    assert rows[1].ttft_s == 2.0
    bad = fake_run("128", 128, True, 3)
    bad.steps[LONG] = [4, 5]
    with pytest.raises(ValueError, match="disagree"):
        median_summaries([summarize_run(r) for r in runs[:3] + [bad]])


def test_csv_round_trip(tmp_path):
    runs = [fake_run(), fake_run("no-chunk", 2048, False)]
    path = tmp_path / "c.csv"
    write_csv(path, runs, {"command": "python -m nanoserve bench chunked", "rounds": 1})
    meta, back = read_csv(path)
    assert meta == {"command": "python -m nanoserve bench chunked", "rounds": "1"}
    assert [(r.label, r.budget, r.chunked) for r in back] == [("128", 128, True), ("no-chunk", 2048, False)]
    assert back[0].tokens == runs[0].tokens and back[0].steps == runs[0].steps
    assert back[0].times[LONG] == runs[0].times[LONG] and back[0].tokens == back[1].tokens


def test_scenario_on_the_tiny_model_counts_chunks_and_keeps_tokens(tiny_model):
    shorts = [[10 + i, 20 + i, 30 + i, 40 + i] for i in range(3)]
    long = [(7 * j) % 200 + 3 for j in range(100)]
    whole = run_scenario(tiny_model, SchedulerConfig(max_num_batched_tokens=256, chunked_prefill=False), shorts, long,
                         short_tokens=30, long_tokens=3, warm=2)
    config = EngineConfig(scheduler=SchedulerConfig(max_num_batched_tokens=23))
    chunked = run_scenario(tiny_model, config, shorts, long, short_tokens=30, long_tokens=3, warm=2)
    assert label_of(config) == chunked.label == "23" and label_of(SchedulerConfig(chunked_prefill=False)) == "no-chunk"
    assert label_of(SchedulerConfig(tpot_slo_ms=60.0)) == "target 60 ms"
    assert summarize_run(whole).prefill_steps == 1
    assert summarize_run(chunked).prefill_steps == 5  # 3 decode tokens + 20 of the prompt a step
    assert all(s[0] < 0 for s in (whole.steps[r] for r in whole.short_ids))  # decoding before it arrived
    assert whole.tokens == chunked.tokens and [len(t) for t in whole.tokens.values()] == [30, 30, 30, 3]
    assert whole.long_cached_tokens == chunked.long_cached_tokens == 0


def test_prompts_share_no_first_block(tok):
    shorts, long = short_prompts(tok, 8), long_prompt(tok, 1000)
    assert len(long) == 1000 and all(len(p) == 24 for p in shorts)
    assert len({tuple(p[:16]) for p in [*shorts, long]}) == 9  # so the prefix cache finds nothing
    with pytest.raises(ValueError, match="distinct places"):
        short_prompts(tok, 200)


def test_the_command_is_registered():
    args = build_parser().parse_args(["bench", "chunked", "--budgets", "64", "128", "--rounds", "1"])
    assert (args.what, args.budgets, args.rounds, args.max_num_seqs) == ("chunked", [64, 128], 1, 32)
