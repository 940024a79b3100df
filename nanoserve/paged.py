"""The paged KV cache: K/V in fixed-size blocks from one shared pool (Days 16-21).

A contiguous cache reserves max_len positions per sequence up front and wastes
what the sequence never uses. Here memory is a pool of `num_blocks` blocks of
`block_size` token slots; a sequence takes blocks only as it grows, so at most
one partly filled block per sequence is wasted, and sequences with a common
prefix can point at the same blocks.

    BlockPool     which blocks are free, how many users each block has (no tensors)
    BlockTable    one sequence: logical block i -> physical block, and its tokens
    PagedKVCache  the pool plus the storage, k[layer] and v[layer] each
                  (num_blocks, block_size, K, D) as in vLLM; sequence operations
                  (match_prefix, append, commit, fork, free); write and gather
    PagedStep     a forward's metadata (positions, slot mapping, block tables,
                  context lengths), passed explicitly, never a global
    PagedAttention the KVBackend: scatter new k/v into their slots, gather each
                  row's blocks into a contiguous (T, K, D) copy, attend. The gather
                  is the *reference* read that the kernel days replace.
    PagedSession  generate.py's Session on a paged sequence; `fork` shares blocks
    generate_n    n samples of one prompt: one prefill, n-1 forks, copy-on-write

A token at position p lives in slot `table.blocks[p // bs] * bs + p % bs`.

One forward, for any number of rows sharing a cache: `cache.append(table, new_ids)`
for each row (same number of new tokens per row), `step = paged_step(tables, n)`,
`model(ids (B, n), step.positions, PagedAttention(cache, step))`, then
`cache.commit(table)` for each row. Running dry raises OutOfBlocks from `append`
with nothing changed; a sequence that could never fit raises RequestTooLarge.

>>> cache = PagedKVCache(ModelConfig.tiny(), num_blocks=4, block_size=2)
>>> t = cache.new_table(); cache.append(t, [5, 6, 7]).tolist(), t.blocks
([0, 1, 2], [0, 1])
>>> u = cache.fork(t); cache.append(u, [8]).tolist(), u.blocks   # shared tail block copied on write
([5], [0, 2])
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .cache import prefix_attention
from .config import ModelConfig
from .generate import Completion, generate
from .model import Llama
from .prefix import PrefixCache, hash_block
from .sampling import SamplingParams
from .tokenizer import Tokenizer

MAX_BLOCK_SIZE = 256


def check_block_size(block_size: int) -> None:
    """Refuse a block size no pool can have, before anything is sized by it."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"block_size={block_size!r} must be an int in [1, {MAX_BLOCK_SIZE}]")


class OutOfBlocks(RuntimeError):
    """The pool has too few free blocks *right now*. Nothing was changed; the scheduler may
    wait or preempt (Day 33) and try again."""

    def __init__(self, needed: int, free: int, total: int):
        super().__init__(f"out of KV blocks: need {needed}, {free} free of {total} in the pool")
        self.needed, self.free, self.total = needed, free, total


class RequestTooLarge(ValueError):
    """A request that would not fit even in an empty pool: refused up front, never retried."""


class BlockPool:
    """A free list and a reference count per block. Bookkeeping only: the tensors live in PagedKVCache.

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


class PagedKVCache:
    """A BlockPool and its storage for one model: k[layer], v[layer] each (num_blocks, block_size, K, D)."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int = 16,
                 dtype: torch.dtype = torch.float32, prefix_caching: bool = True):
        self.cfg = cfg
        self.pool = BlockPool(num_blocks, block_size, prefix_caching)
        shape = (cfg.n_layers, num_blocks, block_size, cfg.n_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype)  # (L, N, bs, K, D)
        self.v = torch.zeros(shape, dtype=dtype)

    @classmethod
    def for_tokens(cls, cfg: ModelConfig, max_tokens: int, block_size: int = 16, **kw) -> PagedKVCache:
        """A pool just big enough for `max_tokens` tokens of one sequence."""
        return cls(cfg, math.ceil(max_tokens / block_size), block_size, **kw)

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def check_fits(self, num_tokens: int) -> None:
        """Refuse up front a sequence that could not fit even if it had the whole pool."""
        need = self.blocks_needed(num_tokens)
        if need > self.num_blocks:
            raise RequestTooLarge(
                f"a sequence of {num_tokens} tokens needs {need} blocks of {self.block_size} tokens; "
                f"the pool has {self.num_blocks} blocks in all")

    # --- sequence operations (vLLM's BlockManager: allocate/append/fork/free) ---

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

    def append(self, table: BlockTable, token_ids: Sequence[int]) -> Tensor:
        """Give the next len(token_ids) positions slots: allocate blocks as needed and copy a shared
        partly-filled tail block before anyone writes into it. Returns the slots (n,) for the write.
        All or nothing: on OutOfBlocks the table and the pool are unchanged."""
        start, n, bs = table.num_tokens, len(token_ids), self.block_size
        self.check_fits(start + n)
        new = self.blocks_needed(start + n) - len(table.blocks)
        cow = int(n > 0 and start % bs != 0 and self.pool.refcount[table.blocks[-1]] > 1)
        if not self.pool.can_allocate(new + cow):
            raise OutOfBlocks(new + cow, self.pool.num_free, self.num_blocks)
        if cow:
            old, (copy,) = table.blocks[-1], self.pool.allocate(1)
            self.k[:, copy], self.v[:, copy] = self.k[:, old], self.v[:, old]  # (L, bs, K, D) each
            self.pool.free(old)
            table.blocks[-1] = copy
        table.blocks.extend(self.pool.allocate(new))
        table.token_ids.extend(token_ids)
        return torch.tensor(table.slots(start, start + n), dtype=torch.long)

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

    # --- the write path and the reference read ---

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Scatter n new tokens' k/v (n, K, D) into their slots (n,)."""
        K, D = k.shape[-2:]
        self.k[layer].view(-1, K, D).index_copy_(0, slots, k.to(self.k.dtype))
        self.v[layer].view(-1, K, D).index_copy_(0, slots, v.to(self.v.dtype))

    def gather(self, layer: int, blocks: Tensor | Sequence[int], length: int) -> tuple[Tensor, Tensor]:
        """A sequence's first `length` tokens of k and v, copied into contiguous (length, K, D) tensors.
        This copy is the cost Day 20 measures and Week 6 removes."""
        blocks = torch.as_tensor(blocks, dtype=torch.long)[: self.blocks_needed(length)]
        K, D = self.k.shape[-2:]
        k = self.k[layer].index_select(0, blocks).view(-1, K, D)[:length]  # (length, K, D)
        v = self.v[layer].index_select(0, blocks).view(-1, K, D)[:length]
        return k, v


@dataclass(frozen=True)
class PagedStep:
    """What one forward of B rows x T new tokens needs to find its K/V. Built by `paged_step`."""

    positions: Tensor  # (B, T) position of each new token
    slot_mapping: Tensor  # (B, T) pool slot each new token's k/v is written to
    block_tables: Tensor  # (B, max_blocks) physical blocks per row, padded with 0
    context_lens: Tensor  # (B,) tokens each row attends over, new ones included


def paged_step(tables: Sequence[BlockTable], num_new: int) -> PagedStep:
    """The step for rows whose last `num_new` appended tokens are this forward's input."""
    positions = torch.tensor([list(range(t.num_tokens - num_new, t.num_tokens)) for t in tables])
    slots = torch.tensor([t.slots(t.num_tokens - num_new, t.num_tokens) for t in tables])
    width = max(len(t.blocks) for t in tables)
    block_tables = torch.tensor([t.blocks + [0] * (width - len(t.blocks)) for t in tables])
    return PagedStep(positions, slots, block_tables, torch.tensor([t.num_tokens for t in tables]))


def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """T new queries (T, H, D), the last T of n positions, over keys/values (n, K, D) -> (T, H*D).

    The arithmetic after the gather is the contiguous cache's own (`cache.prefix_attention`), so
    paged and contiguous differ only in where K/V live and the copy that gathers them."""
    T, n = q.shape[0], k.shape[0]
    return prefix_attention(q[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], n - T)[0]


class PagedAttention:
    """The KVBackend for a PagedStep: write the new k/v into the pool, then attend over a gathered copy."""

    def __init__(self, cache: PagedKVCache, step: PagedStep):
        self.cache, self.step = cache, step

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        B, T, H, D = q.shape  # k, v: (B, T, K, D)
        s = self.step
        self.cache.write(layer, s.slot_mapping.reshape(-1), k.reshape(B * T, *k.shape[2:]),
                         v.reshape(B * T, *v.shape[2:]))
        rows = []
        for b in range(B):
            kc, vc = self.cache.gather(layer, s.block_tables[b], int(s.context_lens[b]))  # (n, K, D)
            rows.append(attend(q[b], kc, vc))
        return torch.stack(rows)  # (B, T, H*D)


class PagedSession:
    """generate.py's Session on one paged sequence. Several sessions can share one cache."""

    def __init__(self, model: Llama, cache: PagedKVCache):
        self.model, self.cache = model, cache
        self.table = cache.new_table()
        self.last_logits: Tensor | None = None
        self.prompt_computed = 0  # prompt tokens the last prefill actually ran (the rest were prefix hits)

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> Tensor:
        """Logits (V,) after the prompt. A fork that already holds exactly `ids` returns its parent's."""
        if self.last_logits is not None and self.table.token_ids == list(ids):
            return self.last_logits
        self.free()
        self.cache.check_fits(len(ids))
        hit = self.cache.match_prefix(self.table, ids)
        self.prompt_computed = len(ids) - hit
        return self._forward(list(ids[hit:]))

    @torch.inference_mode()
    def decode(self, token: int) -> Tensor:
        return self._forward([token])

    def _forward(self, new_ids: list[int]) -> Tensor:
        self.cache.append(self.table, new_ids)
        step = paged_step([self.table], len(new_ids))
        logits = self.model(torch.tensor([new_ids]), step.positions, PagedAttention(self.cache, step),
                            last_only=True)[0]  # (V,)
        self.cache.commit(self.table)
        self.last_logits = logits
        return logits

    def fork(self) -> PagedSession:
        """A second session with this one's history and blocks (shared, copied on write)."""
        child = PagedSession(self.model, self.cache)
        child.table = self.cache.fork(self.table)
        child.last_logits = self.last_logits
        return child

    def free(self) -> None:
        """Give the blocks back (cached full blocks stay findable until evicted)."""
        self.cache.free(self.table)
        self.last_logits = None


def paged_session(model: Llama, max_len: int, block_size: int = 16, prefix_caching: bool = True) -> PagedSession:
    """A session on its own pool sized for `max_len` tokens: the paged twin of cache.cached_session."""
    cache = PagedKVCache.for_tokens(model.cfg, max_len, block_size, dtype=model.dtype,
                                    prefix_caching=prefix_caching)
    return PagedSession(model, cache)


def generate_n(model: Llama, prompt_ids: list[int], params: SamplingParams, cache: PagedKVCache,
               tokenizer: Tokenizer | None = None) -> list[Completion]:
    """params.n samples of one prompt: the prompt is prefilled once and its blocks are shared by
    every sample. Sample i uses seed params.seed + i, so it equals a solo run with that seed."""
    parent = PagedSession(model, cache)
    parent.prefill(prompt_ids)
    sessions = [parent] + [parent.fork() for _ in range(params.n - 1)]
    outs = []
    for i, session in enumerate(sessions):
        seed = None if params.seed is None else params.seed + i
        outs.append(generate(model, prompt_ids, dataclasses.replace(params, n=1, seed=seed), tokenizer, session))
    for session in sessions:
        session.free()
    return outs
