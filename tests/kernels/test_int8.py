"""The int8-activation block product against its torch reference (bit for bit, on every road the CPU has),
ggml's activation rounding, the fp32 block product (within the rounding of x it promises), the same bits for a
row in any batch, and its refusals of bad input."""

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from nanoserve import kernels
from nanoserve.kernels import int8, quant

HAVE_COMPILER = any(shutil.which(c) for c in ("c++", "g++", "clang++"))
FORMATS = ["q4_1", "q8_0"]
# (out rows, in features): block counts off every quad and group of 16, row counts off every tile of four
SHAPES = [(1, 32), (5, 96), (7, 160), (13, 512), (33, 576), (21, 608), (50, 1536), (4, 2080)]


@pytest.fixture(scope="module")
def ext():
    module = kernels.load()
    if module is None:
        if HAVE_COMPILER:
            pytest.fail(f"a C++ compiler is here but the kernels did not build: {kernels.unavailable_reason()}")
        pytest.skip(f"no C++ compiler: {kernels.unavailable_reason()}")
    return module


def blocks_for(n: int, k: int, fmt: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    return quant.quantize(w, fmt), w


def activations(rows: int, k: int, seed: int) -> torch.Tensor:
    """Gaussian rows with a few loud channels, as a decoder's hidden states have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    x[:, torch.randperm(k, generator=g)[: max(1, k // 100)]] *= 30
    return x


def ggml_q8_1_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml's quantize_row_q8_1_ref transcribed (fp32 steps; roundf in float64, where |v| + 0.5 is exact), with
    d and s kept unrounded: rows (R, K) -> q (R, K), d (R, K / 32), s (R, K / 32)."""
    xb = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    amax = np.abs(xb).max(-1)
    d = (amax / np.float32(127)).astype(np.float32)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
    v = (xb * inv[..., None]).astype(np.float32).astype(np.float64)
    q = (np.sign(v) * np.floor(np.abs(v) + 0.5)).astype(np.int8)
    return q.reshape(x.shape), d, q.astype(np.int32).sum(-1)


def test_activations_are_rounded_as_ggml_rounds_them(ext):
    x = activations(6, 1056, seed=1)  # 33 blocks a row
    x[0, :32] = torch.arange(-16, 16) + 0.5  # max 15.5: d = 15.5 / 127, and x * (1 / d) lands near halves
    x[1, :32] = torch.tensor([127.0] + [-126.5, 2.5, -3.5, 0.5, -0.5] + [0.0] * 26)  # d = 1: exact halves
    x[2:4, 544:576], x[4:6, 1024:] = x[0:2, :32], x[0:2, :32]  # the same blocks mid-row and last
    q, d, s = int8.quantize_activations(x)
    want_q, want_d, want_s = ggml_q8_1_ref(x.numpy())
    assert np.array_equal(q.numpy(), want_q) and np.array_equal(d.numpy(), want_d) and np.array_equal(s.numpy(), want_s)
    assert q[1, 1:6].tolist() == [-127, 3, -4, 1, -1]  # halves away from zero, where torch.round goes to even
    for road in ext.int8_roads():  # each road's own quantizer
        for mine, ref in zip(ext.quantize_activations_int8(x, road), (q, d, s), strict=True):
            assert torch.equal(mine, ref), road


def test_zero_tiny_and_non_finite_blocks(ext):
    x = torch.randn(4, 1024)
    x[0, :32] = 0  # d = 0, q = 0
    x[1, 32:64] = 1e-40  # d below FLT_MIN: q = 0 (its 1 / d would overflow)
    x[2, 64] = float("nan")
    x[3, 100] = float("inf")
    x[0, 544:576], x[1, 512:544] = 0, 1e-40  # zero and tiny blocks mid-row among finite ones
    q, d, s = int8.quantize_activations(x)
    assert d[0, 0] == 0 and not q[0, :32].any() and s[0, 0] == 0
    assert 0 < d[1, 1] < torch.finfo(torch.float32).tiny and not q[1, 32:64].any()
    assert d[2, 2].isnan() and d[3, 3].isnan() and not q[2, 64:96].any() and not q[3, 96:128].any()
    assert d[:, :2].isfinite().all() and d[0].isfinite().all()
    for road in ext.int8_roads():  # each road's own quantizer: the same numbers, NaN where the reference has it
        for mine, ref in zip(ext.quantize_activations_int8(x, road), (q, d, s), strict=True):
            assert torch.equal(mine, ref) or torch.allclose(mine, ref, rtol=0, atol=0, equal_nan=True), road
    blocks, _ = blocks_for(9, 1024, "q4_1", seed=2)
    want = int8.block_linear_int8_reference(x, blocks, "q4_1")
    assert want[2:].isnan().all() and want[:2].isfinite().all()  # a non-finite activation: its row is NaN
    for road in ext.int8_roads():
        assert torch.equal(ext.block_linear_int8(x[:2], blocks, "q4_1", road), want[:2]), road
        assert ext.block_linear_int8(x, blocks, "q4_1", road)[2:].isnan().all(), road


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", SHAPES)
def test_every_road_is_the_reference_bit_for_bit(ext, fmt, shape):
    n, k = shape
    blocks, _ = blocks_for(n, k, fmt, seed=n + k)
    x = activations(8, k, seed=k)
    roads = ext.int8_roads()
    assert roads[-1] == "scalar" and ext.int8_road() == roads[0]
    with torch.inference_mode():
        for rows in range(1, 9):
            want = int8.block_linear_int8_reference(x[:rows], blocks, fmt)
            assert torch.equal(int8.block_linear_int8(x[:rows], blocks, fmt), want), rows
            for road in roads:
                assert torch.equal(int8.block_linear_int8(x[:rows], blocks, fmt, road), want), (road, rows)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(576, 1536), (49152, 576)])
def test_real_shapes_are_the_reference_bit_for_bit(ext, fmt, shape):
    """The model's down projection and its LM head (the head's 49152 rows take the reference a while)."""
    n, k = shape
    blocks, _ = blocks_for(n, k, fmt, seed=11)
    x = activations(8, k, seed=12)
    with torch.inference_mode():
        for rows in (1, 3, 8) if n > 10000 else range(1, 9):
            want = int8.block_linear_int8_reference(x[:rows], blocks, fmt)
            for road in ext.int8_roads():
                assert torch.equal(int8.block_linear_int8(x[:rows], blocks, fmt, road), want), (road, rows)


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_row_has_the_same_bits_in_any_batch(ext, fmt):
    """The engine batches rows freely: a row's product may not depend on the rows beside it."""
    blocks, _ = blocks_for(203, 576, fmt, seed=3)
    x = activations(37, 576, seed=4)
    with torch.inference_mode():
        for road in ext.int8_roads():
            full = int8.block_linear_int8(x, blocks, fmt, road)
            for rows in ([5], [0, 36], list(range(3, 12)), list(range(36, -1, -3)), list(range(1, 37))):
                assert torch.equal(int8.block_linear_int8(x[rows], blocks, fmt, road), full[rows]), (road, rows)
            assert torch.equal(int8.block_linear_int8(x.view(37, 1, 576), blocks, fmt, road), full.view(37, 1, 203))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536)])
@pytest.mark.parametrize("loud", [False, True])
def test_error_against_the_fp32_block_product(ext, fmt, shape, loud):
    """Per output, int8 - fp32 is within x's rounding (`error_bound`) plus both products' fp32 rounding. Over a
    matrix (relative, Frobenius): within 1% for Gaussian activations, 2% with loud channels (a loud channel's
    block has a coarse step for all 32 of its numbers)."""
    n, k = shape
    blocks, _ = blocks_for(n, k, fmt, seed=5)
    w = quant.dequantize(blocks, fmt).double()
    x = activations(8, k, seed=6) if loud else torch.randn(8, k, generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        got = int8.block_linear_int8(x, blocks, fmt).double()
        fp32 = quant.block_linear(x, blocks, fmt).double()
    rounding = 2.0**-16 * (x.double().abs() @ w.abs().T)  # fp32 sums of both products, generously
    assert ((got - fp32).abs() <= int8.error_bound(x, blocks, fmt).double() * (1 + 1e-3) + rounding).all()
    assert ((got - fp32).norm() / fp32.norm()).item() < (0.02 if loud else 0.01)


def test_bad_inputs_are_refused_with_the_reason(ext):
    blocks, _ = blocks_for(8, 64, "q4_1", seed=7)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="last dim 48 is not a multiple of the block size 32"):
        ext.block_linear_int8(torch.randn(2, 48), blocks, "q4_1", "")
    with pytest.raises(RuntimeError, match="blocks: rows of 40 bytes, expected 68"):
        ext.block_linear_int8(x, blocks, "q8_0", "")  # Q4_1 rows read as Q8_0
    with pytest.raises(RuntimeError, match="blocks: rows of 40 bytes, expected 80"):
        ext.block_linear_int8(torch.randn(2, 128), blocks, "q4_1", "")  # a weight for 64 inputs, x of 128
    with pytest.raises(RuntimeError, match="x: expected a float32 CPU tensor"):
        ext.block_linear_int8(x.double(), blocks, "q4_1", "")
    with pytest.raises(RuntimeError, match="blocks: expected a contiguous 2-dim uint8"):
        ext.block_linear_int8(x, blocks.to(torch.int8), "q4_1", "")
    with pytest.raises(RuntimeError, match="fmt: expected 'q4_1' or 'q8_0', got 'q4_0'"):
        ext.block_linear_int8(x, blocks, "q4_0", "")
    with pytest.raises(RuntimeError, match="road: unknown 'avx9'; this build has"):
        ext.block_linear_int8(x, blocks, "q4_1", "avx9")
    with pytest.raises(RuntimeError, match="last dim 40 is not a multiple of the block size 32"):
        ext.quantize_activations_int8(torch.randn(3, 40), "")
    with pytest.raises(ValueError, match="unknown block format 'q4_0'"):
        int8.block_linear_int8(x, blocks, "q4_0")
    with pytest.raises(ValueError, match="x: last dim 48 is not a multiple of the block size 32"):
        int8.quantize_activations(torch.randn(2, 48))
    with pytest.raises(ValueError, match="blocks: 2 q4_1 blocks a row do not take 128 inputs"):
        int8.block_linear_int8_reference(torch.randn(2, 128), blocks, "q4_1")
    with pytest.raises(TypeError, match="x: expected float32"):
        int8.block_linear_int8_reference(x.double(), blocks, "q4_1")


def test_the_road_is_the_best_this_cpu_has(ext):
    flags = set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        line = next((ln for ln in cpuinfo.read_text().splitlines() if ln.startswith("flags")), "")
        flags = set(line.split(":")[-1].split())
    if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags:
        assert int8.int8_road() == "avx512-vnni"
    elif "avx_vnni" in flags:
        assert int8.int8_road() == "avx-vnni"
    elif {"avx2", "fma", "f16c"} <= flags:
        assert int8.int8_road() == "avx2"
    assert int8.int8_roads() == ext.int8_roads() and int8.int8_road() in int8.int8_roads()


def test_the_torch_road_is_the_same_bits(ext):
    """With compiled=False (and where nothing compiled) the reference runs: the same numbers."""
    blocks, _ = blocks_for(40, 320, "q4_1", seed=8)
    x = activations(6, 320, seed=9)
    with torch.inference_mode():
        on = int8.block_linear_int8(x, blocks, "q4_1")
        assert torch.equal(int8.block_linear_int8(x, blocks, "q4_1", compiled=False), on)
        with pytest.raises(RuntimeError, match="road 'avx2': the compiled kernels are not in use"):
            int8.block_linear_int8(x, blocks, "q4_1", "avx2", compiled=False)


def packing_roads() -> list[str]:
    """The roads here with a packed layout: the x86 ones (the portable loop reads blocks as they lie)."""
    return [r for r in int8.int8_roads() if r != "scalar"] if int8.packed_here() else []


@pytest.mark.parametrize("fmt", [*FORMATS, "q5_0", "q4_k", "q6_k"])
@pytest.mark.parametrize("shape", [*SHAPES, (576, 1536), (960, 576)])
def test_every_packed_layout_is_the_reference_bit_for_bit(ext, fmt, shape):
    """Products read packed copies: short last groups of blocks, short last groups of rows, 1..9 rows of x (two
    tiles and a short one) must all give block_linear_int8's bits, on every road that packs."""
    if not packing_roads():
        pytest.skip("no road with a packed layout on this CPU")
    n, k = shape
    if k % quant.block_weights(fmt):
        k = -(-k // 256) * 256  # a K-quant's rows are whole super-blocks
    blocks, _ = blocks_for(n, k, fmt, seed=n * k)
    x = activations(9, k, seed=k + 1)
    with torch.inference_mode():
        for road in packing_roads():
            packed = int8.pack(blocks, fmt, road)
            if packed is None:  # AVX512-VNNI's quads have no K-quant layout: its product reads the blocks
                assert fmt in int8.ROWS_ONLY and road == "avx512-vnni"
                continue
            row = k // 32 * int8.PACKED_BLOCK_BYTES[int8.PACKED_AS[fmt]]  # Q5_0 packs as Q8_0, K-quants as K8
            assert packed.numel() == -(-n // 4) * 4 * row + 64  # the same bytes, rows padded to fours, and a
            # 64-byte tail
            for rows in range(1, 10):
                want = int8.block_linear_int8_reference(x[:rows], blocks, fmt)
                assert torch.equal(int8.block_linear_int8_packed(x[:rows], packed, fmt, n, road), want), (road, rows)


def test_packed_layouts_keep_non_finite_blocks_and_refuse_bad_input(ext):
    if not packing_roads():
        pytest.skip("no road with a packed layout on this CPU")
    blocks, _ = blocks_for(6, 96, "q4_1", seed=5)
    x = activations(3, 96, seed=6)
    x[1, 40] = float("inf")  # block 1 of row 1: NaN out, as on every road
    with torch.inference_mode():
        for road in packing_roads():
            got = int8.block_linear_int8_packed(x, int8.pack(blocks, "q4_1", road), "q4_1", 6, road)
            assert torch.equal(got.isnan(), int8.block_linear_int8(x, blocks, "q4_1").isnan()) and got[1].isnan().all()
    packed = int8.pack(blocks, "q4_1")
    with pytest.raises(RuntimeError, match=r"packed: expected the 544 contiguous uint8 bytes of 6 rows of 96 inputs"):
        int8.block_linear_int8_packed(x, packed[:-1], "q4_1", 6)
    with pytest.raises(RuntimeError, match=r"packed: expected the 784 contiguous uint8 bytes of 12 rows"):
        int8.block_linear_int8_packed(x, packed, "q4_1", 12)
    with pytest.raises(RuntimeError, match="fmt: expected 'q4_1', 'q8_0', 'q4_k8' or 'q6_k8', got 'q5_0'"):
        ext.pack_blocks_int8(blocks, "q5_0", "")
    with pytest.raises(RuntimeError, match=r"blocks: expected a contiguous uint8 CPU tensor \(rows, n \* 34\)"):
        ext.pack_blocks_int8(blocks, "q8_0", "")  # rows of 60 bytes are not Q8_0's
    with pytest.raises(RuntimeError, match="road 'scalar' has no packed layout"):
        int8.pack(blocks, "q4_1", "scalar")


GROUPED = ["q5_0", "q4_k", "q6_k"]  # quant.cpp's formats read 32 weights a group (Gemma 3's GGUF)
K_SHAPES = [(1, 256), (7, 512), (17, 768), (33, 1280), (40, 4096)]  # 16 groups a lane wrap past 512 inputs


@pytest.mark.parametrize("fmt", GROUPED)
@pytest.mark.parametrize("shape", K_SHAPES)
def test_grouped_formats_every_road_is_the_reference_bit_for_bit(ext, fmt, shape):
    """Q5_0, Q4_K and Q6_K on int8 activations: the portable loop and AVX2's integer sums (every x86 road) give
    the torch reference's bits, for 1 to 6 rows of x (tiles of four and what is left)."""
    n, k = shape
    blocks, _ = blocks_for(n, k, fmt, seed=n + k)
    x = activations(6, k, seed=k)
    with torch.inference_mode():
        for rows in range(1, 7):
            want = int8.block_linear_int8_reference(x[:rows], blocks, fmt)
            assert torch.equal(int8.block_linear_int8(x[:rows], blocks, fmt), want), rows
            assert torch.equal(int8.block_linear_int8(x[:rows], blocks, fmt, compiled=False), want), rows
            for road in ext.int8_roads():
                assert torch.equal(int8.block_linear_int8(x[:rows], blocks, fmt, road), want), (road, rows)


@pytest.mark.parametrize("k", [96, 352, 608])
def test_q5_0_rows_off_a_chunk_of_eight_groups(ext, k):
    """A Q5_0 row of 3, 11 or 19 groups: the x86 roads take eight at a time, then the rest one at a time."""
    blocks, _ = blocks_for(9, k, "q5_0", seed=k)
    x = activations(5, k, seed=k + 1)
    with torch.inference_mode():
        want = int8.block_linear_int8_reference(x, blocks, "q5_0")
        for road in ext.int8_roads():
            assert torch.equal(int8.block_linear_int8(x, blocks, "q5_0", road), want), road


@pytest.mark.parametrize("k", [32, 96, 352, 640, 2048])
def test_one_row_of_x_reads_q5_0s_own_blocks_with_the_packed_copys_bits(ext, k):
    """A decode step's one row of x meets a Q5_0 weight's own blocks on AVX512-VNNI (eight at a time, a short last
    eight), two rows and more its packed Q8_0 copy: the same bits either way, and the reference's."""
    assert int8.q5_0_blocks(1) == (int8.int8_road() == "avx512-vnni") and not int8.q5_0_blocks(2)
    blocks, _ = blocks_for(37, k, "q5_0", seed=k)
    x = activations(3, k, seed=k + 2)
    packed = int8.pack(blocks, "q5_0")
    with torch.inference_mode():
        for rows in (1, 2, 3):
            want = int8.block_linear_int8_reference(x[:rows], blocks, "q5_0")
            assert torch.equal(int8.block_linear_int8(x[:rows], blocks, "q5_0", packed=packed), want), rows
            assert torch.equal(int8.block_linear_int8(x[:rows], blocks, "q5_0"), want), rows


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
def test_k8_blocks_hold_the_groups_terms(fmt):
    """A K8 block is its group's scales and integers as the product's steps read them (`group_terms`)."""
    blocks, _ = blocks_for(5, 512, fmt, seed=12)
    k8 = int8.as_k8(blocks, fmt).view(5, 16, 40)
    qw, a, b, _ = int8.group_terms(blocks, fmt)
    assert torch.equal(k8[..., :4].contiguous().view(torch.float32)[..., 0], a)
    assert torch.equal(k8[..., 4:8].contiguous().view(torch.float32)[..., 0], b)
    assert torch.equal(k8[..., 8:].contiguous().view(torch.int8).int(), qw)
    with pytest.raises(ValueError, match="as_k8 reads q4_k and q6_k blocks, not q5_0"):
        int8.as_k8(blocks, "q5_0")


def test_q5_0_as_q8_0_holds_the_same_numbers_and_gives_the_same_product():
    """Every Q5_0 bit pattern (finite d): the Q8_0 blocks dequantize to the same weights, and on the torch
    reference (the compiled roads' bits) their int8 product is the Q5_0 product's."""
    blocks = torch.randint(0, 256, (7, 4 * 22), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    blocks.view(7, 4, 22)[..., 1] &= 0xbb  # d finite
    q8 = int8.q5_0_as_q8_0(blocks)
    assert q8.shape == (7, 4 * 34)
    assert torch.equal(quant.dequantize(q8, "q8_0"), quant.dequantize(blocks, "q5_0"))
    x = activations(3, 128, seed=4)
    assert torch.equal(int8.block_linear_int8_reference(x, q8, "q8_0"),
                       int8.block_linear_int8_reference(x, blocks, "q5_0"))
    with pytest.raises(ValueError, match=r"blocks: expected uint8 \(rows, n \* 22\) for q5_0"):
        int8.q5_0_as_q8_0(blocks[:, :30])


@pytest.mark.parametrize("fmt", GROUPED)
def test_grouped_formats_on_random_bytes_and_in_any_batch(ext, fmt):
    """Every bit pattern of the blocks (finite fp16 fields) the reference's way, and a row's bits in any batch."""
    f = quant.FORMATS[fmt]
    blocks = torch.randint(0, 256, (24, 2 * f.bytes), generator=torch.Generator().manual_seed(7), dtype=torch.uint8)
    for at in {"q5_0": [0], "q4_k": [0, 2], "q6_k": [208]}[fmt]:
        blocks.view(24, 2, f.bytes)[..., at + 1] &= 0xbb
    x = activations(13, 2 * f.weights, seed=8)
    with torch.inference_mode():
        full = int8.block_linear_int8_reference(x, blocks, fmt)
        for road in ext.int8_roads():
            assert torch.equal(int8.block_linear_int8(x, blocks, fmt, road), full), road
            for rows in ([5], [0, 12], list(range(3, 10)), list(range(12, -1, -3))):
                assert torch.equal(int8.block_linear_int8(x[rows], blocks, fmt, road), full[rows]), (road, rows)


@pytest.fixture(params=["vector", "amx"])
def tile_unit(request, ext):
    """The tiled products' unit: the vector micro-kernel, or AMX's tile unit where this CPU and process have it."""
    was = int8.amx()
    try:
        int8.amx(request.param == "amx")
    except RuntimeError:
        pytest.skip("no AMX-INT8 tiles here")
    yield request.param
    int8.amx(was)


@pytest.mark.parametrize("fmt", [*FORMATS, *GROUPED])
@pytest.mark.parametrize("shape", [(5, 256), (17, 512), (33, 576), (21, 1536), (40, 2048), (100, 576)])
def test_many_rows_of_x_are_the_reference_bit_for_bit(ext, tile_unit, fmt, shape):
    """From `int8.tiled_rows()` rows of x the AVX512-VNNI road unpacks the weight rows once into tiles of 48 (each
    format an unpacker into the one layout) and multiplies every four rows of x by each (or, on AMX, every 16 in one
    tile operation a block): the reference's bits on both sides of each threshold (a block of x that holds inf among
    them; 100 weight rows are three tiles, the last short), and each row's bits alone (one row takes another road)."""
    n, k = shape
    if k % quant.block_weights(fmt):
        k = -(-k // 256) * 256  # a K-quant's rows are whole super-blocks
    blocks, _ = blocks_for(n, k, fmt, seed=n * k + 1)
    tiles, kquant_tiles = int8.tiled_rows()
    counts = sorted({16, 17, kquant_tiles - 1, kquant_tiles, kquant_tiles + 1, tiles - 1, tiles, tiles + 5})
    x = activations(counts[-1], k, seed=k + 2)
    x[7, 40:50] = float("inf")
    packed = int8.pack(blocks, fmt)
    with torch.inference_mode():
        want = int8.block_linear_int8_reference(x, blocks, fmt)
        for rows in counts:
            got = int8.block_linear_int8(x[:rows], blocks, fmt, packed=packed)
            torch.testing.assert_close(got, want[:rows], rtol=0, atol=0, equal_nan=True, msg=f"{rows} rows")
        alone = torch.cat([int8.block_linear_int8(x[r:r + 1], blocks, fmt, packed=packed) for r in range(len(x))])
        torch.testing.assert_close(alone, want, rtol=0, atol=0, equal_nan=True)
    assert want[7].isnan().all() and not want[6].isnan().any()


@pytest.mark.parametrize("fmt", GROUPED)
@pytest.mark.parametrize("loud", [False, True])
def test_grouped_formats_error_against_the_fp32_block_product(ext, fmt, loud):
    """As for Q4_1 and Q8_0: within x's rounding per output, 1% (2% with loud channels) over the matrix."""
    n, k = 640, 2048
    blocks, _ = blocks_for(n, k, fmt, seed=9)
    w = quant.dequantize(blocks, fmt).double()
    x = activations(8, k, seed=10) if loud else torch.randn(8, k, generator=torch.Generator().manual_seed(10))
    with torch.inference_mode():
        got = int8.block_linear_int8(x, blocks, fmt).double()
        fp32 = quant.block_linear(x, blocks, fmt).double()
    rounding = 2.0**-16 * (x.double().abs() @ w.abs().T)
    assert ((got - fp32).abs() <= int8.error_bound(x, blocks, fmt).double() * (1 + 1e-3) + rounding).all()
    assert ((got - fp32).norm() / fp32.norm()).item() < (0.02 if loud else 0.01)


def test_grouped_formats_refuse_bad_input(ext):
    blocks, _ = blocks_for(4, 512, "q4_k", seed=11)
    with pytest.raises(RuntimeError, match="last dim 320 is not a multiple of the block size 256"):
        ext.block_linear_int8(torch.randn(2, 320), blocks, "q4_k", "")
    with pytest.raises(RuntimeError, match="blocks: rows of 288 bytes, expected 420"):
        ext.block_linear_int8(torch.randn(2, 512), blocks, "q6_k", "")
    with pytest.raises(RuntimeError, match="fmt: expected 'q4_1', 'q8_0', 'q4_k8' or 'q6_k8'"):
        ext.pack_blocks_int8(blocks, "q4_k", "")  # the blocks are packed as K8 (`int8.as_k8`), never as they lie
    if "avx512-vnni" in ext.int8_roads():
        assert int8.pack(blocks, "q4_k", "avx512-vnni") is None  # so its products read the blocks
        with pytest.raises(RuntimeError, match="road 'avx512-vnni' has no packed layout for q4_k8"):
            ext.pack_blocks_int8(int8.as_k8(blocks, "q4_k"), "q4_k8", "avx512-vnni")
