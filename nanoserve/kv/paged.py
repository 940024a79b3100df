"""The paged KV cache: a BlockManager and the storage it describes (Days 16-21).

`KVStorage` holds the tensors, k[layer] and v[layer] each (num_blocks, block_size, K, D)
as in vLLM, and does the three things done to them: write new tokens' k/v into their
slots, copy blocks (copy-on-write), and gather a sequence's blocks into a contiguous copy
(the reference read). `PagedKVCache` is the block manager with its storage attached: its
bookkeeping is the manager's, and `append` applies the copies the manager asks for.

>>> cache = PagedKVCache(ModelConfig.tiny(), num_blocks=4, block_size=2)
>>> t = cache.new_table(); cache.append(t, [5, 6, 7]).tolist(), t.blocks
([0, 1, 2], [0, 1])
>>> u = cache.fork(t); cache.append(u, [8]).tolist(), u.blocks   # shared tail block copied on write
([5], [0, 2])
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ..config import ModelConfig
from .blocks import BlockManager, BlockTable


class KVStorage:
    """k[layer], v[layer] each (num_blocks, block_size, K, D): the pool's tensors."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None):
        shape = (cfg.n_layers, num_blocks, block_size, cfg.n_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # (L, N, bs, K, D)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Scatter n new tokens' k/v (n, K, D) into their slots (n,)."""
        K, D = k.shape[-2:]
        self.k[layer].view(-1, K, D).index_copy_(0, slots, k.to(self.k.dtype))
        self.v[layer].view(-1, K, D).index_copy_(0, slots, v.to(self.v.dtype))

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy every layer's K/V of block src into block dst, for each (src, dst): copy-on-write."""
        for src, dst in copies:
            self.k[:, dst], self.v[:, dst] = self.k[:, src], self.v[:, src]  # (L, bs, K, D) each

    def gather(self, layer: int, blocks: Tensor | Sequence[int], length: int) -> tuple[Tensor, Tensor]:
        """A sequence's first `length` tokens of k and v, copied into contiguous (length, K, D) tensors.
        The copy is the cost Day 20 measures and the compiled attention avoids."""
        bs = self.k.shape[2]
        blocks = torch.as_tensor(blocks, dtype=torch.long)[: math.ceil(length / bs)]
        K, D = self.k.shape[-2:]
        k = self.k[layer].index_select(0, blocks).view(-1, K, D)[:length]  # (length, K, D)
        v = self.v[layer].index_select(0, blocks).view(-1, K, D)[:length]
        return k, v


class PagedKVCache(BlockManager):
    """A BlockManager with its KVStorage: the bookkeeping, and the tensors it describes."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int = 16,
                 dtype: torch.dtype = torch.float32, prefix_caching: bool = True):
        super().__init__(num_blocks, block_size, prefix_caching)
        self.cfg = cfg
        self.storage = KVStorage(cfg, num_blocks, block_size, dtype)

    @classmethod
    def for_tokens(cls, cfg: ModelConfig, max_tokens: int, block_size: int = 16, **kw) -> PagedKVCache:
        """A pool just big enough for `max_tokens` tokens of one sequence."""
        return cls(cfg, math.ceil(max_tokens / block_size), block_size, **kw)

    @property
    def k(self) -> Tensor:
        return self.storage.k

    @property
    def v(self) -> Tensor:
        return self.storage.v

    def append(self, table: BlockTable, token_ids: Sequence[int]) -> Tensor:
        """`append_slots`, with the copy-on-write copies done: the slots (n,) the new tokens' k/v go to."""
        slots, copies = self.append_slots(table, token_ids)
        self.storage.copy_blocks(copies)
        return torch.tensor(slots, dtype=torch.long)

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        self.storage.write(layer, slots, k, v)

    def gather(self, layer: int, blocks: Tensor | Sequence[int], length: int) -> tuple[Tensor, Tensor]:
        return self.storage.gather(layer, blocks, length)
