"""KV cache groups: which layers share a block table (vLLM V1's `KVCacheGroupSpec`).

A full-attention layer keeps every position; a sliding layer of window W needs only its last W. Layers are cut
into groups of the same size, each of one kind, so that one pool of equal blocks serves them all: a block holds
one group's layers, and each group has its own block table per request. A sliding group gives back the blocks
its window has left behind while the request runs; a full group keeps them. A model whose layers are all full
is one group of every layer: one block table, today's pool.

>>> [(g.layers, g.window) for g in kv_cache_groups(ModelConfig.tiny_gemma3())]
[((2,), None), ((0,), 8), ((1,), 8)]
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import ModelConfig


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table per request: all full attention (window None) or all of one window."""

    layers: tuple[int, ...]
    window: int | None = None


def kv_cache_groups(cfg: ModelConfig) -> list[KVCacheGroup]:
    """The model's layers cut into equal groups of one kind each, full-attention groups first. The group size is
    the gcd of the kinds' layer counts, so no group is padded: Gemma 3 270M's 3 full and 15 sliding layers are
    six groups of 3."""
    kinds: dict[int | None, list[int]] = {}
    for layer in range(cfg.n_layers):
        kinds.setdefault(cfg.window(layer), []).append(layer)
    size = math.gcd(*map(len, kinds.values()))
    order = sorted(kinds, key=lambda w: (w is not None, w or 0))
    return [KVCacheGroup(tuple(kinds[w][i:i + size]), w) for w in order for i in range(0, len(kinds[w]), size)]


def single_group(cfg: ModelConfig) -> list[KVCacheGroup]:
    """Every layer in one full-attention group: one block table for all layers (windows read, nothing freed)."""
    return [KVCacheGroup(tuple(range(cfg.n_layers)))]
