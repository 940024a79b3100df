"""The engine on a tiny model: every request ends exactly once with its reason, no block leaks,
greedy requests get the tokens of their solo run whatever shares their steps, seeded ones the same
samples, n samples fork from one prefill, speculative drafts change no token, and bad input (or a
row that cannot be sampled) fails that request alone while the others keep going."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanoserve.config import CacheConfig, EngineConfig, SchedulerConfig
from nanoserve.engine import LLMEngine, RequestStatus
from nanoserve.kv import RequestTooLarge
from nanoserve.sampling import SamplingParams
from nanoserve.stages import NoCacheSession, greedy_session_ids

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
    """Day 08's stage: the whole sequence recomputed every step, the plainest road to the same tokens."""
    return greedy_session_ids(model, NoCacheSession(model), prompt, n)


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


def test_a_tpot_target_splits_prompts_beside_decodes_and_changes_no_token(tiny_model):
    """Under a target no step can meet, every step beside a decode carries it and MIN_PREFILL_TOKENS of prompt:
    a long prompt arrives in small chunks, the decode never waits, and every request gets its solo tokens."""
    from nanoserve.engine.scheduler import MIN_PREFILL_TOKENS
    engine = LLMEngine(tiny_model, num_blocks=64, block_size=4, max_num_batched_tokens=64, tpot_slo_ms=1e-6)
    a = engine.add_request([5, 6, 7], SamplingParams(max_tokens=40, **GREEDY))
    first = [t for _ in range(6) for o in engine.step() for t in o.new_token_ids]  # the step cost is measured
    long_prompt = [(7 * i) % 50 + 3 for i in range(70)]
    b = engine.add_request(long_prompt, SamplingParams(max_tokens=5, **GREEDY))
    out = drain(engine)
    chunks = [c[2] for rec in list(engine.history)[6:] for c in rec.scheduled if c[0] == engine.requests[b].seq_id]
    assert chunks[:4] == [MIN_PREFILL_TOKENS] * 4 and sum(chunks[:5]) == len(long_prompt)
    assert first + out[a] == solo(tiny_model, [5, 6, 7], 40) and out[b] == solo(tiny_model, long_prompt, 5)
    assert engine.scheduler.step_cost.steps == len(engine.history)
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
    held = engine.manager.pool.num_used
    engine.abort(a)
    assert engine.manager.pool.num_used < held and engine.requests[a].finish_reason.value == "abort"
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
    engine = LLMEngine(tiny_model, max_num_batched_tokens=16, enable_chunked_prefill=False)
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
    config = SchedulerConfig(max_num_seqs=draw(st.integers(1, 6)), max_num_batched_tokens=draw(st.integers(1, 48)),
                             num_scheduler_steps=draw(st.sampled_from([1, 3, 8])))
    return block_size, num_blocks, config, draw(st.booleans()), reqs


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workloads())
def test_property_random_workloads(tiny_model, workload):
    """Arrivals, aborts, tiny pools (preemption), small budgets (chunking), shared prefixes, several decode forwards
    per step: every request ends once with the right reason, the pool is whole again, and greedy tokens are each
    request's solo run's."""
    block_size, num_blocks, config, prefix_caching, reqs = workload
    engine = LLMEngine(tiny_model, config=EngineConfig.from_kwargs(
        num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=prefix_caching,
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
        num_scheduler_steps=config.num_scheduler_steps))
    ids: dict[int, str] = {}

    def on_step(step):
        for i, r in enumerate(reqs):
            if r["arrival"] == step:
                ids[i] = engine.add_request(r["prompt"], SamplingParams(max_tokens=r["max_tokens"], **GREEDY))
            if r["abort"] == step and i in ids:
                engine.abort(ids[i])
        engine.manager.pool.check()

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


# ---- n samples, speculative decoding, a bad row, bounded memory --------------------------------------


def test_n_samples_fork_from_one_prefill_and_each_equals_its_seeded_solo_run(tiny_model):
    """A request of n samples computes its prompt once; sample i then equals a request alone seeded seed + i,
    and the partly filled last block of the prompt is copied on the samples' first writes, never shared."""
    prompt = list(range(3, 17))  # 14 tokens: three blocks of 4 and a half-filled fourth
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=6, ignore_eos=True)
    engine = LLMEngine(tiny_model, num_blocks=32, block_size=4, enable_prefix_caching=False)
    rid = engine.add_request(prompt, SamplingParams(**{**vars(params), "n": 3}))
    samples: dict[int, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == rid
            samples.setdefault(out.index, []).extend(out.new_token_ids)
    assert engine.history[0].num_prefill_tokens == len(prompt)  # the prompt, once
    assert sum(r.num_prefill_tokens for r in engine.history) == len(prompt)
    assert engine.history[1].num_requests == 3
    for i in range(3):
        alone = LLMEngine(tiny_model, num_blocks=32, block_size=4)
        one = alone.add_request(prompt, SamplingParams(**{**vars(params), "seed": 11 + i}))
        assert samples[i] == drain(alone)[one], i
    assert len({tuple(t) for t in samples.values()}) > 1  # seeds differ: so do the samples
    engine.check_idle()


def test_n_samples_wait_for_seats_and_are_aborted_together(tiny_model):
    engine = LLMEngine(tiny_model, num_blocks=32, block_size=4, max_num_seqs=3)
    a = engine.add_request([5, 6, 7], SamplingParams(max_tokens=8, **GREEDY))
    b = engine.add_request([8, 9], SamplingParams(temperature=1.0, seed=0, n=3, max_tokens=8, ignore_eos=True))
    engine.step()
    assert len(engine.scheduler.running) == 1  # b's three samples need three seats: they wait for a
    with pytest.raises(ValueError, match="n=4"):
        engine.add_request([1], SamplingParams(n=4))
    while engine.requests[a].status is not RequestStatus.FINISHED:
        engine.step()
    engine.step()
    engine.step()
    assert len(engine.scheduler.running) == 3
    engine.abort(b)
    assert all(s.finish_reason.value == "abort" for s in engine.sequences(b)) and len(engine.sequences(b)) == 3
    engine.check_idle()


@pytest.mark.parametrize("k", [1, 3, 6])
def test_speculative_drafts_change_no_greedy_token(tiny_model, k):
    """Prompt-lookup drafts verified in the same step as other requests' tokens: every greedy request gets
    plain greedy's tokens, sampled ones their seeded samples, some drafts are accepted, and the rejected
    drafts' blocks all come back."""
    loop = [40, 41, 42, 43, 44, 45] * 4  # a prompt that repeats itself: its greedy output tends to copy it
    prompts = [loop, [7, 8, 9, 7, 8, 9, 7, 8], list(range(50, 90))]
    plain = LLMEngine(tiny_model, num_blocks=64, block_size=4)
    spec = LLMEngine(tiny_model, num_blocks=64, block_size=4, max_num_batched_tokens=24,
                     speculative_config={"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1})
    got = []
    for engine in (plain, spec):
        ids = [engine.add_request(p, SamplingParams(max_tokens=30, **GREEDY)) for p in prompts]
        ids.append(engine.add_request([3, 4, 5], SamplingParams(temperature=0.9, seed=5, max_tokens=12)))
        out = drain(engine)
        got.append([out[i] for i in ids])
        engine.check_idle()
    assert got[0] == got[1]
    drafted = sum(r.num_draft_tokens for r in spec.history)
    accepted = sum(r.num_accepted_tokens for r in spec.history)
    assert drafted > 0 and 0 < accepted <= drafted
    assert len(spec.history) < len(plain.history)  # accepted drafts save steps


@pytest.fixture(params=["torch's forward", "compiled step"])
def stepped(request, tiny_cfg):
    """A model whose multi-step decodes loop over the runner's steps (the tiny model on torch's forward), and one
    whose decodes are one compiled call (on int8 blocks)."""
    if request.param == "torch's forward":
        return request.getfixturevalue("tiny_model")
    request.getfixturevalue("compiled")
    from nanoserve.model import Llama
    from nanoserve.model.gguf_weights import to_blocks
    return to_blocks(Llama.random(tiny_cfg, seed=3), activations="int8")


def test_several_decode_forwards_per_step_change_no_token(stepped):
    """num_scheduler_steps=5: while every running request decodes greedily and no one waits, a step runs up to
    5 forwards. Every request gets the tokens and the end it gets one forward per step (a stop token inside a
    step's run ends it there), a waiting or sampled request gets single steps until it is in or gone, the tokens
    chosen inside a step are named in their blocks for prefix caching, and every block comes back."""
    prompts = [list(range(10, 31)), [5, 6, 7], list(range(60, 69))]
    got, engines = [], []
    for k in (1, 5):
        engine = LLMEngine(stepped, num_blocks=48, block_size=4, num_scheduler_steps=k)
        ids = [engine.add_request(p, SamplingParams(max_tokens=m, **GREEDY)) for p, m in zip(prompts, (23, 9, 17))]

        def arrive(step, engine=engine, ids=ids):
            if step == 3:
                ids.append(engine.add_request([8, 9], SamplingParams(max_tokens=7, **GREEDY)))
            if step == 6:
                ids.append(engine.add_request([3, 4, 5], SamplingParams(temperature=0.9, seed=5, max_tokens=6)))
        out = drain(engine, on_step=arrive)
        got.append([(out[i], engine.requests[i].finish_reason) for i in ids])
        engines.append((engine, ids))
        engine.check_idle()
    assert got[0] == got[1]
    single, (multi, ids) = engines[0][0], engines[1]
    assert max(r.num_steps for r in multi.history) == 5 and len(multi.history) < len(single.history)
    sampled = multi.requests[ids[-1]].seq_id
    assert all(r.num_steps == 1 for r in multi.history if any(s == sampled for s, _, _ in r.scheduled))
    # a stop token met inside a step's run ends the request there, with reason stop, and no forward runs after it
    stop = got[0][0][0][7]
    for engine in (single, multi):
        before = len(engine.history)
        rid = engine.add_request(prompts[0], SamplingParams(max_tokens=23, stop_token_ids=[stop], **GREEDY))
        out = drain(engine)[rid]
        assert out == got[0][0][0][:got[0][0][0].index(stop) + 1] and engine.requests[rid].finish_reason.value == "stop"
        assert sum(r.num_steps for r in list(engine.history)[before:]) == len(out)
    # a prompt that repeats a finished request's prompt and output finds the blocks its steps filled
    follow = prompts[0] + got[0][0][0][:-1]
    cached = []
    for engine in (single, multi):
        rid = engine.add_request(follow, SamplingParams(max_tokens=4, **GREEDY))
        assert drain(engine)[rid] == solo(stepped, follow, 4)
        cached.append(engine.requests[rid].num_cached_tokens)
        engine.check_idle()
    assert cached[0] == cached[1] >= len(follow) - 4


def test_a_row_that_cannot_be_sampled_fails_its_request_alone(tiny_model, monkeypatch):
    """NaN logits in one sampled row end that request with finish_reason "error"; the request beside it
    gets its solo tokens and every block comes back."""
    engine = LLMEngine(tiny_model, num_blocks=32, block_size=4)
    ok = engine.add_request([5, 6, 7], SamplingParams(max_tokens=6, **GREEDY))
    bad = engine.add_request([8, 9], SamplingParams(temperature=1.0, seed=0, max_tokens=6))
    real = engine.runner.execute

    def poisoned(chunks, copies=(), num_logits=None):
        logits = real(chunks, copies, num_logits)
        logits[-1] = float("nan")  # the sampled request is last in every step
        return logits

    monkeypatch.setattr(engine.runner, "execute", poisoned)
    outs = engine.step()  # both prompts in one step: the sampled request's row is NaN
    failed = [o for o in outs if o.request_id == bad]
    assert len(failed) == 1 and failed[0].finish_reason == "error" and "could not be sampled" in failed[0].error
    monkeypatch.setattr(engine.runner, "execute", real)
    rest = drain(engine)
    assert [t for o in outs if o.request_id == ok for t in o.new_token_ids] + rest[ok] == solo(tiny_model, [5, 6, 7], 6)
    engine.check_idle()


def test_history_and_finished_requests_are_bounded(tiny_model):
    """A long-running engine keeps the last history_kept steps and finished_kept finished requests, no more."""
    engine = LLMEngine(tiny_model, config=EngineConfig(CacheConfig(4, num_blocks=16), SchedulerConfig(max_num_seqs=1),
                                                       history_kept=5, finished_kept=3))
    ids = [engine.add_request([5 + i, 6], SamplingParams(max_tokens=2, **GREEDY)) for i in range(8)]
    drain(engine)
    assert len(engine.history) == 5 and engine.history[-1].step == engine.steps - 1
    assert sorted(engine.requests) == sorted(ids[-3:])
    engine.check_idle()


def test_reset_prefix_cache_makes_a_seen_prompt_new_and_waits_for_running_requests(tiny_model):
    engine = LLMEngine(tiny_model, num_blocks=32, block_size=4)
    prompt, params = list(range(5, 18)), SamplingParams(max_tokens=3, **GREEDY)

    def run() -> tuple[list[int], int]:
        rid = engine.add_request(prompt, params)
        return drain(engine)[rid], engine.requests[rid].num_cached_tokens

    alone, cached = run()
    assert cached == 0
    again = engine.add_request(prompt, params)
    engine.step()
    assert not engine.reset_prefix_cache()  # a request holds blocks: nothing is forgotten
    drain(engine)
    assert engine.requests[again].num_cached_tokens == 12  # its three whole blocks found (the last token redone)
    assert engine.reset_prefix_cache()
    assert run() == (alone, 0)  # the same tokens, none of the prompt found
    engine.check_idle()
