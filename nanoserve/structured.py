"""Structured outputs: a grammar's token mask over the vocabulary, so every output parses (Day 41).

A request may ask that its output be JSON (any object, or one that validates against a schema), match a
regular expression, be one of a list of strings, or follow a Lark grammar: vLLM's `StructuredOutputsParams`,
and OpenAI's `response_format` on the server. Each such sequence holds a matcher, the grammar's state after
the tokens generated so far. Every step the matcher says which tokens may come next, as a bitmask over the
vocabulary (bit t of word t // 32 set: token t allowed); the sampler sets every other logit to -inf before it
chooses, and the chosen token advances the matcher. A constrained row and a free row share the step: only the
constrained rows' logits are masked.

The grammars are compiled and matched by llguidance (the library behind vLLM's and llama.cpp's guidance
backends): a schema or regex turns into a matcher in well under a millisecond, and what it cannot honour (an
unsupported keyword, an unsatisfiable schema, a regex with look-around) it reports instead of ignoring.

>>> compiler = GrammarCompiler(tok)                                   # doctest: +SKIP
>>> m = compiler.matcher(StructuredOutputsParams(choice=["yes", "no"]))  # doctest: +SKIP
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from . import kernels
from .tokenizer import Tokenizer

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""JSON as `json.dumps` writes it: free whitespace lets a small model spend its tokens on blank lines."""


@dataclass
class StructuredOutputsParams:
    """What the output must be (vLLM's names); exactly one field set. `json`: a JSON schema (a dict or its
    text); `json_object`: any JSON object; `regex`: a regular expression the whole output matches; `choice`:
    one of these strings; `grammar`: a Lark grammar (llguidance's dialect)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"StructuredOutputsParams: give exactly one of json, regex, choice, grammar, json_object;"
                             f" got {given or 'none'}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError(f"StructuredOutputsParams.choice={self.choice!r} must be a non-empty list of strings")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise ValueError(f"StructuredOutputsParams.{name}={v!r} must be a string")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"StructuredOutputsParams.json must be a JSON schema (an object or its text), "
                             f"got {type(self.json).__name__}")

    @property
    def kind(self) -> str:
        return next(f.name for f in fields(self) if getattr(self, f.name) not in (None, False))


class GrammarError(ValueError):
    """A grammar the library cannot compile or honour: `field` names the request field it came from."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class GrammarCompiler:
    """One tokenizer's grammars: turns StructuredOutputsParams into matchers (compiled grammars are kept, so a
    schema sent again costs a copy)."""

    def __init__(self, tokenizer: Tokenizer, eos_ids: list[int]):
        import llguidance

        self.llg = llguidance
        self.vocab_size = tokenizer.vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=self.vocab_size, eos_token=list(eos_ids))
        self._templates: dict[str, object] = {}
        self._lock = threading.Lock()  # a server checks requests in one thread while the engine adds in another

    def grammar(self, params: StructuredOutputsParams, field: str) -> str:
        """The llguidance grammar text for `params` (GrammarError naming `field` if it is not even well formed)."""
        llg = self.llg
        try:
            if params.choice is not None:
                return llg.grammar_from("choice", list(params.choice))
            if params.regex is not None:
                return llg.grammar_from("regex", params.regex)
            if params.grammar is not None:
                return llg.grammar_from("lark", params.grammar)
            schema = {"type": "object"} if params.json_object else params.json
            text = schema if isinstance(schema, str) else json.dumps(schema)
            return llg.LLMatcher.grammar_from_json_schema(text, defaults=JSON_LAYOUT)
        except (ValueError, TypeError) as e:
            raise GrammarError(field, str(e)) from None

    def matcher(self, params: StructuredOutputsParams, field: str = "structured_outputs") -> Matcher:
        """A fresh matcher at the grammar's start. GrammarError naming `field` if the library rejects it."""
        grammar = self.grammar(params, field)
        with self._lock:
            template = self._templates.get(grammar)
            if template is None:
                template = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
                if template.is_error():
                    raise GrammarError(field, _first_line(template.get_error()))
                if len(self._templates) > 256:  # a long-running server sees many schemas: keep the recent ones
                    self._templates.pop(next(iter(self._templates)))
                self._templates[grammar] = template
            copy = template.deep_copy()
        return Matcher(copy, self.vocab_size, field, params.kind)


def _first_line(error: str) -> str:
    return error.split("\n<state>")[0].strip()


class Matcher:
    """One sequence's grammar state: which tokens may come next (`fill`), and the token that came (`consume`)."""

    def __init__(self, matcher, vocab_size: int, field: str, kind: str = "grammar"):
        self.m, self.vocab_size, self.field, self.kind = matcher, vocab_size, field, kind

    def fill(self, bitmask: Tensor) -> None:
        """Write the allowed next tokens into one row of int32 words (ceil(V / 32),). GrammarError if no output
        can satisfy the grammar (found only on the first fill for some grammars: an empty language)."""
        if bitmask.dtype != torch.int32 or not bitmask.is_contiguous() or bitmask.numel() != words(self.vocab_size):
            raise ValueError(f"a bitmask row is {words(self.vocab_size)} contiguous int32 words")
        self.m.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)  # written in place, GIL released
        if self.m.is_error():
            why = _first_line(self.m.get_error())
            if "NoExtension" in why:  # llguidance's word for a language with no string in it
                why = f"no output can satisfy this {self.kind}"
            raise GrammarError(self.field, why)

    def check_start(self) -> None:
        """Take the grammar's first step and one token it allows (on this matcher: use a fresh one). What the
        library cannot follow shows here, before a prompt is computed, rather than at the first generated token:
        a language with no string in it, a choice list or a recursion past its parser's limits (GrammarError)."""
        bitmask = torch.empty(words(self.vocab_size), dtype=torch.int32)
        self.fill(bitmask)
        first = int(allowed(bitmask.view(1, -1), self.vocab_size)[0].nonzero()[0])
        if not self.consume(first):
            raise GrammarError(self.field, f"the grammar library cannot follow this {self.kind}: {self.error}")

    @property
    def error(self) -> str:
        """What the library said when the matcher failed (its first line), else ""."""
        return _first_line(self.m.get_error()) if self.m.is_error() else ""

    def consume(self, token: int) -> bool:
        """Advance by one generated token; False if the grammar did not allow it."""
        return bool(self.m.consume_token(token)) and not self.m.is_error()

    def rollback(self, n: int) -> None:
        self.m.rollback(n)

    @property
    def done(self) -> bool:
        """The grammar is complete and nothing may follow (only the end of the sequence is allowed)."""
        return bool(self.m.is_stopped())


def words(vocab_size: int) -> int:
    """int32 words of one row's bitmask."""
    return -(-vocab_size // 32)


_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def allowed(bitmask: Tensor, vocab_size: int) -> Tensor:
    """The bitmask (R, words) as booleans (R, V): token t allowed or not."""
    R = bitmask.shape[0]
    return (bitmask.contiguous().view(torch.uint8).view(R, -1, 1) & _BITS).view(R, -1)[:, :vocab_size].bool()


def apply_bitmask_(logits: Tensor, bitmask: Tensor, compiled: bool | None = None) -> Tensor:
    """Set the logits (R, V) of every token a row's bitmask (R, words) forbids to -inf, in place: the kernel's
    one pass where `compiled` (None: where built), else `allowed`'s booleans and masked_fill_ (the same logits)."""
    if kernels.resolve(compiled) and kernels.fits(logits) and bitmask.dtype == torch.int32 and bitmask.is_contiguous():
        return kernels.apply_bitmask_(logits, bitmask)
    logits.masked_fill_(~allowed(bitmask, logits.shape[-1]), float("-inf"))
    return logits
