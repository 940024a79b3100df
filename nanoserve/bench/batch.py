"""`python -m nanoserve bench batch`: static batching, measured (Day 29): the blocking run, then uniform batches of
`--sizes` rows, our step (on the kernels and on torch's ops) and transformers' `generate` round by round, the
machine's peak and read bandwidth measured before each round (their medians make the roofline: a machine's pace
moves, and a step timed at one moment over a bandwidth read at another is a ratio of two moments)."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .. import kernels
from ..model import Llama
from ..tokenizer import Tokenizer
from . import harness
from .batchbench import BatchScaling, BatchTiming, fit_batch_scaling, read_csv, write_csv
from .command import common_arguments, csv_header, report, start
from .harness import PASSAGE as PASSAGE  # notebooks read the passage here
from .harness import PROMPTS
from .roofline import measure_bandwidth, measure_gemm_flops, measure_onednn_gemm_flops, measure_roofline, step_roofline

CSV_PATH = "data/day-29-batchbench.csv"
read_run = read_csv  # a batch CSV's header (values JSON-decoded) and labelled runs
TORCH_OPS_LABEL = "nanoserve-torch-ops"  # the CSV's label for our step on torch's ops instead of the kernels


def sweep_prompt(tok: Tokenizer, n_tokens: int = 0) -> list[int]:
    """The first of PROMPTS (n_tokens 0), or n_tokens of prose."""
    return harness.prose(tok, n_tokens) if n_tokens > 0 else tok.encode(PROMPTS[0])


def pooled_median(timings: Sequence[BatchTiming]) -> float:
    """Median decode step over every step of every run."""
    return statistics.median(s for t in timings for s in t.step_s)


def blocking_run(model: Llama, prompts: Sequence[Sequence[int]]) -> BatchTiming:
    """Seven rows of 4 tokens behind one of 32, timed for real."""
    lens = harness.BLOCKING_LENS
    harness.time_model_batch(model, [prompts[0]] * len(lens), [2] * len(lens))  # warm up: the same shape
    return harness.time_model_batch(model, prompts[: len(lens)], [n - 1 for n in lens])[0]


@dataclass
class SweepRuns:
    ours: dict[int, list[BatchTiming]]
    theirs: dict[int, list[BatchTiming]]  # transformers' generate; empty lists without it
    same: dict[int, bool]  # transformers' tokens equal ours in every round
    torch_ops: dict[int, list[BatchTiming]]  # our step on torch's ops; empty without it
    torch_ops_same: dict[int, bool] = field(default_factory=dict)


def sweep_beside(model: Llama, hf_model, prompt: Sequence[int], sizes: Sequence[int], steps: int,
                 rounds: int, before_round: Callable[[int], object] | None = None, torch_ops: bool = False,
                 ) -> SweepRuns:
    """The uniform sweep, `rounds` times, transformers' (and with `torch_ops` our step on torch's ops) right after
    each of ours, in the same machine state; `before_round(r)` runs first in round r."""
    runs = SweepRuns({b: [] for b in sizes}, {b: [] for b in sizes}, {}, {b: [] for b in sizes} if torch_ops else {})
    for r in range(rounds):
        if before_round is not None:
            before_round(r)
        for b in sizes:
            sweep = harness.sweep_batch_sizes(model, prompt, [b], steps, warmup=r == 0)
            runs.ours[b].append(sweep.timings[b])
            if torch_ops:
                plain = harness.sweep_batch_sizes(model, prompt, [b], steps, warmup=r == 0, compiled=False)
                runs.torch_ops[b].append(plain.timings[b])
                runs.torch_ops_same[b] = runs.torch_ops_same.get(b, True) and plain.tokens[b] == sweep.tokens[b]
            if hf_model is not None:
                if r == 0:
                    harness.time_hf_generate(hf_model, [prompt] * b, 2)  # warm up
                timing, tokens = harness.time_hf_generate(hf_model, [prompt] * b, steps)
                runs.theirs[b].append(timing)
                runs.same[b] = runs.same.get(b, True) and tokens == sweep.tokens[b]
    return runs


def sweep_rows(model: Llama, ours: BatchScaling, meta: dict, theirs: BatchScaling | None = None,
               ops: BatchScaling | None = None) -> list[dict]:
    """Our step and tok/s beside transformers' and on torch's ops, against the machine's peaks and best step."""
    rows = []
    for i, b in enumerate(ours.batch_sizes):
        row = dict(B=b, step_ms=ours.step_s[i] * 1e3, tok_s=ours.tok_per_s[i], eff=ours.efficiency[i])
        if ops:
            row.update(ops_ms=ops.step_s[i] * 1e3, x_ops=ours.tok_per_s[i] / ops.tok_per_s[i])
        if theirs:
            row.update(hf_ms=theirs.step_s[i] * 1e3, hf_eff=theirs.efficiency[i],
                       x_hf=ours.tok_per_s[i] / theirs.tok_per_s[i])
        if meta.get("peak_flops_torch"):
            torch_peak, onednn_peak = meta["peak_flops_torch"], meta["peak_flops_onednn"] or 0.0
            point = step_roofline(model, b, meta["sweep_prompt_tokens"] + meta["sweep_steps"] // 2,
                                  max(torch_peak, onednn_peak), meta["read_bandwidth"])
            achieved = point.flops / ours.step_s[i]
            row.update(gflop_s=achieved / 1e9, of_torch=achieved / torch_peak,
                       of_onednn=achieved / (onednn_peak or torch_peak), best_ms=point.best_step_s * 1e3)
        rows.append(row)
    return rows


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--sizes", type=int, nargs="+", default=list(harness.SWEEP_SIZES), help="sweep batch sizes")
    ap.add_argument("--prompt-tokens", type=int, default=0, help="sweep a prompt of this many tokens of prose")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' generate")
    ap.add_argument("--no-roofline", action="store_true", help="skip measuring the machine")
    ap.add_argument("--no-torch-ops", action="store_true", help="skip our step on torch's ops")
    common_arguments(ap, CSV_PATH, steps=32, rounds=3)


def run(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    model, tok = start(args)
    meta = csv_header(argv, kernels=kernels.describe(), weight_bytes=model.weight_bytes())
    print(f"{meta['machine']}\nsteps run: {meta['kernels']}")
    t = blocking = blocking_run(model, [tok.encode(p) for p in PROMPTS])
    print(f"blocking run: {t.batch_size} rows, {t.n_steps} decode steps: issued {t.issued_tokens}, useful "
          f"{t.useful_tokens} (waste {t.waste_fraction:.2f}); a short row is done at {t.row_done_s[0]:.3f} s, returned "
          f"at {t.batch_done_s:.3f} s (head-of-line inflation {t.max_hol_inflation:.1f}x)")
    prompt = sweep_prompt(tok, args.prompt_tokens)
    peaks: list[tuple[float, float | None]] = []  # (torch.matmul, oneDNN) FLOP/s before each round, and at the end
    reads: list[float] = []  # read bytes/s, the same moments

    def measure_machine(_round: int) -> None:
        peaks.append((measure_gemm_flops(), measure_onednn_gemm_flops()))
        reads.append(measure_bandwidth(2**28, 3)[0])

    hf_model = None if args.no_hf else harness.load_hf_model()
    torch_ops = kernels.use_kernels(model.dtype) and not args.no_torch_ops
    runs = sweep_beside(model, hf_model, prompt, args.sizes, args.steps, args.rounds,
                        None if args.no_roofline else measure_machine, torch_ops)
    fit = lambda by: fit_batch_scaling(args.sizes, [pooled_median(by[b]) for b in args.sizes]) if by else None
    meta.update(sweep_prompt_tokens=len(prompt), sweep_steps=args.steps, rounds=args.rounds,
                transformers_same_tokens=all(runs.same.values()) if runs.same else None,
                torch_ops_same_tokens=all(runs.torch_ops_same.values()) if runs.torch_ops_same else None)
    if not args.no_roofline:
        roof = measure_roofline()
        peaks.append((roof.matmul_flops, roof.onednn_flops))
        reads.append(roof.read_bandwidth)
        meta.update(peak_flops_torch=statistics.median(p[0] for p in peaks),
                    peak_flops_onednn=None if roof.onednn_flops is None else statistics.median(p[1] for p in peaks),
                    peak_flops_samples=peaks, read_bandwidth=statistics.median(reads), read_bandwidth_samples=reads,
                    copy_bandwidth=roof.copy_bandwidth)
    roads = lambda b: (("nanoserve", runs.ours[b]), (TORCH_OPS_LABEL, runs.torch_ops.get(b, [])),
                       ("transformers", runs.theirs[b]))
    write_csv(args.out, [("blocking", blocking)] + [(label, t) for b in args.sizes for label, ts in roads(b)
                                                    for t in ts], meta)
    ours = fit(runs.ours)
    print(f"knee {ours.knee}; peak {ours.peak_tok_per_s:.1f} tok/s at batch {ours.peak_batch_size}")
    return report(args.out, meta, sweep_rows(model, ours, meta, fit(runs.theirs) if runs.same else None,
                                             fit(runs.torch_ops)))
