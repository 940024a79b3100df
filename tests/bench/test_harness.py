"""The harness on the real model and a real pool: what it times is what generation runs (Day 29)."""

import pytest

from nanoserve.bench.harness import (
    BLOCKING_LENS,
    PROMPTS,
    build_batched_decode,
    sweep_batch_sizes,
    time_engine_batch,
    time_hf_generate,
    time_model_batch,
    timed_greedy,
)
from nanoserve.generate import greedy_ids
from nanoserve.stages import NoCacheSession, cached_session, greedy_generate_batch


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


def test_the_engine_runs_the_blocking_rows_without_waste_or_blocking(model, prompts):
    """Day 31's acceptance on the real model, counted: the same rows through the scheduled engine."""
    stop_steps = [n - 1 for n in BLOCKING_LENS]
    timing, tokens = time_engine_batch(model, prompts, stop_steps, clock=TickClock())
    assert (timing.issued_tokens, timing.useful_tokens, timing.waste_fraction) == (52, 52, 0.0)
    assert timing.step_rows == [8] * 3 + [1] * 28 and timing.max_hol_inflation == 1.0
    assert tokens == greedy_generate_batch(model, prompts, max_new_tokens=list(BLOCKING_LENS))


@pytest.mark.parametrize("compiled", [None, False], ids=["default", "torch-ops"])
def test_sweep_collects_exactly_greedy_generate_batch_tokens(model, prompts, compiled):
    sweep = sweep_batch_sizes(model, prompts[1], batch_sizes=(1, 2, 3), steps=4, warmup=False, clock=TickClock(),
                              compiled=compiled)
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
    short, long = run.kv.tables
    assert short.num_tokens == len(prompts[0]) + 20  # forwarded and cached to the end, tokens uncollected
    assert len(short.blocks) == -(-short.num_tokens // 4)
    assert [len(t) for t in run.tokens] == [2, 21]
    run.kv.free()
    assert run.kv.manager.pool.num_free == run.kv.manager.num_blocks


def test_transformers_baseline_is_timed_per_step_and_agrees(model, hf_model, prompts):
    timing, tokens = time_hf_generate(hf_model, [prompts[0]] * 2, steps=3, clock=TickClock())
    assert timing.n_steps == 3 and timing.row_steps == [3, 3]
    assert timing.step_s == [1.0, 1.0, 1.0]
    assert tokens == greedy_generate_batch(model, [prompts[0]] * 2, stop_steps=[3, 3])


def test_transformers_baseline_left_pads_ragged_prompts(model, hf_model, prompts):
    _, tokens = time_hf_generate(hf_model, [prompts[0], prompts[2]], steps=2, clock=TickClock())
    assert tokens == greedy_generate_batch(model, [prompts[0], prompts[2]], stop_steps=[2, 2])


@pytest.mark.parametrize("stage", [None, "contiguous", "nocache"])
def test_timed_greedy_tokens_are_greedy_ids_on_every_road(tiny_model, stage):
    session = {None: None, "contiguous": cached_session(tiny_model, 16), "nocache": NoCacheSession(tiny_model)}
    ticks = iter(range(100))
    ids, t = timed_greedy(tiny_model, [5, 6, 7], 6, session[stage], clock=lambda: float(next(ticks)))
    assert ids == greedy_ids(tiny_model, [5, 6, 7], 6) and (t.output_len, t.ttft, t.tpot) == (6, 1.0, 1.2)
