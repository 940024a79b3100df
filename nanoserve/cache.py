"""The KV cache: compute each position's keys and values once, keep them (Day 13).

Without a cache (Day 08) every generated token re-runs the whole sequence, so
step n costs n tokens of work. But a position's k and v never change once it is
computed: causal attention means later tokens cannot affect earlier ones. So we
keep them. Prefill runs the prompt once and writes its K/V; each decode step
runs one token, appends its K/V, and attends that one query over everything kept.

`KVCache` is a `KVBackend` (see model.py): the model hands it the rotated q, k, v
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
import torch.nn.functional as F
from torch import Tensor

from .config import ModelConfig
from .model import Llama


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

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """The KVBackend: write the new k/v, attend the new queries over the whole prefix.

        q (B, T, H, D), k/v (B, T, K, D) -> (B, T, H*D). Query t sits at position length + t
        and sees keys [0, length + t]: everything cached, and the new tokens causally.
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
        if T == 1 and B == 1 and q.dtype == torch.float32 and not q.is_cuda:
            return decode_attention(q, k_layer, v_layer, end, self._value_bags(end, q.shape[2]))
        return prefix_attention(q, k_layer[:, :, :end], v_layer[:, :, :end], start)  # views, no copy

    def _value_bags(self, n: int, n_heads: int) -> tuple[Tensor, Tensor]:
        """embedding_bag indices for decode_attention: query head h sums value rows of its kv head,
        positions [0, n). The same for every layer of a step, so made once per step."""
        if self._bags is None or self._bags[0] != n:
            rep = n_heads // self.cfg.n_kv_heads
            kv_head = torch.arange(n_heads, device=self.k.device) // rep  # (H,)
            rows = (kv_head[:, None] * self.max_len + torch.arange(n, device=self.k.device)).reshape(-1)  # (H*n,)
            self._bags = (n, rows, torch.arange(n_heads, device=self.k.device) * n)
        return self._bags[1], self._bags[2]


def prefix_attention(q: Tensor, keys: Tensor, values: Tensor, start: int) -> Tensor:
    """T new queries over S = start + T keys, causal among the new ones, grouped-query.

    q (B, T, H, D); keys/values (B, K, S, D) -> (B, T, H*D). Three cases, one rule
    (query t, at position start + t, sees keys [0, start + t]):
    a prompt on an empty cache is plain causal attention; one decode query sees every
    key, so it needs no mask at all; a chunk on top of a prefix gets an explicit mask.
    """
    B, T, H, D = q.shape
    S = keys.shape[2]
    mask = None
    if T > 1 and start > 0:
        mask = torch.arange(S, device=q.device)[None, :] <= start + torch.arange(T, device=q.device)[:, None]  # (T, S)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys, values, attn_mask=mask, is_causal=T > 1 and start == 0, enable_gqa=True
    )  # (B, H, T, D)
    return out.transpose(1, 2).reshape(B, T, H * D)


def decode_attention(q: Tensor, keys: Tensor, values: Tensor, n: int, bags: tuple[Tensor, Tensor]) -> Tensor:
    """One new query per head (batch 1, one token) over the first n cached positions.

    q (1, 1, H, D); keys/values: one layer's whole storage (1, K, max_len, D) -> (1, 1, H*D).
    Same result as `prefix_attention` (to fp32 rounding), written for Day 11's lesson: a decode
    step's attention only reads memory, every cached key and value once, so read it well. Scores
    are each kv head's keys times its rep query heads, keys (n, D) @ q (D, rep): every key row read
    once. The output is a weighted sum of value rows per query head: F.embedding_bag again (see
    model.linear), `bags` saying which rows each head sums. About 1.5x faster than
    scaled_dot_product_attention at 1024 positions on this CPU (bench.py measures decode end to end).
    """
    _, _, H, D = q.shape
    K, max_len = keys.shape[1], keys.shape[2]
    qg = q.reshape(K, H // K, D)  # query heads grouped under their kv head
    scores = torch.bmm(keys[0, :, :n], qg.transpose(1, 2))  # (K, n, rep)
    probs = (scores.transpose(1, 2) * D**-0.5).softmax(dim=-1)  # (K, rep, n): one row per query head
    rows, offsets = bags
    out = F.embedding_bag(rows, values[0].view(K * max_len, D), offsets, mode="sum",
                          per_sample_weights=probs.reshape(-1))  # (H, D)
    return out.view(1, 1, H * D)


class CachedSession:
    """The Session of generate.py on a KV cache: prefill once, then one token per decode step."""

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
