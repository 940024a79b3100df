"""The engine: the model runner that executes a step (`model_runner`), sessions that run one
sequence (`session`), the static batch (`static_batch`) and the input checks they share (`checks`)."""

from .checks import check_prompt, check_prompts
from .model_runner import ModelRunner
from .session import NoCacheSession, PagedSession, Session, paged_session
from .static_batch import BatchedPagedKVCache, StaticBatch, greedy_generate_batch

__all__ = [
    "BatchedPagedKVCache", "ModelRunner", "NoCacheSession", "PagedSession", "Session", "StaticBatch",
    "check_prompt", "check_prompts", "greedy_generate_batch", "paged_session",
]
