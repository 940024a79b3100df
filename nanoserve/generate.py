"""Generation: the loop that turns a prompt into a completion (Days 08, 10 and 19).

The loop is the same on every engine path. What differs is how the next logits are
produced, so that sits behind a `Session` (`engine.session`): prefill the prompt, then
decode one token at a time. With no session given, `generate` runs the engine's own
road, a paged cache sized for the request (`PagedSession`); `NoCacheSession` is Day 08's
road, named when wanted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field

from .engine.checks import check_prompt
from .engine.session import PagedSession, Session, paged_session
from .kv.paged import PagedKVCache
from .model import Llama
from .sampling import Sampler, SamplingParams
from .stopping import StopChecker
from .tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["Completion", "StepOutput", "StopChecker", "generate", "generate_n", "greedy_ids", "stream_generate"]


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
    stopper = StopChecker(params, cfg.eos_token_id, cfg.max_position_embeddings - len(prompt_ids))
    session = session or paged_session(model, len(prompt_ids) + stopper.max_new)
    sampler = Sampler(params)
    detok = IncrementalDetokenizer(tokenizer) if tokenizer else None
    seen = list(prompt_ids)
    logits = session.prefill(list(prompt_ids))
    n = 0
    while True:
        token = sampler(logits, seen)
        seen.append(token)
        n += 1
        out = step_output(token, n, stopper, detok)
        yield out
        if out.finish_reason is not None:
            return
        logits = session.decode(token)


def step_output(token: int, n: int, stopper: StopChecker, detok: IncrementalDetokenizer | None) -> StepOutput:
    """The n-th generated token as the stream reports it: the text it releases, and whether it ends the request."""
    piece = detok.push(token) if detok and token not in stopper.stop_ids else ""
    text, reason = stopper.check(token, n, piece)
    if reason == "length" and detok:
        text += detok.flush()
    return StepOutput(token, text, reason)


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


def generate_n(model: Llama, prompt_ids: list[int], params: SamplingParams, cache: PagedKVCache,
               tokenizer: Tokenizer | None = None) -> list[Completion]:
    """params.n samples of one prompt: the prompt is prefilled once and its blocks are shared by
    every sample. Sample i uses seed params.seed + i, so it equals a solo run with that seed."""
    parent = PagedSession(model, cache)
    parent.prefill(prompt_ids)
    sessions = [parent] + [parent.fork() for _ in range(params.n - 1)]
    outs = []
    for i, session in enumerate(sessions):
        seed = None if params.seed is None else params.seed + i
        outs.append(generate(model, prompt_ids, dataclasses.replace(params, n=1, seed=seed), tokenizer, session))
    for session in sessions:
        session.free()
    return outs
