"""Where keys and values live in the paged pool: its bookkeeping, no tensors (`blocks`: the pool, block
tables, the block manager), block names for prefix caching (`prefix`) and the tensors (`storage`)."""

from .blocks import BlockManager, BlockPool, BlockTable, OutOfBlocks, RequestTooLarge, check_block_size
from .storage import KVStorage

__all__ = ["BlockManager", "BlockPool", "BlockTable", "KVStorage", "OutOfBlocks", "RequestTooLarge",
           "check_block_size"]
