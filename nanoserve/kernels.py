"""Compiled glue for the batched decode step: the small calls between the products, fused (Day 29).

At batch 32 the products are most of a decode step, but not all of it. Around them each layer
makes about twenty small torch calls: two norms, RoPE's roll/negate/multiply/add, SwiGLU's silu
and product, the cache write, and the attention's key gather, scores, softmax and value sums.
Each is a dispatch, an allocation and a pass over numbers the products have just pushed out of the
cache; measured in a step they cost 2-4x what they cost in a loop of their own (Day 29).

Four C++ loops (`csrc/decode_kernels.cpp`) do the same arithmetic in four calls per layer:

    add_rms_norm            x + residual and its RMSNorm, one pass
    rope_                   the q and k heads rotated in place
    silu_mul                silu(gate) * up
    paged_decode_attention  each row's query over its keys, read in the pool where they lie:
                            no [rows, longest context] gather, no mask (Week 6's idea, on the CPU)

Each computes a row from that row's numbers only, so a row's result is the same whatever else is
in the batch (bit for bit, as the torch path's rows are); the two paths agree to fp32 rounding.

They are built on first use by torch's own extension builder (a C++ compiler and ninja), once per
machine, and cached under $NANOSERVE_HOME/kernels. Where that is impossible (no compiler, or
NANOSERVE_KERNELS=0) `load()` says why and the step runs on torch's ops: slower, never wrong.
`python -m nanoserve.kernels` builds them ahead of time (`make model` does).
"""

from __future__ import annotations

import os
import platform
import sys
import time
import warnings
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

from .model import Block, KVBackend, linear

SOURCE = Path(__file__).parent / "csrc" / "decode_kernels.cpp"
DISABLE_ENV = "NANOSERVE_KERNELS"  # "0": never build or use them

_state: dict[str, object] = {}  # "module" once built; "reason" once it cannot be


def build_flags() -> tuple[str, list[str]]:
    """The extension's name and compiler flags for this CPU. x86 CPUs with AVX2 get AVX2+FMA code
    (the name says so, so a cache shared with an older CPU cannot hand it the wrong build); others
    get the compiler's baseline. -ffp-contract=off keeps a*b+c two roundings, as torch's ops round;
    -fno-trapping-math lets the loops with min/max vectorize."""
    flags = ["-O3", "-ffp-contract=off", "-fno-trapping-math"]
    if torch.backends.openmp.is_available() and sys.platform.startswith("linux"):
        flags.append("-fopenmp")  # at::parallel_for splits rows over torch's threads only when built with OpenMP
    capability = ""
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        pass
    if platform.machine().lower() in ("x86_64", "amd64") and capability in ("AVX2", "AVX512"):
        return "nanoserve_decode_avx2", flags + ["-mavx2", "-mfma"]
    return "nanoserve_decode", flags


def build_dir(name: str) -> Path:
    from .fetch import nanoserve_home

    py = f"py{sys.version_info[0]}{sys.version_info[1]}"
    return nanoserve_home() / "kernels" / f"{name}-{py}-torch{torch.__version__}"


def load(verbose: bool = False) -> ModuleType | None:
    """The compiled kernels, built on first call; None (with one warning saying why) where they cannot be."""
    if "module" in _state:
        return _state["module"]  # type: ignore[return-value]
    if "reason" in _state:
        return None
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return _unavailable(f"{DISABLE_ENV}=0", warn=False)
    try:
        from torch.utils import cpp_extension

        name, flags = build_flags()
        folder = build_dir(name)
        folder.mkdir(parents=True, exist_ok=True)
        module = cpp_extension.load(name, [str(SOURCE)], extra_cflags=flags, build_directory=str(folder),
                                    verbose=verbose)
    except Exception as e:  # no compiler, no ninja, a failed build: the torch path still works
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return _unavailable(f"{type(e).__name__}: {first}")
    _state["module"] = module
    return module


def _unavailable(reason: str, warn: bool = True) -> None:
    _state["reason"] = reason
    if warn:
        warnings.warn(f"nanoserve's compiled decode kernels are unavailable ({reason}); "
                      "batched decode steps run on torch ops instead", RuntimeWarning, stacklevel=3)
    return None


def unavailable_reason() -> str | None:
    """Why `load()` returned None, or None if it did not (or was not called)."""
    return _state.get("reason")  # type: ignore[return-value]


def fused_layer(block: Block, x: Tensor, cos: Tensor, sin: Tensor, layer: int, kv: KVBackend) -> Tensor:
    """`Block.forward` with the glue compiled: the same products on the same weights, the norms,
    RoPE and SwiGLU each one call. x (B, T, C); cos/sin (B, T, 1, D) -> (B, T, C)."""
    ext = load()
    assert ext is not None, "fused_layer needs the compiled kernels: check kernels.load() first"
    cfg = block.cfg
    B, T, _ = x.shape
    H, K, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    _, h = ext.add_rms_norm(x, None, block.attn_norm, cfg.rms_norm_eps)
    qkv = linear(h, block.wqkv).view(B, T, H + 2 * K, D)  # every head's q, k, v side by side
    ext.rope_(qkv, cos.reshape(B * T, D), sin.reshape(B * T, D), H + K)  # the q and k heads, in place
    q, k, v = qkv.split([H, K, K], dim=2)
    x, h = ext.add_rms_norm(x, linear(kv(layer, q, k, v), block.wo), block.mlp_norm, cfg.rms_norm_eps)
    return x + linear(ext.silu_mul(linear(h, block.w_gate_up)), block.w_down)


def paged_decode_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_tables: Tensor, context_lens: Tensor,
                           scale: float) -> Tensor:
    """One new query per row over its first context_lens[r] keys, read from the pool through its
    block table. q (R, H, D); pools (blocks, block_size, K, D); block_tables (R, W) -> (R, H*D)."""
    ext = load()
    assert ext is not None, "paged_decode_attention needs the compiled kernels: check kernels.load() first"
    return ext.paged_decode_attention(q.contiguous(), k_pool, v_pool, block_tables, context_lens, scale)


def cpp_source(name: str) -> str:
    """One C++ function of `SOURCE`, with the comment above it: what Day 29 shows of the kernels."""
    lines = SOURCE.read_text().splitlines()
    start = next((i for i, ln in enumerate(lines) if not ln.startswith((" ", "//", "}")) and f" {name}(" in ln), None)
    if start is None:
        raise KeyError(f"no function {name!r} in {SOURCE.name}")
    end = lines.index("}", start)
    while start > 0 and lines[start - 1].startswith("//"):
        start -= 1
    return "\n".join(lines[start: end + 1])


def main(argv: list[str] | None = None) -> int:
    """Build the kernels now (they are otherwise built on first use) and say where they are."""
    start = time.perf_counter()
    module = load(verbose="-v" in (argv or sys.argv[1:]))
    if module is None:
        print(f"nanoserve kernels: not built ({unavailable_reason()}); batched decode will use torch ops")
        return 0  # not an error: the engine runs without them
    name, flags = build_flags()
    print(f"nanoserve kernels: {name} ready in {time.perf_counter() - start:.1f} s "
          f"({' '.join(flags)}; {build_dir(name)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
