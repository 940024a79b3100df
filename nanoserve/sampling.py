"""Choosing the next token from logits (Day 09).

`SamplingParams` has vLLM's names. Each filter reshapes the distribution the way
the field means it: repetition penalty (CTRL / transformers: positive logits of
seen tokens divided by the penalty, negative ones multiplied), temperature,
top-k (keep the k most likely), top-p (keep the smallest set whose mass reaches
p), min-p (drop tokens below min_p x the top probability). Temperature 0 is the
greedy path: argmax, no randomness, no generator touched.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from . import kernels


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. Invalid values raise ValueError naming the field."""

    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        real = lambda x: isinstance(x, numbers.Real) and not isinstance(x, bool)  # noqa: E731 (numpy's too)
        whole = lambda x: isinstance(x, numbers.Integral) and not isinstance(x, bool)  # noqa: E731
        t, k, p, m, r = self.temperature, self.top_k, self.top_p, self.min_p, self.repetition_penalty
        checks = [  # each condition is evaluated only if the ones before it held: a type first, then a range
            ("temperature", lambda: real(t) and t >= 0, "must be a number >= 0 (0 means greedy)"),
            ("top_k", lambda: whole(k) and (k == -1 or k >= 0), "must be an int >= 0, or -1 for off"),
            ("top_p", lambda: real(p) and 0.0 < p <= 1.0, "must be a number in (0, 1]"),
            ("min_p", lambda: real(m) and 0.0 <= m <= 1.0, "must be a number in [0, 1]"),
            ("repetition_penalty", lambda: real(r) and r > 0, "must be a number > 0 (1 means off)"),
            ("seed", lambda: self.seed is None or whole(self.seed), "must be an int or None"),
            ("max_tokens", lambda: whole(self.max_tokens) and self.max_tokens >= 1, "must be an int >= 1"),
            ("n", lambda: whole(self.n) and self.n >= 1, "must be an int >= 1"),
            ("stop", lambda: all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
            ("stop_token_ids", lambda: all(whole(i) and i >= 0 for i in self.stop_token_ids),
             "must be token ids (ints >= 0)"),
        ]
        for name, ok, why in checks:
            if not ok():
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r} {why}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


ARGMAX_CHUNK = 1024


def argmax_rows(logits: Tensor) -> Tensor:
    """logits (B, V) -> (B,) each row's argmax, the first index of its largest value, as argmax gives.

    torch's argmax keeps an index beside every comparison and is slow for it; its max alone (amax)
    is vectorised and several times faster. So: the max of each chunk of ARGMAX_CHUNK logits, the first chunk
    holding the row's max, then argmax within that chunk only. Exact: no arithmetic, only
    comparisons, and the first maximal chunk holds the first maximal index (a NaN, which argmax
    counts as largest, propagates through amax the same way).
    """
    B, V = logits.shape
    if kernels.enabled() and kernels.fits(logits) and V > 0:  # the same answer, in one pass of comparisons
        return kernels.argmax_rows(logits)
    if V % ARGMAX_CHUNK or V < 4 * ARGMAX_CHUNK:
        return logits.argmax(-1)
    chunks = logits.view(B, V // ARGMAX_CHUNK, ARGMAX_CHUNK)  # splitting a dim: a view, whatever the strides
    first = chunks.amax(-1).argmax(-1)  # (B,) the first chunk holding each row's max
    within = chunks[torch.arange(B), first].argmax(-1)
    return first * ARGMAX_CHUNK + within


def apply_repetition_penalty(logits: Tensor, seen: Sequence[int], penalty: float) -> Tensor:
    """logits (V,): positive logits of seen ids are divided by `penalty`, negative ones multiplied."""
    if penalty == 1.0 or len(seen) == 0:
        return logits
    idx = torch.tensor(sorted(set(seen)), dtype=torch.long, device=logits.device)
    vals = logits[idx]
    logits = logits.clone()
    logits[idx] = torch.where(vals > 0, vals / penalty, vals * penalty)
    return logits


def filtered_probs(logits: Tensor, params: SamplingParams, seen: Sequence[int] = ()) -> Tensor:
    """The distribution a sampled token is drawn from: logits (V,) -> probabilities (V,).

    With temperature 0 it is one-hot on the argmax. Pure: the Day 09 sliders and the
    statistical test both call it.
    """
    logits = apply_repetition_penalty(logits.float(), seen, params.repetition_penalty)
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        mass_before = sorted_p.cumsum(0) - sorted_p  # mass of strictly more likely tokens
        drop = mass_before >= params.top_p  # keep the smallest prefix reaching top_p
        probs = probs.scatter(0, order, sorted_p.masked_fill(drop, 0.0))
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs / probs.sum()


class Sampler:
    """Per-request sampling state: its own seeded generator, so a request's tokens do not
    depend on what else runs (run to run, or in a batch)."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: Tensor, seen: Sequence[int] = ()) -> int:
        """logits (V,) -> the next token id."""
        if self.params.greedy and self.params.repetition_penalty == 1.0:
            return int(logits.argmax())
        probs = filtered_probs(logits, self.params, seen)
        if self.params.greedy:
            return int(probs.argmax())
        return int(torch.multinomial(probs, 1, generator=self.generator))
