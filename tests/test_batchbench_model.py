"""The Day-29 runner on the real model and a real pool: what it times is what generation runs."""

import json

import pytest

from nanoserve.batch import greedy_generate_batch
from nanoserve.batchbench import read_csv
from nanoserve.runner import (
    BLOCKING_LENS,
    PROMPTS,
    build_batched_decode,
    main,
    sidecar_path,
    step_roofline,
    sweep_batch_sizes,
    sweep_beside,
    time_hf_generate,
    time_model_batch,
)


class TickClock:
    """Every read advances one second: each timed call lasts exactly 1.0."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok.encode(p) for p in PROMPTS]


def test_blocking_run_counts_on_the_real_model(model, prompts):
    stop_steps = [n - 1 for n in BLOCKING_LENS]
    timing, tokens = time_model_batch(model, prompts, stop_steps, clock=TickClock())
    assert (timing.issued_tokens, timing.useful_tokens, round(timing.waste_fraction, 2)) == (248, 52, 0.79)
    assert timing.row_steps == stop_steps and timing.n_steps == 31
    assert timing.max_hol_inflation == (1 + 31) / (1 + 3)  # one prefill, then 31 vs 3 one-second steps
    assert [len(t) for t in tokens] == list(BLOCKING_LENS)
    assert tokens == greedy_generate_batch(model, prompts, max_new_tokens=list(BLOCKING_LENS))


def test_sweep_collects_exactly_greedy_generate_batch_tokens(model, prompts):
    sweep = sweep_batch_sizes(model, prompts[1], batch_sizes=(1, 2, 3), steps=4, warmup=False, clock=TickClock())
    for b in (1, 2, 3):
        assert sweep.tokens[b] == greedy_generate_batch(model, [prompts[1]] * b, stop_steps=[4] * b)
        t = sweep.timings[b]
        assert t.issued_tokens == t.useful_tokens == 4 * b and t.waste_fraction == 0.0
    assert sweep.scaling.batch_sizes == [1, 2, 3]
    assert sweep.scaling.efficiency == [1.0, 1.0, 1.0]  # the tick clock makes every step cost the same


def test_finished_rows_keep_their_blocks(model, prompts):
    run = build_batched_decode(model, prompts[:2], stop_steps=[1, 20], block_size=4)
    run.prefill()
    for _ in range(20):
        run.step()
    short, long = run.batch.kv.tables
    assert short.num_tokens == len(prompts[0]) + 20  # forwarded and cached to the end, tokens uncollected
    assert len(short.blocks) == -(-short.num_tokens // 4)
    assert [len(t) for t in run.tokens] == [2, 21]
    run.free()
    assert run.batch.kv.cache.pool.num_free == run.batch.kv.cache.num_blocks


def test_transformers_baseline_is_timed_per_step_and_agrees(model, hf_model, prompts):
    timing, tokens = time_hf_generate(hf_model, [prompts[0]] * 2, steps=3, clock=TickClock())
    assert timing.n_steps == 3 and timing.row_steps == [3, 3]
    assert timing.step_s == [1.0, 1.0, 1.0]
    assert tokens == greedy_generate_batch(model, [prompts[0]] * 2, stop_steps=[3, 3])


def test_step_roofline_is_memory_bound_at_batch_one(model):
    point = step_roofline(model, 1, context=64, peak_flops=200e9, bandwidth=20e9)
    assert point.intensity == pytest.approx(0.5, rel=0.05)  # 2 FLOPs per 4-byte weight
    assert point.best_step_s == pytest.approx(model.weight_bytes() / 20e9, rel=0.05)
    assert step_roofline(model, 64, 64, 200e9, 20e9).attainable_flops == 200e9  # compute-bound by 64 rows


def test_sweep_calls_before_round_ahead_of_each_round(model, prompts, monkeypatch):
    """The command measures the peak there, so each round's peak sits beside that round's steps."""
    import nanoserve.runner as runner

    events = []
    real_sweep = runner.sweep_batch_sizes

    def logged_sweep(model, prompt, sizes, *args, **kwargs):
        events.append(f"B={sizes[0]}")
        return real_sweep(model, prompt, sizes, *args, **kwargs)

    monkeypatch.setattr(runner, "sweep_batch_sizes", logged_sweep)
    runs = sweep_beside(model, None, prompts[0], [1, 2], steps=1, rounds=2,
                        before_round=lambda r: events.append(f"round {r}"))
    assert events == ["round 0", "B=1", "B=2", "round 1", "B=1", "B=2"]
    assert [len(runs.ours[b]) for b in (1, 2)] == [2, 2] and runs.theirs == {1: [], 2: []} and runs.torch_ops == {}


def test_sweep_times_the_torch_ops_step_beside_the_compiled_one(model, prompts, monkeypatch):
    """Right after each of ours, in the same round: the A/B of what the compiled kernels buy."""
    import nanoserve.runner as runner

    events = []
    real_sweep = runner.sweep_batch_sizes

    def logged_sweep(model, prompt, sizes, *args, kernels=None, **kwargs):
        events.append(f"B={sizes[0]}" + (" ops" if kernels is False else ""))
        return real_sweep(model, prompt, sizes, *args, kernels=kernels, **kwargs)

    monkeypatch.setattr(runner, "sweep_batch_sizes", logged_sweep)
    runs = sweep_beside(model, None, prompts[0], [1, 4], steps=2, rounds=1, torch_ops=True)
    assert events == ["B=1", "B=1 ops", "B=4", "B=4 ops"]
    assert [len(runs.torch_ops[b]) for b in (1, 4)] == [1, 1]
    assert runs.torch_ops_same == {1: True, 4: True}


def test_command_writes_the_csv_and_its_sidecar(tmp_path):
    out = tmp_path / "bb.csv"
    assert main(["--sizes", "1", "2", "--steps", "2", "--rounds", "1", "--no-hf", "--no-roofline",
                 "--out", str(out)]) == 0
    runs = read_csv(out)
    label, blocking = runs[0]
    assert label == "blocking" and (blocking.issued_tokens, blocking.useful_tokens) == (248, 52)
    meta = json.loads(sidecar_path(out).read_text())
    if meta["kernels"].startswith("compiled"):  # then our step on torch's ops is timed beside it
        assert [(lbl, t.batch_size) for lbl, t in runs[1:]] == [
            ("nanoserve", 1), ("nanoserve-torch-ops", 1), ("nanoserve", 2), ("nanoserve-torch-ops", 2)]
        assert meta["torch_ops_same_tokens"] is True
    else:
        assert [(lbl, t.batch_size) for lbl, t in runs[1:]] == [("nanoserve", 1), ("nanoserve", 2)]
    assert meta["command"].startswith("python -m nanoserve.batchbench --sizes 1 2")
    assert "threads" in meta["machine"]
