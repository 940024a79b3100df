"""`bench arrivals`' parts on a tiny model: a trace replayed on the engine, and the CSVs read back (no timing
asserted)."""

import pytest

from nanoserve.bench import csvio
from nanoserve.bench.arrivals import (
    Replay,
    goodput_under,
    read_requests,
    read_summary,
    replay_engine,
    write_csvs,
)
from nanoserve.bench.harness import Workload, greedy, run_requests
from nanoserve.bench.serving import SLO
from nanoserve.bench.timing import RequestTiming
from nanoserve.engine import LLMEngine


def test_a_replayed_trace_gives_every_request_its_tokens_and_frees_the_pool(tiny_model):
    w = Workload("t", [[5, 6, 7], [8] * 9, [9, 10], [3] * 20], [2, 6, 4, 3])
    engine = LLMEngine(tiny_model, max_num_seqs=4, max_num_batched_tokens=8, num_blocks=32)
    r = replay_engine(engine, w, [0.0, 0.0, 0.05, 0.1], rate=2.0)
    assert [len(t) for t in r.tokens] == [2, 6, 4, 3] and [t.output_len for t in r.timings] == [2, 6, 4, 3]
    assert r.timings[2].start - r.timings[0].start == pytest.approx(0.05)  # each clock starts at its arrival
    assert all(t.ttft >= 0 for t in r.timings)
    offline = LLMEngine(tiny_model, max_num_seqs=4, num_blocks=32)
    _, reqs = run_requests(offline, w.prompts, [greedy(n) for n in w.max_tokens])  # all at once
    assert r.tokens == [q.output_token_ids for q in reqs]
    assert not engine.requests  # the replay takes its requests out of the engine
    engine.check_idle()
    # the same trace again, at another rate: its prompts are new to the engine, not prefix hits
    again = replay_engine(engine, w, [0.0, 0.0, 0.0, 0.0], rate=float("inf"))
    assert again.tokens == r.tokens and engine.scheduler.prefix_hit_tokens == 0
    engine.add_request([5, 6, 7], greedy(2))
    engine.step()
    with pytest.raises(RuntimeError, match="needs an idle engine"):  # one request holds blocks
        replay_engine(engine, w, [0.0] * 4)


def test_csvs_round_trip_and_goodput_can_be_recomputed_under_another_slo(tmp_path):
    w = Workload("t", [[1, 2], [3]], [3, 2])
    runs = [Replay("a", 1.0, [RequestTiming(0.0, (1.0, 1.2, 1.4), 1.4), RequestTiming(1.0, (4.5, 5.5), 5.5)],
                   [[1, 2, 3], [4, 5]]),
            Replay("b", 1.0, [RequestTiming(0.0, (0.5, 0.6, 0.7), 0.7), RequestTiming(1.0, (1.5, 1.6), 1.6)],
                   [[1, 2, 3], [4, 5]])]
    slo = SLO(ttft_s=3.0, tpot_s=0.25)
    out = tmp_path / "arr.csv"
    write_csvs(out, runs, w, slo, {"command": "test"})
    meta, summary = read_summary(out)
    assert meta == {"command": "test"} and [r["system"] for r in summary] == ["a", "b"]
    assert csvio.beside(out, "requests").name == "arr-requests.csv" and summary[0]["completed"] == 2.0
    assert summary[0]["good"] == 1 and summary[1]["good"] == 2
    requests = read_requests(out)
    assert len(requests) == 4 and requests[1]["ttft_s"] == 3.5 and requests[1]["met_slo"] == 0
    assert (requests[0]["tpot_s"], requests[1]["tpot_s"]) == (0.2, 1.0)
    same = goodput_under(summary, requests, slo)
    assert same[("a", 1.0)] == pytest.approx(summary[0]["goodput"], rel=1e-3)
    loose = goodput_under(summary, requests, SLO(ttft_s=10.0, tpot_s=1.0))
    assert loose[("a", 1.0)] == pytest.approx(2 / summary[0]["duration_s"])


def test_slo_budget_runs_nanoserve_with_and_without_the_slos_tpot_target_and_a_peer_once():
    from nanoserve.bench.arrivals import budget_runs
    from nanoserve.config import EngineConfig

    config, slo = EngineConfig.from_kwargs(tpot_slo_ms=100.0), SLO(3.0, 0.25)
    options = ["--max-num-seqs", "8", "--tpot-slo-ms", "100.0", "--block-size", "16"]
    (off_label, off, off_opts), (on_label, on, on_opts) = budget_runs("nanoserve-server", "nanoserve-server", config,
                                                                      options, "both", slo)
    assert (off_label, on_label) == ("nanoserve-server", "nanoserve-server slo-budget")
    assert off.scheduler.tpot_slo_ms is None and on.scheduler.tpot_slo_ms == 250.0
    assert off_opts == ["--max-num-seqs", "8", "--block-size", "16"] and on_opts == off_opts + ["--tpot-slo-ms", "250"]
    assert budget_runs("nanoserve-engine", "nanoserve-engine", config, options, "off", slo) == [
        ("nanoserve-engine", config, options)]  # as configured
    assert [label for label, *_ in budget_runs("nanoserve-engine", "nanoserve-engine", config, [], "on", slo)] == [
        "nanoserve-engine slo-budget"]
    assert budget_runs("llama-server", "llama-server -np 8", config, options, "both", slo) == [
        ("llama-server -np 8", config, options)]


def test_nanoserve_runs_once_per_kv_cache_dtype_and_a_peer_once_with_its_own():
    from nanoserve.bench.arrivals import kv_runs

    assert kv_runs("nanoserve-server", "nanoserve-server", ["auto", "bfloat16"]) == [
        ("nanoserve-server", "auto"), ("nanoserve-server kv-bf16", "bfloat16")]
    assert kv_runs("nanoserve-engine", "nanoserve-engine", ["auto"]) == [("nanoserve-engine", "auto")]
    assert kv_runs("llama-server", "llama-server -np 8", ["auto", "bfloat16"]) == [("llama-server -np 8", "auto")]


def test_arrivals_takes_several_kv_cache_dtypes_and_serve_one():
    from nanoserve.cli import build_parser

    args = build_parser().parse_args(["bench", "arrivals", "--kv-cache-dtype", "auto", "bfloat16"])
    assert args.kv_cache_dtype == ["auto", "bfloat16"]
    assert build_parser().parse_args(["bench", "arrivals"]).kv_cache_dtype == ["auto"]
    assert build_parser().parse_args(["serve", "--kv-cache-dtype", "bfloat16"]).kv_cache_dtype == "bfloat16"


def test_the_prompt_heavy_workload_keeps_to_its_ranges(tok):
    from nanoserve.bench.harness import prompt_heavy_workload

    w = prompt_heavy_workload(tok, 40, seed=1)
    assert w.name == "prompt-heavy" and len(w.prompts) == len(w.max_tokens) == 40
    assert all(100 <= len(p) <= 300 for p in w.prompts) and all(30 <= m <= 100 for m in w.max_tokens)
    assert sum(map(len, w.prompts)) > 2 * sum(w.max_tokens)  # prompts outweigh outputs
