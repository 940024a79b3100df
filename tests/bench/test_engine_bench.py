"""`bench engine`'s parts: the workloads, the systems on a tiny model, and the summaries (no timing asserted)."""

import pytest

from nanoserve.bench.engine import (
    Run,
    Workload,
    agreement,
    quantile,
    ragged_workload,
    read_csv,
    run_engine,
    run_static,
    summarize,
    uniform_workload,
    write_csv,
)
from nanoserve.engine import SchedulerConfig


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
    engine, eng = run_engine(tiny_model, w, SchedulerConfig(max_num_seqs=4))
    static = run_static(tiny_model, w, 2)
    assert agreement(engine, static) == 3 and [len(t) for t in engine.tokens] == [2, 6, 4]
    assert engine.latency_s[0] < engine.latency_s[1]  # the engine hands a short request back first
    assert static.latency_s[0] == static.latency_s[1] < static.latency_s[2]  # a batch of 2, then 1
    eng.check_idle()
    path = tmp_path / "e.csv"
    write_csv(path, [engine, static], {"ragged": w}, ["# command: test"])
    meta, rows = read_csv(path)
    assert meta == {"command": "test"} and len(rows) == 6
    s = summarize(rows)
    assert [x.system for x in s] == ["nanoserve-engine", "nanoserve-static-2"] and s[0].useful_tokens == 12


def test_quantile_is_linear_between_order_statistics():
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert quantile([0.0, 10.0], 0.9) == pytest.approx(9.0)
    assert quantile([4.0], 0.9) == 4.0


def test_summary_ratio_inputs():
    r = Run("x", "w", [1.0, 2.0], [[1], [2]], 2.0)
    assert agreement(r, Run("y", "w", [1.0, 1.0], [[1], [3]], 1.0)) == 1
