"""Sliding windows in the paged pool: a block table per KV cache group (vLLM V1's hybrid KV cache manager).

One pool of blocks, each holding one group's layers (`groups`); each request has a block table per group.
A full-attention group keeps every block. A sliding group of window W needs, for a step whose first query is at
position p, only the keys p - W + 1 .. p: once a request's tokens are computed (`commit`), the blocks wholly
before its next query's window go back to the pool, their entries in the table become NULL_BLOCK so logical
indices stay. A long request then holds its full groups' context and only about W tokens per sliding group.

The operations are `BlockManager`'s, group by group, all or nothing across the groups:

    match_prefix  a hit needs every block of a full group, and for a sliding group only the blocks under the
                  window of the first token computed after the hit
    append_slots  every group's new blocks (and copies of shared tail blocks, copy-on-write)
    commit        name the newly full blocks (a name per group), then free what the windows left behind
    truncate, fork, free   per group; NULL_BLOCK entries hold nothing

>>> from nanoserve.kv.groups import KVCacheGroup
>>> m = HybridBlockManager([KVCacheGroup((1,)), KVCacheGroup((0,), window=4)], num_blocks=8, block_size=2)
>>> t = m.new_table(); _ = m.append_slots(t, list(range(7))); m.commit(t); t.groups
[[0, 1, 2, 3], [-1, -1, 6, 7]]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from .blocks import BlockManager, OutOfBlocks, RequestTooLarge
from .groups import KVCacheGroup
from .prefix import hash_block

NULL_BLOCK = -1
"""A table entry whose block a sliding window has left behind (vLLM's null block): no block, never read."""


def num_skipped(window: int | None, num_computed: int, block_size: int) -> int:
    """Leading blocks a group no longer needs once num_computed tokens are in: the next query, at position
    num_computed, sees keys from num_computed - window + 1 on (a full group, window None, needs them all)."""
    return 0 if window is None else max(0, num_computed - window + 1) // block_size


def group_hash(h: bytes, group: int) -> bytes:
    """The prefix cache's name of group `group`'s block for the chained hash h: each group's block is its own."""
    return h if group == 0 else hash_block(h, (-group,))


@dataclass
class HybridTable:
    """One sequence's block tables, one per group: groups[g][i] holds group g's layers for tokens i*bs ..
    (i+1)*bs - 1, or is NULL_BLOCK. `skipped[g]`: how many leading entries of group g are NULL_BLOCK."""

    block_size: int
    groups: list[list[int]]
    token_ids: list[int] = field(default_factory=list)  # tokens whose k/v has a slot
    hashes: list[bytes] = field(default_factory=list)  # chained names of the full blocks committed so far
    skipped: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def blocks(self) -> tuple[list[int], ...]:
        """Every group's block ids, as a step's `Chunk.block_table` takes them on a pool of several groups."""
        return tuple(self.groups)

    def slots(self, start: int, end: int) -> list[list[int]]:
        """Each group's pool slots of positions start .. end - 1."""
        bs = self.block_size
        return [[blocks[p // bs] * bs + p % bs for p in range(start, end)] for blocks in self.groups]


class HybridBlockManager(BlockManager):
    """`BlockManager`'s operations on a pool shared by KV cache groups, a table per group per sequence
    (`blocks_needed` counts one group's table entries)."""

    def __init__(self, groups: Sequence[KVCacheGroup], num_blocks: int, block_size: int = 16,
                 prefix_caching: bool = True):
        super().__init__(num_blocks, block_size, prefix_caching)
        self.groups = list(groups)
        self.windows = [g.window for g in self.groups]

    def num_skipped(self, window: int | None, num_computed: int) -> int:
        """`num_skipped` on this pool's block size."""
        return num_skipped(window, num_computed, self.block_size)

    def max_blocks_held(self, num_tokens: int, max_chunk: int | None = None) -> int:
        """The most blocks a sequence of num_tokens holds at once when computed in chunks of at most max_chunk
        tokens: all of a full group's; of a sliding group's, the window before a chunk and the chunk."""
        n, chunk = self.blocks_needed(num_tokens), min(num_tokens, max_chunk or num_tokens)
        return sum(n if w is None else min(n, math.ceil((w - 1 + chunk) / self.block_size) + 1)
                   for w in self.windows)

    def check_fits(self, num_tokens: int, max_chunk: int | None = None) -> None:
        """Refuse up front a sequence that could not fit even if it had the whole pool."""
        need = self.max_blocks_held(num_tokens, max_chunk)
        if need > self.num_blocks:
            raise RequestTooLarge(
                f"a sequence of {num_tokens} tokens holds up to {need} blocks of {self.block_size} tokens over its "
                f"{len(self.groups)} KV cache groups; the pool has {self.num_blocks} blocks in all")

    def new_table(self) -> HybridTable:
        return HybridTable(self.block_size, [[] for _ in self.groups], skipped=[0] * len(self.groups))

    def match_prefix(self, table: HybridTable, prompt: Sequence[int]) -> int:
        """Point an empty table at the cached blocks that start `prompt`; return how many tokens they cover
        (at most len(prompt) - 1). The hit is the longest run of full blocks that every full group has from the
        start and every sliding group has under the window of the first token computed after it."""
        if table.token_ids:
            raise ValueError("match_prefix needs an empty block table")
        cache, bs = self.pool.prefix, self.block_size
        if cache is None:
            return 0
        hashes: list[bytes] = []
        for i in range((len(prompt) - 1) // bs):
            hashes.append(hash_block(hashes[-1] if hashes else None, prompt[i * bs:(i + 1) * bs]))
        found = lambda g, i: cache.get(group_hash(hashes[i], g), prompt[i * bs:(i + 1) * bs])  # noqa: E731
        n = len(hashes)
        for g, w in enumerate(self.windows):
            if w is None:
                n = next((i for i in range(n) if found(g, i) is None), n)
        while n and any(found(g, i) is None for g, w in enumerate(self.windows) if w is not None
                        for i in range(self.num_skipped(w, n * bs), n)):
            n -= 1
        cache.queries += len(hashes)
        cache.hits += n
        for g, (w, blocks) in enumerate(zip(self.windows, table.groups)):
            table.skipped[g] = skip = self.num_skipped(w, n * bs)
            for i in range(n):
                block = found(g, i) if i >= skip else NULL_BLOCK
                if block != NULL_BLOCK:
                    self.pool.incref(block)
                blocks.append(block)
        table.hashes.extend(hashes[:n])
        table.token_ids.extend(prompt[:n * bs])
        return n * bs

    def _copy_on_write(self, table: HybridTable, n: int) -> list[int]:
        """The groups whose shared, partly filled tail block appending n tokens must copy first."""
        start, bs = table.num_tokens, self.block_size
        if n == 0 or start % bs == 0:
            return []
        return [g for g, blocks in enumerate(table.groups) if self.pool.refcount[blocks[-1]] > 1]

    def blocks_to_append(self, table: HybridTable, n: int) -> int:
        """Free blocks that appending n tokens takes, over every group (new blocks and copies)."""
        new = self.blocks_needed(table.num_tokens + n)
        return sum(new - len(blocks) for blocks in table.groups) + len(self._copy_on_write(table, n))

    def append_slots(self, table: HybridTable, token_ids: Sequence[int]
                     ) -> tuple[list[list[int]], list[tuple[int, int]]]:
        """Give the next len(token_ids) positions slots in every group; returns (each group's slots, the block
        copies (src, dst) the storage makes first). All or nothing: on OutOfBlocks nothing changed."""
        start, n = table.num_tokens, len(token_ids)
        need = self.blocks_to_append(table, n)
        if self.num_held(table) + need > self.num_blocks:
            raise RequestTooLarge(f"{start + n} tokens would hold {self.num_held(table) + need} blocks of "
                                  f"{self.block_size} tokens; the pool has {self.num_blocks} blocks in all")
        if not self.pool.can_allocate(need):
            raise OutOfBlocks(need, self.pool.num_free, self.num_blocks)
        copies = []
        for g in self._copy_on_write(table, n):
            blocks = table.groups[g]
            old, (new,) = blocks[-1], self.pool.allocate(1)
            self.pool.free(old)
            blocks[-1] = new
            copies.append((old, new))
        end = self.blocks_needed(start + n)
        for blocks in table.groups:
            blocks.extend(self.pool.allocate(end - len(blocks)))
        table.token_ids.extend(token_ids)
        return table.slots(start, start + n), copies

    def commit(self, table: HybridTable) -> None:
        """Every appended token's k/v is written: name the newly full blocks of each group for later prompts,
        then give back the blocks the sliding windows have left behind (named ones stay cached)."""
        bs, cache = self.block_size, self.pool.prefix
        if cache is not None:
            for i in range(len(table.hashes), table.num_tokens // bs):
                tokens = table.token_ids[i * bs:(i + 1) * bs]
                h = hash_block(table.hashes[-1] if table.hashes else None, tokens)
                for g, blocks in enumerate(table.groups):
                    if blocks[i] != NULL_BLOCK:
                        cache.insert(blocks[i], group_hash(h, g), tokens)
                table.hashes.append(h)
        for g, (w, blocks) in enumerate(zip(self.windows, table.groups)):
            skip = self.num_skipped(w, table.num_tokens)
            for i in range(table.skipped[g], skip):
                self.pool.free(blocks[i])
                blocks[i] = NULL_BLOCK
            table.skipped[g] = max(skip, table.skipped[g])

    def truncate(self, table: HybridTable, num_tokens: int) -> None:
        """Forget the tokens past `num_tokens` and give back the blocks only they used, in every group."""
        committed = len(table.hashes) * self.block_size
        if not committed <= num_tokens <= table.num_tokens:
            raise ValueError(f"truncate to {num_tokens} tokens: must lie between the {committed} committed "
                             f"and the {table.num_tokens} held")
        keep = self.blocks_needed(num_tokens)
        for blocks in table.groups:
            for b in reversed(blocks[keep:]):
                if b != NULL_BLOCK:
                    self.pool.free(b)
            del blocks[keep:]
        del table.token_ids[num_tokens:]

    def fork(self, table: HybridTable) -> HybridTable:
        """A second sequence with the same history: shares every live block of every group, copies nothing."""
        for blocks in table.groups:
            for b in blocks:
                if b != NULL_BLOCK:
                    self.pool.incref(b)
        return HybridTable(self.block_size, [list(b) for b in table.groups], list(table.token_ids),
                           list(table.hashes), list(table.skipped))

    def free(self, table: HybridTable) -> None:
        """Drop the sequence's references in every group, tail first."""
        for blocks in table.groups:
            for b in reversed(blocks):
                if b != NULL_BLOCK:
                    self.pool.free(b)
            blocks.clear()
        table.token_ids.clear()
        table.hashes.clear()
        table.skipped = [0] * len(self.groups)

    def num_held(self, table: HybridTable) -> int:
        """Live blocks in the sequence's tables (shared ones counted once per table that holds them)."""
        return sum(b != NULL_BLOCK for blocks in table.groups for b in blocks)
