"""The step-cost line the scheduler sizes steps by under a TPOT target: it recovers a line it is fed,
falls back to a cost proportional to tokens where it cannot see a slope, and answers nothing before it
has seen enough steps."""

import math

import pytest

from nanoserve.engine.step_cost import StepCost


def test_it_recovers_the_line_its_steps_lie_on():
    cost = StepCost()
    for tokens in [1, 8, 200, 8, 512, 32, 1, 300] * 3:
        cost.observe(tokens, 0.040 + 0.002 * tokens)
    fixed, per_token = cost.fit()
    assert fixed == pytest.approx(0.040) and per_token == pytest.approx(0.002)
    assert cost.tokens_within(0.250) == 105  # (0.250 - 0.040) / 0.002
    assert cost.tokens_within(0.030) == 0 and cost.predict(100) == pytest.approx(0.240)


def test_nothing_is_said_before_enough_steps_and_empty_or_bad_steps_are_skipped():
    cost = StepCost(min_steps=4)
    for tokens, seconds in [(8, 0.05), (0, 0.01), (100, math.nan), (100, -1.0), (64, 0.1), (300, 0.5)]:
        cost.observe(tokens, seconds)
    assert cost.steps == 3 and cost.fit() is None and cost.tokens_within(1.0) is None
    cost.observe(16, 0.06)
    assert cost.fit() is not None


def test_one_size_of_step_gives_a_cost_proportional_to_tokens():
    cost = StepCost()
    for _ in range(10):
        cost.observe(64, 0.128)
    assert cost.fit() == (0.0, pytest.approx(0.002))
    assert cost.tokens_within(0.250) == 125


def test_recent_steps_outweigh_old_ones_when_the_machine_slows():
    cost = StepCost(decay=0.9)
    for tokens in [1, 100] * 20:
        cost.observe(tokens, 0.010 + 0.001 * tokens)
    for tokens in [1, 100] * 40:  # a neighbour takes a core: every step twice as slow
        cost.observe(tokens, 2 * (0.010 + 0.001 * tokens))
    assert cost.predict(100) == pytest.approx(0.220, rel=0.01)


@pytest.mark.parametrize("decay", [0.0, 1.0, -0.5])
def test_a_decay_outside_zero_to_one_is_refused(decay):
    with pytest.raises(ValueError, match="decay"):
        StepCost(decay=decay)
