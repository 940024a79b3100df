"""The request bodies of OpenAI's completions and chat completions, validated, and turned into SamplingParams.

Field names and defaults are OpenAI's; vLLM's extensions that the engine supports are accepted too (top_k,
min_p, repetition_penalty, stop_token_ids, ignore_eos, return_token_ids, and structured outputs as
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` or `structured_outputs`). Unknown fields
are ignored, as OpenAI-compatible servers do; a known field of the wrong type, or a value out of range, is a
400 naming it. Types are strict where coercion would change the meaning, as OpenAI's are: a bool is only
true/false (not "yes", not 1), a count or token id only an integer (not 1.0, not false); a float field takes
an integer (temperature 1) but not a string or a bool. Options the engine does not implement (best_of,
suffix, logit_bias, tools) are refused with a 400 that says so, rather than silently ignored.

Sampling fields a request leaves out take the model's recommended values (its generation_config.json, as
vLLM does), else OpenAI's (temperature 1, top_p 1): `sampling_params(max_tokens, defaults)`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, model_validator

from ..sampling import MAX_LOGPROBS, SamplingParams
from ..structured import StructuredOutputsParams

MAX_DEPTH = 64
"""The deepest nesting a body may have: a deeper one is refused before anything walks it recursively."""
MAX_STOP = 64
"""Stop strings one request may give: each is checked against every token the request generates."""
OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
SEED_RANGE = (-(1 << 63), 1 << 64)  # what a 64-bit generator seed can hold (negative ones wrap, as torch's do)


class BadRequest(ValueError):
    """A request the server refuses with 400 (or `status`); `param` names the field at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


_PLAIN = {int, float, bool, type(None)}


def check_json(data: Any) -> None:
    """Refuse what would break later steps inside a body already parsed: text that is not Unicode (a lone
    surrogate such as "\\ud800" cannot be encoded, so no tokenizer takes it) and nesting deeper than MAX_DEPTH.
    Iterative, so it never recurses as deep as the body does; a list of numbers, or of text that encodes whole,
    is passed over at C speed (a body of a million token ids is checked in milliseconds, on the event loop)."""
    stack = [(data, ())]
    while stack:
        value, path = stack.pop()
        if len(path) > MAX_DEPTH:
            raise BadRequest(f"the body nests deeper than {MAX_DEPTH} levels (at {_where(path)})", _top(path))
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, dict):
            for k, v in value.items():
                _check_text(str(k), path)
                stack.append((v, (*path, k)))
        elif isinstance(value, list):
            kinds = set(map(type, value))
            if len(path) < MAX_DEPTH and (kinds <= _PLAIN or (kinds == {str} and _encodes("".join(value)))):
                continue  # nothing inside to refuse
            stack.extend((v, (*path, i)) for i, v in enumerate(value) if type(v) not in _PLAIN)


def _encodes(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_text(s: str, path: tuple) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest(f"{_where(path)} holds {s[e.start:e.end]!r} at {e.start}, a lone surrogate: not text",
                         _top(path)) from None


def _where(path: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(path)) \
        or "the body"


def _top(path: tuple) -> str | None:
    return str(path[0]) if path else None


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`: the schema under `schema` (kept whether or not `strict`)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: free text, any JSON object, or JSON that validates against a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(BaseModel):
    """vLLM's `structured_outputs` field: exactly one of these."""

    model_config = ConfigDict(extra="ignore")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    temperature: StrictFloat | None = Field(default=None, ge=0.0, description="below 1e-5: greedy")
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0)
    n: StrictInt = Field(default=1, ge=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(default=None, max_length=MAX_STOP)
    seed: StrictInt | None = Field(default=None, ge=SEED_RANGE[0], lt=SEED_RANGE[1],
                                   description="sample i of n is seeded (seed + i) mod 2**64")
    presence_penalty: StrictFloat = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extensions
    top_k: StrictInt | None = Field(default=None, ge=-1)
    min_p: StrictFloat | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: StrictFloat | None = Field(default=None, ge=0.01, le=10.0)
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    return_token_ids: StrictBool = False
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsRequest | None = None

    @model_validator(mode="before")
    @classmethod
    def _plain_json(cls, data: Any) -> Any:
        check_json(data)
        return data

    def refuse_unsupported(self) -> None:
        if self.logit_bias:
            raise BadRequest("logit_bias is not supported", "logit_bias")

    def structured(self) -> tuple[StructuredOutputsParams, str] | None:
        """The output's constraint, and the request field it came from (a 400 about the grammar names it)."""
        given: list[tuple[str, dict]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise BadRequest("response_format of type json_schema needs a json_schema", "response_format")
            schema = rf.json_schema.json_schema
            given.append(("response_format", {"json": schema} if schema is not None else {"json_object": True}))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                given.append((name, {key: getattr(self, name)}))
        if self.structured_outputs is not None:
            so = self.structured_outputs
            given.append(("structured_outputs", {"json": so.json_, "regex": so.regex, "choice": so.choice,
                                                 "grammar": so.grammar, "json_object": so.json_object}))
        if not given:
            return None
        if len(given) > 1:
            raise BadRequest(f"give one structured-output constraint; got {', '.join(f for f, _ in given)}",
                             given[1][0])
        field, kwargs = given[0]
        try:
            return StructuredOutputsParams(**kwargs), field
        except ValueError as e:
            raise BadRequest(f"{field}: {str(e).removeprefix('StructuredOutputsParams')}".replace(": .", "."),
                             field) from None

    def logprobs_wanted(self) -> int | None:
        """How many likeliest tokens to report beside each generated one (None: no logprobs)."""
        return None

    def sampling_params(self, max_tokens: int, defaults: dict[str, Any] | None = None,
                        structured: StructuredOutputsParams | None = None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """The engine's parameters for the request's n samples (the engine seeds sample i with (seed + i) mod
        2**64). A sampling field the request leaves out takes `defaults` (the model's), else OpenAI's."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        chosen = {name: getattr(self, name) if getattr(self, name) is not None
                  else (defaults or {}).get(name, value) for name, value in OPENAI_DEFAULTS.items()}
        try:
            return SamplingParams(**chosen, seed=self.seed, max_tokens=max_tokens, stop=stop,
                                  stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos, n=self.n,
                                  presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                                  logprobs=self.logprobs_wanted(), prompt_logprobs=prompt_logprobs,
                                  structured_outputs=structured)
        except ValueError as e:
            raise BadRequest(str(e).replace("SamplingParams.", ""), field_of(str(e))) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def field_of(message: str) -> str | None:
    """The field a SamplingParams error names ("SamplingParams.seed=... must be ..." -> "seed")."""
    head = message.split("=", 1)[0]
    return head.removeprefix("SamplingParams.") if head.startswith("SamplingParams.") else None


class CompletionRequest(_Common):
    """POST /v1/completions: a prompt as text or token ids, or a list of either. `logprobs: N` and `echo` are
    OpenAI's legacy fields: with both, the prompt's tokens are scored too (how lm-eval scores a model), and
    `max_tokens: 0` then returns the prompt alone."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0},
        {"prompt": "The capital of France is", "max_tokens": 1, "logprobs": 2, "echo": True}]})

    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: StrictInt | None = Field(default=None, ge=0, description="0 only with echo: score the prompt alone")
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False
    best_of: StrictInt | None = None
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
        if self.best_of not in (None, 1) and self.best_of != self.n:
            raise BadRequest("best_of is not supported", "best_of")
        if self.suffix:
            raise BadRequest("suffix is not supported", "suffix")
        if self.max_tokens == 0 and not self.echo:
            raise BadRequest("max_tokens must be at least 1 (0 only with echo, to score the prompt)", "max_tokens")

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs) and no completion (vLLM's behaviour)."""
        return self.echo and self.max_tokens == 0

    def logprobs_wanted(self) -> int | None:
        return self.logprobs


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
    """POST /v1/chat/completions: messages rendered with the model's chat template. `logprobs: true` with
    `top_logprobs: N` reports each generated token's log-probability and its N likeliest alternatives."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"messages": [{"role": "user", "content": "Give me three tips for learning to cook."}], "max_tokens": 32},
        {"messages": [{"role": "user", "content": "Is the sky blue?"}], "max_tokens": 4,
         "logprobs": True, "top_logprobs": 2}]})

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.tools:
            raise BadRequest("tools are not supported", "tools")
        if self.top_logprobs and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")

    def logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def wanted_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error shape, as every status other than 200 carries it."""

    error: ErrorInfo


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
