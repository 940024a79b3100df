"""`bench engine`'s parts: the workloads, the systems on a tiny model, and the summaries (no timing asserted)."""

import pytest

from nanoserve.bench.engine import (
    SystemRun,
    Workload,
    agreement,
    overhead,
    ragged_workload,
    read_csv,
    run_engine,
    run_static,
    summarize,
    uniform_workload,
    write_csv,
)
from nanoserve.config import EngineConfig, SchedulerConfig


def test_the_ragged_workload_is_what_the_issue_asks_for(tok):
    w = ragged_workload(tok, 32, seed=0)
    assert len(w.prompts) == len(w.max_tokens) == 32
    assert all(20 <= len(p) <= 300 for p in w.prompts) and all(8 <= n <= 128 for n in w.max_tokens)
    assert len({tuple(p[:16]) for p in w.prompts}) == 32  # no two prompts share a first block
    assert w == ragged_workload(tok, 32, seed=0)  # seeded
    u = uniform_workload(tok, 8, prompt_tokens=40, max_tokens=5)
    assert {len(p) for p in u.prompts} == {40} and set(u.max_tokens) == {5}


def test_flops_count_each_prompt_once_and_each_token_at_its_context(tiny_cfg):
    from nanoserve.bench.roofline import forward_flops

    w = Workload("t", [[1, 2, 3]], [3])
    assert w.flops(tiny_cfg) == forward_flops(tiny_cfg, 3) + forward_flops(tiny_cfg, 1, 3) + forward_flops(
        tiny_cfg, 1, 4)


def test_engine_and_static_runs_agree_and_hand_back_in_order(tiny_model, tmp_path):
    w = Workload("ragged", [[5, 6, 7], [8] * 9, [9, 10]], [2, 6, 4])
    engine, eng = run_engine(tiny_model, w, EngineConfig(scheduler=SchedulerConfig(max_num_seqs=4)))
    static = run_static(tiny_model, w, 2)
    assert agreement(engine, static) == 3 and [len(t) for t in engine.tokens] == [2, 6, 4]
    assert engine.latency_s[0] < engine.latency_s[1]  # the engine hands a short request back first
    assert static.latency_s[0] == static.latency_s[1] < static.latency_s[2]  # a batch of 2, then 1
    eng.check_idle()
    path = tmp_path / "e.csv"
    write_csv(path, [engine, static], {"ragged": w}, {"command": "test"})
    meta, rows = read_csv(path)
    assert meta == {"command": "test"} and len(rows) == 6 and rows[1]["prompt_tokens"] == 9
    s = summarize(rows)
    assert [x.system for x in s] == ["nanoserve-engine", "nanoserve-static-2"] and s[0].useful_tokens == 12
    assert s[1].p50_latency_s == pytest.approx(static.latency_s[1], abs=1e-4)  # rows 2 and 3 share a batch
    assert s[0].wall_s == pytest.approx(engine.wall_s, abs=1e-4)
    cost = overhead(eng, min_requests=2)
    assert cost["steps"] >= 1 and 0 <= cost["fraction"] <= 1 and cost["overhead_ms"] <= cost["step_ms"]


def test_summary_percentiles_are_linear_between_order_statistics():
    rows = [dict(workload="w", system="x", max_tokens=n, latency_s=lat, wall_s=2.0)
            for n, lat in ((3, 0.0), (4, 10.0))]
    (s,) = summarize(rows)
    assert (s.useful_tokens, s.useful_tok_s, s.p50_latency_s, s.p90_latency_s) == (7, 3.5, 5.0, 9.0)


def test_agreement_counts_whole_requests():
    r = SystemRun("x", "w", [1.0, 2.0], [[1], [2]], 2.0)
    assert agreement(r, SystemRun("y", "w", [1.0, 1.0], [[1], [3]], 1.0)) == 1
