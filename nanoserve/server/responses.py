"""What the server sends back, in OpenAI's shapes: usage, finish reasons, and log-probabilities.

The engine reports a position's log-probabilities as {token id: (logprob, rank)}, the chosen token first
(`engine.outputs.TokenLogprobs`). OpenAI has two shapes for them:

    chat         choice.logprobs.content[i] = {"token": " Paris", "logprob": -0.3, "bytes": [32, 80, ...],
                                               "top_logprobs": [{"token", "logprob", "bytes"}, ...]}
    completions  choice.logprobs = {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{text: logprob}],
                                    "text_offset": [...]}   (the legacy shape lm-eval reads)

A token's text is its id decoded alone (a piece of a multi-byte character decodes to U+FFFD); its bytes are
the ones it stands for in the byte-level vocabulary, so a client can join a character split across tokens.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

from ..engine.outputs import TokenLogprobs
from ..tokenizer import Tokenizer

LOGPROB_FLOOR = -9999.0
"""A log-probability below this (or -inf) is sent as this: JSON has no infinity (vLLM does the same)."""


def usage_of(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage, with the prompt tokens found in the prefix cache where OpenAI reports them."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def finish_reason(reason: str | None) -> str | None:
    """The engine's reasons in OpenAI's words: eos and stop strings are "stop", the token limit is "length"."""
    return None if reason is None else ("length" if reason == "length" else "stop")


def sse(obj: dict) -> str:
    """One server-sent event carrying a JSON chunk."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as the printable character a byte-level vocabulary writes it with."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class TokenText:
    """Each token id's text and bytes as OpenAI's logprobs name them (kept: a vocabulary is finite)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        decoder = json.loads(tokenizer.to_json()).get("decoder") or {}
        self.byte_level = decoder.get("type") == "ByteLevel"
        self._byte_of = {c: b for b, c in _bytes_to_unicode().items()}
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        got = self._cache.get(token)
        if got is None:
            text = self.tok.decode([token])
            piece = self.tok.id_to_token(token) if self.byte_level else None
            if piece is not None and all(c in self._byte_of for c in piece):
                raw = [self._byte_of[c] for c in piece]
            else:
                raw = list(text.encode("utf-8"))
            got = self._cache[token] = (text, raw)
        return got


def _value(lp: float) -> float:
    return lp if math.isfinite(lp) and lp > LOGPROB_FLOOR else LOGPROB_FLOOR


def top_of(entry: TokenLogprobs, k: int) -> list[tuple[int, float]]:
    """The k likeliest tokens of a position, likeliest first, from the engine's entry (the chosen token first,
    then the top k; the chosen token is among them if it has the entry's k or fewer items)."""
    items = list(entry.items())
    top = items[1:] if len(items) > k else sorted(items, key=lambda kv: kv[1][1])
    return [(t, _value(lp)) for t, (lp, _) in top[:k]]


def chat_logprobs(tokens: Sequence[int], entries: Sequence[TokenLogprobs], k: int, text: TokenText) -> dict:
    """choice.logprobs of a chat completion (or of one streamed chunk) for these generated tokens."""
    content = []
    for t, entry in zip(tokens, entries):
        s, b = text(t)
        top = []
        for u, lp in top_of(entry, k):
            su, bu = text(u)
            top.append({"token": su, "logprob": lp, "bytes": bu})
        content.append({"token": s, "logprob": _value(entry[t][0]), "bytes": b, "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(tokens: Sequence[int], entries: Sequence[TokenLogprobs | None], k: int, text: TokenText,
                        offset: int = 0) -> dict:
    """choice.logprobs of a completion in OpenAI's legacy shape: per token its text, log-probability, the k
    likeliest texts with the chosen one ({text: logprob}), and where its text starts in the choice's text
    (counting from `offset`). An entry of None (a prompt's first token, which nothing precedes) is null."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t, entry in zip(tokens, entries):
        s, _ = text(t)
        out["tokens"].append(s)
        out["text_offset"].append(offset)
        offset += len(s)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_value(entry[t][0]))
        top = {s: _value(entry[t][0])}
        for u, lp in top_of(entry, k):
            top.setdefault(text(u)[0], lp)
        out["top_logprobs"].append(top)
    return out


def joined(a: dict | None, b: dict | None) -> dict | None:
    """Two legacy logprobs blocks one after the other (an echoed prompt's, then the completion's)."""
    if a is None or b is None:
        return a if b is None else b
    return {key: a[key] + b[key] for key in a}
