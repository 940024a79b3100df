"""Input checks every engine path shares: what no path could serve is refused up front, with a
message that says what is wrong and where."""

from __future__ import annotations

import operator
from collections.abc import Sequence

from ..config import ModelConfig


def check_prompt(prompt_ids: Sequence[int], max_context: int, vocab_size: int, max_tokens: int = 1) -> None:
    """Refuse what no engine path can serve, with a message that says what and where.

    `max_tokens`: how many tokens must fit after the prompt (at least the one its prefill produces)."""
    if isinstance(prompt_ids, (str, bytes)):
        raise ValueError(f"prompt is text ({prompt_ids[:20]!r}), not token ids: encode it with the tokenizer first")
    if len(prompt_ids) == 0:
        raise ValueError("prompt is empty: at least one token is needed to produce logits")
    check_prompt_length(len(prompt_ids), max_context, max_tokens)  # first: a million ids refused without a walk
    not_ids = [i for i in prompt_ids if not _is_token_id(i)]
    if not_ids:
        raise ValueError(f"prompt holds values that are not token ids (integers): {not_ids[:5]}")
    bad = [i for i in prompt_ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"prompt has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")


def check_prompt_length(n: int, max_context: int, max_tokens: int = 1) -> None:
    """Refuse a prompt of `n` tokens that leaves no room for `max_tokens` in the context (known before its ids are
    read: the server checks a body's prompt by its length alone, `server.weigh`)."""
    if n + max_tokens > max_context:
        room = ("leaving no room to generate" if max_tokens == 1 else
                f"leaving room for {max(0, max_context - n)} of the {max_tokens} tokens to generate")
        raise ValueError(f"prompt has {n} tokens; the model's context is {max_context}, {room}")


def _is_token_id(x: object) -> bool:
    """An integer (Python, numpy or a one-element integer tensor), not a float or a bool that would pass as one."""
    if isinstance(x, bool):
        return False
    try:
        operator.index(x)
    except TypeError:
        return False
    return True


def check_prompts(prompts: Sequence[Sequence[int]], cfg: ModelConfig, max_new_tokens: int = 1) -> None:
    """Refuse a batch any row of which no engine path could serve; the message names the row.
    Every row needs room for `max_new_tokens` after its prompt."""
    if isinstance(prompts, (str, bytes)):
        raise ValueError(f"need a list of prompts (each a list of token ids), got text {prompts[:20]!r}")
    if len(prompts) == 0:
        raise ValueError("empty batch: need at least one prompt")
    for i, p in enumerate(prompts):
        try:
            ids = p if isinstance(p, (str, bytes)) else list(p)
        except TypeError:
            raise ValueError(f"prompt {i}: expected a sequence of token ids, got {p!r}") from None
        try:
            check_prompt(ids, cfg.max_position_embeddings, cfg.vocab_size, max_new_tokens)
        except ValueError as e:
            raise ValueError(f"prompt {i}: {e}") from None
