"""The block product against its references: the fp32 sums it promises (bit for bit, in its fixed order),
the float64 product of the same weights, gguf's own dequantization; its refusals of bad input; the same
bits for a row in any batch; and a machine without a compiler, which gets one warning and the same weights."""

import shutil
import warnings

import numpy as np
import pytest
import torch

from nanoserve import kernels
from nanoserve.kernels import quant

HAVE_COMPILER = any(shutil.which(c) for c in ("c++", "g++", "clang++"))
FORMATS = ["q4_1", "q8_0"]
GROUPED = ["q5_0", "q4_k", "q6_k"]  # unpacked 32 weights at a time on the "avx2" and "portable" roads
# (out rows, in features, x rows): odd block counts, row counts off every tile and task size, and 1-4 rows of
# x, which take several weight rows together (with one at a time for what is left of a task)
SHAPES = [(1, 32, 1), (7, 96, 3), (17, 160, 9), (33, 576, 5), (50, 1536, 13), (129, 64, 33), (39, 96, 1),
          (38, 160, 2), (21, 64, 4), (45, 160, 70)]  # the last: many rows of x over expanded weight rows
# the same for rows of 256-weight super-blocks (every format takes them): 1 and 2 rows of x expand in registers
# (1 row: two weight rows together, and one alone for an odd count), 3 or more over an expanded weight row
K_SHAPES = [(1, 256, 1), (7, 512, 3), (17, 768, 2), (33, 256, 5), (39, 1280, 1), (38, 256, 2), (21, 512, 4),
            (45, 256, 70), (16, 2048, 8)]


@pytest.fixture(scope="module")
def block_ext():
    module = quant.load()
    if module is None:
        if HAVE_COMPILER:
            pytest.fail(f"a C++ compiler is here but the block product did not build: {quant.unavailable_reason()}")
        pytest.skip(f"no C++ compiler: {quant.unavailable_reason()}")
    return module


def blocks_for(n: int, k: int, fmt: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    return quant.quantize(w, fmt), w


def fixed_order(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The kernel's documented arithmetic in torch: 32 running sums per dot product (sum j takes weight j
    of every block, in block order, by fused multiply-add: the product is exact in float64), then the tree."""
    B, K = x.shape
    nb = K // 32
    xb, wb = x.view(B, 1, nb, 32).double(), w.view(1, -1, nb, 32).double()
    s = torch.zeros(B, w.shape[0], 32)
    for b in range(nb):
        s = (xb[:, :, b] * wb[:, :, b] + s.double()).float()
    t = s[..., :16] + s[..., 16:]
    for half in (8, 4, 2, 1):
        t = t[..., :half] + t[..., half:2 * half]
    return t[..., 0]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", SHAPES)
def test_block_linear_is_its_fixed_order_sum_bit_for_bit(block_ext, fmt, shape):
    n, k, rows = shape
    blocks, _ = blocks_for(n, k, fmt, seed=n + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    w = quant.dequantize(blocks, fmt)
    with torch.inference_mode():
        out = quant.block_linear(x, blocks, fmt)
    assert out.shape == (rows, n)
    assert torch.equal(out, fixed_order(x, w))  # AVX-512, AVX2 and the portable loop all compute this
    exact = x.double() @ w.double().T
    assert (out.double() - exact).abs().max().item() <= 1e-6 * max(1.0, exact.abs().max().item())


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_row_has_the_same_bits_in_any_batch(block_ext, fmt):
    """The engine batches rows freely: a row's product may not depend on the rows beside it."""
    blocks, _ = blocks_for(200, 576, fmt, seed=3)
    x = torch.randn(37, 576, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        full = quant.block_linear(x, blocks, fmt)
        for rows in ([5], [0, 36], list(range(3, 12)), list(range(36, -1, -3)), list(range(1, 37))):
            assert torch.equal(quant.block_linear(x[rows], blocks, fmt), full[rows]), rows
        assert torch.equal(quant.block_linear(x.view(37, 1, 576), blocks, fmt), full.view(37, 1, 200))


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_is_gguf_own_dequantization_exactly(fmt):
    """The weights the kernel expands are the numbers the fp32 conversion writes (gguf.quants)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    blocks, w = blocks_for(24, 192, fmt, seed=5)
    theirs = dequantize(blocks.numpy(), getattr(GGMLQuantizationType, fmt.upper()))
    ours = quant.dequantize(blocks, fmt)
    assert torch.equal(ours, torch.from_numpy(np.asarray(theirs, dtype=np.float32)).view(24, 192))
    step = 1 / 15 if fmt == "q4_1" else 1 / 127  # rounding: at most half a step of the block's range
    assert ((ours - w).abs() <= w.abs().amax() * 2 * step * 0.5 * 1.01).all()


def test_bad_inputs_are_refused_with_the_reason(block_ext):
    blocks, _ = blocks_for(8, 64, "q4_1", seed=6)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="x: expected a float32 CPU tensor"):
        block_ext.block_linear(x.double(), blocks, "q4_1")
    with pytest.raises(RuntimeError, match="blocks: expected a contiguous 2-dim uint8"):
        block_ext.block_linear(x, blocks.to(torch.int8), "q4_1")
    with pytest.raises(RuntimeError, match="blocks: rows of 40 bytes, expected 68"):
        block_ext.block_linear(x, blocks, "q8_0")  # Q4_1 rows read as Q8_0
    with pytest.raises(RuntimeError, match="last dim 48 is not a multiple of the block size 32"):
        block_ext.block_linear(torch.randn(2, 48), blocks, "q4_1")
    with pytest.raises(RuntimeError, match="blocks: expected a contiguous"):
        block_ext.block_linear(x, blocks.t().contiguous().t(), "q4_1")
    with pytest.raises(ValueError, match="unknown block format 'q4_0'"):
        quant.block_linear(x, blocks, "q4_0")
    with pytest.raises(ValueError, match="blocks: expected uint8"):
        quant.dequantize(blocks[:, :-1], "q4_1")
    with pytest.raises(ValueError, match="not a multiple of the block size"):
        quant.quantize(torch.randn(4, 40), "q8_0")


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_torch_road_is_the_same_weights(block_ext, fmt):
    """With compiled=False (and where nothing compiled), the product runs on dequantize's matrix."""
    blocks, _ = blocks_for(40, 320, fmt, seed=7)
    x = torch.randn(6, 320, generator=torch.Generator().manual_seed(8))
    with torch.inference_mode():
        on = quant.block_linear(x, blocks, fmt)
        off = quant.block_linear(x, blocks, fmt, compiled=False)
    torch.testing.assert_close(off, on, atol=1e-5, rtol=1e-5)


def test_no_compiler_falls_back_with_one_warning(monkeypatch):
    """The block product is part of the kernels' extension: without a compiler the kernels warn once, and the
    product runs on dequantize's matrix, saying nothing more."""
    from torch.utils import cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension: c++: command not found")

    saved = dict(kernels._state)
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    monkeypatch.delenv(kernels.DISABLE_ENV, raising=False)
    blocks, w = blocks_for(12, 96, "q8_0", seed=9)
    x = torch.randn(3, 96)
    with pytest.warns(RuntimeWarning, match="compiled kernels are unavailable") as caught:
        with torch.inference_mode():
            out = quant.block_linear(x, blocks, "q8_0")
    assert len(caught) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call says nothing more
        with torch.inference_mode():
            again = quant.block_linear(x, blocks, "q8_0")
    assert torch.equal(out, again) and "command not found" in quant.unavailable_reason()
    torch.testing.assert_close(out, x @ quant.dequantize(blocks, "q8_0").T)
    assert not kernels.available() and quant.describe().startswith("dequantized copies (RuntimeError")
    assert saved.get("module") is not kernels._state.get("module")


def finite_random_blocks(n: int, nb: int, fmt: str, seed: int) -> torch.Tensor:
    """Random bytes as n rows of nb blocks, each fp16 field made finite (exponent below 31): every bit pattern the
    unpackers can meet in a file, as far as the numbers stay numbers."""
    f = quant.FORMATS[fmt]
    b = torch.randint(0, 256, (n, nb, f.bytes), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    for at in {"q4_1": [0, 2], "q8_0": [0], "q5_0": [0], "q4_k": [0, 2], "q6_k": [208]}[fmt]:
        b[..., at + 1] &= 0xbb  # sign kept, exponent bits 0-1 and 3 only: at most 27
    return b.reshape(n, -1)


@pytest.mark.parametrize("fmt", FORMATS + GROUPED)
def test_dequantize_is_gguf_bit_for_bit_on_random_bytes_and_quantized_weights(fmt):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = getattr(GGMLQuantizationType, fmt.upper())
    w = torch.randn(12, 512, generator=torch.Generator().manual_seed(10)) * 0.05
    for blocks in (quant.quantize(w, fmt), finite_random_blocks(12, 512 // quant.block_weights(fmt), fmt, 11)):
        theirs = torch.from_numpy(np.asarray(dequantize(blocks.numpy(), qtype), dtype=np.float32)).view(12, 512)
        ours = quant.dequantize(blocks, fmt)
        assert ours.isfinite().all() and torch.equal(ours, theirs)


def test_the_kernels_table_is_the_python_table(block_ext):
    """Every format has a kernel on the build's road, and the C++ table's bytes and weights a block are FORMATS'."""
    table = block_ext.block_kernels()
    assert {name for name, _, _, _ in table} == set(quant.FORMATS)
    for name, road, nbytes, weights in table:
        assert (nbytes, weights) == (quant.block_bytes(name), quant.block_weights(name)), (name, road)
    for fmt in GROUPED:
        assert quant.roads(fmt)[-1] == "portable"


@pytest.mark.parametrize("fmt", GROUPED)
def test_each_road_expands_exactly_dequantize_numbers(block_ext, fmt):
    """What a road's product multiplies by is quant.dequantize's fp32, bit for bit, on any bit pattern."""
    nb = 1024 // quant.block_weights(fmt)
    blocks = finite_random_blocks(9, nb, fmt, seed=12)
    want = quant.dequantize(blocks, fmt)
    for road in quant.roads(fmt):
        assert torch.equal(block_ext.block_dequantize(blocks, 1024, fmt, road), want), road


@pytest.mark.parametrize("fmt", GROUPED + FORMATS)
@pytest.mark.parametrize("shape", K_SHAPES)
def test_every_road_is_the_fixed_order_sum_bit_for_bit(block_ext, fmt, shape):
    """Q5_0, Q4_K and Q6_K sum as Q4_1 and Q8_0 do (32 running sums over groups of 32, then the tree), on every
    road; the result is x @ dequantize(w).T within 1e-6 of the largest output, as the float64 product shows."""
    n, k, rows = shape
    blocks, _ = blocks_for(n, k, fmt, seed=n + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    w = quant.dequantize(blocks, fmt)
    want = fixed_order(x, w)
    exact = x.double() @ w.double().T
    for road in quant.roads(fmt):
        with torch.inference_mode():
            out = quant.block_linear(x, blocks, fmt, road=road)
        assert torch.equal(out, want), road
        assert (out.double() - exact).abs().max().item() <= 1e-6 * max(1.0, exact.abs().max().item())


@pytest.mark.parametrize("fmt", GROUPED)
def test_a_row_has_the_same_bits_in_any_batch_on_any_road(block_ext, fmt):
    blocks, _ = blocks_for(40, 512, fmt, seed=13)
    x = torch.randn(23, 512, generator=torch.Generator().manual_seed(14))
    with torch.inference_mode():
        full = quant.block_linear(x, blocks, fmt)
        for road in quant.roads(fmt):
            for rows in ([5], [0, 22], list(range(3, 12)), list(range(22, -1, -3)), list(range(23))):
                assert torch.equal(quant.block_linear(x[rows], blocks, fmt, road=road), full[rows]), (road, rows)
        torch.testing.assert_close(quant.block_linear(x, blocks, fmt, compiled=False), full, atol=1e-5, rtol=1e-5)


def test_super_block_rows_and_roads_are_checked(block_ext):
    blocks, _ = blocks_for(4, 512, "q4_k", seed=15)
    with pytest.raises(RuntimeError, match="last dim 320 is not a multiple of the block size 256"):
        block_ext.block_linear(torch.randn(2, 320), blocks, "q4_k")
    with pytest.raises(RuntimeError, match="blocks: rows of 288 bytes, expected 420"):
        block_ext.block_linear(torch.randn(2, 512), blocks, "q6_k")
    with pytest.raises(RuntimeError, match="fmt 'q4_k' on road 'avx9': this build has .*q4_k/portable"):
        block_ext.block_linear(torch.randn(2, 512), blocks, "q4_k", "avx9")
    with pytest.raises(ValueError, match="320 inputs is not a multiple of the block size 256 of q6_k"):
        quant.quantize(torch.randn(2, 320), "q6_k")
    with pytest.raises(ValueError, match="not a multiple of the block size 256 of q4_k"):
        quant.block_linear(torch.randn(2, 320), blocks, "q4_k", compiled=False)


def test_each_format_error_against_fp32_weights():
    """Each format's rounding of Gaussian weights (quantize, then dequantize), and the product's relative error,
    measured here and printed (`pytest -s`): more bits a weight, less error."""
    g = torch.Generator().manual_seed(16)
    w = torch.randn(256, 2048, generator=g)
    x = torch.randn(8, 2048, generator=g)
    exact = x.double() @ w.double().T
    rows = []
    for fmt in ["q8_0", "q6_k", "q5_0", "q4_1", "q4_k"]:
        dq = quant.dequantize(quant.quantize(w, fmt), fmt)
        err = (dq - w).abs()
        prod = ((x.double() @ dq.double().T - exact).norm() / exact.norm()).item()
        rows.append((fmt, 8 * quant.block_bytes(fmt) / quant.block_weights(fmt), err.max().item(), err.mean().item(),
                     prod))
    print("\nformat  bits/weight  max|w - dq(q(w))|  mean|w - dq(q(w))|  product rel. error  (w ~ N(0, 1))")
    for fmt, bits, mx, mean, prod in rows:
        print(f"{fmt:6}  {bits:11.4g}  {mx:17.4g}  {mean:18.4g}  {prod:18.3g}")
    means = {fmt: mean for fmt, _, _, mean, _ in rows}
    assert means["q8_0"] < means["q6_k"] < means["q5_0"] < min(means["q4_1"], means["q4_k"])
    assert all(prod < 0.2 for *_, prod in rows)


@pytest.mark.slow
def test_the_portable_build_gives_the_same_bits(block_ext):
    """quant.cpp built alone as a CPU without AVX2 gets it (every format on its portable road, Q4_1 and Q8_0
    included): the fixed order and this machine's build, bit for bit. Built once, cached by source (~1.5 min)."""
    from pathlib import Path

    name, flags = kernels.build_flags()
    if name == "nanoserve_kernels":
        pytest.skip("this machine's build is the portable one")
    flags = [f for f in flags if not f.startswith("-mavx") and f != "-mfma"] + [f"-I{kernels.CSRC}"]
    ext = kernels.build("nanoserve_quant_portable", [quant.SOURCE, Path(__file__).with_name(
        "quant_portable_module.cpp")], flags)
    assert {road for _, road, _, _ in ext.block_kernels()} == {"portable"}
    for fmt in FORMATS + GROUPED:
        for n, k, rows in K_SHAPES[:5] + K_SHAPES[7:]:
            blocks, _ = blocks_for(n, k, fmt, seed=n + k)
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            out = ext.block_linear(x, blocks, fmt)
            assert torch.equal(out, fixed_order(x, quant.dequantize(blocks, fmt))), (fmt, n, k, rows)
            with torch.inference_mode():
                assert torch.equal(out, quant.block_linear(x, blocks, fmt)), (fmt, n, k, rows)
        random = finite_random_blocks(5, 1024 // quant.block_weights(fmt), fmt, seed=17)
        assert torch.equal(ext.block_dequantize(random, 1024, fmt, ""), quant.dequantize(random, fmt)), fmt
