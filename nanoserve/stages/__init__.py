"""The course's earlier stages: how generation got to the engine, kept as the course builds them and as
the instruments compare against them. Each produces the engine's greedy tokens (tests prove it); none
of them is a road the package's own API takes.

    sessions       Days 08-21: one sequence, no cache (`NoCacheSession`) or a paged pool (`PagedSession`),
                   and the loop over a session (`stream_session`, `run_session`)
    contiguous     Day 13: a contiguous KV cache (`KVCache`, `CachedSession`)
    static_batch   Days 27-29: a static batch (`BatchedPagedKVCache`, `StaticBatch`, `greedy_generate_batch`)
"""

from .contiguous import CachedSession, CacheFullError, KVCache, cached_session
from .sessions import (
    NoCacheSession,
    PagedSession,
    Session,
    greedy_session_ids,
    paged_session,
    run_session,
    stream_session,
)
from .static_batch import BatchedPagedKVCache, StaticBatch, greedy_generate_batch

__all__ = [
    "BatchedPagedKVCache", "CacheFullError", "CachedSession", "KVCache", "NoCacheSession", "PagedSession",
    "Session", "StaticBatch", "cached_session", "greedy_generate_batch", "greedy_session_ids", "paged_session",
    "run_session", "stream_session",
]
