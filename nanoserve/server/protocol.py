"""The request bodies of OpenAI's completions and chat completions, validated, and turned into SamplingParams.

Field names and defaults are OpenAI's; vLLM's extensions that the engine supports are accepted too
(top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos, return_token_ids). Unknown fields are
ignored, as OpenAI-compatible servers do; a known field of the wrong type, or a value out of range, is
a 400 naming it. Options the engine does not implement (logprobs, echo, best_of, penalties other than
0, suffix, tools) are refused with a 400 that says so, rather than silently ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..sampling import SamplingParams


class BadRequest(ValueError):
    """A request the server refuses with 400; `param` names the field at fault."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: Any = None
    user: str | None = None
    # vLLM's extensions
    top_k: int = Field(default=-1, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False

    def refuse_unsupported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                raise BadRequest(f"{name} is not supported (use repetition_penalty)", name)
        if self.logprobs not in (None, False, 0):
            raise BadRequest("logprobs are not supported", "logprobs")

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The engine's parameters for the request's n samples (the engine seeds sample i with seed + i)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        seed = self.seed
        try:
            return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                                  repetition_penalty=self.repetition_penalty, seed=seed, max_tokens=max_tokens,
                                  stop=stop, stop_token_ids=list(self.stop_token_ids or []),
                                  ignore_eos=self.ignore_eos, n=self.n)
        except ValueError as e:
            raise BadRequest(str(e).replace("SamplingParams.", ""), _field_of(str(e))) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _field_of(message: str) -> str | None:
    head = message.split("=", 1)[0]
    return head.removeprefix("SamplingParams.") if head.startswith("SamplingParams.") else None


class CompletionRequest(_Common):
    """POST /v1/completions: a prompt as text or token ids, or a list of either."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            items = [p]
        else:
            items = list(p)
        if not items:
            raise BadRequest("prompt is empty: give a string, a list of token ids, or a list of either", "prompt")
        for i, item in enumerate(items):
            if len(item) == 0:
                raise BadRequest(f"prompt {i} is empty: at least one token is needed", "prompt")
        return items

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo:
            raise BadRequest("echo is not supported", "echo")
        if self.best_of not in (None, 1) and self.best_of != self.n:
            raise BadRequest("best_of is not supported", "best_of")
        if self.suffix:
            raise BadRequest("suffix is not supported", "suffix")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(f"only text content parts are supported, got type {part.get('type')!r}",
                                 "messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Common):
    """POST /v1/chat/completions: messages rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Any] | None = None

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.tools:
            raise BadRequest("tools are not supported", "tools")

    @property
    def wanted_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
