"""The timeline helpers: what each cell says a step did for a request, from the scheduler alone."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from nanoserve.bench.batchbench import BatchTiming  # noqa: E402
from nanoserve.engine import SchedulerConfig  # noqa: E402
from nanoserve.teach import timeline  # noqa: E402


def test_simulate_and_states_follow_the_scheduler():
    steps, reqs = timeline.simulate([(0, 10, 3), (0, 30, 2), (2, 4, 2)], SchedulerConfig(max_num_seqs=2,
                                    max_num_batched_tokens=24), num_blocks=64, block_size=4)
    assert steps[:3] == [[("0", 0, 10), ("1", 0, 14)], [("0", 10, 1), ("1", 14, 16)], [("0", 11, 1), ("1", 30, 1)]]
    rows = timeline.states(steps, reqs)
    assert rows["0"] == ["prefill", "decode", "decode", "", "", ""][:len(steps)]
    assert rows["1"][:3] == ["prefill", "prefill", "decode"]
    assert rows["2"][2] == "waiting"  # arrived at step 2; two requests were running
    assert all(r.finish_reason.value == "length" for r in reqs.values())


def test_preempted_requests_are_drawn_as_preempted():
    steps, reqs = timeline.simulate([(0, 8, 6), (0, 8, 6)], SchedulerConfig(), num_blocks=5, block_size=4)
    assert reqs["1"].num_preemptions >= 1 and "preempted" in timeline.states(steps, reqs)["1"]
    fig, ax = plt.subplots()
    timeline.draw(ax, steps, reqs, "t")
    plt.close(fig)


def test_draw_batch_hatches_only_what_is_held_back():
    fig, ax = plt.subplots()
    static = BatchTiming(1.0, [1.0] * 3, [1, 3])
    timeline.draw_batch(ax, static)
    hatched = [p for p in ax.patches if p.get_hatch()]
    assert len(hatched) == 1 and hatched[0].get_width() == 2.0
    ax.clear()
    timeline.draw_batch(ax, BatchTiming(1.0, [1.0] * 3, [1, 3], [2, 1, 1], returns_rows_when_done=True))
    assert not [p for p in ax.patches if p.get_hatch()]
    plt.close(fig)


def shared_prefix_arrivals(system, tails, at, new=2):
    return [(a, system + tail, new) for a, tail in zip(at, tails)]


def test_simulate_replays_prefix_hits_found_only_after_the_step_that_computes_them():
    system = list(range(100, 112))  # three full blocks of 4
    arrivals = shared_prefix_arrivals(system, [[1, 2], [3], [4, 5, 6], [7]], at=[0, 0, 1, 3])
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)
    steps, reqs = timeline.simulate(arrivals, cfg, num_blocks=32, block_size=4, prefix_caching=True)
    # request 1 is admitted in the step that computes request 0's blocks: nothing is named yet
    assert [reqs[r].num_cached_tokens for r in "0123"] == [0, 0, 12, 12]
    assert steps[0] == [("0", 0, 14), ("1", 0, 13)] and ("2", 12, 3) in steps[1]
    off_steps, off = timeline.simulate(arrivals, cfg, num_blocks=32, block_size=4)
    assert all(r.num_cached_tokens == 0 for r in off.values())
    assert sum(timeline.prefill_tokens(off_steps, off)) - sum(timeline.prefill_tokens(steps, reqs)) == 24
    assert timeline.prefill_tokens(steps, reqs)[:2] == [27, 3]


def test_simulate_is_the_engines_schedule(tiny_model):
    """The scheduler alone, fed the same prompts and arrival steps, plans exactly the engine's steps."""
    from nanoserve.config import CacheConfig, EngineConfig
    from nanoserve.engine import LLMEngine
    from nanoserve.sampling import SamplingParams

    system = [(7 * i) % 200 + 3 for i in range(21)]
    arrivals = shared_prefix_arrivals(system, [[9, 8], [5], [4, 4, 4], [6], [11, 12]], at=[0, 0, 1, 2, 2], new=3)
    cfg = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=32)
    steps, reqs = timeline.simulate(arrivals, cfg, num_blocks=40, block_size=4, prefix_caching=True)
    engine = LLMEngine(tiny_model, config=EngineConfig(CacheConfig(4, num_blocks=40, prefix_caching=True), cfg))
    s = 0
    while s <= max(a for a, _, _ in arrivals) or engine.has_unfinished_requests():
        for i, (at, prompt, new) in enumerate(arrivals):
            if at == s:
                engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True), str(i))
        engine.step()
        s += 1
    assert [list(h.scheduled) for h in engine.history] == steps
    assert [h.num_prefill_tokens for h in engine.history] == timeline.prefill_tokens(steps, reqs)
    assert [engine.requests[r].num_cached_tokens for r in reqs] == [r.num_cached_tokens for r in reqs.values()]
    assert engine.scheduler.prefix_hit_tokens > 0
