"""The engine: requests (`request`), the scheduler that plans each step and does its bookkeeping
(`scheduler`) and what a step costs it under a time-per-token target (`step_cost`), the model runner that
executes it (`model_runner`), prompt-lookup drafting for speculative decoding (`spec`), the input checks every
road shares (`checks`), what a step hands back (`outputs`), and `LLMEngine`, the one loop every road of the
package runs through."""

from ..config import EngineConfig, SchedulerConfig, SpeculativeConfig
from .checks import check_prompt, check_prompts
from .llm_engine import LLMEngine, StepRecord
from .model_runner import ModelRunner
from .outputs import CompletionOutput, RequestOutput, StepOutput
from .request import FinishReason, Request, RequestStatus
from .scheduler import ScheduledChunk, Scheduler, SchedulerOutput

__all__ = [
    "CompletionOutput", "EngineConfig", "FinishReason", "LLMEngine", "ModelRunner", "Request", "RequestOutput",
    "RequestStatus", "ScheduledChunk", "Scheduler", "SchedulerConfig", "SchedulerOutput", "SpeculativeConfig",
    "StepOutput", "StepRecord", "check_prompt", "check_prompts",
]
