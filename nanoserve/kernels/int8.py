"""The block product with int8 activations, as llama.cpp multiplies GGUF blocks; opt-in.

`quant.block_linear` expands each weight block to fp32 and multiplies x as it is. llama.cpp instead
quantizes x too, 32 numbers to a block (its Q8_1 activations), and takes each block's dot product in
integers: the weights stay 4- or 8-bit numbers, one vpdpbusd (VNNI) multiplies 64 bytes by 64 bytes and
adds them in fours, and the fp32 work is a few steps a block instead of one a weight. The price is x's
rounding: each activation moves by up to half its block's step, d / 2 = max|x| / 254, so this is a
different product from the fp32 one (`error_bound` says by how much at most), and nothing calls it
unless asked.

The arithmetic (`csrc/int8.cpp` says it in full), per row of x and weight row:

    x's block b:  d = max|x_j| / 127,  q_j = roundf(x_j * (1 / d)),  s = sum_j q_j
                  (ggml's quantize_row_q8_1_ref, with d and d * s kept in fp32 where ggml stores fp16)
    the product:  isum = sum_j qw_j * q_j (int32, exact)
                  c = (d_w * d) * isum  (+ m_w * (d * s) for Q4_1, whose weights are d_w * qw + m_w)
                  acc[b % 16] += c, block by block
    the end:      the 16 sums added in a fixed tree (`tree16`)

Q5_0, Q4_K and Q6_K (Gemma 3's formats) take the same steps group of 32 by group, each group with its own
scales (`group_terms` says which; `csrc/int8.cpp` has the steps): their integer sums come from the portable loop
or, on every x86 road, from AVX2's. A Q5_0 group's steps are a Q8_0 block's, so Q5_0 packs as Q8_0
(`q5_0_as_q8_0`); one row of x on AVX512-VNNI reads its own blocks instead (`q5_0_blocks`: 22 bytes a block
against the copy's 34, where a batch-1 decode step is read-bound). On the 256-bit
roads the K-quants pack as their groups' integers and fp32 scales (`as_k8`).

The integers are exact and the fp32 steps are fixed, so every road (AVX512-VNNI, AVX-VNNI, AVX2, the
portable loop) gives the same bits, a row's result depends on that row of x only, and
`block_linear_int8_reference` (torch, the same steps) gives them too.

On the x86 roads a weight is best read from a packed copy (`pack`): the same bytes moved once so that each
register's lanes are already one (row, block) each, which spares every block its permutes and horizontal adds.
`BlockWeight.int8_packed` keeps one beside the blocks; the bits are the same either way.

From a few dozen rows of x (`tiled_rows`: a prompt, a large batch) the AVX512-VNNI road unpacks the weight rows
once into tiles, whatever their format (Q4_1, Q8_0 and Q5_0 from their packed copies, Q4_K and Q6_K from their
blocks), each register's 16 lanes 16 weight rows, so that four bytes of a row of x broadcast from memory meet 16
rows in one instruction; one micro-kernel multiplies every four rows of x by a tile: a new format adds an unpacker,
not a product. Same integers, same fp32 steps, the same bits. On a CPU with AMX-INT8 (`amx`) the same tile meets 16
rows of x in one tile operation a block, Intel's tile unit giving the integer sums and the micro-kernel's fp32 steps
following: the same bits again.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.overrides import handle_torch_function, has_torch_function

from . import available, quant, resolve
from . import load as load_kernels
from .quant import BLOCK, block_bytes

LANES = 16  # fp32 sums per dot product: block b is scaled into lane b % 16
FLT_MIN = torch.finfo(torch.float32).tiny  # a smaller scale's 1 / d would overflow: the block is taken as zero
REFERENCE_ELEMENTS = 1 << 22  # block sums the reference holds at once (16 MB); it walks weight rows in chunks


def _blocks_of(x: Tensor) -> Tensor:
    if x.dtype != torch.float32:
        raise TypeError(f"x: expected float32, got {x.dtype}")
    K = x.shape[-1]
    if K % BLOCK:
        raise ValueError(f"x: last dim {K} is not a multiple of the block size {BLOCK}")
    return x.reshape(-1, K // BLOCK, BLOCK)  # (rows, nb, 32)


def round_away(v: Tensor) -> Tensor:
    """C's roundf: to nearest, halves away from zero (torch.round sends them to even). v - trunc(v) is exact."""
    t = v.trunc()
    return torch.where((v - t).abs() >= 0.5, t + torch.sign(v), t)


def quantize_activations(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """x (..., K) fp32 -> q int8 (..., K), d fp32 (..., K / 32), s int32 (..., K / 32): each block of 32 as
    ggml's quantize_row_q8_1_ref makes it (d = max|x| / 127, q = roundf(x * (1 / d)), s = sum q), d kept fp32.
    A block holding inf or NaN gets d = NaN and q = 0; one whose d is below FLT_MIN gets q = 0."""
    xb = _blocks_of(x)  # (rows, nb, 32)
    amax = xb.abs().amax(-1)  # (rows, nb)
    bad = ~torch.isfinite(xb).all(-1)
    d = amax / 127
    inv = torch.where(d >= FLT_MIN, 1 / d, torch.zeros_like(d))
    q = round_away(xb * inv[..., None]).clamp(-127, 127)  # |x * inv| <= 127 up to rounding: the clamp never moves
    q = torch.where(bad[..., None], torch.zeros_like(q), q).to(torch.int8)
    d = torch.where(bad, torch.full_like(d, float("nan")), d)
    s = q.sum(-1, dtype=torch.int32)
    nb_shape = (*x.shape[:-1], x.shape[-1] // BLOCK)
    return q.view(x.shape), d.view(nb_shape), s.view(nb_shape)


def weight_ints(blocks: Tensor, fmt: str) -> tuple[Tensor, Tensor, Tensor | None]:
    """blocks (N, nb * bytes) -> (q (N, nb, 32) int32 in position order, d_w (N, nb) fp32, m_w (N, nb) fp32 or None)."""
    nbytes = block_bytes(fmt)
    if fmt not in ("q4_1", "q8_0"):
        raise ValueError(f"weight_ints reads q4_1 and q8_0 blocks; {fmt}'s are group_terms'")
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % nbytes:
        raise ValueError(f"blocks: expected uint8 (rows, n * {nbytes}) for {fmt}, got {blocks.dtype} "
                         f"{tuple(blocks.shape)}")
    b = blocks.reshape(blocks.shape[0], -1, nbytes)  # (N, nb, bytes)
    d = b[..., 0:2].contiguous().view(torch.float16).float()[..., 0]  # (N, nb)
    if fmt == "q4_1":
        m = b[..., 2:4].contiguous().view(torch.float16).float()[..., 0]
        qs = b[..., 4:]  # (N, nb, 16): position j in byte j's low nibble, position j + 16 in its high nibble
        return torch.cat([qs & 15, qs >> 4], -1).int(), d, m
    return b[..., 2:].contiguous().view(torch.int8).int(), d, None


def group_terms(blocks: Tensor, fmt: str) -> tuple[Tensor, Tensor, Tensor | None, bool]:
    """blocks (N, nb * bytes) in any format -> its groups of 32 as the product reads them: (qw (N, ng, 32) int32 in
    position order, a (N, ng) fp32, b (N, ng) fp32 or None, halves). halves False: c = (a * d) * isum, then + b * ds
    (Q4_1: a = d_w, b = m_w; Q8_0, Q5_0: a = d_w; Q4_K: a = d * sc_s, b = -(dmin * m_s)); halves True (Q6_K):
    c = (a * d) * isum0, then + (b * d) * isum1, a and b the scales of positions 0..15 and 16..31."""
    if fmt in ("q4_1", "q8_0"):
        q, d, m = weight_ints(blocks, fmt)
        return q, d, m, False
    f = quant.block_format(fmt)
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % f.bytes:
        raise ValueError(f"blocks: expected uint8 (rows, n * {f.bytes}) for {fmt}, got {blocks.dtype} "
                         f"{tuple(blocks.shape)}")
    N = blocks.shape[0]
    b = blocks.reshape(N, -1, f.bytes)  # (N, nb, bytes)
    if fmt == "q5_0":
        q, d = quant.q5_0_ints(b)  # one group a block
        return q, d[..., 0], None, False
    if fmt == "q4_k":
        q, step, low = quant.q4_k_ints(b)
        return q.reshape(N, -1, BLOCK), step.reshape(N, -1), -low.reshape(N, -1), False
    q, step = quant.q6_k_ints(b)  # (N, nb, 16, 16): a group of 32 is two sub-blocks
    step = step.reshape(N, -1, 2)
    return q.reshape(N, -1, BLOCK), step[..., 0], step[..., 1], True


def block_linear_int8_reference(x: Tensor, blocks: Tensor, fmt: str) -> Tensor:
    """The compiled product's arithmetic in torch, step for step: x (..., K) fp32, blocks (N, row_bytes(fmt, K))
    -> (..., N), the same bits as `block_linear_int8` on every road."""
    q, d, s = quantize_activations(x)
    qw, aw, bw, halves = group_terms(blocks, fmt)  # (N, nb, 32), (N, nb), (N, nb)
    N, nb = aw.shape
    if nb * BLOCK != x.shape[-1]:
        raise ValueError(f"blocks: {nb} {fmt} blocks a row do not take {x.shape[-1]} inputs")
    B = q.numel() // max(nb * BLOCK, 1)
    qx = q.reshape(B, nb, BLOCK).float()  # small integers: fp32 holds them, and their block sums, exactly
    d = d.reshape(B, nb)
    ds = d * s.reshape(B, nb).float()  # what Q4_1's m multiplies
    out = torch.empty(B, N)
    step = max(1, REFERENCE_ELEMENTS // max(B * nb, 1))
    for n0 in range(0, N, step):
        n1 = min(N, n0 + step)
        qwn = qw[n0:n1].float()
        # isum[r, n, b]: block b's dot product in integers (below 2^20: exact in fp32 in any order), or its halves'
        isum = torch.einsum("rbj,nbj->rnb", qx, qwn)
        if halves:
            isum0 = torch.einsum("rbj,nbj->rnb", qx[..., :16], qwn[..., :16])
            isum1 = torch.einsum("rbj,nbj->rnb", qx[..., 16:], qwn[..., 16:])
        acc = torch.zeros(B, n1 - n0, LANES)
        for b in range(nb):  # block by block, in order, block b into lane b % 16
            if halves:
                c = (aw[None, n0:n1, b] * d[:, None, b]) * isum0[..., b]
                c = c + (bw[None, n0:n1, b] * d[:, None, b]) * isum1[..., b]
            else:
                c = (aw[None, n0:n1, b] * d[:, None, b]) * isum[..., b]  # (B, n): (d_w * d) * isum
                if bw is not None:
                    c = c + bw[None, n0:n1, b] * ds[:, None, b]  # + m_w * (d * s)
            acc[..., b % LANES] = acc[..., b % LANES] + c
        out[:, n0:n1] = tree16(acc)
    return out.view(*x.shape[:-1], N)


def tree16(a: Tensor) -> Tensor:
    """(..., 16) -> (...): the kernel's fixed tree, t_j = a[j] + a[j + 8], then + 4 along, + 2 along, + 1 along."""
    t = a[..., :8] + a[..., 8:]
    t = t[..., :4] + t[..., 4:]
    return (t[..., 0] + t[..., 2]) + (t[..., 1] + t[..., 3])


def block_linear_int8(x: Tensor, blocks: Tensor, fmt: str, road: str | None = None,
                      compiled: bool | None = None, packed: Tensor | None = None) -> Tensor:
    """x (..., K) fp32 @ w.T for the weight w (N, K) that `blocks` hold, x taken as int8 blocks -> (..., N).
    road: None for the best this CPU has, or one of `int8_roads()` (they give the same bits); where the
    kernels are not built, or with compiled=False, the torch reference runs (the same bits again). `packed`
    (`pack(blocks, fmt)`) is read instead of the blocks where the best road runs: the same bits, faster."""
    if has_torch_function((x, blocks)):
        return handle_torch_function(block_linear_int8, (x, blocks), x, blocks, fmt, road, compiled, packed)
    block_bytes(fmt)
    if resolve(compiled) and not (x.requires_grad and torch.is_grad_enabled()):
        if packed is not None and road is None and not (fmt == "q5_0" and q5_0_blocks(x.numel() // x.shape[-1])):
            return block_linear_int8_packed(x, packed, fmt, blocks.shape[0])
        return load_kernels().block_linear_int8(x.contiguous(), blocks, fmt, road or "")  # type: ignore[union-attr]
    if road is not None:
        raise RuntimeError(f"road {road!r}: the compiled kernels are not in use here")
    return block_linear_int8_reference(x, blocks, fmt)


def packed_here() -> bool:
    """Whether this CPU's road reads a packed layout (the x86 roads; not the portable loop): a BlockWeight on
    int8 activations then keeps a packed copy (`pack`), which its products read instead of the blocks."""
    return bool(available() and load_kernels().int8_packed_here())  # type: ignore[union-attr]


PACKED_AS = {"q4_1": "q4_1", "q8_0": "q8_0", "q5_0": "q8_0", "q4_k": "q4_k8", "q6_k": "q6_k8"}
"""Each format with a packed layout -> the blocks that layout moves: its own, Q5_0's as Q8_0 (`q5_0_as_q8_0`), a
K-quant's as K8 (`as_k8`)."""
PACKED_BLOCK_BYTES = {"q4_1": 20, "q8_0": 34, "q4_k8": 40, "q6_k8": 40}  # bytes a group of 32, as packed
ROWS_ONLY = ("q4_k", "q6_k")  # packed by the 256-bit roads only (AVX512-VNNI's quads have no K8 layout)


def as_k8(blocks: Tensor, fmt: str) -> Tensor:
    """Q4_K or Q6_K blocks (N, nb * bytes) -> K8 blocks (N, groups * 40): each group of 32 as its scales a, b (fp32,
    `group_terms`' numbers) and its 32 integer weights (signed bytes). The packed product reads them with the
    format's own fp32 steps (Q4_K: (a * d) * isum + b * ds; Q6_K: (a * d) * isum0 + (b * d) * isum1), so the bits
    are the blocks' product's; at 40 bytes a group instead of 18 (Q4_K) or 26 (Q6_K), the integers need no
    unpacking and the scales no decoding."""
    if fmt not in ROWS_ONLY:
        raise ValueError(f"as_k8 reads q4_k and q6_k blocks, not {fmt}")
    qw, a, b, _ = group_terms(blocks, fmt)
    N, ng = a.shape
    scales = torch.stack([a, b], -1).contiguous().view(torch.uint8)  # (N, ng, 8)
    return torch.cat([scales, qw.to(torch.int8).view(torch.uint8)], -1).reshape(N, ng * 40)


def q5_0_as_q8_0(blocks: Tensor) -> Tensor:
    """Q5_0 blocks (N, nb * 22) -> Q8_0 blocks (N, nb * 34) of the same numbers: each block's fp16 d, then its
    integers q - 16 (-16..15) as signed bytes. The int8 product's steps for a Q5_0 group and a Q8_0 block are the
    same ((d_w * d) * isum into lane b % 16), so the Q8_0 product of these blocks is the Q5_0 product, bit for
    bit, at 34 bytes a block instead of 22: the price of a layout whose integers need no unpacking."""
    f = quant.block_format("q5_0")
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % f.bytes:
        raise ValueError(f"blocks: expected uint8 (rows, n * {f.bytes}) for q5_0, got {blocks.dtype} "
                         f"{tuple(blocks.shape)}")
    b = blocks.reshape(blocks.shape[0], -1, f.bytes)
    q, _ = quant.q5_0_ints(b)
    return torch.cat([b[..., :2], q.to(torch.int8).view(torch.uint8)], -1).reshape(blocks.shape[0], -1)


def pack(blocks: Tensor, fmt: str, road: str | None = None) -> Tensor | None:
    """blocks (N, K / 32 * bytes) -> the same numbers in `road`'s packed layout (None: this CPU's best), 1-dim,
    (N + 3) // 4 * 4 rows' worth and a 64-byte tail: blocks moved so that each register's lanes are one (row,
    block) each (`csrc/int8.cpp`: four rows' quads side by side for AVX512-VNNI, a row's groups of eight for
    AVX2). Q5_0 packs as the Q8_0 blocks of its numbers (`q5_0_as_q8_0`), Q4_K and Q6_K as K8 blocks (`as_k8`) on
    the 256-bit roads. None where the road has no packed layout for the format (AVX512-VNNI: the K-quants), whose
    product then reads the blocks as they lie."""
    block_bytes(fmt)
    if fmt not in PACKED_AS:
        return None
    if fmt in ROWS_ONLY:
        if (road or int8_road()) == "avx512-vnni":
            return None
        blocks = as_k8(blocks, fmt)
    elif fmt == "q5_0":
        blocks = q5_0_as_q8_0(blocks)
    return load_kernels().pack_blocks_int8(blocks, PACKED_AS[fmt], road or "")  # type: ignore[union-attr]


def block_linear_int8_packed(x: Tensor, packed: Tensor, fmt: str, out_features: int, road: str | None = None,
                             ) -> Tensor:
    """`block_linear_int8` on `pack(blocks, fmt, road)`, on that road: the same bits."""
    return load_kernels().block_linear_int8_packed(x.contiguous(), packed, PACKED_AS[fmt], out_features,  # type: ignore
                                                   road or "")


def int8_road() -> str:
    """The road `block_linear_int8` takes here: "avx512-vnni", "avx-vnni", "avx2", "scalar", or "torch"
    where the kernels are not in use."""
    return load_kernels().int8_road() if available() else "torch"  # type: ignore[union-attr]


def q5_0_blocks(rows: int) -> bool:
    """Whether `rows` rows of x meet a Q5_0 weight's own blocks (22 bytes a block) rather than its packed Q8_0 copy
    (34): on the AVX512-VNNI road, for one row of x, whose product is read-bound."""
    return bool(available() and load_kernels().int8_q5_0_blocks(rows))  # type: ignore[union-attr]


def tiled_rows() -> tuple[int, int]:
    """From how many rows of x the AVX512-VNNI road unpacks each group of weights once into a tile, for Q4_1, Q8_0
    and Q5_0, and for Q4_K and Q6_K: below them each row of x meets the packed quads (or `krows_few`). Both roads
    give the same bits; the thresholds are where the tiles' unpacking pays for itself."""
    return tuple(load_kernels().int8_tiled_rows())  # type: ignore[union-attr,return-value]


def amx(on: bool | None = None) -> bool:
    """Whether the AVX512-VNNI road's tiled products (from `tiled_rows` rows of x) take AMX's tile unit, Intel's:
    one tdpbusd gives a block's 16 x 16 integer sums, the fp32 steps are the vector micro-kernel's, so the bits are
    the same either way. On where the CPU has AMX-INT8 and Linux lets the process use its tiles (NANOSERVE_AMX=0
    turns it off); `on` sets it for this process (True only where it is here), for a comparison of the two."""
    if not available():
        return False
    return bool(load_kernels().int8_amx(-1 if on is None else int(on)))  # type: ignore[union-attr]


def int8_roads() -> list[str]:
    """Every compiled road this CPU can run, best first (empty where the kernels are not in use)."""
    return list(load_kernels().int8_roads()) if available() else []  # type: ignore[union-attr]


def error_bound(x: Tensor, blocks: Tensor, fmt: str) -> Tensor:
    """How far x's rounding may move the product from the exact product of the same weights, per output
    (..., N): each activation moves by at most d / 2 (a hair more: 1 / d is itself rounded), so
    |error| <= sum over blocks of d / 2 * sum_j |w_j|. fp32's rounding of the sums comes on top, far smaller."""
    from .quant import dequantize

    _, d, _ = quantize_activations(x)
    wabs = dequantize(blocks, fmt).abs().double()
    N = wabs.shape[0]
    wsum = wabs.view(N, -1, BLOCK).sum(-1)  # (N, nb)
    return ((d.double() / 2) @ wsum.T).float()
