"""Generation: the loop that turns a prompt into a completion (Days 08 and 10).

The loop is the same on every engine path. What differs is how the next logits
are produced, so that sits behind a tiny `Session` interface:

    prefill(prompt_ids) -> logits of the last prompt position
    decode(token_id)     -> logits after appending one token

`NoCacheSession` (Day 08) recomputes the whole sequence every step: simple and
correct, and its cost per token grows with length. Day 13's KV cache is another
Session with the same two methods, and the tokens must not change.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from .model import Llama
from .sampling import Sampler, SamplingParams
from .tokenizer import IncrementalDetokenizer, Tokenizer


class Session(Protocol):
    def prefill(self, ids: list[int]) -> Tensor: ...
    def decode(self, token: int) -> Tensor: ...


class NoCacheSession:
    """Every step runs the full forward over prompt + everything generated so far."""

    def __init__(self, model: Llama):
        self.model = model
        self.ids: list[int] = []

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> Tensor:
        self.ids = list(ids)
        return self.model(torch.tensor([self.ids]), last_only=True)[0]

    @torch.inference_mode()
    def decode(self, token: int) -> Tensor:
        self.ids.append(token)
        return self.model(torch.tensor([self.ids]), last_only=True)[0]


def check_prompt(prompt_ids: Sequence[int], max_context: int, vocab_size: int, max_tokens: int = 1) -> None:
    """Refuse what no engine path can serve, with a message that says what and where.

    `max_tokens`: how many tokens must fit after the prompt (at least the one its prefill produces)."""
    if isinstance(prompt_ids, (str, bytes)):
        raise ValueError(f"prompt is text ({prompt_ids[:20]!r}), not token ids: encode it with the tokenizer first")
    if len(prompt_ids) == 0:
        raise ValueError("prompt is empty: at least one token is needed to produce logits")
    not_ids = [i for i in prompt_ids if not _is_token_id(i)]
    if not_ids:
        raise ValueError(f"prompt holds values that are not token ids (integers): {not_ids[:5]}")
    if len(prompt_ids) + max_tokens > max_context:
        room = ("leaving no room to generate" if max_tokens == 1 else
                f"leaving room for {max(0, max_context - len(prompt_ids))} of the {max_tokens} tokens to generate")
        raise ValueError(f"prompt has {len(prompt_ids)} tokens; the model's context is {max_context}, {room}")
    bad = [i for i in prompt_ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"prompt has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")


def _is_token_id(x: object) -> bool:
    """An integer (Python, numpy or a one-element integer tensor), not a float or a bool that would pass as one."""
    if isinstance(x, bool):
        return False
    try:
        operator.index(x)
    except TypeError:
        return False
    return True


@dataclass
class StepOutput:
    """One generated token and the text it completes (may be '' mid-character)."""

    token_id: int
    text: str
    finish_reason: str | None = None  # "stop" (EOS or stop string) or "length"


@dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None


class StopChecker:
    """Decides when a sequence ends: EOS / stop ids, stop strings in the text, max tokens, context.

    A stop string can span several tokens, so text that could still become the start of one is
    held back (at most the longest stop string minus one character) until it cannot.
    """

    def __init__(self, params: SamplingParams, eos_ids: list[int], max_new: int):
        self.params = params
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        self.max_new = min(params.max_tokens, max_new)
        self.hold = max((len(s) - 1 for s in params.stop), default=0)
        self.text = ""
        self.emitted = 0  # characters of self.text already handed out

    def _release(self, upto: int) -> str:
        upto = max(self.emitted, upto)  # never negative: a negative index would wrap around
        out, self.emitted = self.text[self.emitted:upto], upto
        return out

    def check(self, token: int, n_generated: int, piece: str) -> tuple[str, str | None]:
        """Returns (text to emit, finish reason or None). Text stops before a stop string."""
        if token in self.stop_ids:
            return self._release(len(self.text)), "stop"
        checked = len(self.text)
        self.text += piece
        for s in self.params.stop:
            # only a match that reaches into the new piece is new
            at = self.text.find(s, max(0, checked - len(s) + 1))
            if at != -1:
                self.text = self.text[:at]
                return self._release(at), "stop"
        if n_generated >= self.max_new:
            return self._release(len(self.text)), "length"
        return self._release(len(self.text) - self.hold), None


def stream_generate(
    model: Llama, prompt_ids: list[int], params: SamplingParams | None = None,
    tokenizer: Tokenizer | None = None, session: Session | None = None,
) -> Iterator[StepOutput]:
    """Yield one StepOutput per generated token; the last one carries a finish_reason."""
    params = params or SamplingParams(temperature=0.0)
    cfg = model.cfg
    check_prompt(prompt_ids, cfg.max_position_embeddings, cfg.vocab_size)
    if params.stop and tokenizer is None:
        raise ValueError("stop strings need a tokenizer to see the text")
    session = session or NoCacheSession(model)
    sampler = Sampler(params)
    stopper = StopChecker(params, cfg.eos_token_id, cfg.max_position_embeddings - len(prompt_ids))
    detok = IncrementalDetokenizer(tokenizer) if tokenizer else None
    seen = list(prompt_ids)
    logits = session.prefill(list(prompt_ids))
    n = 0
    while True:
        token = sampler(logits, seen)
        seen.append(token)
        n += 1
        piece = detok.push(token) if detok and token not in stopper.stop_ids else ""
        text, reason = stopper.check(token, n, piece)
        if reason == "length" and detok:
            text += detok.flush()
        yield StepOutput(token, text, reason)
        if reason is not None:
            return
        logits = session.decode(token)


def generate(
    model: Llama, prompt_ids: list[int], params: SamplingParams | None = None,
    tokenizer: Tokenizer | None = None, session: Session | None = None,
) -> Completion:
    """Run `stream_generate` to the end and collect the ids and text.

    >>> generate(model, tok.encode("The capital of France is"), SamplingParams(temperature=0, max_tokens=3),
    ...          tok).text                                     # doctest: +SKIP
    ' Paris.'
    """
    out = Completion(list(prompt_ids))
    for step in stream_generate(model, prompt_ids, params, tokenizer, session):
        out.token_ids.append(step.token_id)
        out.text += step.text
        out.finish_reason = step.finish_reason
    return out


def greedy_ids(model: Llama, prompt_ids: list[int], max_tokens: int, session: Session | None = None,
               ignore_eos: bool = True) -> list[int]:
    """Greedy token ids only (no text): the form equivalence tests compare across engine paths."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    return generate(model, prompt_ids, params, session=session).token_ids
