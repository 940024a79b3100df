"""`load`: a checkpoint folder or a model's name (or the fetched SmolLM2) as a model and its tokenizer, one call."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from .model import Llama, load_model
from .model.fetch import gguf_of, model_folder
from .tokenizer import Tokenizer

WEIGHTS = ("fp32", "gguf")
ACTIVATIONS = ("fp32", "int8")
KV_CACHE_DTYPES = ("auto", "bfloat16")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def add_cli_arguments(ap: argparse.ArgumentParser, weights: str = "fp32", gguf: bool = False,
                      several_kv: bool = False) -> None:
    """`load`'s options as flags, one set for `generate`, `serve` and the benches (`weights`: --weights' default;
    `gguf`: a --gguf file may be named; `several_kv`: --kv-cache-dtype takes several, a bench's runs of each)."""
    ap.add_argument("--model", help="a checkpoint folder, or a model's name: smollm2-135m, gemma3-270m (fetched and "
                    "converted on first use; default: smollm2-135m)")
    ap.add_argument("--weights", choices=WEIGHTS, default=weights,
                    help=f"fp32: the folder's safetensors; gguf: the GGUF's own blocks (default: {weights})")
    if gguf:
        ap.add_argument("--gguf", help="with --weights gguf: the GGUF file (default: the fetched one)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="bfloat16: the folder's matrices and the K/V cache in bf16 (faster, not exact)")
    ap.add_argument("--activations", choices=ACTIVATIONS, default="fp32",
                    help="int8: with --weights gguf, the blocks multiply int8-rounded activations (llama.cpp's way)")
    kv_help = "bfloat16: the K/V cache in bf16 whatever the weights (half its bytes; not exact)"
    if several_kv:
        ap.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, nargs="+", default=["auto"],
                        help=kv_help + "; several for runs of each")
    else:
        ap.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help=kv_help)


def one_kv(args: argparse.Namespace) -> str:
    """The K/V cache dtype the flags ask for: a bench's several (`several_kv`) are each a run's, the first here."""
    kv = args.kv_cache_dtype
    return kv[0] if isinstance(kv, list) else kv


def from_cli(args: argparse.Namespace) -> tuple[Llama, Tokenizer]:
    """`load` as `add_cli_arguments`' flags ask."""
    return load(args.model, dtype=args.dtype, weights=args.weights, gguf=getattr(args, "gguf", None),
                activations=args.activations, kv_cache_dtype=one_kv(args))


def cli_argv(args: argparse.Namespace) -> list[str]:
    """The flags that load the same model in another process (a `serve` a bench starts)."""
    out = ["--weights", args.weights, "--dtype", args.dtype, "--activations", args.activations,
           "--kv-cache-dtype", one_kv(args)]
    return out + (["--model", str(args.model)] if args.model else [])


def as_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """A `dtype=` argument as a torch dtype: None or "float32" (the exact default), or "bfloat16"."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype={dtype!r}: expected 'float32' or 'bfloat16'")


def load(model_dir: str | Path | None = None, dtype: str | torch.dtype | None = None, pack: bool = True,
         weights: str = "fp32", gguf: str | Path | None = None, activations: str = "fp32",
         kv_cache_dtype: str = "auto") -> tuple[Llama, Tokenizer]:
    """The model and tokenizer of a checkpoint folder, or of a model named in `fetch.MODELS` ("gemma3-270m"); with
    neither, the fetched SmolLM2 (fetched and converted on first use). The folder's architecture picks the
    family's class (`model.registry`). `pack`: see `load_model`; on GGUF blocks, whether int8
    activations read packed copies of them (`load_gguf`).

    `weights="gguf"` keeps the weights as the GGUF file ships them (its blocks, multiplied where they lie:
    `model.gguf_weights`), the file being `gguf` or the one the folder was converted from; the numbers are
    the fp32 folder's, the bytes a fifth (SmolLM2) or a fraction (Gemma 3). `weights="fp32"` reads the
    folder's safetensors.

    `dtype="bfloat16"` (opt-in) holds the folder's matrices and the K/V cache in bf16, products on bf16
    inputs with fp32 sums, the rest fp32 (`Llama.cast_matrices`): faster, no longer the fp32 numbers.

    `activations="int8"` (GGUF blocks only; opt-in) has each product take x rounded to int8 blocks, as
    llama.cpp multiplies them: faster, no longer the fp32 numbers.

    `kv_cache_dtype="bfloat16"` (opt-in; vLLM's name) holds the K/V cache in bf16 whatever the weights
    (`Llama.round_kv`): half the bytes a long context's decode step reads, no longer the fp32 numbers. "auto" keeps
    the model's own: fp32, or bf16 with `dtype="bfloat16"`."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights={weights!r}: expected 'fp32' (the folder's safetensors) or 'gguf' (the blocks)")
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations={activations!r}: expected one of {ACTIVATIONS}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}: expected one of {KV_CACHE_DTYPES}")
    dtype = as_dtype(dtype)
    folder = model_folder(model_dir)
    if weights == "gguf":
        from .model.gguf_weights import load_gguf

        if dtype != torch.float32:
            raise ValueError(f"weights='gguf' multiplies its blocks in float32; dtype={dtype} is not possible")
        model = load_gguf(Path(gguf) if gguf else gguf_of(folder), activations=activations, pack=pack)
    elif activations != "fp32":
        raise ValueError(f"activations={activations!r} multiplies GGUF blocks: it needs weights='gguf'")
    else:
        model = load_model(folder, dtype, pack=pack)
    if kv_cache_dtype != "auto":
        if not hasattr(model, "round_kv"):
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}: {model.cfg.architecture} holds its K/V cache in "
                             "float32 so far")
        model.round_kv(DTYPES[kv_cache_dtype])
    return model, Tokenizer.from_folder(folder)
