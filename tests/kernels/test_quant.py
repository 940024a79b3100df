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
# (out rows, in features, x rows): odd block counts, row counts off every tile and task size, and 1-4 rows of
# x, which take several weight rows together (with one at a time for what is left of a task)
SHAPES = [(1, 32, 1), (7, 96, 3), (17, 160, 9), (33, 576, 5), (50, 1536, 13), (129, 64, 33), (39, 96, 1),
          (38, 160, 2), (21, 64, 4), (45, 160, 70)]  # the last: many rows of x over expanded weight rows


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
