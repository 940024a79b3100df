"""Day 13's stage: the KV cache, contiguous. Compute each position's keys and values once, keep them.

Without a cache (Day 08) every generated token re-runs the whole sequence, so
step n costs n tokens of work. But a position's k and v never change once it is
computed: causal attention means later tokens cannot affect earlier ones. So we
keep them. Prefill runs the prompt once and writes its K/V; each decode step
runs one token, appends its K/V, and attends that one query over everything kept.

`KVCache` is a `KVBackend` (`attention.causal`): the model hands it the rotated q, k, v
of the new tokens, layer by layer, and never learns where they are kept. Here
they are kept contiguously, preallocated for `max_len` positions per sequence:

    k, v: (layers, batch, kv_heads, max_len, head_dim)

Head-major, so each head's keys are one contiguous run that a matmul reads as is.
Memory is reserved up front for the longest sequence allowed, used or not (Day 15
measures that waste; the paged cache of Days 16-21 removes it).

>>> cache = KVCache(ModelConfig.tiny(), max_len=32)
>>> tuple(cache.k.shape), cache.length
((2, 1, 2, 32, 16), 0)
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..attention.causal import causal_attention
from ..attention.torch_ops import decode_attention, value_bags
from ..config import ModelConfig
from ..model import Llama


class CacheFullError(ValueError):
    """More positions were asked for than the cache was allocated with."""


class KVCache:
    """A contiguous K/V store for `batch` sequences that advance in lockstep (batch 1: one sequence).

    Protocol for one forward of T new tokens: `positions = cache.reserve(T)`, run the model with
    `kv=cache` (each layer writes its slots [length, length + T) and attends over [0, length + T)),
    then `cache.advance(T)`. If the forward fails midway nothing is committed: `length` still says
    which slots hold valid K/V, and the partly written ones are overwritten next time.
    """

    def __init__(self, cfg: ModelConfig, max_len: int, batch: int = 1,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        self.cfg, self.max_len, self.batch = cfg, max_len, batch
        shape = (cfg.n_layers, batch, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # (L, B, K, S, D)
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # (L, B, K, S, D)
        self.length = 0  # positions [0, length) hold valid K/V
        self._layers = list(zip(self.k.unbind(0), self.v.unbind(0)))  # per-layer views, made once
        self._bags: tuple[int, Tensor, Tensor] | None = None  # decode_attention's indices for one length

    @classmethod
    def for_model(cls, model: Llama, max_len: int, batch: int = 1) -> KVCache:
        return cls(model.cfg, max_len, batch, model.dtype, model.embed.device)

    @property
    def nbytes(self) -> int:
        """Memory the cache holds: 2 x layers x batch x kv_heads x max_len x head_dim x dtype bytes."""
        return 2 * self.k.numel() * self.k.element_size()

    def reset(self) -> None:
        """Forget every position (the memory stays allocated for the next sequence)."""
        self.length = 0
        self._bags = None

    def reserve(self, n_new: int) -> Tensor:
        """Positions (batch, n_new) the next forward's tokens will take; refuses what does not fit."""
        if n_new < 1:
            raise ValueError(f"a forward needs at least one new token, got {n_new}")
        if self.length + n_new > self.max_len:
            raise CacheFullError(
                f"KV cache full: {self.length} positions held + {n_new} new > max_len {self.max_len}; "
                f"allocate the cache with max_len >= prompt + generated tokens"
            )
        return torch.arange(self.length, self.length + n_new, device=self.k.device).expand(self.batch, n_new)

    def advance(self, n_new: int) -> None:
        """Commit the positions the last forward wrote."""
        if self.length + n_new > self.max_len:
            raise CacheFullError(f"cannot advance {n_new} past max_len {self.max_len} (length {self.length})")
        self.length += n_new

    supports_sliding_window = True

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor, window: int | None = None) -> Tensor:
        """The KVBackend: write the new k/v, attend the new queries over the whole prefix.

        q (B, T, H, D), k/v (B, T, K, D) -> (B, T, H*D). Query t sits at position length + t
        and sees keys [0, length + t]: everything cached, and the new tokens causally; with a sliding
        `window`, only the last `window` of them (the slots before stay allocated, unread).
        """
        B, T = q.shape[:2]
        start, end = self.length, self.length + T
        if end > self.max_len:
            raise CacheFullError(f"KV cache full: writing positions [{start}, {end}) into max_len {self.max_len}")
        if B != self.batch:
            raise ValueError(f"cache holds {self.batch} sequences, the forward has {B}")
        k_layer, v_layer = self._layers[layer]  # (B, K, S, D) views of this layer's storage
        k_layer.narrow(2, start, T).copy_(k.transpose(1, 2))  # (B, K, T, D) into the slots
        v_layer.narrow(2, start, T).copy_(v.transpose(1, 2))
        if window is not None and end > window:
            keys, values = k_layer[:, :, :end].transpose(1, 2), v_layer[:, :, :end].transpose(1, 2)
            return causal_attention(q, keys, values, start, window=window)
        if T == 1 and B == 1 and q.dtype == torch.float32 and not q.is_cuda:  # one query: the bag read (Day 13)
            values = v_layer.reshape(-1, v_layer.shape[-1])  # (K * max_len, D): the rows the bags index
            return decode_attention(q, k_layer[:, :, :end], values, self._value_bags(end, q.shape[2]))
        keys, values = k_layer[:, :, :end].transpose(1, 2), v_layer[:, :, :end].transpose(1, 2)  # (B, S, K, D) views
        return causal_attention(q, keys, values, start)

    def _value_bags(self, n: int, n_heads: int) -> tuple[Tensor, Tensor]:
        """decode_attention's value bags for positions [0, n): the same for every layer of a step."""
        if self._bags is None or self._bags[0] != n:
            K = self.cfg.n_kv_heads
            rows = torch.arange(K, device=self.k.device)[:, None] * self.max_len + torch.arange(n, device=self.k.device)
            self._bags = (n, *value_bags(rows[None], n_heads // K))  # rows (1, K, n): kv head g's row l
        return self._bags[1], self._bags[2]


class CachedSession:
    """A Session (`stages.sessions`) on a KV cache: prefill once, then one token per decode step."""

    def __init__(self, model: Llama, max_len: int):
        self.model = model
        self.cache = KVCache.for_model(model, max_len)

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    def _forward(self, ids: list[int]) -> Tensor:
        positions = self.cache.reserve(len(ids))  # refuses before any work if it does not fit
        x = torch.tensor([ids], device=self.cache.k.device)  # (1, T)
        logits = self.model(x, positions, kv=self.cache, last_only=True)[0]  # (V,)
        self.cache.advance(len(ids))
        return logits

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> Tensor:
        """Start a new sequence: write the prompt's K/V, return the last position's logits (V,)."""
        if len(ids) == 0:
            raise ValueError("prefill needs at least one token")
        if len(ids) > self.cache.max_len:
            raise CacheFullError(f"prompt has {len(ids)} tokens but the KV cache holds max_len {self.max_len}")
        self.cache.reset()
        return self._forward(list(ids))

    @torch.inference_mode()
    def decode(self, token: int) -> Tensor:
        """Append one token: its K/V goes into the next slot; returns the logits (V,) after it."""
        if self.cache.length == 0:
            raise RuntimeError("decode() before prefill(): there is no sequence to extend")
        return self._forward([token])


def cached_session(model: Llama, max_len: int) -> CachedSession:
    """A Session whose cache holds `max_len` positions (prompt + generated), checked on every step."""
    return CachedSession(model, max_len)
