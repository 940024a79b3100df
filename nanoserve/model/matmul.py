"""The weight products on a CPU: which kernel multiplies x by a weight, and why (Day 11).

Every matrix is stored [in, out] (`linear_weight`): the same (out, in) tensor F.linear
expects, transposed in memory. `linear(x, w)` then takes the first road of `ROADS`, one table keyed by the
weight's format, that takes x and w (`road(x, w)` names it):

- x86 CPUs with AVX2 or AVX-512 (`TILES`), with the compiled kernels: `kernels.fp32_linear`, on the copy of w
  that `pack` lays out in tiles of 16 outputs. Each output sums its inputs in slices of 64, each slice an
  in-order chain, the slices added in order: one order for any number of rows, so a row gets the same bits
  alone as in a batch without rows added, and one row streams w at the memory's speed. torch's roads below sum
  one row and many in different orders (`bench layout --rows` compares them all).
- one row (a batch-1 decode step): a matrix-vector product is bound by how fast w streams
  from memory, and x @ w.T = sum_i x[i] * w.T[i] is a weighted sum of w's contiguous rows.
  F.embedding_bag computes exactly that (`bag_linear`); one batched product of row slices
  is the same sum (`bmm_linear`). `ONE_ROW` picks the faster per CPU. Both add the rows in
  bags and sum the partial sums, which rounds less than one long running sum.
- two or more rows (prefill, batched decode): oneDNN's product, which picks its kernel by what
  the CPU can do, reads a copy of w in its own blocked layout when `pack` made one, and gives
  each row the same bits however many rows the call has (batching relies on that).
- bf16 matrices (`Llama.cast_matrices`): x rounded to bf16 if it is fp32; on CPUs with AVX512_BF16, with the
  compiled kernels, `kernels.bf16_tiles_linear` on the copy of w that `pack` lays out in tiles of 16 outputs and
  pairs of inputs (one order for any number of rows, as fp32's tiles; AMX's tile unit multiplies them where the
  CPU has one, AVX512_BF16's pair products elsewhere); else oneDNN's bf16 product
  for any row count where it has a packed copy; where torch's oneDNN takes no bf16 (AVX2 CPUs, `bf16_road`), the
  compiled kernel `kernels.bf16_panels_linear` on the copy of w that `pack` lays out in panels of 16 outputs
  (`kernels.bf16_linear` on w itself where there is none), which streams the bf16 matrix and widens it (in
  registers, or once per column panel for many rows), or without kernels x and w widened to fp32 and multiplied
  on fp32's roads above (torch's own bf16 product reads an [in, out] matrix far slower there). The output stays
  bf16, widened by whatever reads it in fp32 (RoPE, the residual add), fed as is to the next product.
- anything else (gradients on, other dtypes, no oneDNN): F.linear.

A weight may also be a `BlockWeight`: GGUF's blocks as the checkpoint ships them (Q4_1, Q8_0: Day 25;
Gemma 3's Q5_0 and K-quants), multiplied where they lie by `kernels.quant.block_linear` for any number of
rows, or, opted into (`activations="int8"`), by `kernels.int8.block_linear_int8` on x quantized to int8
blocks, as llama.cpp multiplies them; or `RowGroups`, such weights of different formats stacked.

`python -m nanoserve bench layout` times the candidates on the machine at hand.
"""

from __future__ import annotations

import functools
import platform
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import handle_torch_function, has_torch_function

from .. import kernels
from ..kernels import int8, quant

ACTIVATIONS = ("fp32", "int8")  # what a BlockWeight multiplies: x as it is, or x quantized to int8 blocks


def linear_weight(out_features: int, in_features: int) -> nn.Parameter:
    """An (out, in) weight, as F.linear expects, laid out in memory as its transpose (in, out):
    `w.t()` is the contiguous tensor, so one row of x reads w as one front-to-back stream."""
    return nn.Parameter(torch.empty(in_features, out_features).t())


def _has_onednn() -> bool:
    """Whether this torch build carries oneDNN's linear (x86 and most ARM builds do)."""
    try:
        return torch.backends.mkldnn.is_available() and all(
            hasattr(torch.ops.mkldnn, op) for op in ("_linear_pointwise", "_reorder_linear_weight"))
    except (AttributeError, RuntimeError):
        return False


def one_row_road() -> str:
    """How `linear` multiplies one row on this CPU: "bag" on AMD CPUs with AVX-512, where embedding_bag
    streamed fastest, "bmm" elsewhere (AVX2 CPUs, Intel's AVX-512 ones), where one batched product did.
    `python -m nanoserve bench layout` measures both on the machine at hand."""
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        return "bag"
    try:
        amd = "AuthenticAMD" in Path("/proc/cpuinfo").read_text()
    except OSError:
        amd = False
    return "bag" if capability == "AVX512" and amd else "bmm"


def tiles_road() -> bool:
    """Whether fp32 products take the compiled kernel's tiles here (`kernels.fp32_linear`): x86 CPUs whose widest
    vector unit torch uses is AVX2 or AVX-512 (the kernel is built for that unit). torch's one-row road sums in
    another order than its many-row one, so a batch-invariant engine would put a lone request on oneDNN's product
    of a few rows, slow there; the tiles sum every row count in one order, the same on both units
    (`python -m nanoserve bench layout --rows` compares the roads on the machine at hand). Elsewhere torch's
    roads stay."""
    try:
        return platform.machine().lower() in ("x86_64", "amd64") and \
            torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    except (AttributeError, RuntimeError):
        return False


def cpu_flags() -> set[str]:
    try:
        line = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
    except (OSError, StopIteration):
        return set()
    return set(line.split(":", 1)[1].split())


@functools.lru_cache(maxsize=1)
def bf16_road() -> str:
    """How a bf16 product runs on this CPU: the compiled kernel's tiles ("tiles", on AVX512_BF16 CPUs: on AMX's
    tile unit where there is one, else on AVX512_BF16's pair products, `kernels.bf16_tiles_units`; one summation
    order for any row count, so a lone row needs no padding), oneDNN's own product (the kernels off: "amx-bf16" on
    AMX, whose kernels differ with the row count and so change a row's last bits with its batch; "avx512-bf16";
    "avx512", widening bf16 to fp32 for fp32 FMAs), or, where torch's oneDNN takes no bf16 (AVX2 CPUs), x and w
    widened to fp32 by `linear`, in the compiled kernel or for fp32's product ("widen"). Each multiplies bf16
    numbers (their products exact in fp32), sums in fp32 and rounds the output to bf16: the same numbers to a last
    bf16 digit, at different speeds."""
    flags, onednn = cpu_flags(), ONEDNN and onednn_takes_bf16()
    if kernels.bf16_tiles_here():
        return "tiles"
    if not onednn:
        return "widen"
    if "amx_bf16" in flags:
        return "amx-bf16"
    return "avx512-bf16" if "avx512_bf16" in flags else "avx512"


@functools.lru_cache(maxsize=1)
def onednn_takes_bf16() -> bool:
    """Whether torch's oneDNN blocks a bf16 weight here (what `pack` needs): asked of it, once."""
    try:
        with torch.inference_mode(False), torch.no_grad():
            torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 16)
        return True
    except (AttributeError, RuntimeError):
        return False


ONEDNN = _has_onednn()
ONEDNN_DTYPES = (torch.float32, torch.bfloat16)  # what `pack` blocks for oneDNN (bf16 where its build takes bf16)
ONE_ROW = one_row_road()
TILES = tiles_road()
BAG_ROWS = 16  # rows per partial sum of the bag road (at least): the rounding is best near 16
PARTIAL_SUMS = 1 << 19  # at most this many partial-sum floats (2 MB): only the LM head needs bigger bags
BMM_ROWS = 32  # rows per slice of the bmm road (it divides the model's in-features: 576, 1536)
PACK_ROWS = 32  # the row count oneDNN blocks a packed weight for; calls of any other count read it too
ROW_MULTIPLE = 4
"""Products of two or more rows run a multiple of this many (zero rows added). oneDNN gives a row
the same bits for any count; MKL's F.linear (the fallback) only when the count is a multiple of 4."""


def forward_rows(n: int) -> int:
    """Rows a product of n rows runs: one row alone (its own road), else n rounded up to ROW_MULTIPLE."""
    return 1 if n == 1 else -(-n // ROW_MULTIPLE) * ROW_MULTIPLE


@functools.lru_cache(maxsize=32)
def _bags(n_in: int, n_out: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Row indices 0..n_in-1 and the offsets that cut them into bags. Made once per shape, outside
    inference mode so that autograd may save them when a caller records gradients."""
    rows_per_bag = max(BAG_ROWS, -(-n_in * n_out // PARTIAL_SUMS))
    with torch.inference_mode(False):
        return torch.arange(n_in, device=device), torch.arange(0, n_in, rows_per_bag, device=device)


def bag_linear(x: Tensor, w: Tensor) -> Tensor:
    """x @ w.T for ONE row x and a weight stored [in, out]: the weighted sum of w.T's rows,
    summed by F.embedding_bag in bags of BAG_ROWS (or more) and the bags' partial sums added."""
    n_out, n_in = w.shape
    rows, offsets = _bags(n_in, n_out, x.device)
    partial = F.embedding_bag(rows, w.t(), offsets, mode="sum", per_sample_weights=x.reshape(n_in))
    return partial.sum(0).view(*x.shape[:-1], n_out)  # partial: (bags, out)


def bmm_linear(x: Tensor, w: Tensor) -> Tensor:
    """The same sum as `bag_linear` as one batched product: w.T's rows in slices of BMM_ROWS, each
    slice times its piece of x, then the slices' partial sums added. Needs n_in % BMM_ROWS == 0."""
    n_out, n_in = w.shape
    slices = n_in // BMM_ROWS
    partial = torch.bmm(x.reshape(slices, 1, BMM_ROWS), w.t().view(slices, BMM_ROWS, n_out))  # (slices, 1, out)
    return partial.sum(0).view(*x.shape[:-1], n_out)


def pack(w: Tensor, rows: int = PACK_ROWS, tiles: bool = True) -> bool:
    """Keep a copy of w beside it (an attribute of w) for `linear` to read: its tiles (`tiled`) where `TILES` and
    the kernels are built (a bf16 w: where `bf16_road` is "tiles"; its panels, `panels`, where it is "widen"),
    else, or with `tiles` False (`bench layout` compares the two), oneDNN's blocked layout (`packed`, made for
    `rows` rows). False where there is none. The copy costs w's bytes again, and is ignored once w is written (its
    version moves on): it never serves stale weights."""
    if not (w.device.type == "cpu" and w.dim() == 2) or w.is_inference():
        return False  # (an inference tensor keeps no version: a write to it could not be seen)
    if tiles and ((TILES and w.dtype == torch.float32 and kernels.available()) or
                  (w.dtype == torch.bfloat16 and bf16_road() == "tiles")):
        with torch.inference_mode(False), torch.no_grad():
            copy = kernels.pack_fp32(w.detach()) if w.dtype == torch.float32 else kernels.pack_bf16(w.detach())
            w._nanoserve_tiles = (w._version, copy)
        return True
    if tiles and w.dtype == torch.bfloat16 and bf16_road() == "widen" and kernels.available() and w.shape[0] % 16 == 0:
        with torch.inference_mode(False), torch.no_grad():
            w._nanoserve_panels = (w._version, kernels.pack_bf16_panels(w.detach()))
        return True
    if not (ONEDNN and w.dtype in ONEDNN_DTYPES):
        return False
    try:
        with torch.inference_mode(False), torch.no_grad():
            blocked = torch.ops.mkldnn._reorder_linear_weight(w.detach(), rows)
    except RuntimeError:  # bf16 on a CPU (or an ONEDNN_MAX_CPU_ISA) torch's oneDNN takes no bf16 on
        return False
    w._nanoserve_packed = (w._version, blocked)
    return True


def packed(w: Tensor) -> Tensor | None:
    """w's oneDNN-blocked copy, if it has a current one."""
    entry = getattr(w, "_nanoserve_packed", None)
    return entry[1] if entry is not None and entry[0] == w._version else None


def tiled(w: Tensor) -> Tensor | None:
    """w's tiles for `kernels.fp32_linear` (or, bf16, `kernels.bf16_tiles_linear`), if it has a current copy."""
    entry = getattr(w, "_nanoserve_tiles", None)
    return entry[1] if entry is not None and entry[0] == w._version and entry[1].dtype == w.dtype else None


def panels(w: Tensor) -> Tensor | None:
    """w's panels for `kernels.bf16_panels_linear` (a bf16 w where `bf16_road` is "widen"), if it has a current copy."""
    entry = getattr(w, "_nanoserve_panels", None)
    return entry[1] if entry is not None and entry[0] == w._version else None


def onednn_linear(x: Tensor, w: Tensor) -> Tensor:
    """x @ w.T through oneDNN's product (torch's bundled mkldnn), on w's packed copy if it has one.
    Routed through handle_torch_function so tools that watch torch calls see the product and its weight."""
    if has_torch_function((x, w)):
        return handle_torch_function(onednn_linear, (x, w), x, w)
    wp = packed(w)
    return torch.ops.mkldnn._linear_pointwise(x, w if wp is None else wp, None, "none", [], "")


class BlockWeight(nn.Module):
    """A weight (out, in) held as GGUF blocks, 32 weights of a row to a block (256 for a K-quant,
    `kernels.quant`): what
    `linear` multiplies where it lies and `embedding` expands row by row. Its numbers are the fp32
    conversion's; its bytes a fraction of them. `activations`: what it multiplies, "fp32" (x as it is: the
    fp32 conversion's products) or "int8" (x rounded to int8 blocks first, `kernels.int8`: faster, not exact)."""

    def __init__(self, blocks: Tensor, fmt: str, in_features: int, activations: str = "fp32"):
        super().__init__()
        per = quant.block_weights(fmt)
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or in_features % per \
                or blocks.shape[1] != in_features // per * quant.block_bytes(fmt):
            raise ValueError(f"blocks {blocks.dtype} {tuple(blocks.shape)} do not hold {fmt} rows of {in_features}")
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations={activations!r}: expected one of {ACTIVATIONS}")
        self.fmt, self.activations = fmt, activations
        self.register_buffer("blocks", blocks.contiguous())  # (out, in / per block * bytes) uint8
        self.shape = torch.Size((blocks.shape[0], in_features))
        self._int8_packed: tuple[int, Tensor] | None = None
        self.keep_packed = True  # whether int8_packed may keep a copy (`load(..., pack=False)`: not)

    def int8_packed(self) -> Tensor | None:
        """The blocks in the int8 product's packed layout, for int8 activations on a CPU whose road has one
        (`kernels.int8.packed_here`: the x86 roads), else None. Made on first use and kept beside the blocks
        (their bytes again, as `pack` keeps oneDNN's copy of an fp32 matrix); the blocks are the checkpoint's,
        never written."""
        kept = self._int8_packed  # every product asks: the kept copy first, read past nn.Module's attribute lookup
        if kept is not None and self.keep_packed and self.activations == "int8" \
                and kept[0] == self._buffers["blocks"].data_ptr():
            return kept[1]
        if not self.keep_packed or self.activations != "int8" or self.blocks.device.type != "cpu":
            return None
        if not int8.packed_here():
            return None
        self._int8_packed = (self.blocks.data_ptr(), int8.pack(self.blocks, self.fmt))
        return self._int8_packed[1]

    def keep_int8_packed(self, packed: Tensor) -> None:
        """Keep `packed` as the packed copy (the same bytes `int8_packed` makes, held elsewhere: `pack_int8`)."""
        self._int8_packed = (self.blocks.data_ptr(), packed)

    @classmethod
    def quantize(cls, w: Tensor, fmt: str) -> BlockWeight:
        """Blocks made from an fp32 weight (out, in) by llama.cpp's reference rounding."""
        return cls(quant.quantize(w, fmt), fmt, w.shape[1])

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32  # the numbers a product sees

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def nbytes(self) -> int:
        return self.blocks.numel()

    def dequantize(self) -> Tensor:
        """The weights (out, in) in fp32: what the fp32 conversion of the same file holds."""
        return quant.dequantize(self.blocks, self.fmt)

    def extra_repr(self) -> str:
        return f"{self.fmt}, out={self.shape[0]}, in={self.shape[1]}, activations={self.activations}"


class RowGroups(nn.Module):
    """A fused weight whose row groups the file ships in different formats (Gemma 3's q, k in Q5_0 and v in Q8_0,
    in half its layers): each group a `BlockWeight`, multiplied where it lies, the outputs side by side. Fusing
    them into one format would mean re-quantizing the checkpoint; this keeps its numbers."""

    def __init__(self, parts: list[BlockWeight]):
        super().__init__()
        if len({p.shape[1] for p in parts}) != 1:
            raise ValueError(f"row groups of {[p.shape[1] for p in parts]} inputs cannot be stacked")
        self.parts = nn.ModuleList(parts)
        self.shape = torch.Size((sum(p.shape[0] for p in parts), parts[0].shape[1]))

    dtype = BlockWeight.dtype

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)

    def dequantize(self) -> Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def extra_repr(self) -> str:
        return f"out={self.shape[0]}, in={self.shape[1]}"


def embedding(ids: Tensor, w: Tensor | BlockWeight, dtype: torch.dtype | None = None) -> Tensor:
    """Rows `ids` of a table w (V, C), like F.embedding, in `dtype` (default w's); a BlockWeight expands only
    the rows asked for."""
    if isinstance(w, BlockWeight):
        return quant.dequantize(w.blocks[ids.reshape(-1)], w.fmt).view(*ids.shape, w.shape[1])
    return F.embedding(ids, w).to(dtype or w.dtype)


Weight = Tensor | BlockWeight | RowGroups


class Road(NamedTuple):
    """One way to multiply x by a weight: its name, whether it takes this x and w here (`compiled` already made
    definite), and the product. `ROADS` lists them per weight format, first choice first."""

    name: str
    takes: Callable[[Tensor, Weight, bool], bool]
    product: Callable[[Tensor, Weight, bool], Tensor]


_DTYPE_FORMATS = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def weight_format(w: Weight) -> str:
    """The key `ROADS` is read by: "row-groups"; a BlockWeight's "blocks" or "blocks-int8" (what it multiplies,
    whatever its GGUF format: the block kernels take every one); a matrix's "fp32" or "bf16"; else "other"."""
    if isinstance(w, RowGroups):
        return "row-groups"
    if isinstance(w, BlockWeight):
        return "blocks-int8" if w.activations == "int8" else "blocks"
    return _DTYPE_FORMATS.get(w.dtype, "other")


def _cpu_in_out(x: Tensor, w: Tensor) -> bool:
    """fp32 x on the CPU and w stored [in, out], what every fp32 road below reads."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and w.stride() == (1, w.shape[0])


def _one_row(x: Tensor, w: Tensor) -> bool:
    return _cpu_in_out(x, w) and x.numel() == w.shape[1]


def _no_grad_cpu(x: Tensor) -> bool:
    return not torch.is_grad_enabled() and x.device.type == "cpu"


def _bf16(x: Tensor) -> Tensor:
    return x.to(torch.bfloat16)


def _fp32_tiles(x: Tensor, w: Tensor, compiled: bool) -> Tensor:
    n_out, n_in = w.shape
    return kernels.fp32_linear(x.reshape(-1, n_in), tiled(w), n_out).view(*x.shape[:-1], n_out)


def _bf16_tiles(x: Tensor, w: Tensor, compiled: bool) -> Tensor:
    n_out, n_in = w.shape
    return kernels.bf16_tiles_linear(_bf16(x).reshape(-1, n_in), tiled(w), n_out).view(*x.shape[:-1], n_out)


def _bf16_widening(x: Tensor, w: Tensor, compiled: bool) -> Tensor:
    n_out, n_in = w.shape
    return kernels.bf16_linear(_bf16(x).reshape(-1, n_in), w).view(*x.shape[:-1], n_out)


def _bf16_panels(x: Tensor, w: Tensor, compiled: bool) -> Tensor:
    n_out, n_in = w.shape
    return kernels.bf16_panels_linear(_bf16(x).reshape(-1, n_in), panels(w)).view(*x.shape[:-1], n_out)


def _recording(x: Tensor) -> bool:
    """Whether autograd records a product of x (the kernels have no backward)."""
    return x.requires_grad and torch.is_grad_enabled()


def _always(x: Tensor, w: Weight, compiled: bool) -> bool:
    return True


ROADS: dict[str, tuple[Road, ...]] = {
    "row-groups": (Road("each group's, side by side", _always,
                        lambda x, w, c: torch.cat([linear(x, p, c) for p in w.parts], -1)),),
    "blocks": (Road("block kernel", lambda x, w, c: c and not _recording(x),
                    lambda x, w, c: quant.block_linear(x, w.blocks, w.fmt, True)),
               Road("dequantized", _always, lambda x, w, c: quant.block_linear(x, w.blocks, w.fmt, False))),
    "blocks-int8": (Road("int8 kernel", lambda x, w, c: c and not _recording(x),
                         lambda x, w, c: int8.block_linear_int8(x, w.blocks, w.fmt, compiled=True,
                                                                packed=w.int8_packed())),
                    Road("int8 in torch", _always,
                         lambda x, w, c: int8.block_linear_int8(x, w.blocks, w.fmt, compiled=False))),
    "fp32": (Road("tiles", lambda x, w, c: c and _cpu_in_out(x, w) and not torch.is_grad_enabled()
                  and tiled(w) is not None, _fp32_tiles),
             Road("bmm", lambda x, w, c: _one_row(x, w) and ONE_ROW == "bmm" and w.shape[1] % BMM_ROWS == 0,
                  lambda x, w, c: bmm_linear(x, w)),
             Road("bag", lambda x, w, c: _one_row(x, w), lambda x, w, c: bag_linear(x, w)),
             Road("oneDNN", lambda x, w, c: _cpu_in_out(x, w) and ONEDNN and not torch.is_grad_enabled(),
                  lambda x, w, c: onednn_linear(x, w)),
             Road("F.linear", _always, lambda x, w, c: F.linear(x, w))),
    # bf16 matrices: x in bf16 (rounded if fp32), fp32 sums, bf16 out; each row's bits fixed on every road here
    "bf16": (Road("bf16 tiles", lambda x, w, c: c and _no_grad_cpu(x) and tiled(w) is not None, _bf16_tiles),
             Road("oneDNN bf16", lambda x, w, c: _no_grad_cpu(x) and packed(w) is not None,
                  lambda x, w, c: onednn_linear(_bf16(x), w)),
             Road("widening kernel, panels", lambda x, w, c: c and _no_grad_cpu(x) and panels(w) is not None,
                  _bf16_panels),
             Road("widening kernel", lambda x, w, c: c and _no_grad_cpu(x) and bf16_road() == "widen"
                  and w.stride() == (1, w.shape[0]), _bf16_widening),
             Road("widened to fp32", lambda x, w, c: _no_grad_cpu(x) and bf16_road() == "widen",
                  lambda x, w, c: linear(_bf16(x).float(), w.float()).to(w.dtype)),
             Road("F.linear", _always, lambda x, w, c: F.linear(_bf16(x), w))),
    "other": (Road("F.linear", _always, lambda x, w, c: F.linear(x, w)),),
}
"""Every product `linear` can take, per weight format, first choice first: a new format or kernel is a line here."""


def _first(x: Tensor, w: Weight, compiled: bool) -> Road:
    for r in ROADS[weight_format(w)]:  # (a plain loop: this runs for every matrix of every step)
        if r.takes(x, w, compiled):
            return r
    raise AssertionError("every format's last road takes any x")


def road(x: Tensor, w: Weight, compiled: bool | None = None) -> Road:
    """The road `linear` takes for x and w on this machine: the first of the weight format's that takes them."""
    return _first(x, w, kernels.resolve(compiled))


def linear(x: Tensor, w: Weight, compiled: bool | None = None) -> Tensor:
    """x @ w.T for a weight w (out, in), like F.linear, on the first road of `ROADS` that takes x and w (see the
    module doc). `compiled`: the kernels' roads (None: where built); without them, torch's roads for an fp32 or
    bf16 w, a dequantized copy for blocks with fp32 activations, the int8 product's torch reference (the same
    bits) for int8 activations."""
    c = kernels.resolve(compiled)
    return _first(x, w, c).product(x, w, c)
