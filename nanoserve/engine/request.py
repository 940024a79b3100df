"""A request: a prompt, how to sample it, and where it is in its life (Day 30).

vLLM V1's view: there is no prefill phase and no decode phase. A request has tokens (its prompt,
then what it has generated) and a count of how many of them are computed, their K/V in the cache.
Each step the scheduler gives it some of the rest to compute: a whole prompt, a chunk of one, one
decode token, or, after a preemption, everything again. When the computed count reaches the end, the
step's logits at its last token are sampled into a new token.

    WAITING --admitted--> RUNNING --last token--> FINISHED (stop token, stop string, length, abort)
       ^                    |
       +--- PREEMPTED <-----+   its blocks freed; recomputed when readmitted, nothing lost

A request asking for n samples is n of these, one per sample (`index`), sharing the caller's
`request_id`: the first is queued, the others wait in its `forks` and join when its prompt is
computed, each starting from a fork of its blocks (Day 19) and its own seeded generator.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..kv.blocks import BlockTable
from ..kv.hybrid import HybridTable
from ..sampling import RowSampler, SamplingParams
from ..stopping import StopChecker
from ..structured import Matcher
from ..tokenizer import Tokenizer
from .outputs import StepOutput, TokenLogprobs
from .spec import NgramIndex


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    """Why a request ended, in the OpenAI API's words: "stop" is a stop token or a stop string
    (`Request.stop_reason` says which), "length" its max_tokens or the model's context."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"  # this request alone failed (a row whose logits could not be sampled)


@dataclass(eq=False)
class Request:
    """One sequence's whole state. The scheduler moves it between queues; the runner samples for it."""

    request_id: str  # the caller's id (shared by the n samples of one request)
    prompt_token_ids: list[int]
    params: SamplingParams
    max_new_tokens: int  # params.max_tokens, cut to what fits in the model's context
    eos_token_ids: Sequence[int] = ()
    tokenizer: Tokenizer | None = None
    arrival_time: float = 0.0  # clock reading when it was added
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V is in the cache
    table: BlockTable | HybridTable | None = None  # a HybridTable: one block table per KV cache group
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token or stop string that ended it
    text: str = ""  # the output as text (with a tokenizer), a stop string and what follows cut off
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at its first admission
    num_preemptions: int = 0
    token_times: list[float] = field(default_factory=list)  # clock reading at each sampled token
    finish_time: float | None = None
    events: list[tuple[int, RequestStatus]] = field(default_factory=list)  # (engine step, new status)
    index: int = 0  # which of the request's samples
    seq_id: str = ""  # the engine's key: request_id, or request_id/index for a request of several samples
    forks: list[Request] = field(default_factory=list)  # the other samples, waiting for this one's prompt
    spec_token_ids: list[int] = field(default_factory=list)  # draft tokens to verify in the next step
    num_draft_tokens: int = 0  # drafts verified over the request's life
    num_accepted_tokens: int = 0  # ... and accepted
    error: str | None = None
    matcher: Matcher | None = None  # structured outputs: the grammar's state after the output so far
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # once the prompt is computed, if asked for
    prompt_logprobs_sent: bool = False
    prompt_logprobs_partial: list[TokenLogprobs] = field(default_factory=list)  # scored so far

    def __post_init__(self) -> None:
        self.seq_id = self.seq_id or self.request_id
        self.sampler = RowSampler(self.params)
        self.stopper = StopChecker(self.params, list(self.eos_token_ids), self.max_new_tokens, self.tokenizer)
        self.ngrams: NgramIndex | None = None  # speculative decoding's index, made by the engine on first use

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, stop: int | None = None) -> list[int]:
        """all_token_ids[start:stop] without joining the two lists first: each decode step asks for its last
        token, and joining copies the whole sequence."""
        p, stop = len(self.prompt_token_ids), self.num_tokens if stop is None else stop
        if start >= p:
            return self.output_token_ids[start - p:stop - p]
        return self.prompt_token_ids[start:stop] + self.output_token_ids[:max(0, stop - p)]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        """Tokens not yet in the cache: the whole prompt at first, one after each sampled token."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def move(self, status: RequestStatus, step: int) -> None:
        """Change state, and log it for the timeline (Day 30 draws it)."""
        self.status = status
        self.events.append((step, status))

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_token(self, token: int, now: float) -> str:
        """Record a sampled token; returns the text it releases. Sets finish_reason when it ends the request."""
        self.output_token_ids.append(token)
        self.token_times.append(now)
        text, reason = self.stopper.push(token)
        if reason is not None:
            self.finish_reason = FinishReason(reason)
            self.stop_reason = token if token in self.stopper.stop_ids else self.stopper.matched
        self.text += text
        return text

    @property
    def collects_prompt_logprobs(self) -> bool:
        """Its prompt's log-probabilities are asked for and not yet computed."""
        return self.params.prompt_logprobs is not None and self.prompt_logprobs is None

    def output(self, new_token_ids: list[int], new_text: str, logprobs: list[TokenLogprobs] | None = None
               ) -> StepOutput:
        """This step's StepOutput for the sequence (its prompt's log-probabilities ride on the first one)."""
        reason = self.finish_reason.value if self.finish_reason is not None and self.finished else None
        prompt = None
        if self.prompt_logprobs is not None and not self.prompt_logprobs_sent:
            prompt, self.prompt_logprobs_sent = self.prompt_logprobs, True
        return StepOutput(self.request_id, new_token_ids, new_text, reason, self.index, self.stop_reason,
                          self.num_prompt_tokens, self.num_output_tokens, self.num_cached_tokens, self.error,
                          logprobs if self.params.logprobs is not None else None, prompt)
