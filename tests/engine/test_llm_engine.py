"""The engine on a tiny model: every request ends exactly once with its reason, no block leaks,
greedy requests get the tokens of their solo run whatever shares their steps, seeded ones the same
samples, and bad input is refused while the others keep going."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanoserve.engine import LLMEngine, NoCacheSession, RequestStatus, SchedulerConfig
from nanoserve.generate import greedy_ids
from nanoserve.kv import RequestTooLarge
from nanoserve.sampling import SamplingParams

GREEDY = dict(temperature=0, ignore_eos=True)


def drain(engine: LLMEngine, max_steps: int = 10_000, on_step=None, min_steps: int = 0) -> dict[str, list[int]]:
    """Step until every request is done (and at least `min_steps` times, calling `on_step(step)` before each);
    each request's tokens, checking each finishes once."""
    tokens: dict[str, list[int]] = {}
    finished: list[str] = []
    for step in range(max_steps):
        if step >= min_steps and not engine.has_unfinished_requests():
            break
        if on_step:
            on_step(step)
        for out in engine.step():
            assert out.request_id not in finished, f"request {out.request_id} produced a token after finishing"
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finished.append(out.request_id)
    assert not engine.has_unfinished_requests(), "the engine did not finish in max_steps"
    return tokens


def solo(model, prompt, n):
    return greedy_ids(model, prompt, n, NoCacheSession(model))


def test_one_request_gives_its_solo_tokens_and_gives_its_blocks_back(tiny_model):
    engine = LLMEngine(tiny_model, num_blocks=16, block_size=4)
    rid = engine.add_request([5, 6, 7, 8, 9], SamplingParams(max_tokens=12, **GREEDY))
    assert drain(engine)[rid] == solo(tiny_model, [5, 6, 7, 8, 9], 12)
    req = engine.requests[rid]
    assert req.finish_reason.value == "length" and req.status is RequestStatus.FINISHED
    assert [s for _, s in req.events] == [RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.FINISHED]
    engine.check_idle()


def test_a_request_arriving_mid_run_joins_the_running_batch(tiny_model):
    engine = LLMEngine(tiny_model, num_blocks=32, block_size=4)
    a = engine.add_request([5, 6, 7], SamplingParams(max_tokens=10, **GREEDY))
    engine.step(), engine.step()
    b = engine.add_request([9, 8, 7, 6, 5, 4], SamplingParams(max_tokens=3, **GREEDY))
    out = drain(engine)
    assert engine.history[2].num_requests == 2  # b's prefill rode along a's decode step
    assert engine.requests[b].finish_time < engine.requests[a].finish_time  # b left as soon as it was done
    assert out[b] == solo(tiny_model, [9, 8, 7, 6, 5, 4], 3)
    engine.check_idle()


def test_stop_tokens_and_eos_end_a_request_with_reason_stop(tiny_model):
    prompt = [3, 4, 5, 6]
    ref = solo(tiny_model, prompt, 8)
    engine = LLMEngine(tiny_model, num_blocks=16, block_size=4)
    a = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[ref[2]]))
    out = drain(engine)
    k = ref.index(ref[2])
    assert out[a] == ref[:k + 1]
    assert engine.requests[a].finish_reason.value == "stop" and engine.requests[a].stop_reason == ref[2]


def test_abort_frees_the_blocks_at_once_and_the_others_go_on(tiny_model):
    engine = LLMEngine(tiny_model, num_blocks=32, block_size=4)
    a = engine.add_request(list(range(3, 20)), SamplingParams(max_tokens=20, **GREEDY))
    b = engine.add_request([7, 8, 9], SamplingParams(max_tokens=6, **GREEDY))
    early = [o for _ in range(2) for o in engine.step()]
    assert [o.request_id for o in early] == [a, b, a, b]
    held = engine.cache.pool.num_used
    engine.abort(a)
    assert engine.cache.pool.num_used < held and engine.requests[a].finish_reason.value == "abort"
    engine.abort(a)  # a second abort of a finished request does nothing
    out = drain(engine)
    assert a not in out and [o.new_token_ids[0] for o in early if o.request_id == b] + out[b] == \
        solo(tiny_model, [7, 8, 9], 6)
    with pytest.raises(KeyError, match="no request 'nope'"):
        engine.abort("nope")
    engine.check_idle()


def test_bad_requests_are_refused_and_the_engine_keeps_serving(tiny_model):
    engine = LLMEngine(tiny_model, num_blocks=8, block_size=4)
    ok = engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, **GREEDY))
    (first,) = engine.step()
    ctx = tiny_model.cfg.max_position_embeddings
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request([])
    with pytest.raises(ValueError, match=f"the model's context is {ctx}"):
        engine.add_request([5] * ctx)
    with pytest.raises(RequestTooLarge, match="needs 9 blocks of 4 tokens; the pool has 8"):
        engine.add_request([5] * 30, SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match="max_tokens=0"):
        engine.add_request([5], SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request([5], SamplingParams(temperature=-1))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([5, 100_000])
    with pytest.raises(ValueError, match="needs the engine's tokenizer"):
        engine.add_request("hello")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([5], request_id=ok)
    assert first.new_token_ids + drain(engine)[ok] == solo(tiny_model, [5, 6, 7], 4)
    engine.check_idle()


def test_without_chunking_a_request_must_fit_one_step(tiny_model):
    engine = LLMEngine(tiny_model, config=SchedulerConfig(max_num_batched_tokens=16, chunked_prefill=False))
    with pytest.raises(RequestTooLarge, match="max_num_batched_tokens=16"):
        engine.add_request([5] * 10, SamplingParams(max_tokens=8))


def test_greedy_and_seeded_rows_side_by_side_each_as_alone(tiny_model):
    """A seeded sampled request draws the same tokens alone and among others: the runner is batch-invariant
    and each request has its own generator."""
    sampled = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, min_p=0.01, seed=7, max_tokens=10, ignore_eos=True)
    alone = LLMEngine(tiny_model, num_blocks=64, block_size=4)
    rid = alone.add_request([10, 11, 12], sampled)
    mine = drain(alone)[rid]
    engine = LLMEngine(tiny_model, num_blocks=64, block_size=4)
    others = [engine.add_request([20 + i] * (i + 2), SamplingParams(max_tokens=3 + 2 * i, **GREEDY)) for i in range(3)]
    rid = engine.add_request([10, 11, 12], sampled)
    more = engine.add_request([30, 31], SamplingParams(temperature=1.0, seed=1, max_tokens=6, ignore_eos=True))
    out = drain(engine)
    assert out[rid] == mine
    for i, o in enumerate(others):
        assert out[o] == solo(tiny_model, [20 + i] * (i + 2), 3 + 2 * i)
    assert len(out[more]) == 6
    engine.check_idle()


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    n = draw(st.integers(1, 6))
    prefix = draw(st.lists(st.integers(3, 255), min_size=0, max_size=12))
    reqs = []
    for _ in range(n):
        shared = draw(st.booleans())
        own = draw(st.lists(st.integers(3, 255), min_size=1, max_size=20))
        reqs.append(dict(prompt=(prefix if shared else []) + own, max_tokens=draw(st.integers(1, 10)),
                         arrival=draw(st.integers(0, 6)), abort=draw(st.one_of(st.none(), st.integers(0, 12)))))
    need = max(-(-(len(r["prompt"]) + r["max_tokens"]) // block_size) for r in reqs)
    num_blocks = need + draw(st.integers(0, 2 * need))  # at the low end, only one request fits: preemption
    config = SchedulerConfig(max_num_seqs=draw(st.integers(1, 6)), max_num_batched_tokens=draw(st.integers(1, 48)))
    return block_size, num_blocks, config, draw(st.booleans()), reqs


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workloads())
def test_property_random_workloads(tiny_model, workload):
    """Arrivals, aborts, tiny pools (preemption), small budgets (chunking), shared prefixes: every request ends
    once with the right reason, the pool is whole again, and greedy tokens are each request's solo run's."""
    block_size, num_blocks, config, prefix_caching, reqs = workload
    engine = LLMEngine(tiny_model, config=config, num_blocks=num_blocks, block_size=block_size,
                       prefix_caching=prefix_caching)
    ids: dict[int, str] = {}

    def on_step(step):
        for i, r in enumerate(reqs):
            if r["arrival"] == step:
                ids[i] = engine.add_request(r["prompt"], SamplingParams(max_tokens=r["max_tokens"], **GREEDY))
            if r["abort"] == step and i in ids:
                engine.abort(ids[i])
        engine.cache.pool.check()

    out = drain(engine, on_step=on_step, min_steps=7)  # everyone arrives, even into an idle engine
    for i, r in enumerate(reqs):
        req = engine.requests[ids[i]]
        assert req.status is RequestStatus.FINISHED
        ref = solo(tiny_model, r["prompt"], r["max_tokens"])
        got = out.get(ids[i], [])
        assert got == req.output_token_ids
        if req.finish_reason.value == "abort":
            assert got == ref[:len(got)] and len(got) < r["max_tokens"]
        else:
            assert req.finish_reason.value == "length" and got == ref
    engine.check_idle()
