"""The engine: the model runner that executes a step (`model_runner`), sessions that run one
sequence (`session`), the static batch (`static_batch`), the input checks they share (`checks`),
and the scheduled engine: requests (`request`), the scheduler (`scheduler`), `LLMEngine`."""

from .checks import check_prompt, check_prompts
from .llm_engine import LLMEngine, RequestOutput, StepRecord
from .model_runner import ModelRunner
from .request import FinishReason, Request, RequestStatus
from .scheduler import ScheduledChunk, Scheduler, SchedulerConfig, SchedulerOutput
from .session import NoCacheSession, PagedSession, Session, paged_session
from .static_batch import BatchedPagedKVCache, StaticBatch, greedy_generate_batch

__all__ = [
    "BatchedPagedKVCache", "FinishReason", "LLMEngine", "ModelRunner", "NoCacheSession", "PagedSession", "Request",
    "RequestOutput", "RequestStatus", "ScheduledChunk", "Scheduler", "SchedulerConfig", "SchedulerOutput", "Session",
    "StaticBatch", "StepRecord", "check_prompt", "check_prompts", "greedy_generate_batch", "paged_session",
]
