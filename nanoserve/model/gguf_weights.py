"""The checkpoint as shipped: a model whose matrices are the GGUF file's own blocks (Day 25).

`fetch` turns the GGUF into an fp32 folder (538 MB of weights for SmolLM2); this module keeps the file's
blocks instead (SmolLM2's Q4_1 and Q8_0, a fifth of the bytes; Gemma 3's Q5_0, Q8_0, Q4_K and Q6_K) as
`BlockWeight`s, which `linear` multiplies where they lie. The numbers are the same: a block expands to
exactly what the conversion wrote. With `activations="int8"` (opt-in, `set_activations`) the products take x
quantized to int8 blocks instead, as llama.cpp computes them: faster at batch 1, and no longer the fp32
conversion's numbers. Like the conversion, it undoes llama.cpp's q/k row permutation (Llama's), here on whole
rows of blocks (a block lies within a row), and fuses q/k/v and gate/up by stacking their rows. What goes where
is each family's: `place_llama` here, `Gemma3.place_gguf` in its own file.

    >>> model = load_gguf(fetch.download_gguf(nanoserve_home() / "downloads"))   # doctest: +SKIP
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..config import CheckpointError, ModelConfig
from ..kernels import side_by_side
from ..kernels.quant import dequantize
from .base import DecoderLM, set_weight
from .fetch import family_converter, unpermute_rope_rows
from .gguf_file import GGUFFile
from .llama import Llama
from .matmul import ACTIVATIONS, BlockWeight, RowGroups
from .registry import ModelRegistry

BLOCK_TYPES = {"Q4_1": "q4_1", "Q8_0": "q8_0", "Q5_0": "q5_0", "Q4_K": "q4_k", "Q6_K": "q6_k"}
"""GGUF tensor types `BlockWeight` multiplies as they lie; a matrix of any other type is expanded to fp32."""


class Tensors:
    """A GGUF file's tensors by name, as a family's loader asks for them: matrices (blocks where the file has a
    format `BlockWeight` multiplies, else fp32, each such expansion noted for `expanded`) and fp32 vectors."""

    def __init__(self, reader: GGUFFile, path: Path):
        self.path, self.by_name = path, {t.name: t for t in reader.tensors}
        self.expanded: dict[str, list[str]] = {}  # GGUF type -> the matrices expanded to fp32

    def _get(self, name: str):
        if name not in self.by_name:
            raise CheckpointError(f"{self.path.name}: tensor {name!r} is missing")
        return self.by_name[name]

    def rows(self, name: str, heads: int | None = None) -> tuple[np.ndarray, str | None]:
        """A matrix's rows: (rows, bytes) uint8 blocks and their format, or (rows, in) fp32 for any other type;
        `heads`: llama.cpp's q/k row permutation undone for that many heads."""
        t = self._get(name)
        fmt = BLOCK_TYPES.get(t.tensor_type.name)
        if fmt is not None:
            a = np.asarray(t.data)  # (rows, in / weights a block * bytes)
        else:
            from gguf.quants import dequantize

            if t.tensor_type.name not in ("F32", "F16", "BF16"):
                self.expanded.setdefault(t.tensor_type.name, []).append(name)
            a = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
            a = a.reshape([int(x) for x in reversed(t.shape)])
        if heads is not None:
            a = unpermute_rope_rows(a, heads)
        return a, fmt

    def matrix(self, names: list[str], shape: tuple[int, int], what: str, heads: list[int | None] | None = None,
               ) -> BlockWeight | RowGroups | nn.Parameter:
        """The tensors `names` stacked by rows into one (out, in) matrix (`_matrix`)."""
        return _matrix([self.rows(n, h) for n, h in zip(names, heads or [None] * len(names))], shape, what)

    def vector(self, name: str) -> torch.Tensor:
        return torch.from_numpy(self.rows(name)[0].astype(np.float32).reshape(-1))

    def note_expanded(self) -> None:
        """One line per GGUF type that was expanded to fp32 for want of a kernel: what, how many, how big."""
        for kind, names in self.expanded.items():
            mb = sum(int(np.prod(self.by_name[n].shape)) for n in names) * 4 / 1e6
            warnings.warn(f"{self.path.name}: {len(names)} {kind} matrices ({names[0]}, ...) have no block kernel; "
                          f"expanded to fp32 ({mb:.1f} MB)", stacklevel=3)


def _matrix(parts: list[tuple[np.ndarray, str | None]], shape: tuple[int, int], what: str
            ) -> BlockWeight | RowGroups | nn.Parameter:
    """Row groups stacked into one (out, in) matrix: one `BlockWeight` if every group is blocks of one format,
    `RowGroups` if they are blocks of several, else an fp32 weight laid out as `linear_weight` lays it."""
    fmts = [fmt for _, fmt in parts]
    try:
        if None in fmts:
            rows = [torch.from_numpy(np.array(a)) if fmt is None else dequantize(torch.from_numpy(np.array(a)), fmt)
                    for a, fmt in parts]
            w: BlockWeight | RowGroups | nn.Parameter = nn.Parameter(torch.cat(rows).t().contiguous().t(),
                                                                     requires_grad=False)
        elif len(set(fmts)) == 1:  # np.concatenate copies: the file's map is read-only
            w = BlockWeight(torch.from_numpy(np.concatenate([a for a, _ in parts])), fmts[0], shape[1])
        else:
            w = RowGroups([BlockWeight(torch.from_numpy(np.array(a)), fmt, shape[1]) for a, fmt in parts])
    except ValueError as e:
        raise CheckpointError(f"{what}: {e}") from None
    if tuple(w.shape) != shape:
        raise CheckpointError(f"{what} has shape {tuple(w.shape)}, the config says {shape}")
    return w


def set_activations(model: DecoderLM, activations: str) -> DecoderLM:
    """What every block matrix of `model` multiplies, in place: "fp32" (x as it is) or "int8" (x rounded to
    int8 blocks first, `kernels.int8`). The token table's lookup is the same either way."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations={activations!r}: expected one of {ACTIVATIONS}")
    blocks = model.block_weights()
    if activations != "fp32" and not blocks:
        raise ValueError(f"activations={activations!r} needs a model on GGUF blocks (weights='gguf')")
    for w in blocks:
        w.activations = activations
    return pack_int8(model)


def pack_int8(model: DecoderLM) -> DecoderLM:
    """Make every int8 block matrix's packed copy now (`BlockWeight.int8_packed`), all of them side by side in one
    buffer on 2 MB pages (`kernels.side_by_side`): a decode step streams them all, and on 4 KB pages it would
    cross a page translation every 4 KB. Matrices off int8 activations, or without packed copies here, are left."""
    mats = [w for w in model.block_weights() if w.int8_packed() is not None]
    for w, packed in zip(mats, side_by_side([w.int8_packed() for w in mats]) if mats else []):
        w.keep_int8_packed(packed)
    return model


def to_blocks(model: Llama, fmt: str = "q4_1", head_fmt: str = "q8_0", activations: str = "fp32") -> Llama:
    """Quantize a model's matrices into blocks in place (`BlockWeight.quantize`), the head (and tied table)
    to `head_fmt`, as the shipped file has them: for models that did not come as GGUF, and for tests."""
    with torch.no_grad():
        head = BlockWeight.quantize(model.lm_head.detach(), head_fmt)
        if model.cfg.tie_word_embeddings:
            set_weight(model, "embed", head)
        set_weight(model, "lm_head", head)
        for blk in model.layers:
            for name in ("wqkv", "wo", "w_gate_up", "w_down"):
                set_weight(blk, name, BlockWeight.quantize(getattr(blk, name).detach(), fmt))
    return set_activations(model, activations)


def load_gguf(path: str | Path, cfg: ModelConfig | None = None, activations: str = "fp32",
              pack: bool = True) -> DecoderLM:
    """The model of a GGUF file on its blocks, in eval mode: its family's class (`model.registry`), matrices
    `BlockWeight`s where the file holds a format `BLOCK_TYPES` names (`RowGroups` where a fused matrix's parts
    differ; another type is expanded to fp32, with one line saying so), norms fp32; `activations`: what the
    blocks multiply (`set_activations`); `pack=False`: no packed copies for int8 activations (their bytes
    saved, their speed given up: `BlockWeight.int8_packed`)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: GGUF file not found")
    try:
        reader = GGUFFile(path)
    except Exception as e:  # ValueError, struct's and numpy's errors on a file cut short
        raise CheckpointError(f"{path}: not a readable GGUF file ({e})") from None
    try:
        family = family_converter(reader)
        cfg = cfg or family.gguf_config(reader)
    except ValueError as e:
        raise CheckpointError(f"{path.name}: {e}") from None
    tensors = Tensors(reader, path)
    model = ModelRegistry.resolve_model_cls(cfg.architecture)(cfg)
    with torch.no_grad():
        place_llama(model, tensors) if isinstance(model, Llama) else model.place_gguf(tensors)
    tensors.note_expanded()
    for w in model.block_weights():
        w.keep_packed = pack
    return set_activations(model, activations).eval()


def place_llama(model: Llama, t: Tensors) -> None:
    """Llama's GGUF tensors into `model`: q/k un-permuted, q/k/v and gate/up stacked as the conversion fuses them."""
    cfg = model.cfg
    C, D, F_ = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    H, K = cfg.n_heads, cfg.n_kv_heads
    set_weight(model, "embed", t.matrix(["token_embd.weight"], (cfg.vocab_size, C), "token_embd"))
    set_weight(model, "lm_head", model.embed if cfg.tie_word_embeddings else t.matrix(
        ["output.weight"], (cfg.vocab_size, C), "output"))
    model.norm.copy_(t.vector("output_norm.weight"))
    for i, blk in enumerate(model.layers):
        p = f"blk.{i}."
        blk.attn_norm.copy_(t.vector(p + "attn_norm.weight"))
        blk.mlp_norm.copy_(t.vector(p + "ffn_norm.weight"))
        set_weight(blk, "wqkv", t.matrix([p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"],
                                         ((H + 2 * K) * D, C), p + "attn_qkv", heads=[H, K, None]))
        set_weight(blk, "wo", t.matrix([p + "attn_output.weight"], (C, H * D), p + "attn_output"))
        set_weight(blk, "w_gate_up", t.matrix([p + "ffn_gate.weight", p + "ffn_up.weight"], (2 * F_, C),
                                              p + "ffn_gate_up"))
        set_weight(blk, "w_down", t.matrix([p + "ffn_down.weight"], (C, F_), p + "ffn_down"))
