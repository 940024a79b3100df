"""Prompt-lookup speculative decoding (Day 40): several tokens per forward, the same greedy tokens.

A batch-1 decode step streams every weight from memory to compute one row. Rows two to k+1 of the
same product cost far less than the first, so if someone guesses the next k tokens, one forward over
[last token, guess_1 .. guess_k] checks them all: the model's argmax after each position says whether
the next guess was right. Keep the longest right prefix, plus the model's own token after it (the
bonus): between 1 and k+1 tokens per forward, and the very tokens plain greedy decoding would choose.

The guesses here cost nothing: `propose` finds the last n tokens (n from `prompt_lookup_max` down to
`prompt_lookup_min`) earlier in prompt + output and proposes the k tokens that followed them there.
Text that copies its prompt (editing, summarizing, answering from a document) is full of such repeats.
The names are vLLM's (`prompt_lookup_max`, `prompt_lookup_min`, `num_speculative_tokens`).

>>> propose([1, 2, 3, 9, 1, 2], k=3, max_ngram=3, min_ngram=1)
Proposal(ngram=2, start=0, tokens=[3, 9, 1])
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from .engine.checks import check_prompt
from .engine.session import PagedSession, paged_session
from .generate import Completion, StepOutput, step_output
from .model import Llama
from .sampling import Sampler, SamplingParams
from .stopping import StopChecker
from .tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["Proposal", "SpecConfig", "SpecStats", "SpecStep", "expected_tokens_per_forward", "propose",
           "speculative_generate", "stream_speculative"]


@dataclass(frozen=True)
class SpecConfig:
    """How many tokens to guess, and the n-gram sizes the guess may be looked up by (vLLM's names)."""

    num_speculative_tokens: int = 5
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 2

    def __post_init__(self) -> None:
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min ({self.prompt_lookup_min}) <= prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens} must be >= 1")


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


@dataclass(frozen=True)
class SpecStep:
    """One forward after the prefill: the draft it verified (None: a plain decode step), how many draft
    tokens the model agreed with, and the tokens it produced (accepted drafts, then its own)."""

    proposal: Proposal | None
    accepted: int
    tokens: list[int]


@dataclass
class SpecStats:
    """Acceptance accounting for one request."""

    steps: list[SpecStep] = field(default_factory=list)

    @property
    def forwards(self) -> int:
        """Model forwards after the prefill (decode and verify steps)."""
        return len(self.steps)

    @property
    def proposed(self) -> int:
        return sum(len(s.proposal.tokens) for s in self.steps if s.proposal)

    @property
    def accepted(self) -> int:
        return sum(s.accepted for s in self.steps)

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / proposed draft tokens (0 when nothing was proposed)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Tokens the forwards after the prefill produced, per forward (plain decoding: exactly 1)."""
        return sum(len(s.tokens) for s in self.steps) / self.forwards if self.forwards else 0.0


def stream_speculative(
    model: Llama, prompt_ids: list[int], params: SamplingParams | None = None, tokenizer: Tokenizer | None = None,
    config: SpecConfig | None = None, session: PagedSession | None = None, stats: SpecStats | None = None,
) -> Iterator[StepOutput]:
    """`stream_generate`'s outputs, produced up to k+1 tokens per forward. Greedy only. Stops exactly where
    generate stops (EOS, stop ids and strings, max_tokens): no token past a stop is yielded. The session's
    blocks are freed at the end. `stats`, if given, collects every step."""
    params = params or SamplingParams(temperature=0.0)
    if not params.greedy:
        raise ValueError(f"prompt-lookup decoding is greedy only (temperature 0), got temperature="
                         f"{params.temperature}: a sampled request needs generate(), or rejection sampling")
    if params.n != 1:
        raise ValueError(f"n={params.n}: speculative decoding runs one sequence")
    config = config or SpecConfig()
    stats = stats if stats is not None else SpecStats()
    cfg = model.cfg
    check_prompt(prompt_ids, cfg.max_position_embeddings, cfg.vocab_size)
    if params.stop and tokenizer is None:
        raise ValueError("stop strings need a tokenizer to see the text")
    stopper = StopChecker(params, cfg.eos_token_id, cfg.max_position_embeddings - len(prompt_ids))
    session = session or paged_session(model, len(prompt_ids) + stopper.max_new)
    sampler = Sampler(params)  # greedy: a pure function of (logits, tokens seen)
    detok = IncrementalDetokenizer(tokenizer) if tokenizer else None
    seen = list(prompt_ids)
    try:
        pending = [sampler(session.prefill(list(prompt_ids)), seen)]  # chosen, not yet yielded
        while True:
            for token in pending:  # through the stop checker one by one, as generate yields them
                seen.append(token)
                n = len(seen) - len(prompt_ids)
                out = step_output(token, n, stopper, detok)
                yield out
                if out.finish_reason is not None:
                    return
            k = min(config.num_speculative_tokens, stopper.max_new - n - 1)  # never draft past max_tokens
            proposal = propose(seen, k, config.prompt_lookup_max, config.prompt_lookup_min) if k > 0 else None
            if proposal is None:  # nothing to guess: an ordinary decode step
                pending = [sampler(session.decode(seen[-1]), seen)]
                stats.steps.append(SpecStep(None, 0, pending))
                continue
            draft = proposal.tokens
            logits = session.extend([seen[-1], *draft])  # (k+1, V): row i decides the token after draft[:i]
            pending = []
            for i in range(len(draft) + 1):
                pending.append(sampler(logits[i], seen + pending))
                if i == len(draft) or pending[-1] != draft[i]:
                    break
            accepted = len(pending) - 1
            session.truncate(len(seen) + accepted)  # keep the accepted drafts; the bonus token is not in yet
            stats.steps.append(SpecStep(proposal, accepted, pending))
    finally:
        session.free()


def speculative_generate(
    model: Llama, prompt_ids: list[int], params: SamplingParams | None = None, tokenizer: Tokenizer | None = None,
    config: SpecConfig | None = None, session: PagedSession | None = None,
) -> tuple[Completion, SpecStats]:
    """Run `stream_speculative` to the end: the completion (as `generate` returns it) and its accounting."""
    stats = SpecStats()
    out = Completion(list(prompt_ids))
    for step in stream_speculative(model, prompt_ids, params, tokenizer, config, session, stats):
        out.token_ids.append(step.token_id)
        out.text += step.text
        out.finish_reason = step.finish_reason
    return out, stats
