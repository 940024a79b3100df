"""`load`: a checkpoint folder (or the fetched SmolLM2) as a model and its tokenizer, one call."""

from __future__ import annotations

from pathlib import Path

import torch

from .config import nanoserve_home
from .model import Llama, load_model
from .model.fetch import download_gguf, ensure_model
from .tokenizer import Tokenizer

WEIGHTS = ("fp32", "gguf")
ACTIVATIONS = ("fp32", "int8")


def load(model_dir: str | Path | None = None, dtype: torch.dtype | None = None, pack: bool = True,
         weights: str = "fp32", gguf: str | Path | None = None, activations: str = "fp32") -> tuple[Llama, Tokenizer]:
    """The model and tokenizer of a checkpoint folder; with no folder, the fetched SmolLM2
    (fetched and converted on first use). `pack`: see `load_model`.

    `weights="gguf"` keeps the weights as the GGUF file ships them (its Q4_1/Q8_0 blocks, multiplied
    where they lie: `model.gguf_weights`), the file being `gguf` or the fetched one; the numbers are
    the fp32 folder's, the bytes a fifth. `weights="fp32"` reads the folder's safetensors.

    `activations="int8"` (GGUF blocks only; opt-in) has each product take x rounded to int8 blocks, as
    llama.cpp multiplies them: faster, no longer the fp32 numbers."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights={weights!r}: expected 'fp32' (the folder's safetensors) or 'gguf' (the blocks)")
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations={activations!r}: expected one of {ACTIVATIONS}")
    folder = Path(model_dir) if model_dir else ensure_model()
    if weights == "gguf":
        from .model.gguf_weights import load_gguf

        if dtype not in (None, torch.float32):
            raise ValueError(f"weights='gguf' computes in float32; dtype={dtype} is not possible")
        path = Path(gguf) if gguf else download_gguf(nanoserve_home() / "downloads")
        return load_gguf(path, activations=activations), Tokenizer.from_folder(folder)
    if activations != "fp32":
        raise ValueError(f"activations={activations!r} multiplies GGUF blocks: it needs weights='gguf'")
    return load_model(folder, dtype or torch.float32, pack=pack), Tokenizer.from_folder(folder)
