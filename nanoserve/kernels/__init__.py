"""Compiled kernels: the small calls of a decoder layer, its paged attention, and the model on blocks, in C++.

Between its weight products a layer makes about twenty small torch calls: two norms, RoPE's
roll/negate/multiply/add, SwiGLU's silu and product, and the attention's gather, scores,
softmax and value sums. Each is a dispatch, an allocation and a pass over numbers the
products have just pushed out of the cache. Four loops (`csrc/kernels.cpp`) do the same
arithmetic in four calls:

    add_rms_norm     x + residual and its RMSNorm, one pass
    rope_            the q and k heads rotated in place
    silu_mul         silu(gate) * up (gelu_tanh_mul: Gemma's gelu_tanh(gate) * up)
    paged_attention  each query row over its request's keys, read where they lie in the pool; a long
                     decode row split into pieces on several cores and merged (split-K)

Each computes a row from that row's numbers only, so a row's result is the same whatever else is in the step.
Whether they run is the caller's explicit choice, `compiled`, one name everywhere: `model.ops` and the forward
take `compiled=True/False`, the model runner and the engine hold it for their steps (`use_kernels` resolves a
request for them against what this machine has); the two roads agree to fp32 rounding. The same extension holds
the product on GGUF blocks (`csrc/quant.cpp`, `kernels.quant`), `BlockModel` (`csrc/step.cpp`,
`model.compiled`), which steps a model on blocks through all of these in one call, the product of a bf16 matrix,
on AVX512_BF16's pair products (`bf16_tiles_linear`) or, where torch has no fast one, widened to fp32
(`bf16_linear`, or `bf16_panels_linear` on a copy packed at load; all `csrc/matmul_bf16.cpp`), and an fp32
matrix's product; the tiled ones sum in one order for any number of rows (`fp32_linear`,
`csrc/matmul_fp32.cpp`).

They are built on first use by torch's own extension builder (a C++ compiler and ninja), once
per machine, and cached under $NANOSERVE_HOME/kernels. Where that is impossible (no compiler,
or NANOSERVE_KERNELS=0) `load()` says why, once, and everything runs on torch's ops.
`python -m nanoserve kernels` builds them ahead of time (`make model` does).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor
from torch.overrides import handle_torch_function, has_torch_function

from ..config import nanoserve_home

CSRC = Path(__file__).parent / "csrc"
SOURCE = CSRC / "kernels.cpp"
SOURCES = [SOURCE, CSRC / "attention_bf16.cpp", CSRC / "matmul_bf16.cpp", CSRC / "matmul_fp32.cpp",
           CSRC / "quant.cpp", CSRC / "int8.cpp",
           CSRC / "step.cpp", CSRC / "peak.cpp", CSRC / "module.cpp"]  # one extension, and its header:
HEADERS = [CSRC / "nanoserve.h"]
DISABLE_ENV = "NANOSERVE_KERNELS"  # "0": never build or use them

_state: dict[str, object] = {}  # "module" once built; "reason" once it cannot be


def build_flags() -> tuple[str, list[str]]:
    """The extension's name and compiler flags for this CPU: x86 code for the widest vector unit torch
    dispatches to (AVX-512 or AVX2; the name says which, so a cache shared with another CPU cannot hand
    it the wrong build), the compiler's baseline elsewhere. Every build does the same arithmetic in the
    same order, so they give the same bits. -ffp-contract=off keeps a*b+c two roundings, as torch's ops
    round; -fno-trapping-math lets the loops with min/max vectorize."""
    flags = ["-O3", "-ffp-contract=off", "-fno-trapping-math"]
    if torch.backends.openmp.is_available() and sys.platform.startswith("linux"):
        flags.append("-fopenmp")  # at::parallel_for splits work over torch's threads only when built with OpenMP
    capability = ""
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        pass
    if platform.machine().lower() in ("x86_64", "amd64"):
        if capability == "AVX512":
            return "nanoserve_kernels_avx512", flags + ["-mavx2", "-mfma", "-mavx512f", "-mavx512vl", "-mavx512dq"]
        if capability == "AVX2":
            return "nanoserve_kernels_avx2", flags + ["-mavx2", "-mfma"]
    return "nanoserve_kernels", flags


def build_dir(name: str, sources: Sequence[Path] = SOURCES) -> Path:
    """Where a build lives: one folder per name, Python, torch, and sources (their paths and their text, and the
    header's), so two clones, or two versions of the source, never rebuild over each other's library."""
    py = f"py{sys.version_info[0]}{sys.version_info[1]}"
    digest = hashlib.sha256(b"\0".join(str(f.resolve()).encode() + b"\0" + f.read_bytes()
                                       for f in [*sources, *HEADERS]))
    return nanoserve_home() / "kernels" / f"{name}-{py}-torch{torch.__version__}-{digest.hexdigest()[:12]}"


def build(name: str, sources: Sequence[Path], flags: list[str], verbose: bool = False) -> ModuleType:
    """Compile `sources` as the extension `name` into its own folder (`build_dir`), or load it from there."""
    from torch.utils import cpp_extension

    folder = build_dir(name, sources)
    folder.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(name, [str(f) for f in sources], extra_cflags=flags, build_directory=str(folder),
                              verbose=verbose)


def load(verbose: bool = False) -> ModuleType | None:
    """The compiled kernels, built on first call; None (with one warning saying why) where they cannot be."""
    if "module" in _state:
        return _state["module"]  # type: ignore[return-value]
    if "reason" in _state:
        return None
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return _unavailable(f"{DISABLE_ENV}=0", warn=False)
    try:
        name, flags = build_flags()
        module = build(name, SOURCES, flags, verbose)
    except Exception as e:  # no compiler, no ninja, a failed build: the torch path still works
        return _unavailable(f"{type(e).__name__}: {_gist(str(e))}")
    _state["module"] = module
    return module


def _gist(message: str) -> str:
    """A build failure in one line: the compiler's first error if it printed one, else the first line."""
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    return next((ln for ln in lines if ": error:" in ln), lines[0] if lines else "no message")


def _unavailable(reason: str, warn: bool = True) -> None:
    _state["reason"] = reason
    if warn:
        warnings.warn(f"nanoserve's compiled kernels are unavailable ({reason}); the engine runs on torch ops "
                      "instead (slower, same tokens)", RuntimeWarning, stacklevel=3)
    return None


def unavailable_reason() -> str | None:
    """Why `load()` returned None, or None if it did not (or was not called)."""
    return _state.get("reason")  # type: ignore[return-value]


def available() -> bool:
    """Whether the kernels are built (or can be, on first call) on this machine."""
    return load() is not None


def resolve(want: bool | None) -> bool:
    """A `compiled=` argument made definite: None means wherever they are available."""
    return available() if want is None else bool(want)


def use_kernels(dtype: torch.dtype, want: bool | None = None) -> bool:
    """Resolve a `compiled=` argument for a model of `dtype`: None means where they can run (fp32, built),
    True insists (and says why it cannot), False never."""
    if want is False:
        return False
    if dtype != torch.float32:
        if want:
            raise ValueError(f"the compiled kernels are fp32 only; this model is {dtype}")
        return False
    if load() is None:
        if want:
            raise RuntimeError(f"the compiled kernels are unavailable: {unavailable_reason()}")
        return False
    return True


def fits(*tensors: Tensor, bf16: bool = False) -> bool:
    """Whether the kernels take these tensors: contiguous fp32 (or, with bf16, bf16) on the CPU, no gradient wanted."""
    if torch.is_grad_enabled():
        return False
    for t in tensors:  # (a plain loop: every layer op of every step asks)
        if not ((t.dtype == torch.float32 or (bf16 and t.dtype == torch.bfloat16)) and t.is_cpu and t.is_contiguous()):
            return False
    return True


# The calls. Each goes through handle_torch_function, as torch's own ops do, so tools that watch torch
# calls (the Day 12 profiler) see it by name.

def add_rms_norm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float,
                 h_dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """(x + residual, rms_norm(x + residual) * weight); with residual None, (x, rms_norm(x) * weight). x fp32,
    residual fp32 or bf16 (a bf16 product's output); the norm comes back in h_dtype (bf16: rounded once)."""
    args = (x, weight) if residual is None else (x, residual, weight)
    if has_torch_function(args):
        return handle_torch_function(add_rms_norm, args, x, residual, weight, eps, h_dtype)
    return _ext().add_rms_norm(x, residual, weight, eps, h_dtype == torch.bfloat16)


def rope_(qkv: Tensor, cos: Tensor, sin: Tensor, heads: int, round_bf16: bool = False) -> Tensor:
    """Rotate the first `heads` heads of qkv (N, heads_total, D) in place by cos/sin (N, D); with round_bf16, then
    round all of qkv to bf16's numbers (kept fp32) in the same call, as a bf16 K/V cache needs. Returns qkv."""
    if has_torch_function((qkv, cos, sin)):
        return handle_torch_function(rope_, (qkv, cos, sin), qkv, cos, sin, heads, round_bf16)
    _ext().rope_(qkv, cos, sin, heads, round_bf16)
    return qkv


def gelu_tanh_mul(gate_up: Tensor) -> Tensor:
    """gate_up (..., 2I) fp32 -> gelu_tanh(gate) * up (..., I): GeGLU's middle (Gemma), as x / (1 + e^(-2u))."""
    if has_torch_function((gate_up,)):
        return handle_torch_function(gelu_tanh_mul, (gate_up,), gate_up)
    return _ext().gelu_tanh_mul(gate_up)


def silu_mul(gate_up: Tensor) -> Tensor:
    """gate_up (..., 2I) -> silu(gate) * up (..., I), in gate_up's dtype (bf16: computed in fp32, rounded once)."""
    if has_torch_function((gate_up,)):
        return handle_torch_function(silu_mul, (gate_up,), gate_up)
    return _ext().silu_mul(gate_up)


def argmax_rows(logits: Tensor) -> Tensor:
    """logits (B, V) fp32 -> (B,) each row's first largest index, a NaN counting as largest (torch.argmax's)."""
    if has_torch_function((logits,)):
        return handle_torch_function(argmax_rows, (logits,), logits)
    return _ext().argmax_rows(logits)


def logprob_rows(logits: Tensor, tokens: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """logits (R, V) fp32, tokens (R,) int64 -> what log-probabilities read of each row, in one call: its
    log-sum-exp (R,) (torch.logsumexp's to a few ulp), the token's logit (R,), its rank (R,) (1 + the logits above
    it), and the row's k largest (R, k) with their indices (R, k) (torch.topk's; equal logits, the first index
    first)."""
    if has_torch_function((logits, tokens)):
        return handle_torch_function(logprob_rows, (logits, tokens), logits, tokens, k)
    return tuple(_ext().logprob_rows(logits, tokens, k))


def apply_bitmask_(logits: Tensor, bitmask: Tensor) -> Tensor:
    """logits (R, V) fp32, bitmask (R, ceil(V / 32)) int32: every token a row's bits forbid set to -inf, in
    place, in one pass (`structured.apply_bitmask_` says what the bits mean)."""
    if has_torch_function((logits, bitmask)):
        return handle_torch_function(apply_bitmask_, (logits, bitmask), logits, bitmask)
    _ext().apply_bitmask_(logits, bitmask)
    return logits


SPLIT_KEYS = 512
"""Split-K's piece: a query row with more keys than this is read in pieces of this many keys, one task each,
merged in order (flash-decoding). A constant, so a row's pieces, and its bits, never depend on the batch or
the thread count; a multiple of every block size the engine uses."""


def paged_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, query_start_loc: Tensor, seq_lens: Tensor,
                    block_tables: Tensor, scale: float, split_keys: int | None = None, window: int = 0) -> Tensor:
    """Each query row over its request's keys in the pool (see `attention.metadata`). q (N, H, D);
    pools (blocks, block_size, K, D) -> (N, H*D); padding rows past query_start_loc[-1] are zero. Every query
    row is computed as a decode row, so its bits depend on its query and its keys only. split_keys: split-K's
    piece for rows of more keys (None: SPLIT_KEYS; 0: never split). window > 0: a sliding layer's, the query at
    position p sees keys p - window + 1 .. p only (at most split_keys of them)."""
    args = (q, k_pool, v_pool, query_start_loc, seq_lens, block_tables)
    split_keys = SPLIT_KEYS if split_keys is None else split_keys
    if has_torch_function(args):
        return handle_torch_function(paged_attention, args, *args, scale, split_keys, window)
    return _ext().paged_attention(q.contiguous(), k_pool, v_pool, query_start_loc, seq_lens, block_tables, scale,
                                  split_keys, window)


PROMPT_BF16_HEAD_DIMS = (64, 128)
"""The head sizes `prompt_attention_bf16` is built for (its value sums keep a row's D outputs in registers)."""


def prompt_attention_bf16_here(head_dim: int) -> bool:
    """Whether `prompt_attention_bf16` runs here for heads of head_dim: the kernels built, a CPU with AVX512_BF16."""
    module = load()
    return head_dim in PROMPT_BF16_HEAD_DIMS and module is not None and module.prompt_attention_bf16_here()


def prompt_attention_bf16(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """A whole prompt's causal attention with bf16 products: q, k, v and the softmax weights rounded to bf16,
    every sum in fp32 (csrc/attention_bf16.cpp). q (T, H, D), k/v (T, K, D), fp32, dims consecutive -> (T, H*D)."""
    if has_torch_function((q, k, v)):
        return handle_torch_function(prompt_attention_bf16, (q, k, v), q, k, v, scale)
    return _ext().prompt_attention_bf16(q, k, v, scale)


def bf16_linear(x: Tensor, w: Tensor) -> Tensor:
    """x @ w.T for a bf16 matrix w (N, K) stored [in, out], x (M, K): x rounded to bf16, each row's sums in fp32
    in input order, the output rounded to bf16 (csrc/matmul_bf16.cpp). The road of a CPU whose torch has no
    bf16 product worth the name; a row's bits do not depend on the other rows."""
    if has_torch_function((x, w)):
        return handle_torch_function(bf16_linear, (x, w), x, w)
    return _ext().bf16_linear(x, w)


def pack_bf16_panels(w: Tensor) -> Tensor:
    """A bf16 matrix w (N, K), N a multiple of 16, as the panels `bf16_panels_linear` reads: (N / 16, K, 16), the
    weights of 16 consecutive outputs for every input one contiguous stretch."""
    return _ext().pack_bf16_panels(w)


def bf16_panels_linear(x: Tensor, panels: Tensor) -> Tensor:
    """`bf16_linear`'s product, the same bits, with w read from its panels (`pack_bf16_panels`): one contiguous
    stretch per task, which memory streams at its speed, where the [in, out] matrix gives a task pieces of 128
    bytes a whole row apart."""
    if has_torch_function((x, panels)):
        return handle_torch_function(bf16_panels_linear, (x, panels), x, panels)
    return _ext().bf16_panels_linear(x, panels)


def bf16_tiles_here() -> bool:
    """Whether `bf16_tiles_linear` runs here: the kernels built, on a CPU with AVX512_BF16."""
    module = load()
    return module is not None and module.prompt_attention_bf16_here()


def pack_bf16(w: Tensor) -> Tensor:
    """A bf16 matrix w (N, K) as the tiles `bf16_tiles_linear` reads: (ceil(N / 16), ceil(K / 2), 16, 2), the
    weights of 16 consecutive outputs one contiguous stretch, each pair of inputs side by side."""
    return _ext().pack_bf16(w)


def bf16_tiles_linear(x: Tensor, tiles: Tensor, n_out: int, unit: str = "") -> Tensor:
    """x @ w.T for x (M, K) bf16 from w's tiles (`pack_bf16`) -> (M, n_out) bf16: fp32 sums of exact bf16
    products in input order, rounded to bf16 (csrc/matmul_bf16.cpp), on `unit` (`bf16_tiles_units`; "" the first:
    AMX's tile unit where the CPU has one, else AVX512_BF16's pair products). The order never depends on M, so a
    row gets the same bits alone as beside any other rows; the two units add a pair's products differently, so a
    CPU takes one of them for every product."""
    if has_torch_function((x, tiles)):
        return handle_torch_function(bf16_tiles_linear, (x, tiles), x, tiles, n_out, unit)
    return _ext().bf16_tiles_linear(x, tiles, n_out, unit)


def bf16_tiles_units() -> list[str]:
    """The units that multiply bf16 tiles here, first the one taken: "amx" (Intel's tile unit, where Linux lets
    this process use it and NANOSERVE_AMX is not 0), "avx512-bf16"; none without the kernels or AVX512_BF16."""
    module = load()
    return list(module.bf16_tiles_units()) if module is not None else []


def pack_fp32(w: Tensor) -> Tensor:
    """An fp32 matrix w (N, K) as the tiles `fp32_linear` reads: (ceil(N / 16), K, 16), the weights of 16
    consecutive outputs one contiguous stretch, the last tile padded with zero outputs."""
    return _ext().pack_fp32(w)


def fp32_linear(x: Tensor, tiles: Tensor, n_out: int) -> Tensor:
    """x @ w.T for x (M, K) fp32 from w's tiles (`pack_fp32`) -> (M, n_out): each output the in-order sum of its
    slices of 64 inputs, each slice an in-order chain of fused multiply-adds (csrc/matmul_fp32.cpp). The order
    never depends on M, so a row gets the same bits alone as beside any other rows."""
    if has_torch_function((x, tiles)):
        return handle_torch_function(fp32_linear, (x, tiles), x, tiles, n_out)
    return _ext().fp32_linear(x, tiles, n_out)


def _ext() -> ModuleType:
    module = load()
    if module is None:
        raise RuntimeError(f"the compiled kernels are unavailable: {unavailable_reason()}")
    return module


def cpp_source(name: str, file: str = "kernels.cpp") -> str:
    """One C++ function of a file of `csrc/` (`SOURCE` unless told; its first definition where a file has one per
    road), with its template line and the comment above it: what the notebooks show of the kernels."""
    path = CSRC / file
    lines = path.read_text().splitlines()
    start = next((i for i, ln in enumerate(lines) if not ln.startswith((" ", "//", "}", "#")) and f" {name}(" in ln),
                 None)
    if start is None:
        raise KeyError(f"no function {name!r} in {path.name}")
    end = lines.index("}", start)
    while start > 0 and lines[start - 1].startswith(("//", "template <")):
        start -= 1
    return "\n".join(lines[start: end + 1])


def describe() -> str:
    """What the engine's kernels are on this machine: the build, or why torch's ops run instead."""
    if load() is None:
        return f"torch ops ({unavailable_reason()})"
    name, flags = build_flags()
    return f"compiled kernels {name} ({' '.join(flags)})"


HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14


def huge_pages(nbytes: int) -> Tensor:
    """`nbytes` of uint8, starting on a 2 MB boundary, that Linux is asked to back with 2 MB pages (transparent
    huge pages, `madvise`) before anything is written there; ordinary 4 KB pages where it cannot or will not. A
    decode step streams every weight once: on 4 KB pages that is a page translation every 4 KB of it."""
    buf = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    out = buf[-buf.data_ptr() % HUGE_PAGE:][:nbytes]  # a view: it keeps the whole buffer alive
    if nbytes >= HUGE_PAGE and sys.platform == "linux":
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise(ctypes.c_void_p(out.data_ptr()), ctypes.c_size_t(nbytes), MADV_HUGEPAGE)
        except (OSError, AttributeError):  # no libc to ask: ordinary pages, the same bytes
            pass
    return out


def side_by_side(tensors: Sequence[Tensor]) -> list[Tensor]:
    """Copies of `tensors` laid one after another (each on a 64-byte boundary) in one `huge_pages` buffer: small
    matrices share the 2 MB pages that a buffer of their own could not fill."""
    at, offsets = 0, []
    for t in tensors:
        offsets.append(at)
        at += -(-t.numel() * t.element_size() // 64) * 64
    buf = huge_pages(at)
    return [buf[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape).copy_(t)
            for o, t in zip(offsets, tensors)]
