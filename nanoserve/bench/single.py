"""Single-stream benchmarks (Days 11 and 13): `python -m nanoserve bench single|layout`.

`single` times one request at a time on four engines, interleaved in the same run
with the same threads: nanoserve without a cache (every step recomputes the whole
sequence: what Day 13 removes), nanoserve with Day 13's contiguous cache, nanoserve's
own road (the paged cache and compiled kernels `generate` runs by default), and
transformers' `generate` (its own KV cache) on the same checkpoint folder. Each run is recorded
by timing.py's StreamTimer, so prefill is TTFT (prompt tokens / TTFT) and decode is
TPOT (vLLM's definition), and every number is a median over repeats. The roofline
limit (read bandwidth / weight bytes) is measured in the same run and printed beside.

`layout` measures how fast each candidate layout and call streams the weights of a
batch-1 decode step: the measurement the model's weight layout was chosen on.

Both print a table and write a CSV under data/ whose first lines (starting with #)
give the command and the machine.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..config import ModelConfig
from ..generate import stream_generate
from ..model import Llama, linear
from ..model.matmul import ONEDNN, bag_linear, bmm_linear, onednn_linear, pack
from ..sampling import SamplingParams
from ..stages import CachedSession, NoCacheSession, Session, stream_session
from .machine import command_line, csv_header, use_threads
from .roofline import decode_limit_tok_s, forward_flops, measure_roofline
from .timing import DEFAULT_CLOCK, Clock, RequestTiming, StreamTimer, time_callable

# ---- one request, timed by the stdlib core ---------------------------------------------------------


def timed_greedy(model: Llama, prompt_ids: list[int], new_tokens: int, session: Session | None = None,
                 clock: Clock = DEFAULT_CLOCK) -> tuple[list[int], RequestTiming]:
    """Greedy ids of exactly `new_tokens` and their timing: one StreamTimer.token() per token. With no
    session, the engine's road (`stream_generate`); with one, a course stage's loop over it."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    timer = StreamTimer(clock)
    timer.start()
    ids = []
    steps = stream_generate(model, prompt_ids, params) if session is None else \
        stream_session(model, session, prompt_ids, params)
    for step in steps:
        for t in step.new_token_ids:
            timer.token()
            ids.append(t)
    return ids, timer.finish()


def session_for(model: Llama, engine: str, max_len: int) -> Session | None:
    """The Session each nanoserve road of the benchmark runs (None: the engine, as `generate` runs it)."""
    if engine == "nanoserve":
        return None
    if engine == "nanoserve-contiguous":  # Day 13's contiguous cache
        return CachedSession(model, max_len)
    if engine == "nanoserve-nocache":  # Day 08: recompute everything every step
        return NoCacheSession(model)
    raise ValueError(f"unknown engine {engine!r}")


def time_nanoserve(model: Llama, prompt_ids: list[int], new_tokens: int, engine: str = "nanoserve") -> RequestTiming:
    """One request on one of nanoserve's engines (see ENGINES)."""
    return timed_greedy(model, prompt_ids, new_tokens, session_for(model, engine, len(prompt_ids) + new_tokens))[1]


def forward_sweep(model: Llama, lengths: list[int], repeats: int = 3) -> list[dict]:
    """Time one forward of T prompt tokens (last-position logits) for each T: prefill's cost curve.

    T = 1 is a decode step in its purest form (no context to attend to): it streams every weight
    for one token. The achieved FLOP/s and weight GB/s say which roof each T is under.
    """
    rows = []
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for T in tqdm(lengths, desc="forward sweep", leave=False):
            ids = torch.randint(0, model.cfg.vocab_size, (1, T), generator=g)
            sec = statistics.median(time_callable(lambda ids=ids: model(ids, last_only=True), repeats))
            flops = forward_flops(model.cfg, T)
            rows.append(dict(tokens=T, seconds=sec, ms_per_token=sec / T * 1e3, gflop_s=flops / sec / 1e9,
                             intensity=flops / model.weight_bytes(), weight_gb_s=model.weight_bytes() / sec / 1e9))
    return rows


class _TimerStreamer:
    """transformers' streamer hook: generate() calls put() with the prompt, then once per new token."""

    def __init__(self, timer: StreamTimer):
        self.timer, self.seen_prompt = timer, False

    def put(self, value) -> None:
        if self.seen_prompt:
            self.timer.token()
        self.seen_prompt = True

    def end(self) -> None:
        pass


def load_transformers(folder: str | Path):
    """The reference model, imported only when asked for (transformers is not a runtime dependency)."""
    try:
        import transformers
    except ImportError:
        sys.exit("nanoserve bench: this comparison needs transformers: pip install 'nanoserve[test]'")
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def time_transformers(hf_model, prompt_ids: list[int], new_tokens: int) -> RequestTiming:
    """transformers' generate (greedy, its own KV cache), exactly `new_tokens`, timed the same way."""
    x = torch.tensor([prompt_ids])
    timer = StreamTimer()
    timer.start()
    with torch.inference_mode():
        hf_model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, pad_token_id=0, streamer=_TimerStreamer(timer))
    return timer.finish()


# ---- single: prefill and decode, three engines, same run -----------------------------------------


@dataclass
class Row:
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


ENGINES = ("nanoserve-nocache", "nanoserve-contiguous", "nanoserve", "transformers")


def run_single(model: Llama, hf_model, contexts: list[int], new_tokens: int, repeats: int,
               nocache_tokens: int, seed: int = 0) -> list[Row]:
    """Every (context, repeat) runs the engines back to back, so drifts in machine load hit all three."""
    vocab = model.cfg.vocab_size
    warm = list(range(100, 116))  # untimed: first calls pay one-off costs (allocator, BLAS setup)
    for engine in ENGINES[:-1]:
        time_nanoserve(model, warm, 3 if engine != "nanoserve-nocache" else 2, engine)
    time_transformers(hf_model, warm, 3)
    jobs = [(c, r, e) for c in contexts for r in range(repeats) for e in ENGINES]
    rows = []
    for context, rep, engine in tqdm(jobs, desc="bench single", leave=False):
        g = torch.Generator().manual_seed(seed + context)
        prompt = torch.randint(100, vocab - 100, (context,), generator=g).tolist()
        if engine == "transformers":
            t, n = time_transformers(hf_model, prompt, new_tokens), new_tokens
        else:
            nocache = engine == "nanoserve-nocache"
            if nocache and rep > 0:
                continue  # recomputation is slow and its cost is not in doubt: one repeat
            n = nocache_tokens if nocache else new_tokens
            t = time_nanoserve(model, prompt, n, engine)
        rows.append(Row(engine, context, n, rep, t.ttft, t.tpot or float("nan")))
    return rows


def summarize_single(rows: list[Row], limit_tok_s: float) -> list[dict]:
    """Medians per (engine, context), and the ratios the issue asks for."""
    out = []
    for context in sorted({r.context for r in rows}):
        med = {}
        for engine in ENGINES:
            sel = [r for r in rows if r.engine == engine and r.context == context]
            if sel:
                med[engine] = (statistics.median(r.prefill_tok_s for r in sel),
                               statistics.median(r.decode_tok_s for r in sel), len(sel))
        ref = med.get("transformers")
        hf_tpot = {r.repeat: r.tpot_s for r in rows if r.engine == "transformers" and r.context == context}
        for engine, (prefill, decode, n) in med.items():
            # each repeat ran this engine and transformers back to back: the median of those paired
            # ratios shrugs off load that drifts between repeats (a shared machine's usual state)
            paired = [hf_tpot[r.repeat] / r.tpot_s for r in rows
                      if r.engine == engine and r.context == context and r.repeat in hf_tpot]
            out.append(dict(engine=engine, context=context, n=n, prefill_tok_s=prefill, decode_tok_s=decode,
                            tpot_ms=1e3 / decode,
                            decode_vs_transformers=decode / ref[1] if ref else float("nan"),
                            paired_vs_transformers=statistics.median(paired) if paired else float("nan"),
                            decode_vs_limit=decode / limit_tok_s))
    return out


def _write_csv(path: Path, header: list[str], rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        for line in header:
            f.write(f"{line}\n")
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows({k: float(f"{v:.5g}") if isinstance(v, float) else v for k, v in r.items()} for r in rows)


# ---- layout: how fast each candidate streams a decode step's weights -------------------------------


def _packed(w: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode(False):
        w = w.clone()  # a normal tensor (one made in inference mode keeps no version, so `pack` refuses it)
    pack(w)  # the blocked copy lives beside w, as long as w does
    return w


# name -> (prepare the stored weight from W (out, in), the batch-1 call on it)
Prepare = Callable[[torch.Tensor], torch.Tensor]
Call = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
LAYOUTS: dict[str, tuple[Prepare, Call]] = {
    "F.linear, W [out,in] (torch default)": (lambda w: w, lambda x, w: F.linear(x, w)),
    "torch.mv, W [out,in]": (lambda w: w, lambda x, w: torch.mv(w, x[0])),
    "x @ W, W [in,out]": (lambda w: w.t().contiguous(), lambda x, wt: x @ wt),
    # same (out, in) shape as the default, memory transposed: what matmul.linear_weight stores
    "F.linear, W stored [in,out]": (lambda w: w.t().contiguous().t(), lambda x, w: F.linear(x, w)),
    # oneDNN's matrix product on the same stored weight, and on a copy in its own blocked layout
    # (`matmul.pack`): what matmul.linear uses for two rows or more
    "oneDNN, W stored [in,out]": (lambda w: w.t().contiguous().t(), onednn_linear),
    "oneDNN, W packed": (lambda w: _packed(w.t().contiguous().t()), onednn_linear),
    # the same stored weight as a weighted sum of its rows: F.embedding_bag (matmul.bag_linear)
    "embedding_bag, W stored [in,out]": (lambda w: w.t().contiguous().t(), bag_linear),
    # the same partial sums as one batched product (matmul.bmm_linear)
    "torch.bmm of row slices, W stored [in,out]": (lambda w: w.t().contiguous().t(), bmm_linear),
    # what matmul.linear does with one row on this CPU: the bag or bmm (matmul.ONE_ROW)
    "nanoserve's linear, W stored [in,out]": (lambda w: w.t().contiguous().t(), linear),
}
if not ONEDNN:
    del LAYOUTS["oneDNN, W stored [in,out]"], LAYOUTS["oneDNN, W packed"]


def layout_groups(cfg: ModelConfig) -> dict[str, list[tuple[int, int]]]:
    """The (out, in) matrices one decode step reads, grouped; fused and split forms of q/k/v, gate/up."""
    C, D, L = cfg.hidden_size, cfg.head_dim, cfg.n_layers
    H, K, Fi = cfg.n_heads * D, cfg.n_kv_heads * D, cfg.intermediate_size
    return {
        "qkv fused": [(H + 2 * K, C)] * L,
        "q, k, v split": [(H, C), (K, C), (K, C)] * L,
        "o": [(C, H)] * L,
        "gate/up fused": [(2 * Fi, C)] * L,
        "gate, up split": [(Fi, C), (Fi, C)] * L,
        "down": [(C, Fi)] * L,
        "lm head": [(cfg.vocab_size, C)],
    }


def layout_rates(cfg: ModelConfig | None = None, repeats: int = 9, groups: list[str] | None = None,
                 candidates: list[str] | None = None) -> list[dict]:
    """GB/s of weight streamed per candidate and group (median of repeats, candidates interleaved).

    Random weights of the model's shapes: a matrix-vector product's speed does not depend on values.
    """
    cfg = cfg or ModelConfig()
    all_groups = layout_groups(cfg)
    g = torch.Generator().manual_seed(0)
    rows = []
    with torch.inference_mode():
        for group in tqdm(groups or list(all_groups), desc="layouts", leave=False):
            weights = [torch.randn(shape, generator=g) for shape in all_groups[group]]  # (out, in) each
            nbytes = sum(w.numel() * w.element_size() for w in weights)
            x = torch.randn(1, weights[0].shape[1], generator=g)  # (1, in): the one token of batch 1
            calls, times = {}, {}
            for name in candidates or list(LAYOUTS):
                prepare, call = LAYOUTS[name]
                stored = [prepare(w) for w in weights]
                calls[name] = lambda call=call, stored=stored, x=x: [call(x, w) for w in stored]
                times[name] = []
            for _ in range(repeats):  # interleave: each repeat runs every candidate once
                for name, call in calls.items():
                    times[name] += time_callable(call, repeats=1, warmup=1)
            for name, ts in times.items():
                med = statistics.median(ts)
                rows.append(dict(group=group, candidate=name, matrices=len(weights), mbytes=nbytes / 1e6,
                                 median_ms=med * 1e3, gb_s=nbytes / med / 1e9))
    return rows


# ---- command line ----------------------------------------------------------------------------------


def _table(rows: list[dict], cols: list[str]) -> str:
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)
    cells = [[fmt(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def add_arguments(single: argparse.ArgumentParser, layout: argparse.ArgumentParser) -> None:
    single.add_argument("--contexts", type=int, nargs="+", default=[128, 1024])
    single.add_argument("--new-tokens", type=int, default=32)
    single.add_argument("--nocache-tokens", type=int, default=4, help="tokens for the (slow) no-cache engine")
    single.add_argument("--repeats", type=int, default=3)
    single.add_argument("--out", default="data/bench-single.csv")
    layout.add_argument("--repeats", type=int, default=9)
    layout.add_argument("--out", default="data/bench-layout.csv")
    for p in (single, layout):
        p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
        p.add_argument("--model", default=None, help="HF checkpoint folder (default: the fetched SmolLM2)")


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """`python -m nanoserve bench single` or `bench layout` (args.what)."""
    use_threads(args)
    busy = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if busy > 0.5 * (os.cpu_count() or 1):
        print(f"warning: load average {busy:.1f} on {os.cpu_count()} cores: other work shares this machine, so "
              "absolute numbers will be low and noisy (ratios less so); with more than one thread a busy core "
              "can stall every parallel op, so compare with --threads 1", file=sys.stderr)
    from ..model import load_model
    from ..model.fetch import ensure_model

    folder = Path(args.model) if args.model else ensure_model()
    if args.what == "layout":
        rows = layout_rates(ModelConfig.from_folder(folder), args.repeats)
        print(_table(rows, ["group", "candidate", "mbytes", "median_ms", "gb_s"]))
        _write_csv(Path(args.out), csv_header(command_line(argv)), rows)
        return 0
    model = load_model(folder)
    hf_model = load_transformers(folder)
    roof = measure_roofline()
    limit = decode_limit_tok_s(model.weight_bytes(), roof.read_bandwidth)
    rows = run_single(model, hf_model, args.contexts, args.new_tokens, args.repeats, args.nocache_tokens)
    summary = summarize_single(rows, limit)
    print(_table(summary, list(summary[0])))
    print(f"roofline: {roof.describe()}")
    print(f"decode limit at batch 1: {roof.read_bandwidth / 1e9:.1f} GB/s / {model.weight_bytes() / 1e6:.0f} MB "
          f"of weights = {limit:.1f} tok/s")
    header = csv_header(command_line(argv), roofline=roof.describe(), weight_bytes=model.weight_bytes(),
                        decode_limit_tok_s=f"{limit:.2f}")
    raw = [dict(asdict(r), prefill_tok_s=r.prefill_tok_s, decode_tok_s=r.decode_tok_s) for r in rows]
    out = Path(args.out)
    _write_csv(out, header, summary)
    _write_csv(out.with_name(out.stem + "-raw.csv"), header, raw)
    print(f"wrote {out} (medians) and {out.stem}-raw.csv (every run)")
    return 0
