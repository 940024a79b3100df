"""When a sequence ends, and what text it releases on the way (Day 10): a stop token, a stop string in
the text, max_tokens, the context.

`StopChecker.push` takes each generated token in turn: it turns it into text (an incremental
detokenizer, so a character split across tokens comes out whole) and says whether the sequence ends
there. Every road that generates text pushes its tokens through it: the engine's requests and the
course's stage loops alike.
"""

from __future__ import annotations

from collections.abc import Sequence

from .sampling import SamplingParams
from .tokenizer import IncrementalDetokenizer, Tokenizer


class StopChecker:
    """Decides when a sequence ends: EOS / stop ids, stop strings in the text, max tokens, context.

    A stop string can span several tokens, so text that could still become the start of one is
    held back (at most the longest stop string minus one character) until it cannot.
    """

    def __init__(self, params: SamplingParams, eos_ids: Sequence[int], max_new: int,
                 tokenizer: Tokenizer | None = None):
        self.params = params
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        self.max_new = min(params.max_tokens, max_new)
        self.hold = max((len(s) - 1 for s in params.stop), default=0)
        self.detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.generated = 0  # tokens pushed
        self.text = ""
        self.emitted = 0  # characters of self.text already handed out
        self.matched: str | None = None  # the stop string that ended the sequence, if one did

    def push(self, token: int) -> tuple[str, str | None]:
        """The next generated token -> (the text it releases, the finish reason or None)."""
        self.generated += 1
        piece = self.detok.push(token) if self.detok is not None and token not in self.stop_ids else ""
        text, reason = self.check(token, self.generated, piece)
        if reason == "length" and self.detok is not None:
            text += self.detok.flush()
        return text, reason

    def _release(self, upto: int) -> str:
        upto = max(self.emitted, upto)  # never negative: a negative index would wrap around
        out, self.emitted = self.text[self.emitted:upto], upto
        return out

    def check(self, token: int, n_generated: int, piece: str) -> tuple[str, str | None]:
        """Returns (text to emit, finish reason or None) for the n-th token and its text `piece`. Text
        stops before a stop string."""
        if token in self.stop_ids:
            return self._release(len(self.text)), "stop"
        checked = len(self.text)
        self.text += piece
        for s in self.params.stop:
            # only a match that reaches into the new piece is new
            at = self.text.find(s, max(0, checked - len(s) + 1))
            if at != -1:
                self.text, self.matched = self.text[:at], s
                return self._release(at), "stop"
        if n_generated >= self.max_new:
            return self._release(len(self.text)), "length"
        return self._release(len(self.text) - self.hold), None
