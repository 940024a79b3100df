"""The scheduler without a model: queues, the token budget, chunking, admission, preemption and
prefix hits, planned on a BlockManager (no tensors)."""

import math

import pytest

from nanoserve.engine import Request, RequestStatus, Scheduler, SchedulerConfig
from nanoserve.kv import BlockManager
from nanoserve.sampling import SamplingParams


def request(rid, prompt_len, max_new=8, first=1):
    return Request(str(rid), list(range(first, first + prompt_len)), SamplingParams(temperature=0), max_new)


def run_step(sched, step=0, token=99):
    """Plan a step and play the engine's part: count the computed tokens, sample `token` where a chunk completes."""
    plan = sched.schedule(step)
    for c in plan.chunks:
        c.request.num_computed_tokens += c.num_tokens
        sched.manager.commit(c.request.table)
        if c.completes:
            c.request.output_token_ids.append(token)
    return plan


def shape(plan):
    return [(c.request.request_id, c.start, c.num_tokens) for c in plan.chunks]


def test_running_requests_come_first_and_waiting_ones_are_admitted_in_order():
    sched = Scheduler(BlockManager(64, 4), SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100))
    a, b = request("a", 5), request("b", 3)
    sched.add(a), sched.add(b)
    assert shape(run_step(sched)) == [("a", 0, 5), ("b", 0, 3)]
    c = request("c", 4)
    sched.add(c)
    plan = run_step(sched, 1)
    assert shape(plan) == [("a", 5, 1), ("b", 3, 1), ("c", 0, 4)]  # decodes first, then the newcomer
    assert plan.num_decode_tokens == 2 and plan.num_prefill_tokens == 4 and plan.admitted == [c]
    assert [r.status for r in (a, b, c)] == [RequestStatus.RUNNING] * 3


def test_a_long_prompt_is_chunked_and_the_decodes_never_stall():
    sched = Scheduler(BlockManager(64, 4), SchedulerConfig(max_num_batched_tokens=8))
    a = request("a", 3)
    sched.add(a)
    run_step(sched)
    long = request("long", 20)
    sched.add(long)
    plans = [shape(run_step(sched, s)) for s in range(1, 5)]
    assert plans == [
        [("a", 3, 1), ("long", 0, 7)],
        [("a", 4, 1), ("long", 7, 7)],
        [("a", 5, 1), ("long", 14, 6)],  # the last chunk completes the prompt: a token is sampled
        [("a", 6, 1), ("long", 20, 1)],
    ]
    assert long.output_token_ids == [99, 99]


def test_without_chunked_prefill_a_prompt_waits_for_a_budget_it_fits_in_whole():
    sched = Scheduler(BlockManager(64, 4), SchedulerConfig(max_num_batched_tokens=8, chunked_prefill=False))
    sched.add(request("a", 3)), sched.add(request("b", 6)), sched.add(request("c", 1))
    assert shape(run_step(sched)) == [("a", 0, 3)]  # b does not fit the 5 left; c waits behind it (FCFS)
    assert shape(run_step(sched, 1)) == [("a", 3, 1), ("b", 0, 6), ("c", 0, 1)]


def test_max_num_seqs_caps_the_running_requests():
    sched = Scheduler(BlockManager(64, 4), SchedulerConfig(max_num_seqs=2))
    for i in range(4):
        sched.add(request(i, 2))
    assert [r.request_id for r in run_step(sched).admitted] == ["0", "1"]
    assert [r.request_id for r in sched.waiting] == ["2", "3"]
    sched.finish(sched.running[0])
    assert [r.request_id for r in run_step(sched, 1).admitted] == ["2"]


def test_admission_waits_for_free_blocks():
    sched = Scheduler(BlockManager(4, 4), SchedulerConfig())
    sched.add(request("a", 12)), sched.add(request("b", 5, first=50))
    plan = run_step(sched)
    assert shape(plan) == [("a", 0, 12)] and len(sched.waiting) == 1  # b needs 2 blocks, 1 is free
    sched.finish(sched.running[0])
    assert shape(run_step(sched, 1)) == [("b", 0, 5)]


def test_when_the_pool_runs_dry_the_newest_request_is_preempted_and_readmitted_first():
    sched = Scheduler(BlockManager(4, 2, prefix_caching=False), SchedulerConfig())
    a, b, c = request("a", 4), request("b", 4, first=10), request("c", 1, first=20)
    for r in (a, b, c):
        sched.add(r)
    run_step(sched)  # a: 2 blocks, b: 2 blocks; c waits
    assert sched.manager.pool.num_free == 0 and list(sched.waiting) == [c]
    plan = run_step(sched, 1)  # a's 5th token needs a 3rd block: b, the newest, gives its 2 back
    assert plan.preempted == [b] and shape(plan) == [("a", 4, 1)]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.table is None
    assert list(sched.waiting) == [b, c] and b.num_preemptions == 1
    sched.finish(a)
    plan = run_step(sched, 2)
    assert shape(plan) == [("b", 0, 5), ("c", 0, 1)]  # b recomputes its prompt and its token: nothing lost
    assert [s for _, s in b.events] == [RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED,
                                        RequestStatus.RUNNING]


def test_a_request_that_is_itself_the_newest_waits_instead():
    sched = Scheduler(BlockManager(2, 2, prefix_caching=False), SchedulerConfig())
    a = request("a", 4)
    sched.add(a)
    run_step(sched)
    plan = run_step(sched, 1)  # a's 5th token needs a 3rd block, and nobody else runs
    assert plan.preempted == [a] and plan.chunks == [] and list(sched.waiting) == [a]


def test_a_shared_prefix_is_found_at_admission_and_not_recomputed():
    sched = Scheduler(BlockManager(16, 4), SchedulerConfig())
    first = request("first", 10)
    sched.add(first)
    run_step(sched)  # computes 10 tokens, names the 2 full blocks
    second = Request("second", list(range(1, 9)) + [50, 51, 52], SamplingParams(temperature=0), 4)
    sched.add(second)
    plan = run_step(sched, 1)
    assert shape(plan) == [("first", 10, 1), ("second", 8, 3)]
    assert second.num_cached_tokens == 8 and second.table.blocks[:2] == first.table.blocks[:2]
    assert sched.prefix_hit_tokens == 8 and sched.prefix_queried_tokens == 21
    assert sched.prefix_hit_rate == pytest.approx(8 / 21)


def test_finish_frees_the_blocks_from_either_queue():
    m = BlockManager(8, 4, prefix_caching=False)
    sched = Scheduler(m, SchedulerConfig())
    a, b = request("a", 6), request("b", 40)
    sched.add(a), sched.add(b)
    run_step(sched)
    sched.finish(a)
    sched.finish(b)
    assert not sched.has_unfinished() and m.pool.num_free == 8 and a.status is RequestStatus.FINISHED
    m.pool.check()


@pytest.mark.parametrize("kw", [dict(max_num_seqs=0), dict(max_num_batched_tokens=-1), dict(max_num_seqs=True),
                                dict(max_num_batched_tokens=2.5)])
def test_bad_knobs_are_refused(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        SchedulerConfig(**kw)


def test_a_requests_token_slice_is_the_slice_of_all_its_tokens():
    """What a step asks of a request (`token_ids`, no joined copy) is all_token_ids' slice, across the boundary."""
    r = request(0, prompt_len=5)
    r.output_token_ids += [100, 101, 102]
    everything = r.all_token_ids
    assert everything == list(range(1, 6)) + [100, 101, 102] and r.token_ids(0) == everything
    for start in range(len(everything) + 1):
        for stop in range(start, len(everything) + 1):
            assert r.token_ids(start, stop) == everything[start:stop], (start, stop)


def test_several_decode_forwards_are_planned_only_where_every_slot_fits():
    """num_scheduler_steps: a step of greedy decodes gets slots for up to k tokens each, never past a request's
    last token; with too few free blocks for them, or a request waiting, the step is one forward, as always."""
    sched = Scheduler(BlockManager(7, 4, prefix_caching=False), SchedulerConfig(num_scheduler_steps=6))
    a = Request("a", [1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=20), 20)
    b = Request("b", list(range(30, 37)), SamplingParams(temperature=0, max_tokens=4), 4)
    sched.add(a), sched.add(b)
    plan = sched.schedule(0)
    assert plan.num_steps == 1  # the prompts
    sched.update_from_output(plan, {a: [99], b: [99]}, 0.0)
    plan = sched.schedule(1)
    assert plan.num_steps == 3  # b has 3 tokens left to choose
    assert [c.request.table.num_tokens for c in plan.chunks] == [4 + 3, 7 + 3]
    sched.update_from_output(plan, {a: [98, 97, 96], b: [98, 97, 96]}, 0.0)
    assert b.finished and a.table.token_ids[-3:] == [99, 98, 97]  # the step's input, then the tokens it chose
    assert a.num_computed_tokens == 7 and sched.manager.pool.num_free == 7 - 2
    plan = sched.schedule(2)
    assert plan.num_steps == 6 and sched.manager.pool.num_free == 7 - 4
    sched.update_from_output(plan, {a: [1, 2, 3, 4, 5, 6]}, 0.0)
    sched.add(request("c", 3, first=50))
    assert sched.schedule(3).num_steps == 1  # someone waits: it is admitted at once, beside a's one token
    tight = Scheduler(BlockManager(2, 4, prefix_caching=False), SchedulerConfig(num_scheduler_steps=6))
    d = request("d", 7, max_new=20)
    tight.add(d)
    run_step(tight)
    assert tight.schedule(1).num_steps == 1 and tight.manager.pool.num_free == 0  # no block for 5 more tokens


@pytest.mark.parametrize("bad, why", [(dict(num_scheduler_steps=0), "num_scheduler_steps"),
                                      (dict(num_scheduler_steps=4, speculative_config={"num_speculative_tokens": 2}),
                                       "speculative decoding and num_scheduler_steps")])
def test_bad_multi_step_settings_are_refused_by_name(bad, why):
    from nanoserve.config import EngineConfig
    with pytest.raises(ValueError, match=why):
        EngineConfig.from_kwargs(**bad)


def tpot_target_scheduler(fixed: float, per_token: float, target_ms: float = 150.0, budget: int = 512):
    sched = Scheduler(BlockManager(256, 4), SchedulerConfig(max_num_batched_tokens=budget, tpot_slo_ms=target_ms))
    for tokens in (1, 64, 256, 512):
        sched.step_cost.observe(tokens, fixed + per_token * tokens)
    return sched


def test_a_tpot_target_shrinks_prompt_chunks_only_while_someone_decodes():
    """With steps costing 50 ms + 1 ms a token and a 150 ms target, a step beside a decode carries 100 tokens: the
    decode's one and 99 of the prompt; with no one decoding, a prompt takes the whole budget."""
    sched = tpot_target_scheduler(0.050, 0.001)
    long = request("long", 600, first=1000)
    sched.add(long)
    assert shape(run_step(sched)) == [("long", 0, 512)]  # alone: nobody's TPOT to keep
    a = request("a", 5)
    sched.add(a)
    assert shape(run_step(sched, 1)) == [("long", 512, 88), ("a", 0, 5)]  # long's last chunk completes it
    b = request("b", 400, first=2000)
    sched.add(b)
    plan = run_step(sched, 2)
    assert shape(plan) == [("long", 600, 1), ("a", 5, 1), ("b", 0, 98)] and plan.num_tokens == 100
    assert sched.token_budget() == 100


def test_under_a_target_below_the_fixed_cost_prompts_still_move():
    sched = tpot_target_scheduler(0.200, 0.001)  # a step costs more than the target whatever it carries
    a, b = request("a", 5), request("b", 300, first=2000)
    sched.add(a)
    run_step(sched)
    sched.add(b)
    from nanoserve.engine.scheduler import MIN_PREFILL_TOKENS
    assert shape(run_step(sched, 1)) == [("a", 5, 1), ("b", 0, MIN_PREFILL_TOKENS)]


def test_without_a_target_or_a_measured_step_the_budget_is_the_configured_one():
    plain = Scheduler(BlockManager(64, 4), SchedulerConfig(max_num_batched_tokens=64))
    unmeasured = Scheduler(BlockManager(64, 4), SchedulerConfig(max_num_batched_tokens=64, tpot_slo_ms=1.0))
    for sched in (plain, unmeasured):
        sched.add(request("a", 5))
        run_step(sched)
        sched.add(request("b", 100, first=500))
        assert shape(run_step(sched, 1)) == [("a", 5, 1), ("b", 0, 63)]


@pytest.mark.parametrize("bad", [0, -5.0, math.inf, math.nan, True, "250"])
def test_a_bad_tpot_target_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="tpot_slo_ms"):
        SchedulerConfig(tpot_slo_ms=bad)
