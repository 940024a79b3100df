"""The paged pool's tensors (Days 17-19): what the block manager's numbers describe.

`KVStorage` holds k[slot] and v[slot], each (num_blocks, block_size, K, D) as in vLLM, one slot per layer of a
KV cache group (`groups`): a block holds one group's layers, so with one group of every layer (the default)
slot is layer. It does the three things done to them: write new tokens' k/v into their slots, copy blocks
(copy-on-write), and gather a sequence's blocks into a contiguous copy (the reference read). The bookkeeping (which
block is free, which sequence holds which) is `blocks.BlockManager`'s, and holds no tensors: the
scheduler plans with the manager, the model runner owns the storage.

>>> from nanoserve.kv.blocks import BlockManager
>>> manager, storage = BlockManager(num_blocks=4, block_size=2), KVStorage(ModelConfig.tiny(), 4, 2)
>>> t = manager.new_table(); manager.append_slots(t, [5, 6, 7]), t.blocks
(([0, 1, 2], []), [0, 1])
>>> u = manager.fork(t); slots, copies = manager.append_slots(u, [8]); storage.copy_blocks(copies); copies
[(1, 2)]
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ..config import ModelConfig
from .groups import KVCacheGroup, single_group


class KVStorage:
    """k[slot], v[slot] each (num_blocks, block_size, K, D): the pool's tensors. Layer l of the model lives in
    slot `layer_slot[l]` of the blocks of its group `layer_group[l]`'s block table."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, groups: Sequence[KVCacheGroup] | None = None):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.groups = list(groups) if groups is not None else single_group(cfg)
        per = len(self.groups[0].layers)
        if any(len(g.layers) != per for g in self.groups) or \
                sorted(i for g in self.groups for i in g.layers) != list(range(cfg.n_layers)):
            raise ValueError(f"KV cache groups must share out the {cfg.n_layers} layers in groups of one size")
        self.layer_group, self.layer_slot = [0] * cfg.n_layers, [0] * cfg.n_layers
        for g, group in enumerate(self.groups):
            for s, layer in enumerate(group.layers):
                self.layer_group[layer], self.layer_slot[layer] = g, s
        shape = (per, num_blocks, block_size, cfg.n_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # (L / groups, N, bs, K, D)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def layer(self, layer: int) -> tuple[Tensor, Tensor]:
        """Layer `layer`'s k and v pools, (num_blocks, bs, K, D) each, indexed by its group's block ids."""
        s = self.layer_slot[layer]
        return self.k[s], self.v[s]

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Scatter n new tokens' k/v (n, K, D) into their slots (n,)."""
        K, D = k.shape[-2:]
        k_pool, v_pool = self.layer(layer)
        k_pool.view(-1, K, D).index_copy_(0, slots, k.to(self.k.dtype))
        v_pool.view(-1, K, D).index_copy_(0, slots, v.to(self.v.dtype))

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy every slot's K/V of block src into block dst, for each (src, dst): copy-on-write. The one
        place block copies happen (the model runner calls it before a step's forward)."""
        for src, dst in copies:
            self.k[:, dst], self.v[:, dst] = self.k[:, src], self.v[:, src]  # (L / groups, bs, K, D) each

    def gather(self, layer: int, blocks: Tensor | Sequence[int], length: int) -> tuple[Tensor, Tensor]:
        """A sequence's first `length` tokens of k and v, copied into contiguous (length, K, D) tensors.
        The copy is the cost Day 20 measures and the compiled attention avoids."""
        bs = self.k.shape[2]
        blocks = torch.as_tensor(blocks, dtype=torch.long)[: math.ceil(length / bs)]
        K, D = self.k.shape[-2:]
        k_pool, v_pool = self.layer(layer)
        k = k_pool.index_select(0, blocks).view(-1, K, D)[:length]  # (length, K, D)
        v = v_pool.index_select(0, blocks).view(-1, K, D)[:length]
        return k, v
