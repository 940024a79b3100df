"""`python -m nanoserve bench batch`: static batching, measured (Day 29).

Two measurements on the real model, each written to one CSV under data/ that opens with its
command, the machine and the roofline:

- the blocking run: seven rows of 4 tokens batched behind one of 32 (issued vs useful tokens,
  head-of-line inflation);
- the sweep: uniform batches of 1..32 rows, our step and transformers' static `generate`
  interleaved round by round (and our step on torch's ops, what the compiled kernels buy), with
  the machine's peak measured before each round. `--prompt-tokens N` sweeps a prompt of N tokens
  instead of the 5-token one: at a few hundred tokens the prefill and the K/V reads weigh in.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import kernels
from ..model import Llama
from ..tokenizer import Tokenizer
from .batchbench import BatchScaling, BatchTiming, fit_batch_scaling, read_csv, write_csv
from .harness import (
    BLOCKING_LENS,
    PROMPTS,
    SWEEP_SIZES,
    load_hf_model,
    sweep_batch_sizes,
    time_hf_generate,
    time_model_batch,
    warm_up,
)
from .machine import add_common_arguments, command_line, machine_line, use_threads
from .roofline import step_roofline

CSV_PATH = "data/day-29-batchbench.csv"

PASSAGE = (
    "The lighthouse on the northern cape was built in 1858 from granite quarried on the island itself. "
    "For ninety years a keeper climbed its one hundred and twelve steps every evening to light the lamp, "
    "wind the clockwork that turned the lens, and write the weather in a log that still survives. "
    "Ships rounding the cape in winter storms steered by its flash, one long and two short every twenty "
    "seconds, and the keepers' families grew vegetables in the lee of the tower where the wind could not "
    "reach them. When the light was automated the last keeper left a note in the log: the lamp is clean, "
    "the stairs are swept, and the gulls are fed. "
)
"""The text a long sweep prompt is cut from (repeated as needed): ordinary prose, not a repeated token."""


def sweep_prompt(tok: Tokenizer, n_tokens: int = 0) -> list[int]:
    """The sweep's prompt: the first of PROMPTS (n_tokens 0), or the first n_tokens of PASSAGE repeated."""
    if n_tokens <= 0:
        return tok.encode(PROMPTS[0])
    ids = tok.encode(PASSAGE)
    return (ids * (n_tokens // len(ids) + 1))[:n_tokens]


def read_meta(path: str | Path) -> dict:
    """The `# key: value` lines of a batch CSV, values JSON-decoded where they are JSON."""
    meta = {}
    for line in Path(path).read_text().splitlines():
        if not line.startswith("#"):
            break
        key, _, value = line[1:].strip().partition(": ")
        try:
            meta[key] = json.loads(value)
        except json.JSONDecodeError:
            meta[key] = value
    return meta


def read_run(path: str | Path) -> tuple[dict, list[tuple[str, BatchTiming]]]:
    """A batch CSV: its meta lines and its labelled runs."""
    return read_meta(path), read_csv(path)


TORCH_OPS_LABEL = "nanoserve-torch-ops"
"""The CSV's label for our decode step run on torch's ops instead of the compiled kernels."""


def pooled_median(timings: Sequence[BatchTiming]) -> float:
    """Median decode step over every step of every run (the sweep's rounds)."""
    return statistics.median(s for t in timings for s in t.step_s)


def blocking_run(model: Llama, prompts: Sequence[Sequence[int]]) -> BatchTiming:
    """Day 29's blocking run: seven rows of 4 tokens batched behind one row of 32, timed for real."""
    warm_up(model, prompts[0], len(BLOCKING_LENS))
    timing, _ = time_model_batch(model, prompts[: len(BLOCKING_LENS)], [n - 1 for n in BLOCKING_LENS])
    return timing


@dataclass
class SweepRuns:
    """What `sweep_beside` timed, per batch size: every round's run of each path."""

    ours: dict[int, list[BatchTiming]]
    theirs: dict[int, list[BatchTiming]]  # transformers' generate; empty lists without it
    same: dict[int, bool]  # transformers' tokens equal ours in every round
    torch_ops: dict[int, list[BatchTiming]]  # our step on torch's ops instead of the compiled kernels; may be empty
    torch_ops_same: dict[int, bool] = field(default_factory=dict)  # their tokens equal ours in every round


def sweep_beside(model: Llama, hf_model, prompt: Sequence[int], sizes: Sequence[int], steps: int,
                 rounds: int, before_round: Callable[[int], object] | None = None, torch_ops: bool = False,
                 ) -> SweepRuns:
    """The uniform sweep, `rounds` times, transformers' generate right after each of ours (same machine
    state for both); with `torch_ops`, our step on torch's ops too (what the compiled kernels buy);
    `before_round(r)` runs first in round r (the command measures the peak there)."""
    runs = SweepRuns({b: [] for b in sizes}, {b: [] for b in sizes}, {}, {b: [] for b in sizes} if torch_ops else {})
    ours, theirs, same = runs.ours, runs.theirs, runs.same
    for r in range(rounds):
        if before_round is not None:
            before_round(r)
        for b in sizes:
            sweep = sweep_batch_sizes(model, prompt, [b], steps, warmup=r == 0)
            ours[b].append(sweep.timings[b])
            if torch_ops:
                plain = sweep_batch_sizes(model, prompt, [b], steps, warmup=r == 0, kernels=False)
                runs.torch_ops[b].append(plain.timings[b])
                runs.torch_ops_same[b] = runs.torch_ops_same.get(b, True) and plain.tokens[b] == sweep.tokens[b]
            if hf_model is not None:
                if r == 0:
                    time_hf_generate(hf_model, [prompt] * b, 2)  # warm up
                timing, tokens = time_hf_generate(hf_model, [prompt] * b, steps)
                theirs[b].append(timing)
                same[b] = same.get(b, True) and tokens == sweep.tokens[b]
    return runs


def print_blocking(t: BatchTiming) -> None:
    print(f"\nblocking run: {t.batch_size} rows generating {[s + 1 for s in t.row_steps]} tokens, "
          f"{t.n_steps} decode steps\n  issued {t.issued_tokens}, useful {t.useful_tokens}, waste fraction "
          f"{t.waste_fraction:.2f}\n  a short row's work ends at {t.row_done_s[0]:.3f} s, it is returned at "
          f"{t.batch_done_s:.3f} s: head-of-line inflation {t.max_hol_inflation:.1f}x")


def print_sweep(model: Llama, ours: BatchScaling, theirs: BatchScaling | None, meta: dict,
                plain: BatchScaling | None = None) -> None:
    """The sweep's table: our step and tokens/s, transformers' beside them, our step on torch's ops
    (`plain`), and where the step sits against the machine's peak FLOP/s (torch's matmul, and
    oneDNN's) and the roofline's best step."""
    peaks = [meta.get("peak_flops_torch"), meta.get("peak_flops_onednn")]
    head = f"{'B':>3} {'step ms':>8} {'tok/s':>7} {'eff':>5}"
    head += f" | {'ops ms':>7} {'x ops':>5}" if plain else ""
    head += f" | {'hf ms':>7} {'hf tok/s':>8} {'hf eff':>6} {'x hf':>5}" if theirs else ""
    head += f" | {'GFLOP/s':>7} {'/torch':>6} {'/oneDNN':>7} {'best ms':>7}" if peaks[0] else ""
    print(head)
    for i, b in enumerate(ours.batch_sizes):
        line = f"{b:3d} {ours.step_s[i] * 1e3:8.1f} {ours.tok_per_s[i]:7.1f} {ours.efficiency[i]:5.2f}"
        if plain:
            line += f" | {plain.step_s[i] * 1e3:7.1f} {ours.tok_per_s[i] / plain.tok_per_s[i]:5.2f}"
        if theirs:
            line += (f" | {theirs.step_s[i] * 1e3:7.1f} {theirs.tok_per_s[i]:8.1f} {theirs.efficiency[i]:6.2f} "
                     f"{ours.tok_per_s[i] / theirs.tok_per_s[i]:5.2f}")
        if peaks[0]:
            peak = max(p or 0.0 for p in peaks)
            point = step_roofline(model, b, meta["sweep_prompt_tokens"] + meta["sweep_steps"] // 2, peak,
                                  meta["read_bandwidth"])
            achieved = point.flops / ours.step_s[i]
            line += (f" | {achieved / 1e9:7.1f} {achieved / peaks[0]:6.2f} {achieved / (peaks[1] or peak):7.2f} "
                     f"{point.best_step_s * 1e3:7.1f}")
        print(line)
    print(f"knee {ours.knee}; peak {ours.peak_tok_per_s:.1f} tok/s at batch {ours.peak_batch_size}")




def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SWEEP_SIZES), help="sweep batch sizes")
    ap.add_argument("--steps", type=int, default=32, help="decode steps per row in the sweep")
    ap.add_argument("--prompt-tokens", type=int, default=0,
                    help="sweep a prompt of this many tokens (default: the 5-token prompt)")
    ap.add_argument("--rounds", type=int, default=3, help="sweep rounds; the median step pools every round")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' generate")
    ap.add_argument("--no-roofline", action="store_true", help="skip measuring the machine")
    ap.add_argument("--no-torch-ops", action="store_true",
                    help="skip timing our step on torch's ops beside the compiled kernels")
    add_common_arguments(ap, CSV_PATH)


def run(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    """Both Day-29 measurements on the real model, transformers beside them, the roofline beside both."""
    use_threads(args)
    from ..loader import load
    from ..model.fetch import ensure_model
    from .roofline import measure_gemm_flops, measure_onednn_gemm_flops, measure_roofline

    model, tok = load()
    compiled = kernels.use_kernels(model.dtype)
    meta: dict = dict(command=command_line(argv), machine=machine_line(), kernels=kernels.describe(),
                      weight_bytes=model.weight_bytes())
    print(f"{meta['machine']}\nsteps run: {meta['kernels']}")
    prompts = [tok.encode(p) for p in PROMPTS]
    blocking = blocking_run(model, prompts)
    print_blocking(blocking)

    prompt = sweep_prompt(tok, args.prompt_tokens)
    hf_model = None if args.no_hf else load_hf_model(ensure_model())
    peaks: list[tuple[float, float | None]] = []  # (torch.matmul, oneDNN) FLOP/s, one pair per round

    def measure_peaks(_round: int) -> None:
        with torch.inference_mode():
            peaks.append((measure_gemm_flops(), measure_onednn_gemm_flops()))

    runs = sweep_beside(model, hf_model, prompt, args.sizes, args.steps, args.rounds,
                        None if args.no_roofline else measure_peaks, torch_ops=compiled and not args.no_torch_ops)
    ours, theirs, same = runs.ours, runs.theirs, runs.same
    scaling = fit_batch_scaling(args.sizes, [pooled_median(ours[b]) for b in args.sizes])
    hf_scaling = fit_batch_scaling(args.sizes, [pooled_median(theirs[b]) for b in args.sizes]) if same else None
    plain = fit_batch_scaling(args.sizes, [pooled_median(runs.torch_ops[b]) for b in args.sizes]) \
        if runs.torch_ops else None
    meta.update(sweep_prompt_tokens=len(prompt), sweep_steps=args.steps, rounds=args.rounds,
                transformers_same_tokens=all(same.values()) if same else None,
                torch_ops_same_tokens=all(runs.torch_ops_same.values()) if runs.torch_ops_same else None)
    if not args.no_roofline:
        roof = measure_roofline()
        peaks.append((roof.matmul_flops, roof.onednn_flops))
        meta.update(peak_flops_torch=statistics.median(p[0] for p in peaks),
                    peak_flops_onednn=None if roof.onednn_flops is None else statistics.median(p[1] for p in peaks),
                    peak_flops_samples=peaks, read_bandwidth=roof.read_bandwidth, copy_bandwidth=roof.copy_bandwidth)
        print(f"\nroofline: {roof.describe()}\npeak GFLOP/s (torch.matmul, oneDNN) before each round and at the "
              f"end: {', '.join(f'({t / 1e9:.0f}, {(o or 0) / 1e9:.0f})' for t, o in peaks)}; the sweep's table "
              f"divides by their medians")
    print(f"\nsweep: a {len(prompt)}-token prompt x B rows, {args.steps} decode steps x {args.rounds} rounds, median "
          f"step; transformers' generate interleaved (same tokens: {meta['transformers_same_tokens']})"
          + (f"; ours on torch's ops too (same tokens: {meta['torch_ops_same_tokens']})" if plain else ""))
    print_sweep(model, scaling, hf_scaling, meta, plain)

    paths = lambda b: (("nanoserve", ours[b]), (TORCH_OPS_LABEL, runs.torch_ops.get(b, [])),
                       ("transformers", theirs[b]))
    rows = [("blocking", blocking)] + [(label, t) for b in args.sizes for label, ts in paths(b) for t in ts]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_csv(args.out, rows, [f"# {k}: {v if isinstance(v, str) else json.dumps(v)}" for k, v in meta.items()])
    print(f"-> {args.out}")
    return 0
