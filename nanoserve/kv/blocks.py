"""KV blocks without tensors: the pool's bookkeeping (Days 16-17, 19, 21).

A contiguous cache reserves max_len positions per sequence up front and wastes what
the sequence never uses. A paged cache is a pool of `num_blocks` blocks of
`block_size` token slots; a sequence takes blocks only as it grows, so at most one
partly filled block per sequence is wasted, and sequences with a common prefix can
point at the same blocks. Everything here is lists and counts; the tensors those
numbers describe live in `storage.KVStorage`, so a scheduler can plan (can this
request be admitted? whom to preempt?) without touching them.

    BlockPool     which blocks are free, how many users each block has
    BlockTable    one sequence: logical block i -> physical block, and its tokens
    BlockManager  sequence operations on the pool (vLLM's KVCacheManager, nano-vllm's
                  BlockManager): match_prefix, append_slots, commit, truncate, fork, free

A token at position p lives in slot `table.blocks[p // bs] * bs + p % bs`.

>>> m = BlockManager(num_blocks=4, block_size=2)
>>> t = m.new_table(); m.append_slots(t, [5, 6, 7]), t.blocks
(([0, 1, 2], []), [0, 1])
>>> u = m.fork(t); m.append_slots(u, [8]), u.blocks   # the shared tail block is copied on write
(([5], [(1, 2)]), [0, 2])
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..config import MAX_BLOCK_SIZE
from .prefix import PrefixCache, hash_block


def check_block_size(block_size: int) -> None:
    """Refuse a block size no pool can have, before anything is sized by it."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"block_size={block_size!r} must be an int in [1, {MAX_BLOCK_SIZE}]")


class OutOfBlocks(RuntimeError):
    """The pool has too few free blocks *right now*. Nothing was changed; the scheduler may
    wait, or preempt another request, and try again."""

    def __init__(self, needed: int, free: int, total: int):
        super().__init__(f"out of KV blocks: need {needed}, {free} free of {total} in the pool")
        self.needed, self.free, self.total = needed, free, total


class RequestTooLarge(ValueError):
    """A request that would not fit even in an empty pool: refused up front, never retried."""


class BlockPool:
    """A free list and a reference count per block. Bookkeeping only: the tensors live in KVStorage.

    Every block is in exactly one state: free (on the free list), referenced (refcount > 0), or
    cached-evictable (refcount 0, K/V kept for prefix hits, handed out again only when the free list is empty).
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        check_block_size(block_size)
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_list: deque[int] = deque(range(num_blocks))
        self.refcount = [0] * num_blocks
        self.prefix: PrefixCache | None = PrefixCache() if prefix_caching else None

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out: the free list plus unreferenced cached blocks."""
        return len(self.free_list) + (len(self.prefix.evictable) if self.prefix else 0)

    @property
    def num_used(self) -> int:
        """Blocks with at least one user."""
        return self.num_blocks - self.num_free

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int = 1) -> list[int]:
        """n blocks with refcount 1, all or nothing: raises OutOfBlocks before touching anything."""
        if n > self.num_free:
            raise OutOfBlocks(n, self.num_free, self.num_blocks)
        out = [self.free_list.popleft() if self.free_list else self.prefix.evict() for _ in range(n)]
        for b in out:
            self.refcount[b] = 1
        return out

    def incref(self, block: int) -> None:
        """One more user of a live block (fork, prefix hit)."""
        self._check_id(block)
        if self.refcount[block] == 0:
            if not (self.prefix and block in self.prefix.evictable):
                raise ValueError(f"incref of free block {block}: allocate it first")
            self.prefix.unpark(block)  # a cached block comes back into use
        self.refcount[block] += 1

    def free(self, block: int) -> None:
        """One user fewer. At zero the block returns to the free list, or, if it is a named
        full block, stays cached as evictable."""
        self._check_id(block)
        if self.refcount[block] <= 0:
            raise ValueError(f"free of block {block} whose refcount is already 0 (double free)")
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            if self.prefix is not None and block in self.prefix:
                self.prefix.park(block)
            else:
                self.free_list.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's `reset_prefix_cache`): the unreferenced cached blocks go back to the
        free list and no block is found by its tokens any more. Only while no block is in use (a running
        request's blocks keep their names): False, and nothing done, otherwise."""
        if self.prefix is None:
            return True
        if any(self.refcount):
            return False
        parked = list(self.prefix.evictable)
        self.prefix.clear()
        self.free_list.extend(parked)
        return True

    def _check_id(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"block id {block} outside the pool [0, {self.num_blocks})")

    def check(self) -> None:
        """Assert the invariants the property tests rely on (cheap enough to call after every operation)."""
        free = list(self.free_list)
        evictable = list(self.prefix.evictable) if self.prefix else []
        assert len(set(free)) == len(free), "a block is on the free list twice"
        assert all(r >= 0 for r in self.refcount), "negative refcount"
        assert all(self.refcount[b] == 0 for b in free + evictable), "a block is both free and referenced"
        assert not set(free) & set(evictable), "a block is both free and cached"
        referenced = sum(r > 0 for r in self.refcount)
        assert referenced + len(free) + len(evictable) == self.num_blocks, "a block leaked"


@dataclass
class BlockTable:
    """One sequence's view of the pool: blocks[i] holds its tokens i*bs .. (i+1)*bs - 1."""

    block_size: int
    blocks: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # tokens whose k/v has a slot
    hashes: list[bytes] = field(default_factory=list)  # chained names of the full blocks committed so far

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def slot(self, pos: int) -> int:
        """Token position -> pool slot = physical block * block_size + offset."""
        if not 0 <= pos < len(self.blocks) * self.block_size:
            raise IndexError(f"position {pos} has no block (the table holds {len(self.blocks)})")
        return self.blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    def slots(self, start: int, end: int) -> list[int]:
        return [self.slot(p) for p in range(start, end)]


class BlockManager:
    """Sequence operations on a BlockPool. Holds no tensors: it says which slots to write and which
    blocks to copy, and `KVStorage` does it."""

    def __init__(self, num_blocks: int, block_size: int = 16, prefix_caching: bool = True):
        self.pool = BlockPool(num_blocks, block_size, prefix_caching)

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def reset_prefix_cache(self) -> bool:
        """`BlockPool.reset_prefix_cache`: every cached prefix forgotten, unless a block is in use (then False)."""
        return self.pool.reset_prefix_cache()

    def max_blocks_held(self, num_tokens: int, max_chunk: int | None = None) -> int:
        """The most blocks a sequence of num_tokens holds at once: all of them, however it is chunked (the
        `HybridBlockManager` of a model with sliding windows holds fewer)."""
        return self.blocks_needed(num_tokens)

    def check_fits(self, num_tokens: int) -> None:
        """Refuse up front a sequence that could not fit even if it had the whole pool."""
        need = self.blocks_needed(num_tokens)
        if need > self.num_blocks:
            raise RequestTooLarge(
                f"a sequence of {num_tokens} tokens needs {need} blocks of {self.block_size} tokens; "
                f"the pool has {self.num_blocks} blocks in all")

    def new_table(self) -> BlockTable:
        return BlockTable(self.block_size)

    def match_prefix(self, table: BlockTable, prompt: Sequence[int]) -> int:
        """Point an empty table at the cached full blocks that start `prompt`; return how many tokens
        they cover. At most len(prompt) - 1 tokens are reused: the last one is always computed, so the
        prefill has logits to sample from."""
        if table.blocks:
            raise ValueError("match_prefix needs an empty block table")
        if self.pool.prefix is None:
            return 0
        bs = self.block_size
        for i in range((len(prompt) - 1) // bs):
            tokens = prompt[i * bs:(i + 1) * bs]
            h = hash_block(table.hashes[-1] if table.hashes else None, tokens)
            block = self.pool.prefix.find(h, tokens)
            if block is None:
                break
            self.pool.incref(block)
            table.blocks.append(block)
            table.hashes.append(h)
            table.token_ids.extend(tokens)
        return table.num_tokens

    def blocks_to_append(self, table: BlockTable, n: int) -> int:
        """Free blocks that appending n tokens takes: new blocks, plus one if a shared tail must be copied."""
        start, bs = table.num_tokens, self.block_size
        cow = int(n > 0 and start % bs != 0 and self.pool.refcount[table.blocks[-1]] > 1)
        return self.blocks_needed(start + n) - len(table.blocks) + cow

    def append_slots(self, table: BlockTable, token_ids: Sequence[int]) -> tuple[list[int], list[tuple[int, int]]]:
        """Give the next len(token_ids) positions slots, allocating blocks as needed. A shared partly
        filled tail block is replaced by a fresh one before anyone writes into it: the returned
        copies (src, dst) say which blocks' K/V the storage must copy first. Returns (slots, copies).
        All or nothing: on OutOfBlocks the table and the pool are unchanged."""
        start, n = table.num_tokens, len(token_ids)
        self.check_fits(start + n)
        need = self.blocks_to_append(table, n)
        if not self.pool.can_allocate(need):
            raise OutOfBlocks(need, self.pool.num_free, self.num_blocks)
        copies = []
        if need > self.blocks_needed(start + n) - len(table.blocks):  # copy on write
            old, (new,) = table.blocks[-1], self.pool.allocate(1)
            self.pool.free(old)
            table.blocks[-1] = new
            copies.append((old, new))
        table.blocks.extend(self.pool.allocate(self.blocks_needed(start + n) - len(table.blocks)))
        table.token_ids.extend(token_ids)
        return table.slots(start, start + n), copies

    def commit(self, table: BlockTable) -> None:
        """The k/v of every appended token is now written: name the newly full blocks so later
        requests can find them. Called after the forward, so a half-written block is never shared."""
        if self.pool.prefix is None:
            return
        bs = self.block_size
        for i in range(len(table.hashes), table.num_tokens // bs):
            tokens = table.token_ids[i * bs:(i + 1) * bs]
            h = hash_block(table.hashes[-1] if table.hashes else None, tokens)
            self.pool.prefix.insert(table.blocks[i], h, tokens)
            table.hashes.append(h)

    def truncate(self, table: BlockTable, num_tokens: int) -> None:
        """Forget the tokens past `num_tokens` (a speculative step's rejected drafts) and give back the
        blocks only they used, tail first. Committed tokens stay: a named block's tokens cannot change."""
        committed = len(table.hashes) * self.block_size
        if not committed <= num_tokens <= table.num_tokens:
            raise ValueError(f"truncate to {num_tokens} tokens: must lie between the {committed} committed "
                             f"and the {table.num_tokens} held")
        keep = self.blocks_needed(num_tokens)
        for b in reversed(table.blocks[keep:]):
            self.pool.free(b)
        del table.blocks[keep:]
        del table.token_ids[num_tokens:]

    def fork(self, table: BlockTable) -> BlockTable:
        """A second sequence with the same history: shares every block (refcount + 1), copies nothing."""
        for b in table.blocks:
            self.pool.incref(b)
        return BlockTable(self.block_size, list(table.blocks), list(table.token_ids), list(table.hashes))

    def free(self, table: BlockTable) -> None:
        """Drop the sequence's references, tail first, so the tail is evicted before its prefix."""
        for b in reversed(table.blocks):
            self.pool.free(b)
        table.blocks.clear()
        table.token_ids.clear()
        table.hashes.clear()
