"""nanoserve: an LLM inference engine built from an empty folder, one notebook a day.

    config, tokenizer, sampling, stopping, generate
                 a request's ends: settings, text, choosing tokens, when to stop, the loop
    llm          the offline API in vLLM's shapes: LLM(...).generate(prompts, SamplingParams(...))
    spec         prompt-lookup speculative decoding: plain greedy's tokens in fewer forwards
    model/       the Llama decoder, its ops, its weight products, checkpoints
    kernels/     the compiled C++ kernels the model and attention call where they can
    kv/          where keys and values live: a contiguous cache, the paged pool's blocks and storage
    attention/   one step's metadata and the paged attention backend
    engine/      the model runner, sessions, the static batch, the scheduler and LLMEngine
    bench/       instruments: timing, roofline, profiler, benchmark commands
    teach/       helpers the notebooks use to show things
"""

from __future__ import annotations

from pathlib import Path

from .config import CheckpointError, ModelConfig
from .engine import NoCacheSession, PagedSession
from .generate import Completion, generate, stream_generate
from .llm import LLM, CompletionOutput, RequestOutput
from .model import Llama, load_model
from .sampling import SamplingParams
from .tokenizer import Tokenizer

__version__ = "0.1.0"

__all__ = [
    "LLM", "CheckpointError", "Completion", "CompletionOutput", "Llama", "ModelConfig", "NoCacheSession",
    "PagedSession", "RequestOutput", "SamplingParams", "Tokenizer", "generate", "load", "load_model", "stream_generate",
]


def load(model_dir: str | Path | None = None, dtype=None, pack: bool = True, weights: str = "fp32",
         gguf: str | Path | None = None) -> tuple[Llama, Tokenizer]:
    """The model and tokenizer of a checkpoint folder; with no folder, the fetched SmolLM2
    (fetched and converted on first use). `pack`: see `load_model`.

    `weights="gguf"` keeps the weights as the GGUF file ships them (its Q4_1/Q8_0 blocks, multiplied
    where they lie: `model.gguf_weights`), the file being `gguf` or the fetched one; the numbers are
    the fp32 folder's, the bytes a fifth. `weights="fp32"` reads the folder's safetensors."""
    import torch

    from .model.fetch import download_gguf, ensure_model

    if weights not in ("fp32", "gguf"):
        raise ValueError(f"weights={weights!r}: expected 'fp32' (the folder's safetensors) or 'gguf' (the blocks)")
    folder = Path(model_dir) if model_dir else ensure_model()
    if weights == "gguf":
        from .config import nanoserve_home
        from .model.gguf_weights import load_gguf

        if dtype not in (None, torch.float32):
            raise ValueError(f"weights='gguf' computes in float32; dtype={dtype} is not possible")
        path = Path(gguf) if gguf else download_gguf(nanoserve_home() / "downloads")
        return load_gguf(path), Tokenizer.from_folder(folder)
    return load_model(folder, dtype or torch.float32, pack=pack), Tokenizer.from_folder(folder)
