"""What a step costs, learned from the steps the engine has run: the scheduler's guide to a TPOT target.

A step's wall time grows with the tokens it carries: a fixed part (reading every weight once, the
sampler, Python) and a part per token (the matrix work each row adds). Sarathi-Serve sizes each step's
prefill chunk from such a profile so that the decodes sharing the step keep their time-per-output-token
target; nanoserve fits the profile online, as a line through its recent steps, so it follows the machine
it runs on (another CPU, a neighbour taking cores) without a profiling pass.
"""

from __future__ import annotations

import math


class StepCost:
    """A step's seconds as `fixed + per_token x tokens`, a least-squares line through the steps observed,
    each weighing `decay` times the one after it (about 1 / (1 - decay) recent steps count)."""

    def __init__(self, decay: float = 0.97, min_steps: int = 4):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"StepCost.decay must lie in (0, 1), got {decay!r}")
        self.decay, self.min_steps = decay, min_steps
        self.steps = 0
        self._w = self._x = self._y = self._xx = self._xy = 0.0  # decayed sums of 1, x, y, x^2, xy

    def observe(self, tokens: int, seconds: float) -> None:
        """One step of `tokens` took `seconds` (a step that carried nothing, or a bad clock, is skipped)."""
        if tokens <= 0 or not math.isfinite(seconds) or seconds <= 0:
            return
        d = self.decay
        self._w, self._x, self._y = d * self._w + 1, d * self._x + tokens, d * self._y + seconds
        self._xx, self._xy = d * self._xx + tokens * tokens, d * self._xy + tokens * seconds
        self.steps += 1

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None before `min_steps` steps. Where the steps seen all carried
        about one size, or the line slopes the wrong way (noise), the cost is taken as proportional to tokens:
        it overstates the cost of a smaller step, never understates that of a larger one."""
        if self.steps < self.min_steps:
            return None
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        slope = (self._xy / self._w - mx * my) / var if var > 1.0 else 0.0
        if slope <= 0.0:
            return 0.0, my / mx
        return max(0.0, my - slope * mx), slope

    def predict(self, tokens: int) -> float | None:
        """Seconds a step of `tokens` is expected to take (None before the fit)."""
        fit = self.fit()
        return None if fit is None else fit[0] + fit[1] * tokens

    def tokens_within(self, seconds: float) -> int | None:
        """The most tokens a step can carry and be expected to take at most `seconds` (None before the fit)."""
        fit = self.fit()
        if fit is None:
            return None
        fixed, per_token = fit
        return max(0, math.floor((seconds - fixed) / per_token + 1e-6))  # 1e-6: a fit's rounding is no token
