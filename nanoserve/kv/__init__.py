"""Where keys and values live in the paged pool: its bookkeeping, no tensors (`blocks`: the pool, block
tables, the block manager; `groups` and `hybrid`: a block table per group of layers, so sliding windows give
blocks back), block names for prefix caching (`prefix`) and the tensors (`storage`)."""

from .blocks import BlockManager, BlockPool, BlockTable, OutOfBlocks, RequestTooLarge, check_block_size
from .groups import KVCacheGroup, kv_cache_groups
from .hybrid import HybridBlockManager, HybridTable
from .storage import KVStorage

__all__ = ["BlockManager", "BlockPool", "BlockTable", "HybridBlockManager", "HybridTable", "KVCacheGroup",
           "KVStorage", "OutOfBlocks", "RequestTooLarge", "check_block_size", "kv_cache_groups"]
