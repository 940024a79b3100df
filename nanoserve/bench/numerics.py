"""`python -m nanoserve bench numerics`: what bf16 and int8 activations buy in speed and cost in numbers (Day 42).

Five formats of one checkpoint, loaded side by side: fp32 (the exact default), bf16 (matrices and K/V in bf16,
`load(dtype="bfloat16")`), the GGUF's blocks on fp32 activations (the fp32 numbers, a fifth of the bytes), the
blocks on int8 activations (`activations="int8"`), and those with a bf16 K/V cache (`kv_cache_dtype="bfloat16"`).
Against fp32, on text that ships with Python itself (`pydoc_data`, no download): logit error (max, mean),
perplexity, and greedy agreement over many prompts (where the first divergence falls, and fp32's lead there). Then
speed, formats interleaved: prefill tok/s, decode tok/s at each batch size through the engine, the bytes batch 1's
step reads (every weight once, and the request's K/V over its context, as `step_roofline` counts them) as a
fraction of the read bandwidth (measured just before and just after each batch-1 decode; the median of each
decode's fraction, over three times the rounds), the same decode speeds with several forwards per engine step
(`--scheduler-steps`, the `multistep_` rows), and goodput on a ragged arrival trace. One long-format CSV (format,
measure, size, value, vs_fp32) and one row per greedy prompt (`-greedy.csv`).
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable, Sequence

import torch

from ..config import kv_bytes_per_token
from ..engine import LLMEngine
from ..kernels import int8
from ..loader import load
from ..model import Llama
from ..model.matmul import bf16_road
from ..tokenizer import Tokenizer
from .arrivals import replay_engine
from .command import common_arguments, csv_header, report, start
from .csvio import beside, write_csv
from .harness import decode_steps, greedy, ragged_workload, run_requests
from .roofline import measure_bandwidth
from .serving import SLO, arrival_times, serving_metrics
from .timing import interleaved, rounds

FORMATS = {"fp32": {}, "bf16": {"dtype": "bfloat16"}, "blocks": {"weights": "gguf"},
           "blocks-int8": {"weights": "gguf", "activations": "int8"},
           "blocks-int8-kv16": {"weights": "gguf", "activations": "int8", "kv_cache_dtype": "bfloat16"}}
NEAR_TIE = 1e-3
"""A reference top1 - top2 logit gap below this is a genuine near-tie: there two correct paths may part (the
parity tests, the notebooks and this bench all use this one)."""


def held_out_ids(tok: Tokenizer) -> list[int]:
    """Python's own documentation (pydoc_data, in every CPython), as token ids: text found on any machine."""
    from pydoc_data.topics import topics

    return tok.encode("\n\n".join(topics[k] for k in sorted(topics)), add_special_tokens=False)


def windows(ids: Sequence[int], n: int, length: int) -> list[list[int]]:
    """n windows of `length` tokens spread evenly over ids."""
    step = (len(ids) - length) // max(1, n)
    return [list(ids[i * step:i * step + length]) for i in range(n)]


@torch.inference_mode()
def accuracy(models: dict[str, Llama], texts: Sequence[list[int]]) -> dict[str, dict[str, float]]:
    """Per format: max and mean |logit - fp32's| over every position of `texts`, and its perplexity on them."""
    out: dict[str, dict[str, float]] = {}
    exact = [models["fp32"](torch.tensor([t]))[0] for t in texts]
    for name, model in models.items():
        errs, nll, n = [], 0.0, 0
        for t, ref in zip(texts, exact):
            logits = ref if name == "fp32" else model(torch.tensor([t]))[0]
            errs.append((logits - ref).abs())
            nll += float(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(t[1:]), reduction="sum"))
            n += len(t) - 1
        err = torch.cat([e.flatten() for e in errs])
        out[name] = {"logit_max_err": float(err.max()), "logit_mean_err": float(err.mean()),
                     "perplexity": math.exp(nll / n)}
    return out


def greedy_tokens(model: Llama, tok: Tokenizer, prompts: Sequence[list[int]], n: int) -> list[list[int]]:
    """Each prompt's n greedy tokens, all prompts in one engine."""
    _, reqs = run_requests(LLMEngine(model, tok, max_num_seqs=len(prompts)), prompts, [greedy(n)] * len(prompts))
    return [r.output_token_ids for r in reqs]


@torch.inference_mode()
def divergences(exact: Llama, prompts: Sequence[list[int]], ref: Sequence[list[int]], got: Sequence[list[int]],
                ) -> list[dict]:
    """Per prompt: the first step where `got` leaves fp32's tokens (None: never), and fp32's lead of its own token
    over the one taken there (computed on the shared context): small leads are where any rounding may turn."""
    rows = []
    for i, (p, a, b) in enumerate(zip(prompts, ref, got)):
        k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        lead = None
        if k is not None:
            logits = exact(torch.tensor([p + a[:k]]), last_only=True)[0]
            lead = float(logits[a[k]] - logits[b[k]])
        rows.append(dict(prompt=i, first_divergence=k, fp32_lead=lead))
    return rows


def decode_speed(model: Llama, tok: Tokenizer, prompts: Sequence[list[int]], steps: int,
                 scheduler_steps: int = 1) -> tuple[float, float]:
    """Decode tok/s of len(prompts) requests stepping together in the engine (the median decode forward: each
    `step()` call timed whole, as the loop that drives it sees it, over the forwards it ran), and the bytes per
    second a forward reads: every weight once, each request's K/V over its context (the median step's mean).
    `scheduler_steps`: the engine's num_scheduler_steps."""
    engine = LLMEngine(model, tok, max_num_seqs=len(prompts), num_scheduler_steps=scheduler_steps)
    recs = decode_steps(engine, prompts, [greedy(steps)] * len(prompts))
    forward_s = statistics.median(w / r.num_steps for w, r in recs)
    kv = kv_bytes_per_token(model.cfg, model.kv_dtype.itemsize)
    read = statistics.median(model.weight_bytes() + kv * sum(s + (r.num_steps + 1) / 2 for _, s, _ in r.scheduled)
                             for _, r in recs)
    return len(prompts) / forward_s, read / forward_s


def around(decode: Callable[[], tuple[float, float]], measure: bool) -> tuple[float, float, float]:
    """(read bandwidth, *decode()): the bandwidth the mean of one measured just before the decode and one just
    after (0.0 unless `measure`), so that a change of the machine's pace while it runs is seen from both sides."""
    before = measure_bandwidth(2**28, 3)[0] if measure else 0.0
    got = decode()
    return ((before + measure_bandwidth(2**28, 3)[0]) / 2 if measure else 0.0, *got)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--formats", nargs="+", choices=list(FORMATS), default=list(FORMATS))
    ap.add_argument("--prompts", type=int, default=24, help="greedy prompts compared with fp32")
    ap.add_argument("--new-tokens", type=int, default=48, help="greedy tokens per prompt")
    ap.add_argument("--windows", type=int, default=4, help="windows of held-out text for error and perplexity")
    ap.add_argument("--scheduler-steps", type=int, default=8,
                    help="decode speed again with this num_scheduler_steps (the multistep_ rows; 1: none)")
    common_arguments(ap, "data/bench-numerics.csv", contexts=[128, 512, 1024], batch_sizes=[1, 8, 32], steps=24,
                     repeats=3, requests=40, rates=[4.0, 8.0, 16.0], seed=0)


def run(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    start(args, model=False)
    formats = ["fp32"] + [f for f in args.formats if f != "fp32"]  # fp32: every other format's reference
    loaded = {f: load(**FORMATS[f]) for f in formats}
    models, tok = {f: m for f, (m, _) in loaded.items()}, loaded["fp32"][1]
    text = held_out_ids(tok)
    errors = accuracy(models, windows(text, args.windows, 512))
    rows = [dict(format=f, measure=k, size="", value=v) for f, d in errors.items() for k, v in d.items()]
    prompts = windows(text, args.prompts, 64)
    tokens = {f: greedy_tokens(m, tok, prompts, args.new_tokens) for f, m in models.items()}
    greedy_rows = [dict(format=f, **r) for f in formats[1:]
                   for r in divergences(models["fp32"], prompts, tokens["fp32"], tokens[f])]
    for f in formats[1:]:
        mine = [r for r in greedy_rows if r["format"] == f]
        rows += [dict(format=f, measure="greedy_identical", size=args.new_tokens,
                      value=sum(r["first_divergence"] is None for r in mine) / len(mine)),
                 dict(format=f, measure="greedy_near_tie_divergences", size=args.new_tokens,
                      value=sum(r["fp32_lead"] is not None and r["fp32_lead"] < NEAR_TIE for r in mine))]
    with torch.inference_mode():
        for ctx in args.contexts:
            ids = torch.tensor([text[:ctx]])
            # a prompt takes tens of milliseconds: twice the rounds, so that one slow moment cannot move a median
            times = interleaved([lambda m=m, ids=ids: m(ids, last_only=True) for m in models.values()],
                                2 * args.repeats)
            rows += [dict(format=f, measure="prefill_tok_s", size=ctx, value=ctx / statistics.median(t))
                     for f, t in zip(formats, times)]
    bandwidths: list[float] = []
    for b in args.batch_sizes:
        # per format, per round: (at batch 1 the read bandwidth around it, tok/s, bytes/s read): a shared
        # machine's bandwidth moves from minute to minute, so each decode is divided by its own moment's
        jobs = {(f, k): lambda m=m, b=b, k=k: around(lambda: decode_speed(m, tok, prompts[:b], args.steps, k), b == 1)
                for f, m in models.items() for k in sorted({1, args.scheduler_steps})}
        # batch 1's fraction of read bandwidth moves by a tenth from one round to the next: three times the rounds
        for (f, k), timed in rounds(jobs, args.repeats * (3 if b == 1 else 1)).items():
            multi = "multistep_" if k > 1 else ""  # several decode forwards per engine step
            rows.append(dict(format=f, measure=f"{multi}decode_tok_s", size=b,
                             value=statistics.median(t for _, t, _ in timed)))
            if b == 1:
                bandwidths += [bw for bw, _, _ in timed]
                rows.append(dict(format=f, measure=f"{multi}read_bandwidth_fraction", size=1, value=statistics.median(
                    read / bw for bw, _, read in timed)))
    read_bw = statistics.median(bandwidths) if bandwidths else measure_bandwidth()[0]
    w = ragged_workload(tok, args.requests, seed=args.seed)
    for rate in args.rates:
        trace = arrival_times(args.requests, rate, 1.0, args.seed)
        for f, m in models.items():
            replay = replay_engine(LLMEngine(m, tok), w, trace, rate)
            rows.append(dict(format=f, measure="goodput_req_s", size=rate, value=serving_metrics(replay.timings,
                                                                                                 SLO()).goodput))
    for r in rows:  # each speed's ratio to fp32's at the same size, same run
        base = next((x["value"] for x in rows if x["format"] == "fp32" and (x["measure"], x["size"]) ==
                     (r["measure"], r["size"])), None)
        r["vs_fp32"] = r["value"] / base if base and r["measure"].endswith(("tok_s", "req_s")) else ""
    meta = csv_header(argv, bf16_road=bf16_road(), int8_road=int8.int8_road(), read_bandwidth_gb_s=read_bw / 1e9,
                      held_out="pydoc_data.topics (Python's documentation)", windows=args.windows,
                      prompts=args.prompts, new_tokens=args.new_tokens, scheduler_steps=args.scheduler_steps,
                      slo=dict(ttft_s=SLO().ttft_s, tpot_s=SLO().tpot_s))
    write_csv(args.out, rows, meta)
    write_csv(beside(args.out, "greedy"), greedy_rows, meta)
    return report(args.out, meta, rows)
