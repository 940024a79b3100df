"""The field's programs beside `serve`: llama-server's command line and its absence, and GuideLLM and lm-eval
run unchanged against a real `serve` (where they are installed; the test extra installs both)."""

import json
import urllib.request

import pytest
import torch

from nanoserve.bench import arrivals
from nanoserve.bench.clients import (
    LM_EVAL_TASKS,
    free_port,
    guidellm_summary,
    llama_server_argv,
    llama_server_path,
    run_guidellm,
    run_lm_eval,
    start_server,
    write_lm_eval_tasks,
)
from nanoserve.cli import build_parser


def test_llama_server_gets_a_slot_per_sequence_and_the_context_they_need(tmp_path):
    argv = llama_server_argv(tmp_path / "llama-server", tmp_path / "m.gguf", 8123, parallel=4, slot_tokens=300,
                             threads=2)
    flags = dict(zip(argv, argv[1:]))  # each option and the word after it
    assert "--cont-batching" in argv and flags["--parallel"] == "4" and flags["--ctx-size"] == "1200"
    assert flags["--threads"] == flags["--threads-batch"] == "2" and flags["--host"] == "127.0.0.1"
    assert flags["--port"] == "8123" and flags["-m"] == str(tmp_path / "m.gguf")
    assert flags["--cache-type-k"] == flags["--cache-type-v"] == "f16"  # its K/V cache named, as the CSV records it


@pytest.mark.parametrize("system, starts", [("nanoserve-server", 1), ("llama-server", 3)])
def test_a_peer_server_is_fresh_for_each_replay_so_no_rate_hits_anothers_prompt_cache(system, starts, tmp_path,
                                                                                      monkeypatch):
    from nanoserve.bench.harness import Workload

    started, sent = [], []

    class Proc:
        def terminate(self):
            started[-1] = "stopped"

        def wait(self, timeout):
            pass

    def fake_start(port, extra=(), command=None):
        assert "running" not in started  # the last process is gone before the next starts
        started.append("running")
        return Proc()

    monkeypatch.setattr(arrivals, "start_server", fake_start)
    monkeypatch.setattr(arrivals, "replay_server", lambda port, w, a, rate=0.0, system="", tok=None: sent.append(w))
    monkeypatch.setattr(arrivals, "llama_server_path", lambda: tmp_path / "llama-server")
    monkeypatch.setattr(arrivals, "gguf_of", lambda folder: folder / "m.gguf")
    w = Workload("w", [[1, 2, 3, 4], [5, 6, 7]], [2, 2])
    with arrivals.serving(system, None, None, arrivals.EngineConfig(), w, folder=tmp_path) as replay:
        for rate in (1.0, 2.0, 4.0):
            replay(w, [0.0, 0.1], rate)
    assert len(started) == starts and set(started) == {"stopped"}
    assert [x.prompts for x in sent if x.name == "warm"] == [[[4, 3, 2, 1], [7, 6, 5]]] * starts  # no shared prefix


def test_llama_server_runs_once_per_slot_count_each_under_its_own_label(tmp_path, monkeypatch):
    from nanoserve.bench.harness import Workload

    assert arrivals.peer_runs(["nanoserve-server", "llama-server"], None) == [
        ("nanoserve-server", "nanoserve-server", None), ("llama-server", "llama-server", None)]
    assert arrivals.peer_runs(["llama-server"], [16]) == [("llama-server", "llama-server", 16)]
    assert arrivals.peer_runs(["nanoserve-server", "llama-server"], [4, 32]) == [
        ("nanoserve-server", "nanoserve-server", None), ("llama-server", "llama-server -np 4", 4),
        ("llama-server", "llama-server -np 32", 32)]
    commands = []

    class Proc:
        def terminate(self):
            pass

        def wait(self, timeout):
            pass

    monkeypatch.setattr(arrivals, "start_server",
                        lambda port, extra=(), command=None: commands.append(command) or Proc())
    monkeypatch.setattr(arrivals, "replay_server", lambda *a, **k: None)
    monkeypatch.setattr(arrivals, "llama_server_path", lambda: tmp_path / "llama-server")
    monkeypatch.setattr(arrivals, "gguf_of", lambda folder: folder / "m.gguf")
    w = Workload("w", [[1, 2, 3, 4], [5, 6, 7]], [2, 9])
    for slots, want in ((None, "32"), (8, "8")):
        with arrivals.serving("llama-server", None, None, arrivals.EngineConfig(), w, folder=tmp_path, slots=slots):
            pass
        flags = dict(zip(commands[-1], commands[-1][1:]))
        assert flags["--parallel"] == want and flags["--ctx-size"] == str(int(want) * 12)  # 3 + 9: the longest


def test_bench_arrivals_skips_llama_server_where_it_is_not_built(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NANOSERVE_HOME", str(tmp_path))
    assert llama_server_path() is None
    argv = ["bench", "arrivals", "--systems", "llama-server", "--out", str(tmp_path / "a.csv")]
    assert arrivals.run(build_parser().parse_args(argv), argv) == 0
    assert "llama-server: skipped, not built" in capsys.readouterr().err and not (tmp_path / "a.csv").exists()


def test_lm_eval_tasks_are_local_files(tmp_path):
    names = write_lm_eval_tasks(tmp_path)
    assert names == list(LM_EVAL_TASKS)
    for name in names:
        task = json.loads((tmp_path / f"{name}.yaml").read_text())
        assert task["task"] == name and task["dataset_path"] == "json"
        data = task["dataset_kwargs"]["data_files"]["test"]
        assert [json.loads(line) for line in open(data)] == LM_EVAL_TASKS[name][1]


def test_guidellm_summary_reads_counts_medians_and_cached_tokens():
    stat = lambda v: {"successful": {"median": v, "count": 2}}
    report = {"benchmarks": [{"metrics": {"request_totals": {"successful": 2, "errored": 0, "incomplete": 0},
                                          "time_to_first_token_ms": stat(120.0), "inter_token_latency_ms": stat(30.0),
                                          "time_per_output_token_ms": stat(36.0), "prompt_token_count": stat(64.0),
                                          "output_token_count": stat(16.0)},
                              "requests": {"successful": [{"input_metrics": {"cached_tokens": 0}},
                                                          {"input_metrics": {"cached_tokens": 32}}]}}]}
    s = guidellm_summary(report)
    assert (s["successful"], s["errored"], s["ttft_ms"], s["itl_ms"], s["cached_tokens"]) == (2, 0, 120.0, 30.0,
                                                                                              [0, 32])


@pytest.fixture(scope="module")
def served(model_dir):
    """`serve` on the folder's fp32 weights, so its log-probabilities can be held to transformers'."""
    port = free_port()
    proc = start_server(port, ["--model", str(model_dir), "--kv-cache-gib", "0.1", "--threads", "1"], timeout_s=300)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def finished_counts(url: str) -> tuple[float, float]:
    """The server's own counts, from its /metrics: requests finished by length, tokens generated."""
    lines = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode().splitlines()

    def total(name: str, label: str = "") -> float:
        return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines if ln.startswith(name + "{") and label in ln)

    return total("nanoserve:request_success_total", 'finished_reason="length"'), total(
        "nanoserve:generation_tokens_total")


@pytest.mark.slow
def test_guidellm_benchmarks_serve(served, model_dir, tmp_path):
    pytest.importorskip("guidellm")
    before = finished_counts(served)
    s = guidellm_summary(run_guidellm(served, model_dir, tmp_path, requests=3, prompt_tokens=32, output_tokens=8))
    after = finished_counts(served)
    assert (after[0] - before[0], after[1] - before[1]) == (3, 24)  # the server served its three requests whole
    # guidellm counts a request only where its completion falls inside the window it measures: on a loaded
    # machine the last one can land on the window's edge and go uncounted, neither errored nor incomplete
    assert s["errored"] == s["incomplete"] == 0 and s["successful"] in (2, 3)
    assert s["prompt_tokens"] == 32 and s["output_tokens"] == 8  # usage's counts, ignore_eos honoured
    assert s["ttft_ms"] > 0 and s["itl_ms"] > 0 and s["tpot_ms"] > 0
    assert all(isinstance(c, int) for c in s["cached_tokens"])  # usage.prompt_tokens_details.cached_tokens


@pytest.mark.slow
def test_lm_eval_local_completions_scores_through_serve_as_transformers_does(served, model_dir, hf_model, hf_tok,
                                                                             tmp_path):
    """Loglikelihoods come from echo=True with logprobs (lm-eval sums the continuation's); generate_until from a
    greedy completion cut at its stop strings. Both are held to transformers on the same weights."""
    pytest.importorskip("lm_eval")
    out = run_lm_eval(served, model_dir.name, model_dir, tmp_path)
    assert set(out["results"]) == set(LM_EVAL_TASKS)
    for s in out["samples"]["nanoserve_tiny_choice"]:
        context = hf_tok(s["doc"]["question"]).input_ids
        for choice, resp in zip(s["doc"]["choices"], s["resps"]):
            whole = hf_tok(s["doc"]["question"] + " " + choice).input_ids
            with torch.no_grad():
                logp = hf_model(torch.tensor([whole])).logits[0].log_softmax(-1)
            want = sum(logp[i - 1, whole[i]].item() for i in range(len(context), len(whole)))
            assert float(resp[0][0]) == pytest.approx(want, abs=1e-3)
    (s,) = out["samples"]["nanoserve_tiny_generate"]
    ids = hf_tok(s["doc"]["question"], return_tensors="pt").input_ids
    with torch.no_grad():
        greedy = hf_model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:]
    text = hf_tok.decode(greedy)
    for stop in LM_EVAL_TASKS["nanoserve_tiny_generate"][0]["generation_kwargs"]["until"]:
        text = text.split(stop)[0]
    assert s["resps"][0][0] == text
