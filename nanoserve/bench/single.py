"""`python -m nanoserve bench single|layout` (Days 11, 13): `single` times one request at a time on the four
ENGINES, interleaved, beside the batch-1 roofline limit measured in the same run; `layout` how fast each candidate
layout and call streams a batch-1 decode step's weights."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..generate import stream_generate
from ..model import Llama, linear
from ..model.fetch import ensure_model
from ..model.matmul import ONEDNN, bag_linear, bmm_linear, onednn_linear, pack
from ..sampling import SamplingParams
from ..stages import CachedSession, NoCacheSession, Session, stream_session
from . import csvio
from .command import common_arguments, csv_header, report, start
from .harness import hf_generate, load_hf_model
from .roofline import decode_limit_tok_s, forward_flops, measure_roofline
from .timing import DEFAULT_CLOCK, Clock, RequestTiming, StreamTimer, interleaved, time_callable

ENGINES = ("nanoserve-nocache", "nanoserve-contiguous", "nanoserve", "transformers")


def timed_greedy(model: Llama, prompt_ids: list[int], new_tokens: int, session: Session | None = None,
                 clock: Clock = DEFAULT_CLOCK) -> tuple[list[int], RequestTiming]:
    """Greedy ids of exactly `new_tokens` and their timing, a StreamTimer.token() per token: with no session the
    engine's road (`stream_generate`), with one a course stage's loop over it."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    timer, ids = StreamTimer(clock), []
    timer.start()
    for step in stream_generate(model, prompt_ids, params) if session is None else \
            stream_session(model, session, prompt_ids, params):
        for t in step.new_token_ids:
            timer.token()
            ids.append(t)
    return ids, timer.finish()


def time_nanoserve(model: Llama, prompt_ids: list[int], new_tokens: int, engine: str = "nanoserve") -> RequestTiming:
    """One request on one of nanoserve's roads: `generate`'s engine, Day 13's cache, or Day 08's no cache."""
    session = {"nanoserve": lambda: None, "nanoserve-nocache": lambda: NoCacheSession(model),
               "nanoserve-contiguous": lambda: CachedSession(model, len(prompt_ids) + new_tokens)}[engine]()
    return timed_greedy(model, prompt_ids, new_tokens, session)[1]


def time_transformers(hf_model, prompt_ids: list[int], new_tokens: int, clock: Clock = DEFAULT_CLOCK) -> RequestTiming:
    """transformers' generate, greedy, exactly `new_tokens`, a clock reading per token."""
    start, stamps, _ = hf_generate(hf_model, [prompt_ids], new_tokens, clock)
    return RequestTiming(start, tuple(stamps), clock())


def forward_sweep(model: Llama, lengths: list[int], repeats: int = 3) -> list[dict]:
    """One forward of T prompt tokens per T: prefill's cost curve, its FLOP/s and weight GB/s (which roof)."""
    rows, g = [], torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for T in lengths:
            ids = torch.randint(0, model.cfg.vocab_size, (1, T), generator=g)
            sec = statistics.median(time_callable(lambda ids=ids: model(ids, last_only=True), repeats))
            flops = forward_flops(model.cfg, T)
            rows.append(dict(tokens=T, seconds=sec, ms_per_token=sec / T * 1e3, gflop_s=flops / sec / 1e9,
                             intensity=flops / model.weight_bytes(), weight_gb_s=model.weight_bytes() / sec / 1e9))
    return rows


@dataclass
class SingleRun:
    engine: str
    context: int
    new_tokens: int
    repeat: int
    ttft_s: float
    tpot_s: float

    @property
    def prefill_tok_s(self) -> float:
        return self.context / self.ttft_s

    @property
    def decode_tok_s(self) -> float:
        return 1.0 / self.tpot_s


def run_single(model: Llama, hf_model, contexts: list[int], new_tokens: int, repeats: int,
               nocache_tokens: int, seed: int = 0) -> list[SingleRun]:
    """The roads back to back per (context, repeat), so drifting load hits all; the slow no-cache road once."""
    warm = list(range(100, 116))  # untimed: first calls pay one-off costs (allocator, BLAS setup)
    for engine in ENGINES[:-1]:
        time_nanoserve(model, warm, 2, engine)
    time_transformers(hf_model, warm, 3)
    rows = []
    for context in contexts:
        g = torch.Generator().manual_seed(seed + context)
        prompt = torch.randint(100, model.cfg.vocab_size - 100, (context,), generator=g).tolist()
        for rep in range(repeats):
            for engine in ENGINES[rep > 0:]:  # the no-cache road, first, runs once
                n = nocache_tokens if engine == "nanoserve-nocache" else new_tokens
                t = time_transformers(hf_model, prompt, n) if engine == "transformers" else \
                    time_nanoserve(model, prompt, n, engine)
                rows.append(SingleRun(engine, context, n, rep, t.ttft, t.tpot or float("nan")))
    return rows


def summarize_single(rows: list[SingleRun], limit_tok_s: float) -> list[dict]:
    """Medians per (engine, context), their ratios to transformers (of the medians, and the median of paired
    per-repeat ratios, which shrug off drifting load) and to the roofline's limit."""
    out = []
    for context in sorted({r.context for r in rows}):
        hf = {r.repeat: r for r in rows if r.engine == "transformers" and r.context == context}
        hf_decode = statistics.median(r.decode_tok_s for r in hf.values()) if hf else float("nan")
        for engine in ENGINES:
            sel = [r for r in rows if r.engine == engine and r.context == context]
            if sel:
                decode = statistics.median(r.decode_tok_s for r in sel)
                paired = [hf[r.repeat].tpot_s / r.tpot_s for r in sel if r.repeat in hf] or [float("nan")]
                out.append(dict(engine=engine, context=context, n=len(sel),
                                prefill_tok_s=statistics.median(r.prefill_tok_s for r in sel), decode_tok_s=decode,
                                tpot_ms=1e3 / decode, decode_vs_transformers=decode / hf_decode,
                                paired_vs_transformers=statistics.median(paired), decode_vs_limit=decode / limit_tok_s))
    return out


def _packed(w: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode(False):
        w = w.clone()  # a normal tensor (one made in inference mode keeps no version, so `pack` refuses it)
    pack(w)  # the blocked copy lives beside w, as long as w does
    return w


_in_out = lambda w: w.t().contiguous().t()  # (out, in) shape, memory transposed: what matmul.linear_weight stores
LAYOUTS: dict[str, tuple[Callable, Callable]] = {  # name -> (the stored weight from W (out, in), the batch-1 call)
    "F.linear, W [out,in] (torch default)": (lambda w: w, lambda x, w: F.linear(x, w)),
    "torch.mv, W [out,in]": (lambda w: w, lambda x, w: torch.mv(w, x[0])),
    "x @ W, W [in,out]": (lambda w: w.t().contiguous(), lambda x, wt: x @ wt),
    "F.linear, W stored [in,out]": (_in_out, lambda x, w: F.linear(x, w)),
    "oneDNN, W stored [in,out]": (_in_out, onednn_linear),  # oneDNN's product, and on its own blocked copy
    "oneDNN, W packed": (lambda w: _packed(_in_out(w)), onednn_linear),
    "embedding_bag, W stored [in,out]": (_in_out, bag_linear),  # a weighted sum of rows (matmul.bag_linear)
    "torch.bmm of row slices, W stored [in,out]": (_in_out, bmm_linear),  # the same sums as one product
    "nanoserve's linear, W stored [in,out]": (_in_out, linear),  # one row on this CPU: matmul.ONE_ROW
}
if not ONEDNN:
    del LAYOUTS["oneDNN, W stored [in,out]"], LAYOUTS["oneDNN, W packed"]


def layout_groups(cfg: ModelConfig) -> dict[str, list[tuple[int, int]]]:
    """The (out, in) matrices one decode step reads, grouped, q/k/v and gate/up fused and split."""
    C, D, L = cfg.hidden_size, cfg.head_dim, cfg.n_layers
    H, K, Fi = cfg.n_heads * D, cfg.n_kv_heads * D, cfg.intermediate_size
    return {"qkv fused": [(H + 2 * K, C)] * L, "q, k, v split": [(H, C), (K, C), (K, C)] * L, "o": [(C, H)] * L,
            "gate/up fused": [(2 * Fi, C)] * L, "gate, up split": [(Fi, C), (Fi, C)] * L, "down": [(C, Fi)] * L,
            "lm head": [(cfg.vocab_size, C)]}


def layout_rates(cfg: ModelConfig | None = None, repeats: int = 9, groups: list[str] | None = None,
                 candidates: list[str] | None = None) -> list[dict]:
    """Weight GB/s per candidate and group, candidates interleaved and warm, on random weights of the model's
    shapes (a product's speed does not depend on values)."""
    all_groups, g, rows = layout_groups(cfg or ModelConfig()), torch.Generator().manual_seed(0), []
    with torch.inference_mode():
        for group in groups or list(all_groups):
            weights = [torch.randn(shape, generator=g) for shape in all_groups[group]]  # (out, in) each
            nbytes = sum(w.numel() * w.element_size() for w in weights)
            x = torch.randn(1, weights[0].shape[1], generator=g)  # (1, in): the one token of batch 1
            names = candidates or list(LAYOUTS)
            stored = {name: [LAYOUTS[name][0](w) for w in weights] for name in names}
            calls = [lambda call=LAYOUTS[name][1], ws=stored[name], x=x: [call(x, w) for w in ws] for name in names]
            for name, ts in zip(names, interleaved(calls, repeats, warmup=0, before=lambda call: call())):
                med = statistics.median(ts)
                rows.append(dict(group=group, candidate=name, matrices=len(weights), mbytes=nbytes / 1e6,
                                 median_ms=med * 1e3, gb_s=nbytes / med / 1e9))
    return rows


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--nocache-tokens", type=int, default=4, help="tokens for the (slow) no-cache road")
    common_arguments(ap, "data/bench-single.csv", contexts=[128, 1024], repeats=3, model=None)


def add_layout_arguments(ap: argparse.ArgumentParser) -> None:
    common_arguments(ap, "data/bench-layout.csv", repeats=9, model=None)


def run(args: argparse.Namespace, argv: list[str]) -> int:
    loaded = start(args, model=args.what == "single")
    rounded = lambda rows: [{k: float(f"{v:.5g}") if isinstance(v, float) else v for k, v in r.items()} for r in rows]
    folder = Path(args.model) if args.model else ensure_model()
    if args.what == "layout":
        rows, meta = rounded(layout_rates(ModelConfig.from_folder(folder), args.repeats)), csv_header(argv)
        return report(csvio.write_csv(args.out, rows, meta), meta, rows)
    model, hf_model, roof = loaded[0], load_hf_model(folder), measure_roofline()
    limit = decode_limit_tok_s(model.weight_bytes(), roof.read_bandwidth)
    rows = run_single(model, hf_model, args.contexts, args.new_tokens, args.repeats, args.nocache_tokens)
    meta = csv_header(argv, roofline=roof.describe(), weight_bytes=model.weight_bytes(),
                      decode_limit_tok_s=f"{limit:.2f}")
    out, summary = Path(args.out), rounded(summarize_single(rows, limit))
    raw = [dict(asdict(r), prefill_tok_s=r.prefill_tok_s, decode_tok_s=r.decode_tok_s) for r in rows]
    csvio.write_csv(out.with_name(out.stem + "-raw.csv"), rounded(raw), meta)  # every run; --out has the medians
    return report(csvio.write_csv(out, summary, meta), meta, summary)
