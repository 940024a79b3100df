"""Prefix caching: finding a full block of K/V by the tokens that produced it (Day 21).

A block's K/V depends on its own tokens *and on every token before them*, so a
block is named by a hash chained to its parent block's hash:

    h_0 = H(tokens[0:bs]),  h_i = H(h_{i-1}, tokens[i*bs:(i+1)*bs])

Two requests that share a system prompt produce the same chain for the shared
full blocks, so the second one finds the first one's blocks and skips their
prefill. A hash is only a pointer: on a hit the block's stored tokens are
compared token by token before it is reused, so a collision can cost a miss but
never a wrong answer.

A cached block whose last user is gone keeps its K/V and stays findable; it is
*evictable*, and the pool hands it out again (forgetting its hash) only when the
free list is empty, least recently used first. `BlockPool` in `blocks.py` owns
the free list and the reference counts; this class only remembers names.

>>> h0 = hash_block(None, [1, 2])
>>> h0 == hash_block(None, [1, 2]), h0 == hash_block(hash_block(None, [9, 9]), [1, 2])
(True, False)
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence


def hash_block(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """The chained name of a full block: 16 bytes of BLAKE2b over the parent's name and the tokens."""
    h = hashlib.blake2b(parent or b"\x00", digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def chain_hashes(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """The chained hash of every *full* block of `tokens` (a partial tail block has no name)."""
    out: list[bytes] = []
    for i in range(len(tokens) // block_size):
        out.append(hash_block(out[-1] if out else None, tokens[i * block_size:(i + 1) * block_size]))
    return out


class PrefixCache:
    """hash -> block for full blocks whose K/V is written, plus the LRU order of the unreferenced ones."""

    def __init__(self) -> None:
        self.by_hash: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.tokens_of: dict[int, tuple[int, ...]] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # refcount-0 cached blocks, oldest first
        self.queries = 0  # full blocks looked up
        self.hits = 0  # ... and found
        self.evictions = 0  # cached blocks forgotten to make room

    def __len__(self) -> int:
        return len(self.by_hash)

    def __contains__(self, block: int) -> bool:
        return block in self.hash_of

    def find(self, h: bytes, tokens: Sequence[int]) -> int | None:
        """The block cached under `h` if its tokens are exactly `tokens`, else None. Counts the query."""
        self.queries += 1
        block = self.get(h, tokens)
        self.hits += block is not None
        return block

    def get(self, h: bytes, tokens: Sequence[int]) -> int | None:
        """`find` without counting: a look-up that is not a query of its own (a group's block of a hit)."""
        block = self.by_hash.get(h)
        return None if block is None or self.tokens_of[block] != tuple(tokens) else block

    def insert(self, block: int, h: bytes, tokens: Sequence[int]) -> bool:
        """Name a freshly written full block. False if that content is already cached under another block
        (two requests computed it at once): the first one stays the findable copy."""
        if h in self.by_hash or block in self.hash_of:
            return False
        self.by_hash[h] = block
        self.hash_of[block] = h
        self.tokens_of[block] = tuple(tokens)
        return True

    def park(self, block: int) -> None:
        """The block's last user left: keep it, as the most recently used evictable block."""
        self.evictable[block] = None
        self.evictable.move_to_end(block)

    def unpark(self, block: int) -> None:
        """A parked block was hit: it is in use again and may not be evicted."""
        del self.evictable[block]

    def evict(self) -> int:
        """Forget the least recently used unreferenced block and return it for reuse."""
        block, _ = self.evictable.popitem(last=False)
        del self.by_hash[self.hash_of.pop(block)]
        del self.tokens_of[block]
        self.evictions += 1
        return block

    def clear(self) -> None:
        """Forget every name and every parked block (the counters stay)."""
        self.by_hash.clear()
        self.hash_of.clear()
        self.tokens_of.clear()
        self.evictable.clear()

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0
