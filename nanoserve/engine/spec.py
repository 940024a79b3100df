"""Prompt-lookup speculative decoding (Day 40): several tokens per forward, the same greedy tokens.

A batch-1 decode step streams every weight from memory to compute one row. Rows two to k+1 of the
same product cost far less than the first, so if someone guesses the next k tokens, one forward over
[last token, guess_1 .. guess_k] checks them all: the model's argmax after each position says whether
the next guess was right. Keep the longest right prefix, plus the model's own token after it (the
bonus): between 1 and k+1 tokens per forward, and the very tokens plain greedy decoding would choose.

The guesses here cost nothing: `propose` finds the last n tokens (n from `prompt_lookup_max` down to
`prompt_lookup_min`) earlier in prompt + output and proposes the k tokens that followed them there.
Text that copies its prompt (editing, summarizing, answering from a document) is full of such repeats.
The names are vLLM's (`SpeculativeConfig`: num_speculative_tokens, prompt_lookup_max, prompt_lookup_min).

In the engine a draft is part of a request's share of a step: the scheduler gives it 1 + k tokens, the
model runner returns logits at each of them, the engine keeps the agreed prefix and the bonus, and
`Scheduler.update_from_output` gives back the blocks the rejected drafts took (`BlockManager.truncate`).
`NgramIndex` finds what `propose` finds in constant time per token, so drafting costs a step nothing.

>>> propose([1, 2, 3, 9, 1, 2], k=3, max_ngram=3, min_ngram=1)
Proposal(ngram=2, start=0, tokens=[3, 9, 1])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Proposal:
    """The last `ngram` tokens also stand at `start`; `tokens` followed them there (the draft)."""

    ngram: int
    start: int
    tokens: list[int]


def propose(tokens: Sequence[int], k: int, max_ngram: int = 3, min_ngram: int = 2) -> Proposal | None:
    """Draft up to k tokens: the longest suffix of `tokens` (max_ngram down to min_ngram long) that occurs
    earlier, at its latest earlier place, and the tokens that followed it there. None if nothing matches."""
    tokens = list(tokens)
    last, best, best_end = len(tokens) - 1, 0, -1
    for end in range(last - 1, -1, -1):  # latest first: where an earlier copy of the suffix could end
        n = 0
        while n < max_ngram and end - n >= 0 and tokens[end - n] == tokens[last - n]:
            n += 1
        if n > best:
            best, best_end = n, end
            if n == max_ngram:
                break
    if best < min_ngram or k < 1:
        return None
    return Proposal(best, best_end - best + 1, tokens[best_end + 1:best_end + 1 + k])


def expected_tokens_per_forward(alpha: float, k: int) -> float:
    """Tokens one verify step yields if each draft token is right with probability alpha, independently
    (Leviathan et al., 2023): 1 + alpha + ... + alpha^k. The bonus token is the 1; k+1 at alpha = 1.

    >>> expected_tokens_per_forward(0.5, 2)
    1.75
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha} must lie in [0, 1]")
    return float(sum(alpha ** i for i in range(k + 1)))


class NgramIndex:
    """One sequence's n-grams (min_ngram .. max_ngram long) by the position they end at, kept up to date
    as tokens arrive, so a proposal is a few dictionary lookups however long the sequence: the same
    proposal `propose` scans for."""

    def __init__(self, max_ngram: int, min_ngram: int):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokens: list[int] = []
        self.latest: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_ngram + 1)]  # n -> gram -> end

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens; n-grams ending before the newest token become findable (the newest is the suffix)."""
        for t in tokens:
            self.tokens.append(int(t))
            end = len(self.tokens) - 2  # the n-grams ending here may now be found by a later suffix
            for n in range(self.min_ngram, self.max_ngram + 1):
                if end - n + 1 < 0:
                    break
                self.latest[n][tuple(self.tokens[end - n + 1:end + 1])] = end

    def propose(self, k: int) -> Proposal | None:
        """`propose(self.tokens, k, max_ngram, min_ngram)`, from the index."""
        last = len(self.tokens) - 1
        if k < 1:
            return None
        for n in range(min(self.max_ngram, last), self.min_ngram - 1, -1):
            end = self.latest[n].get(tuple(self.tokens[last - n + 1:]))
            if end is not None:
                return Proposal(n, end - n + 1, self.tokens[end + 1:end + 1 + k])
        return None
