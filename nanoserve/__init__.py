"""nanoserve: an LLM inference engine built from an empty folder, one notebook a day.

    config       every configuration: the model's, the KV cache's, the scheduler's, speculative decoding's
    tokenizer, sampling, stopping
                 a request's ends: text to ids and back, choosing tokens, when to stop
    kernels/     the compiled C++ kernels the model and attention call where asked
    kv/          the paged pool: its bookkeeping (no tensors) and its storage
    attention/   causal self-attention, one step's metadata, the paged backend and its implementations
    model/       the Llama decoder, its ops, its weight products, checkpoints, the GGUF's blocks
    engine/      the one generation loop: requests, the scheduler, the model runner, speculative drafts
    stages/      the course's earlier stages (no cache, contiguous cache, paged session, static batch)
    generate, llm, loader
                 the API: one prompt (`generate`), many in vLLM's shapes (`LLM`), `load` a checkpoint
    server/      an OpenAI-compatible HTTP server over the engine
    bench/       instruments: timing, roofline, profiler, benchmark commands
    teach/       helpers the notebooks use to show things
"""

from __future__ import annotations

from .config import CacheConfig, CheckpointError, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from .engine import LLMEngine
from .engine.outputs import CompletionOutput, RequestOutput, StepOutput
from .generate import generate, stream_generate
from .llm import LLM
from .loader import load
from .model import Llama, load_model
from .sampling import SamplingParams
from .tokenizer import Tokenizer

__version__ = "0.1.0"

__all__ = [
    "LLM", "CacheConfig", "CheckpointError", "CompletionOutput", "EngineConfig", "LLMEngine", "Llama", "ModelConfig",
    "RequestOutput", "SamplingParams", "SchedulerConfig", "SpeculativeConfig", "StepOutput", "Tokenizer", "generate",
    "load", "load_model", "stream_generate",
]
