"""Text to token ids and back (Day 02), and detokenizing a stream safely (Day 10).

The BPE itself is the `tokenizers` library running the checkpoint's tokenizer.json,
the file transformers reads too; chat templates are the checkpoint's jinja2
template rendered with jinja2. Nothing here re-implements either.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from .config import CheckpointError

PIECE_CHARS = 16384
"""With a limit, a longer text is encoded in pieces of about this many characters until its tokens pass the limit."""


class TooManyTokens(ValueError):
    """A text holding more tokens than a limit, found without encoding all of it."""

    def __init__(self, limit: int, count: int, chars: int):
        super().__init__(f"holds more than {limit} tokens (its first {chars} characters already hold {count})")
        self.limit, self.count, self.chars = limit, count, chars


class Tokenizer:
    """A checkpoint folder's tokenizer: encode, decode, chat template, special tokens.

    >>> tok = Tokenizer.from_folder(fetch.default_model_dir())   # doctest: +SKIP
    >>> tok.encode("Hello world")                                 # doctest: +SKIP
    [19556, 905]
    """

    def __init__(self, tok: _HFTokenizer, config: dict | None = None):
        self._tok = tok
        cfg = config or {}
        self.chat_template: str | None = cfg.get("chat_template")
        self.bos_token: str | None = _token_text(cfg.get("bos_token"))
        self.eos_token: str | None = _token_text(cfg.get("eos_token"))
        self.add_bos = bool(cfg.get("add_bos_token", False))
        self.bos_id = self.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_id = self.token_to_id(self.eos_token) if self.eos_token else None
        self._env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{path}: tokenizer.json not found")
        try:
            tok = _HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on a bad file
            raise CheckpointError(f"{path}: not a valid tokenizer.json ({e})") from None
        cfg_path = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        return cls(tok, cfg)

    def to_json(self) -> str:
        """The tokenizer.json text: what other libraries that need the vocabulary (a grammar's matcher) read."""
        return self._tok.to_str()

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def encode(self, text: str, add_special_tokens: bool = True, limit: int | None = None) -> list[int]:
        """Special tokens written in the text (e.g. <|im_start|>) become their single ids. (encode_batch, because it
        lets go of the GIL while it works: a server tokenizing a long prompt keeps answering others.) With `limit`,
        a text holding more tokens than that is refused (TooManyTokens) having encoded about `limit` of them: a
        megabyte of emoji (three tokens a character) costs a server what one context's worth of text does."""
        if limit is not None and len(text) > PIECE_CHARS:
            self._within(text, limit)
        ids = self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def _within(self, text: str, limit: int) -> None:
        """Encode `text` piece by piece, each cut before a space (where byte-level and SentencePiece vocabularies
        end a token anyway, so the pieces' counts add up to the whole's), until more than `limit` tokens are seen."""
        count, start = 0, 0
        while start < len(text):
            end = start + PIECE_CHARS
            if end < len(text):
                space = text.rfind(" ", start + PIECE_CHARS // 2, end)
                end = space if space > start else end
            count += len(self._tok.encode_batch([text[start:end]], add_special_tokens=False)[0].ids)
            if count > limit:
                raise TooManyTokens(limit, count, end)
            start = end

    def pieces(self, text: str) -> list[tuple[int, str]]:
        """(id, the exact substring of `text` it covers): what Day 02's text box shows."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return [(i, text[a:b]) for i, (a, b) in zip(enc.ids, enc.offsets)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Render the checkpoint's jinja2 chat template (the same string transformers renders)."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat_template; pass plain text instead of --chat")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {m!r}")
        template = self._env.from_string(self.chat_template)
        return template.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "",
        )

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)


def _token_text(t: str | dict | None) -> str | None:
    return t.get("content") if isinstance(t, dict) else t


class IncrementalDetokenizer:
    """Turn a stream of ids into a stream of text that never splits a character.

    Byte-level BPE can cut a UTF-8 character across tokens ('é' may be two tokens).
    We decode a small window of recent ids and emit only the new text once it no
    longer ends in the replacement character U+FFFD, the way vLLM and TGI do.

    >>> d = IncrementalDetokenizer(tok)         # doctest: +SKIP
    >>> [d.push(i) for i in ids]                # doctest: +SKIP
    ['Hello', ' world', '', ' é']
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tok = tokenizer
        self.skip_special = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the window we decode for context
        self.read_offset = 0  # everything before this has been emitted

    def push(self, token_id: int) -> str:
        """Add one id; return the text it completes (possibly '')."""
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special)
        full = self.tok.decode(self.ids[self.prefix_offset:], self.skip_special)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""  # an incomplete character: wait for the next token
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix):]

    def flush(self) -> str:
        """Whatever is still held back at the end of the stream (a genuinely broken tail)."""
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special)
        full = self.tok.decode(self.ids[self.prefix_offset:], self.skip_special)
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):]


def stream_text(tokenizer: Tokenizer, ids: Iterable[int]) -> Iterator[str]:
    """Detokenize an id stream into text pieces, each a whole number of characters."""
    d = IncrementalDetokenizer(tokenizer)
    for i in ids:
        if piece := d.push(i):
            yield piece
    if tail := d.flush():
        yield tail
