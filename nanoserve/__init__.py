"""nanoserve: an LLM inference engine built from an empty folder, one notebook a day."""

from __future__ import annotations

from pathlib import Path

from .config import CheckpointError, ModelConfig
from .generate import Completion, NoCacheSession, generate, stream_generate
from .model import Llama
from .sampling import SamplingParams
from .tokenizer import Tokenizer
from .weights import load_model

__version__ = "0.1.0"

__all__ = [
    "CheckpointError", "Completion", "Llama", "ModelConfig", "NoCacheSession", "SamplingParams",
    "Tokenizer", "generate", "load", "load_model", "stream_generate",
]


def load(model_dir: str | Path | None = None, dtype=None, pack: bool = True) -> tuple[Llama, Tokenizer]:
    """The model and tokenizer of a checkpoint folder; with no folder, the fetched SmolLM2
    (fetched and converted on first use). `pack`: see `load_model`."""
    import torch

    from .fetch import ensure_model

    folder = Path(model_dir) if model_dir else ensure_model()
    return load_model(folder, dtype or torch.float32, pack=pack), Tokenizer.from_folder(folder)
