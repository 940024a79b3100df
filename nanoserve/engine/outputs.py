"""What generation hands back: one type per step inside the package, and vLLM's shapes at the API.

    StepOutput        one step, one sequence: the tokens it gained and the text they released (every road)
    CompletionOutput  one finished sample: its text and token ids (vLLM's CompletionOutput)
    RequestOutput     one prompt's samples (vLLM's RequestOutput: what `LLM.generate` returns)
"""

from __future__ import annotations

from dataclasses import dataclass, field

TokenLogprobs = dict[int, tuple[float, int]]
"""One position's log-probabilities: {token id: (logprob, rank)}, the chosen (or prompt) token first, then the
likeliest others (`sampling.logprobs_of`). Rank 1 is the likeliest token."""


@dataclass
class StepOutput:
    """What one step produced for one sequence: its new tokens (several when speculative drafts were
    accepted) and the text they release, and at its end why it ended and its counts."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finish_reason: str | None = None  # "stop", "length", "abort", or "error" (this request alone failed)
    index: int = 0  # which of the request's n samples
    stop_reason: int | str | None = None  # the stop token or stop string that ended it
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # generated so far
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    error: str | None = None  # with finish_reason "error": what went wrong
    logprobs: list[TokenLogprobs] | None = None  # one per new token, if the request asked for them
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # once, with the first output (the first token: None)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    """One sample of one prompt (vLLM's CompletionOutput)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    stop_reason: int | str | None = None  # the stop token or stop string that ended it
    logprobs: list[TokenLogprobs] | None = None  # one per token, if the request asked for them

    def add(self, step: StepOutput) -> None:
        """Fold in one of this sample's steps: its tokens, text and log-probabilities, and how it ended."""
        self.token_ids += step.new_token_ids
        self.text += step.new_text
        if step.logprobs is not None:
            self.logprobs = (self.logprobs or []) + step.logprobs
        if step.finished:
            self.finish_reason, self.stop_reason = step.finish_reason, step.stop_reason


@dataclass
class RequestOutput:
    """Everything one prompt produced (vLLM's RequestOutput): its samples in `outputs`."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    prompt_logprobs: list[TokenLogprobs | None] | None = None
