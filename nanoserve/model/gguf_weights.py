"""The checkpoint as shipped: a `Llama` whose matrices are the GGUF file's own blocks (Day 25).

`fetch` turns the GGUF into an fp32 folder (538 MB of weights); this module keeps the file's
Q4_1 and Q8_0 blocks instead (a fifth of the bytes) as `BlockWeight`s, which `linear` multiplies
where they lie. The numbers are the same: a block expands to exactly what the conversion wrote.
With `activations="int8"` (opt-in, `set_activations`) the products take x quantized to int8 blocks
instead, as llama.cpp computes them: faster at batch 1, and no longer the fp32 conversion's numbers.
Like the conversion, it undoes llama.cpp's q/k row permutation, here on whole rows of blocks
(a block lies within a row), and fuses q/k/v and gate/up by stacking their rows.

    >>> model = load_gguf(fetch.download_gguf(nanoserve_home() / "downloads"))   # doctest: +SKIP
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..config import CheckpointError, ModelConfig
from ..kernels import side_by_side
from ..kernels.quant import dequantize
from .fetch import gguf_config, unpermute_rope_rows
from .gguf_file import GGUFFile
from .llama import Llama
from .matmul import ACTIVATIONS, BlockWeight

BLOCK_TYPES = {"Q4_1": "q4_1", "Q8_0": "q8_0"}  # GGUF tensor types `BlockWeight` multiplies as they are


def _rows(t, heads: int | None) -> tuple[np.ndarray, str | None]:
    """A tensor's rows: (rows, bytes) uint8 blocks and their format, or (rows, in) fp32 for any other type."""
    fmt = BLOCK_TYPES.get(t.tensor_type.name)
    if fmt is not None:
        a = np.asarray(t.data)  # (rows, in / 32 * bytes)
    else:
        from gguf.quants import dequantize

        a = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        a = a.reshape([int(x) for x in reversed(t.shape)])
    if heads is not None:
        a = unpermute_rope_rows(a, heads)
    return a, fmt


def _matrix(parts: list[tuple[np.ndarray, str | None]], shape: tuple[int, int], what: str
            ) -> BlockWeight | nn.Parameter:
    """Row groups stacked into one (out, in) matrix: blocks if every group is blocks of one format,
    else an fp32 weight laid out as `linear_weight` lays it."""
    fmts = {fmt for _, fmt in parts}
    try:
        if len(fmts) == 1 and None not in fmts:
            blocks = torch.from_numpy(np.concatenate([a for a, _ in parts]))  # a copy: the file's map is read-only
            w: BlockWeight | nn.Parameter = BlockWeight(blocks, fmts.pop(), shape[1])
        else:
            rows = [torch.from_numpy(np.array(a)) if fmt is None else dequantize(torch.from_numpy(np.array(a)), fmt)
                    for a, fmt in parts]
            w = nn.Parameter(torch.cat(rows).t().contiguous().t(), requires_grad=False)
    except ValueError as e:
        raise CheckpointError(f"{what}: {e}") from None
    if tuple(w.shape) != shape:
        raise CheckpointError(f"{what} has shape {tuple(w.shape)}, the config says {shape}")
    return w


def set_activations(model: Llama, activations: str) -> Llama:
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


def pack_int8(model: Llama) -> Llama:
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
            _set(model, "embed", head)
        _set(model, "lm_head", head)
        for blk in model.layers:
            for name in ("wqkv", "wo", "w_gate_up", "w_down"):
                _set(blk, name, BlockWeight.quantize(getattr(blk, name).detach(), fmt))
    return set_activations(model, activations)


def _set(module: nn.Module, name: str, w: BlockWeight | nn.Parameter) -> None:
    """Put w where the module's fp32 parameter `name` was (a module may not overwrite a parameter in place)."""
    delattr(module, name)
    setattr(module, name, w)


def load_gguf(path: str | Path, cfg: ModelConfig | None = None, activations: str = "fp32",
              pack: bool = True) -> Llama:
    """A `Llama` on the GGUF file's blocks, in eval mode: its matrices are `BlockWeight`s where the file
    holds Q4_1/Q8_0 blocks (other types are expanded to fp32), its norms fp32; `activations`: what the
    blocks multiply (`set_activations`); `pack=False`: no packed copies for int8 activations (their bytes
    saved, their speed given up: `BlockWeight.int8_packed`)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: GGUF file not found")
    try:
        reader = GGUFFile(path)
    except Exception as e:  # ValueError, struct's and numpy's errors on a file cut short
        raise CheckpointError(f"{path}: not a readable GGUF file ({e})") from None
    cfg = cfg or gguf_config(reader)
    tensors = {t.name: t for t in reader.tensors}

    def get(name: str, heads: int | None = None) -> tuple[np.ndarray, str | None]:
        if name not in tensors:
            raise CheckpointError(f"{path.name}: tensor {name!r} is missing")
        return _rows(tensors[name], heads)

    def vector(name: str) -> torch.Tensor:
        return torch.from_numpy(get(name)[0].astype(np.float32).reshape(-1))

    C, D, F_ = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    H, K = cfg.n_heads, cfg.n_kv_heads
    model = Llama(cfg)
    with torch.no_grad():
        _set(model, "embed", _matrix([get("token_embd.weight")], (cfg.vocab_size, C), "token_embd"))
        _set(model, "lm_head", model.embed if cfg.tie_word_embeddings else _matrix(
            [get("output.weight")], (cfg.vocab_size, C), "output"))
        model.norm.copy_(vector("output_norm.weight"))
        for i, blk in enumerate(model.layers):
            p = f"blk.{i}."
            blk.attn_norm.copy_(vector(p + "attn_norm.weight"))
            blk.mlp_norm.copy_(vector(p + "ffn_norm.weight"))
            _set(blk, "wqkv", _matrix([get(p + "attn_q.weight", H), get(p + "attn_k.weight", K),
                                       get(p + "attn_v.weight")], ((H + 2 * K) * D, C), p + "attn_qkv"))
            _set(blk, "wo", _matrix([get(p + "attn_output.weight")], (C, H * D), p + "attn_output"))
            _set(blk, "w_gate_up", _matrix([get(p + "ffn_gate.weight"), get(p + "ffn_up.weight")], (2 * F_, C),
                                           p + "ffn_gate_up"))
            _set(blk, "w_down", _matrix([get(p + "ffn_down.weight")], (C, F_), p + "ffn_down"))
    for w in model.block_weights():
        w.keep_packed = pack
    return set_activations(model, activations).eval()
