"""`python -m nanoserve bench layout` (Day 11): how fast each candidate layout and call streams a batch-1 decode
step's weights, on random weights of the model's shapes (a product's speed does not depend on values); with
`--rows`, the candidates that take several rows at each count too (a batch's decode step, a prompt); with
`--dtype bfloat16`, a bf16 model's roads instead (Day 42: oneDNN's product, and the tiles where the CPU has
AVX512_BF16)."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..model import linear
from ..model.fetch import ensure_model
from ..model.matmul import ONEDNN, bag_linear, bf16_road, bmm_linear, onednn_linear, onednn_takes_bf16, pack
from . import csvio
from .command import common_arguments, csv_header, report, start
from .timing import interleaved


def _packed(w: torch.Tensor, tiles: bool = True) -> torch.Tensor:
    with torch.inference_mode(False):
        w = w.clone()  # a normal tensor (one made in inference mode keeps no version, so `pack` refuses it)
    pack(w, tiles=tiles)  # the copy lives beside w, as long as w does
    return w


_in_out = lambda w: w.t().contiguous().t()  # (out, in) shape, memory transposed: what matmul.linear_weight stores
LAYOUTS: dict[str, tuple[Callable, Callable]] = {  # name -> (the stored weight from W (out, in), the batch-1 call)
    "F.linear, W [out,in] (torch default)": (lambda w: w, lambda x, w: F.linear(x, w)),
    "torch.mv, W [out,in]": (lambda w: w, lambda x, w: torch.mv(w, x[0])),
    "x @ W, W [in,out]": (lambda w: w.t().contiguous(), lambda x, wt: x @ wt),
    "F.linear, W stored [in,out]": (_in_out, lambda x, w: F.linear(x, w)),
    "oneDNN, W stored [in,out]": (_in_out, onednn_linear),  # oneDNN's product, and on its own blocked copy
    "oneDNN, W packed": (lambda w: _packed(_in_out(w), tiles=False), onednn_linear),
    "embedding_bag, W stored [in,out]": (_in_out, bag_linear),  # a weighted sum of rows (matmul.bag_linear)
    "torch.bmm of row slices, W stored [in,out]": (_in_out, bmm_linear),  # the same sums as one product
    "nanoserve's linear, W stored [in,out]": (_in_out, linear),  # one row on this CPU: matmul.ONE_ROW
    "nanoserve's linear, W as load() keeps it": (lambda w: _packed(_in_out(w)), linear),  # x86: the tiles
}
if not ONEDNN:
    del LAYOUTS["oneDNN, W stored [in,out]"], LAYOUTS["oneDNN, W packed"]
ONE_ROW_ONLY = ("torch.mv, W [out,in]", "embedding_bag, W stored [in,out]",  # calls that take one row only
                "torch.bmm of row slices, W stored [in,out]")
_bf16 = lambda w: _in_out(w).bfloat16()  # (strides kept: [in, out], as Llama.cast_matrices keeps them)
BF16_LAYOUTS: dict[str, tuple[Callable, Callable]] = {  # a bf16 model's roads (`linear` on a bf16 W)
    "bf16 W, oneDNN packed": (lambda w: _packed(_bf16(w), tiles=False), linear),
    "bf16 W, tiles (AVX512_BF16)": (lambda w: _packed(_bf16(w)), linear),
}


def bf16_layouts() -> list[str]:
    """The BF16_LAYOUTS this machine has: oneDNN's where its build takes bf16, the tiles where `bf16_road` is
    "tiles" (asked when called: the answer builds the kernels)."""
    here = {"bf16 W, oneDNN packed": ONEDNN and onednn_takes_bf16(), "bf16 W, tiles (AVX512_BF16)":
            bf16_road() == "tiles"}
    return [name for name in BF16_LAYOUTS if here[name]]


def layout_groups(cfg: ModelConfig) -> dict[str, list[tuple[int, int]]]:
    """The (out, in) matrices one decode step reads, grouped, q/k/v and gate/up fused and split."""
    C, D, L = cfg.hidden_size, cfg.head_dim, cfg.n_layers
    H, K, Fi = cfg.n_heads * D, cfg.n_kv_heads * D, cfg.intermediate_size
    return {"qkv fused": [(H + 2 * K, C)] * L, "q, k, v split": [(H, C), (K, C), (K, C)] * L, "o": [(C, H)] * L,
            "gate/up fused": [(2 * Fi, C)] * L, "gate, up split": [(Fi, C), (Fi, C)] * L, "down": [(C, Fi)] * L,
            "lm head": [(cfg.vocab_size, C)]}


def layout_rates(cfg: ModelConfig | None = None, repeats: int = 9, groups: list[str] | None = None,
                 candidates: list[str] | None = None, rows: int = 1, bf16: bool = False) -> list[dict]:
    """Weight GB/s and GFLOP/s per candidate and group for products of `rows` rows, candidates interleaved and warm,
    on random weights of the model's shapes (a product's speed does not depend on values). Past one row, only the
    candidates that take several rows. `bf16`: the candidates of BF16_LAYOUTS (a bf16 model's roads)."""
    all_groups, g, out = layout_groups(cfg or ModelConfig()), torch.Generator().manual_seed(0), []
    layouts = BF16_LAYOUTS if bf16 else LAYOUTS
    with torch.inference_mode():
        for group in groups or list(all_groups):
            weights = [torch.randn(shape, generator=g) for shape in all_groups[group]]  # (out, in) each
            x = torch.randn(rows, weights[0].shape[1], generator=g)  # (rows, in): one token per row
            names = [n for n in candidates or (bf16_layouts() if bf16 else layouts)
                     if rows == 1 or n not in ONE_ROW_ONLY]
            stored = {name: [layouts[name][0](w) for w in weights] for name in names}
            calls = [lambda call=layouts[name][1], ws=stored[name], x=x: [call(x, w) for w in ws] for name in names]
            flops = 2 * rows * sum(w.numel() for w in weights)
            for name, ts in zip(names, interleaved(calls, repeats, warmup=0, before=lambda call: call())):
                med, nbytes = statistics.median(ts), sum(w.numel() * w.element_size() for w in stored[name])
                out.append(dict(group=group, candidate=name, rows=rows, matrices=len(weights), mbytes=nbytes / 1e6,
                                median_ms=med * 1e3, gb_s=nbytes / med / 1e9, gflop_s=flops / med / 1e9))
    return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    common_arguments(ap, "data/bench-layout.csv", repeats=9, model=None)
    ap.add_argument("--rows", type=int, nargs="+", default=[1], help="rows per product (default: 1, a decode step)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="bfloat16: a bf16 model's roads (oneDNN, and the tiles on AVX512_BF16) instead of fp32's")


def run(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    start(args, model=False)
    folder = Path(args.model) if args.model else ensure_model()
    cfg = ModelConfig.from_folder(folder)
    rows = [{k: float(f"{v:.5g}") if isinstance(v, float) else v for k, v in r.items()}
            for n in args.rows for r in layout_rates(cfg, args.repeats, rows=n, bf16=args.dtype == "bfloat16")]
    meta = csv_header(argv, dtype=args.dtype, bf16_road=bf16_road())
    return report(csvio.write_csv(args.out, rows, meta), meta, rows)
