"""Sessions: one sequence's two calls, as generate.py's loop makes them (Days 08, 13, 17-21).

    prefill(prompt_ids) -> logits of the last prompt position
    decode(token_id)     -> logits after appending one token

`NoCacheSession` (Day 08) recomputes the whole sequence every step: simple, correct, and
its cost per token grows with length. `kv.CachedSession` (Day 13) keeps a contiguous cache.
`PagedSession` keeps the sequence in a paged pool that several sessions may share, and runs
its steps through the ModelRunner: the engine's own road, and the default of `generate`.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from ..attention import Chunk
from ..kv.paged import PagedKVCache
from ..model import Llama
from .model_runner import ModelRunner


class Session(Protocol):
    def prefill(self, ids: list[int]) -> Tensor: ...
    def decode(self, token: int) -> Tensor: ...


class NoCacheSession:
    """Every step runs the full forward over prompt + everything generated so far."""

    def __init__(self, model: Llama):
        self.model = model
        self.ids: list[int] = []

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> Tensor:
        self.ids = list(ids)
        return self.model(torch.tensor([self.ids]), last_only=True)[0]

    @torch.inference_mode()
    def decode(self, token: int) -> Tensor:
        self.ids.append(token)
        return self.model(torch.tensor([self.ids]), last_only=True)[0]


class PagedSession:
    """One sequence in a paged pool; several sessions can share one cache (and, by `fork`, blocks).
    `kernels` and `attention` choose the ModelRunner's road."""

    def __init__(self, model: Llama, cache: PagedKVCache, kernels: bool | None = None, attention: str | None = None):
        self.model, self.cache = model, cache
        self.runner = ModelRunner(model, cache, kernels, attention)
        self.table = cache.new_table()
        self.last_logits: Tensor | None = None
        self.prompt_computed = 0  # prompt tokens the last prefill actually ran (the rest were prefix hits)

    def prefill(self, ids: list[int]) -> Tensor:
        """Logits (V,) after the prompt. A fork that already holds exactly `ids` returns its parent's."""
        if self.last_logits is not None and self.table.token_ids == list(ids):
            return self.last_logits
        self.free()
        self.cache.check_fits(len(ids))
        hit = self.cache.match_prefix(self.table, ids)
        self.prompt_computed = len(ids) - hit
        return self._forward(list(ids[hit:]))

    def decode(self, token: int) -> Tensor:
        """Append one token: its K/V goes into the next slot; returns the logits (V,) after it."""
        if self.table.num_tokens == 0:
            raise RuntimeError("decode() before prefill(): there is no sequence to extend")
        return self._forward([token])

    def extend(self, ids: list[int]) -> Tensor:
        """Append several tokens in one step; logits (n, V) after each of them. Nothing is committed to the
        prefix cache until `truncate` says how many of them stay (speculative decoding's verify step)."""
        if self.table.num_tokens == 0:
            raise RuntimeError("extend() before prefill(): there is no sequence to extend")
        start = self.table.num_tokens
        self.cache.append(self.table, ids)
        logits = self.runner.execute([Chunk(ids, start, self.table.blocks)], all_rows=True)  # (n, V)
        self.last_logits = None
        return logits

    def truncate(self, num_tokens: int) -> None:
        """Keep the first `num_tokens` tokens (drop rejected drafts, free blocks they alone held), then
        name the full blocks that remain."""
        self.cache.truncate(self.table, num_tokens)
        self.cache.commit(self.table)

    def _forward(self, new_ids: list[int]) -> Tensor:
        start = self.table.num_tokens
        self.cache.append(self.table, new_ids)  # slots for the new tokens (all or nothing)
        logits = self.runner.execute([Chunk(new_ids, start, self.table.blocks)])[0]  # (V,)
        self.cache.commit(self.table)
        self.last_logits = logits
        return logits

    def fork(self) -> PagedSession:
        """A second session with this one's history and blocks (shared, copied on write)."""
        child = PagedSession(self.model, self.cache, self.runner.kernels, self.runner.attention)
        child.table = self.cache.fork(self.table)
        child.last_logits = self.last_logits
        return child

    def free(self) -> None:
        """Give the blocks back (cached full blocks stay findable until evicted)."""
        self.cache.free(self.table)
        self.last_logits = None


def paged_session(model: Llama, max_len: int, block_size: int = 16, prefix_caching: bool = True,
                  kernels: bool | None = None, attention: str | None = None) -> PagedSession:
    """A session on its own pool sized for `max_len` tokens: the paged twin of kv.CachedSession."""
    cache = PagedKVCache.for_tokens(model.cfg, max_len, block_size, dtype=model.dtype,
                                    prefix_caching=prefix_caching)
    return PagedSession(model, cache, kernels, attention)
