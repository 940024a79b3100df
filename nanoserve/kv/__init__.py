"""Where keys and values are kept: a contiguous cache (`contiguous`, Day 13), and the paged
pool: its bookkeeping (`blocks`), block names for prefix caching (`prefix`) and its tensors (`paged`)."""

from .blocks import BlockManager, BlockPool, BlockTable, OutOfBlocks, RequestTooLarge, check_block_size
from .contiguous import CachedSession, CacheFullError, KVCache, cached_session
from .paged import KVStorage, PagedKVCache

__all__ = [
    "BlockManager", "BlockPool", "BlockTable", "CacheFullError", "CachedSession", "KVCache", "KVStorage",
    "OutOfBlocks", "PagedKVCache", "RequestTooLarge", "cached_session", "check_block_size",
]
