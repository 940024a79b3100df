"""The weight product on GGUF's blocks where they lie: no fp32 copy of the weights.

A GGUF file stores each matrix row as blocks. SmolLM2's ships two formats of 32 weights a block, Gemma 3's
three more, two of them K-quants (super-blocks of 256 weights in sub-blocks with their own 6- or 8-bit scales):

    Q4_1  fp16 d, fp16 m, 16 bytes of nibbles            20 bytes / 32    w = d * q + m,          q in 0..15
    Q8_0  fp16 d, 32 signed bytes                         34 bytes / 32    w = d * q,              q in -128..127
    Q5_0  fp16 d, 32 high bits, 16 bytes of nibbles       22 bytes / 32    w = d * (q - 16),       q in 0..31
    Q4_K  fp16 d, dmin, 8 6-bit scales and mins, nibbles  144 bytes / 256  w = d sc_s q - dmin m_s, q in 0..15
    Q6_K  nibbles, 2-bit highs, 16 int8 scales, fp16 d    210 bytes / 256  w = d sc_s (q - 32),    q in 0..63

A batch-1 decode step streams every weight once, so bytes are time: a Q4_K super-block is 0.5625 bytes a
weight where fp32 is 4. `block_linear` (`csrc/quant.cpp`) expands each block into registers and
multiplies it there, fp32 all the way, using each expanded block for up to a tile of x's rows; every format
sums in one order, so every road (AVX-512, AVX2, portable) gives the same bits. `FORMATS` is the table: each
format's bytes and weights a block, its unpacker (`dequantize` runs it: the fp32 numbers gguf's conversion
writes, bit for bit) and its packer (`quantize`: llama.cpp's reference rounding for the 32-weight formats, a
plainer one for the K-quants, for tests and for models that did not come as GGUF).

The kernel is part of the compiled kernels' extension (`kernels.load`), built with them on first use. Where it
cannot be, or with `compiled=False`, `block_linear` multiplies by `dequantize`'s matrix instead: same weights,
fp32 rounding apart, slower.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import handle_torch_function, has_torch_function

from . import CSRC, build_flags, resolve
from . import load as load_kernels
from . import unavailable_reason as kernels_unavailable

SOURCE = CSRC / "quant.cpp"
BLOCK = 32  # weights per block of Q4_1, Q8_0, Q5_0, and per sub-block of a K-quant's super-block
QK_K = 256  # weights per K-quant super-block


@dataclass(frozen=True)
class Format:
    """A block format as data: its bytes and weights per block, its unpacker, blocks (N, nb, bytes) uint8 ->
    weights (N, nb, weights) fp32, and its packer, the other way. The compiled product keeps the same table,
    keyed by name and road (`csrc/quant.cpp`)."""
    bytes: int
    weights: int
    unpack: Callable[[Tensor], Tensor]
    pack: Callable[[Tensor], Tensor]


def _half(b: Tensor, at: int) -> Tensor:
    """The fp16 at byte `at` of each block, as fp32 (N, nb, 1)."""
    return b[..., at:at + 2].contiguous().view(torch.float16).float()


def unpack_q4_1(b: Tensor) -> Tensor:
    """Q4_1, 20 bytes: fp16 d, fp16 m, 16 bytes of nibbles -> d * q + m (two roundings, the first exact)."""
    qs = b[..., 4:]  # (N, nb, 16): weight j in the low nibble of byte j, weight j + 16 in its high nibble
    return _half(b, 0) * torch.cat([qs & 15, qs >> 4], -1).float() + _half(b, 2)


def unpack_q8_0(b: Tensor) -> Tensor:
    """Q8_0, 34 bytes: fp16 d, 32 signed bytes -> q * d (exact)."""
    return b[..., 2:].contiguous().view(torch.int8).float() * _half(b, 0)


def q5_0_ints(b: Tensor) -> tuple[Tensor, Tensor]:
    """Q5_0 blocks (N, nb, 22) -> their integers q - 16 (N, nb, 32) int32 in -16..15 and d (N, nb, 1)."""
    qh = b[..., 2:6].long()  # (N, nb, 4)
    bits = (qh.unsqueeze(-1) >> torch.arange(8)) & 1  # (N, nb, 4, 8): bit j of the 32 is weight j's fifth bit
    qs = b[..., 6:]
    q = torch.cat([qs & 15, qs >> 4], -1).long() | (bits.flatten(-2) << 4)
    return (q - 16).int(), _half(b, 0)


def unpack_q5_0(b: Tensor) -> Tensor:
    """Q5_0, 22 bytes: fp16 d, 32 high bits (little-endian), 16 bytes of low nibbles -> d * (q - 16) (exact)."""
    q, d = q5_0_ints(b)
    return d * q.float()


def q4_k_ints(b: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Q4_K super-blocks (N, nb, 144) -> q (N, nb, 8, 32) int32 in 0..15, each sub-block's step d * sc and offset
    dmin * m (N, nb, 8, 1), exact: 12 bytes hold the 8 6-bit scales and mins (llama.cpp's get_scale_min_k4)."""
    s = b[..., 4:16].long()  # (N, nb, 12)
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([lo & 63, (hi & 15) | ((lo >> 6) << 4)], -1)  # (N, nb, 8)
    mn = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], -1)
    qs = b[..., 16:].reshape(*b.shape[:-1], 4, 1, 32)  # sub-block 2c: low nibbles of bytes 32c.., 2c + 1: high
    q = torch.cat([qs & 15, qs >> 4], -2).reshape(*b.shape[:-1], 8, 32).int()
    return q, (_half(b, 0) * sc.float()).unsqueeze(-1), (_half(b, 2) * mn.float()).unsqueeze(-1)


def unpack_q4_k(b: Tensor) -> Tensor:
    """Q4_K, 144 bytes a super-block of 8 x 32: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes
    of nibbles -> (d * sc) * q - dmin * m per sub-block (d * sc, its product with q and dmin * m are exact)."""
    q, step, low = q4_k_ints(b)
    return (step * q.float() - low).flatten(-2)


def q6_k_ints(b: Tensor) -> tuple[Tensor, Tensor]:
    """Q6_K super-blocks (N, nb, 210) -> q - 32 (N, nb, 16, 16) int32 in -32..31 and each sub-block's step
    d * scale (N, nb, 16, 1), exact."""
    ql = b[..., 0:128].reshape(*b.shape[:-1], 2, 1, 64)  # each half of 128 weights: 64 low nibbles, 64 high
    low = torch.cat([ql & 15, ql >> 4], -2).reshape(*b.shape[:-1], 2, 128)
    qh = b[..., 128:192].reshape(*b.shape[:-1], 2, 1, 32)  # bits 2k, 2k + 1 of byte j: weight 32k + j of the half
    high = ((qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)) & 3).reshape(*b.shape[:-1], 2, 128)
    q = ((low.int() | (high.int() << 4)) - 32).reshape(*b.shape[:-1], 16, 16)
    return q, (_half(b, 208) * b[..., 192:208].contiguous().view(torch.int8).float()).unsqueeze(-1)


def unpack_q6_k(b: Tensor) -> Tensor:
    """Q6_K, 210 bytes a super-block of 16 x 16: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales,
    fp16 d -> (d * scale) * (q - 32) per sub-block (exact)."""
    q, step = q6_k_ints(b)
    return (step * q.float()).flatten(-2)


def load(verbose: bool = False) -> ModuleType | None:
    """The compiled kernels' extension, which holds the block product (`kernels.load`); None where it cannot be
    built (it warns once, saying why)."""
    return load_kernels(verbose)


def unavailable_reason() -> str | None:
    """Why `load()` returned None, or None if it did not (or was not called)."""
    return kernels_unavailable()


def block_format(fmt: str) -> Format:
    if fmt not in FORMATS:
        raise ValueError(f"unknown block format {fmt!r}; expected one of {sorted(FORMATS)}")
    return FORMATS[fmt]


def block_bytes(fmt: str) -> int:
    """Bytes per block (per 256-weight super-block for the K-quants)."""
    return block_format(fmt).bytes


def block_weights(fmt: str) -> int:
    """Weights per block: 32, or 256 for the K-quants; a row's length must be a multiple of it."""
    return block_format(fmt).weights


def row_bytes(fmt: str, k: int) -> int:
    """Bytes of a row of k weights in `fmt` (k a multiple of `block_weights(fmt)`)."""
    f = block_format(fmt)
    if k % f.weights:
        raise ValueError(f"{k} inputs is not a multiple of the block size {f.weights} of {fmt}")
    return k // f.weights * f.bytes


def dequantize(blocks: Tensor, fmt: str) -> Tensor:
    """blocks (N, nb * bytes) uint8 -> the weights (N, nb * weights per block) fp32 by the format's unpacker,
    computed as gguf.quants does, so the numbers are the fp32 conversion's, bit for bit."""
    f = block_format(fmt)
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % f.bytes:
        raise ValueError(f"blocks: expected uint8 (rows, n * {f.bytes}) for {fmt}, got {blocks.dtype} "
                         f"{tuple(blocks.shape)}")
    b = blocks.reshape(blocks.shape[0], -1, f.bytes)  # (N, nb, bytes)
    return f.unpack(b).reshape(blocks.shape[0], -1)


def _round(v: Tensor) -> Tensor:
    """C's roundf (halves away from zero), as llama.cpp's quantizers round."""
    return v.sign() * (v.abs() + 0.5).floor()


def _inverse(d: Tensor) -> Tensor:
    return torch.where(d != 0, 1 / torch.where(d != 0, d, torch.ones_like(d)), torch.zeros_like(d))


def quantize(w: Tensor, fmt: str) -> Tensor:
    """fp32 weights (N, K) -> blocks (N, row_bytes(fmt, K)) uint8. Q4_1, Q8_0 and Q5_0 round as llama.cpp's
    reference quantizers do (Q4_1: d = (max - min) / 15, m = min; Q8_0: d = max|w| / 127; Q5_0: d = the
    largest-magnitude weight / -16). Q4_K and Q6_K take each sub-block's range and round to nearest, without
    the search for better scales that llama.cpp's make_qkx2_quants / make_qx_quants run: real-looking blocks
    for tests, a little less accurate than llama.cpp's."""
    f = block_format(fmt)
    N, K = w.shape
    row_bytes(fmt, K)
    x = w.detach().float().reshape(N, K // f.weights, f.weights)
    out = f.pack(x).reshape(N, -1)
    assert out.shape[1] == K // f.weights * f.bytes
    return out.contiguous()


def _quantize_q4_1(x: Tensor) -> Tensor:  # (N, nb, 32) -> (N, nb, 20)
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    d = (hi - lo) / 15
    q = ((x - lo) * _inverse(d) + 0.5).floor().clamp(0, 15).to(torch.uint8)
    return torch.cat([d.half().view(torch.uint8), lo.half().view(torch.uint8), q[..., :16] | (q[..., 16:] << 4)], -1)


def _quantize_q8_0(x: Tensor) -> Tensor:  # (N, nb, 32) -> (N, nb, 34)
    d = x.abs().amax(-1, keepdim=True) / 127
    return torch.cat([d.half().view(torch.uint8), (x * _inverse(d)).round().clamp(-128, 127).to(torch.int8).view(
        torch.uint8)], -1)


def _quantize_q5_0(x: Tensor) -> Tensor:  # (N, nb, 32) -> (N, nb, 22), gguf's Q5_0.quantize_blocks
    far = x.gather(-1, x.abs().argmax(-1, keepdim=True))
    d = far / -16
    q = ((x * _inverse(d)) + 16.5).trunc().clamp(0, 31).to(torch.uint8)
    qh = ((q >> 4).long() << torch.arange(32)).sum(-1, keepdim=True)  # (N, nb, 1): bit j = weight j's fifth bit
    qh = torch.cat([(qh >> (8 * i)) & 255 for i in range(4)], -1).to(torch.uint8)
    return torch.cat([d.half().view(torch.uint8), qh, (q[..., :16] & 15) | ((q[..., 16:] & 15) << 4)], -1)


def _quantize_q4_k(x: Tensor) -> Tensor:  # (N, nb, 256) -> (N, nb, 144)
    s = x.reshape(*x.shape[:-1], 8, 32)
    lo = s.amin(-1).clamp(max=0)  # (N, nb, 8): w = scale * q - min with min >= 0
    scale, mins = (s.amax(-1) - lo) / 15, -lo
    d, dmin = scale.amax(-1, keepdim=True) / 63, mins.amax(-1, keepdim=True) / 63  # (N, nb, 1)
    d16, dmin16 = d.half(), dmin.half()
    sc = _round(scale * _inverse(d16.float())).clamp(0, 63).long()
    mn = _round(mins * _inverse(dmin16.float())).clamp(0, 63).long()
    step, low = (d16.float() * sc.float()).unsqueeze(-1), (dmin16.float() * mn.float()).unsqueeze(-1)
    q = _round((s + low) * _inverse(step)).clamp(0, 15).to(torch.uint8)  # (N, nb, 8, 32)
    head = torch.cat([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), mn[..., :4] | ((mn[..., 4:] >> 4) << 6),
                      (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)], -1).to(torch.uint8)  # (N, nb, 12)
    qs = (q[..., 0::2, :] | (q[..., 1::2, :] << 4)).flatten(-2)  # (N, nb, 128)
    return torch.cat([d16.view(torch.uint8), dmin16.view(torch.uint8), head, qs], -1)


def _quantize_q6_k(x: Tensor) -> Tensor:  # (N, nb, 256) -> (N, nb, 210)
    s = x.reshape(*x.shape[:-1], 16, 16)
    scale = s.gather(-1, s.abs().argmax(-1, keepdim=True))[..., 0] / -32  # (N, nb, 16)
    d = scale.abs().amax(-1, keepdim=True) / 127
    d16 = d.half()
    sc = _round(scale * _inverse(d16.float())).clamp(-128, 127)
    step = (d16.float() * sc).unsqueeze(-1)
    q = (_round(s * _inverse(step)).clamp(-32, 31) + 32).to(torch.uint8).reshape(*x.shape[:-1], 2, 4, 32)
    ql = (q[..., 0:2, :] & 15) | ((q[..., 2:4, :] & 15) << 4)  # (N, nb, 2, 2, 32): byte j of 64 per half
    qh = (q >> 4) << torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)
    qh = qh[..., 0, :] | qh[..., 1, :] | qh[..., 2, :] | qh[..., 3, :]  # (N, nb, 2, 32)
    return torch.cat([ql.flatten(-3), qh.flatten(-2), sc.to(torch.int8).view(torch.uint8), d16.view(torch.uint8)], -1)


FORMATS = {
    "q4_1": Format(20, BLOCK, unpack_q4_1, _quantize_q4_1),
    "q8_0": Format(34, BLOCK, unpack_q8_0, _quantize_q8_0),
    "q5_0": Format(22, BLOCK, unpack_q5_0, _quantize_q5_0),
    "q4_k": Format(144, QK_K, unpack_q4_k, _quantize_q4_k),
    "q6_k": Format(210, QK_K, unpack_q6_k, _quantize_q6_k),
}  # the formats GGUF files ship that `block_linear` multiplies where they lie


def block_linear(x: Tensor, blocks: Tensor, fmt: str, compiled: bool | None = None, road: str | None = None,
                 ) -> Tensor:
    """x (..., K) fp32 @ w.T for the weight w (N, K) that `blocks` (N, row_bytes(fmt, K)) hold -> (..., N).
    Each row of the result depends on that row of x only: the same bits in any batch, and on any road.
    `compiled`: the kernel (None: where it is built), or False for the product with `dequantize`'s matrix;
    `road`: one of `roads(fmt)` (None: the best here)."""
    if has_torch_function((x, blocks)):
        return handle_torch_function(block_linear, (x, blocks), x, blocks, fmt, compiled, road)
    block_format(fmt)
    if resolve(compiled) and not (x.requires_grad and torch.is_grad_enabled()):
        return load().block_linear(x.contiguous(), blocks, fmt, road or "")  # type: ignore[union-attr]
    if road is not None:
        raise RuntimeError(f"road {road!r}: the compiled kernels are not in use here")
    if x.dtype != torch.float32:
        raise TypeError(f"x: expected float32, got {x.dtype}")
    row_bytes(fmt, x.shape[-1])
    return F.linear(x, dequantize(blocks, fmt))


def roads(fmt: str) -> list[str]:
    """The compiled roads that multiply `fmt` here, best first ("avx512", "avx2", "portable"; they give the same
    bits); empty where the kernels are not in use."""
    block_format(fmt)
    if load() is None:
        return []
    return [road for name, road, _, _ in load().block_kernels() if name == fmt]  # type: ignore[union-attr]


def describe() -> str:
    """What multiplies block weights on this machine: the build, or why dequantized copies do."""
    if load() is None:
        return f"dequantized copies ({unavailable_reason()})"
    name, flags = build_flags()
    return f"compiled block product in {name} ({' '.join(flags)})"
