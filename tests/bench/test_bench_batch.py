"""`python -m nanoserve bench batch`: the sweep's interleaving, the CSV it writes with its meta lines,
and the prompts it sweeps."""

import json

import pytest

from nanoserve.bench import harness
from nanoserve.bench.batch import (
    PASSAGE,
    PROMPTS,
    TORCH_OPS_LABEL,
    pooled_median,
    read_run,
    sweep_beside,
    sweep_prompt,
)
from nanoserve.bench.batchbench import BatchTiming, write_csv
from nanoserve.cli import main


@pytest.fixture(scope="module")
def prompt(tok):
    return tok.encode(PROMPTS[0])


def test_sweep_prompt_is_the_first_prompt_or_n_tokens_of_the_passage(tok):
    assert sweep_prompt(tok) == tok.encode(PROMPTS[0])
    long = sweep_prompt(tok, 300)
    assert len(long) == 300 and long[:20] == tok.encode(PASSAGE)[:20]
    assert tok.decode(long).startswith("The lighthouse on the northern cape")


def test_read_meta_decodes_json_values(tmp_path):
    path = tmp_path / "b.csv"
    t = BatchTiming(prefill_s=0.5, step_s=[0.25, 0.25], row_steps=[2])
    write_csv(path, [("nanoserve", t)], {"command": "python -m nanoserve bench batch", "same": True,
                                         "peaks": [1.5, None], "machine": "a | b"})
    meta, runs = read_run(path)
    assert meta == {"command": "python -m nanoserve bench batch", "same": True, "peaks": [1.5, None],
                    "machine": "a | b"}
    assert runs == [("nanoserve", t)]


def test_pooled_median_pools_every_step_of_every_round():
    runs = [BatchTiming(0.0, [1.0, 5.0], [2]), BatchTiming(0.0, [2.0, 3.0], [2])]
    assert pooled_median(runs) == 2.5


def test_sweep_calls_before_round_ahead_of_each_round(model, prompt, monkeypatch):
    """The command measures the peak there, so each round's peak sits beside that round's steps."""
    events = []
    real_sweep = harness.sweep_batch_sizes

    def logged_sweep(model, prompt, sizes, *args, **kwargs):
        events.append(f"B={sizes[0]}")
        return real_sweep(model, prompt, sizes, *args, **kwargs)

    monkeypatch.setattr(harness, "sweep_batch_sizes", logged_sweep)
    runs = sweep_beside(model, None, prompt, [1, 2], steps=1, rounds=2,
                        before_round=lambda r: events.append(f"round {r}"))
    assert events == ["round 0", "B=1", "B=2", "round 1", "B=1", "B=2"]
    assert [len(runs.ours[b]) for b in (1, 2)] == [2, 2] and runs.theirs == {1: [], 2: []} and runs.torch_ops == {}


def test_sweep_times_the_torch_ops_step_beside_the_compiled_one(model, prompt, monkeypatch):
    """Right after each of ours, in the same round: the A/B of what the compiled kernels buy."""
    events = []
    real_sweep = harness.sweep_batch_sizes

    def logged_sweep(model, prompt, sizes, *args, compiled=None, **kwargs):
        events.append(f"B={sizes[0]}" + (" ops" if compiled is False else ""))
        return real_sweep(model, prompt, sizes, *args, compiled=compiled, **kwargs)

    monkeypatch.setattr(harness, "sweep_batch_sizes", logged_sweep)
    runs = sweep_beside(model, None, prompt, [1, 4], steps=2, rounds=1, torch_ops=True)
    assert events == ["B=1", "B=1 ops", "B=4", "B=4 ops"]
    assert [len(runs.torch_ops[b]) for b in (1, 4)] == [1, 1]
    assert runs.torch_ops_same == {1: True, 4: True}


def test_sweep_beside_transformers_compares_their_tokens(model, hf_model, prompt):
    runs = sweep_beside(model, hf_model, prompt, [2], steps=2, rounds=1)
    assert len(runs.theirs[2]) == 1 and runs.same == {2: True}


def test_command_writes_the_csv_with_its_meta_lines(model, tmp_path, compiled):
    out = tmp_path / "bb.csv"
    argv = ["bench", "batch", "--sizes", "1", "2", "--steps", "2", "--rounds", "1", "--no-hf", "--no-roofline",
            "--out", str(out)]
    assert main(argv) == 0
    meta, runs = read_run(out)
    label, blocking = runs[0]
    assert label == "blocking" and (blocking.issued_tokens, blocking.useful_tokens) == (248, 52)
    assert meta["kernels"].startswith("compiled")  # then our step on torch's ops is timed beside it
    assert [(lbl, t.batch_size) for lbl, t in runs[1:]] == [
        ("nanoserve", 1), (TORCH_OPS_LABEL, 1), ("nanoserve", 2), (TORCH_OPS_LABEL, 2)]
    assert meta["torch_ops_same_tokens"] is True and meta["transformers_same_tokens"] is None
    assert meta["command"] == "python -m nanoserve " + " ".join(argv)
    assert "threads" in meta["machine"] and meta["weight_bytes"] == model.weight_bytes()
    assert json.dumps(meta)  # every meta value is plain data


def test_the_roofline_takes_the_median_of_the_peaks_and_reads_measured_beside_the_rounds(model, tmp_path,
                                                                                         monkeypatch):
    from nanoserve.bench import batch
    from nanoserve.bench.roofline import Roofline

    flops, reads = iter([3e11, 1e11]), iter([5e10, 8e10])  # before rounds 0 and 1; the end's come from Roofline
    monkeypatch.setattr(batch, "measure_gemm_flops", lambda: next(flops))
    monkeypatch.setattr(batch, "measure_onednn_gemm_flops", lambda: None)
    monkeypatch.setattr(batch, "measure_bandwidth", lambda nbytes, repeats: (next(reads), 0.0))
    monkeypatch.setattr(batch, "measure_roofline", lambda: Roofline(2e11, None, 7e10, 6e10, 2, 2048, 2**30))
    out = tmp_path / "bb.csv"
    assert main(["bench", "batch", "--sizes", "1", "--steps", "2", "--rounds", "2", "--no-hf", "--no-torch-ops",
                 "--out", str(out)]) == 0
    meta, _ = read_run(out)
    assert meta["peak_flops_torch"] == 2e11 and meta["peak_flops_onednn"] is None
    assert meta["read_bandwidth_samples"] == [5e10, 8e10, 7e10] and meta["read_bandwidth"] == 7e10  # their median
    assert meta["copy_bandwidth"] == 6e10
