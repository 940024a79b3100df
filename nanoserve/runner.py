"""The runner: the real model and a real batched pool, handed to measuring code as closures (Day 26).

A benchmark that times a function called in isolation measures that function. The runner
builds exactly what generation builds, a `StaticBatch` (the Day-27 padded prefill into a
real `BatchedPagedKVCache`, then Day-28 batched decode steps), and hands the stdlib timing
core (`batchbench.time_static_batch`) its two bound methods. What gets timed is the loop
`greedy_generate_batch` runs, and the tokens it collects are that function's tokens.

    build_batched_decode  one static batch, as a prefill() and a step() closure
    time_model_batch      time it: a BatchTiming (prefill, every step, each row's budget) and the tokens
    sweep_batch_sizes     uniform batches of 1, 2, 4, ... rows: throughput against batch size
    time_hf_generate      transformers' static batched generate on the same checkpoint, timed per step

transformers is imported only inside the two functions that use it: it is the reference, not a dependency.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .batch import StaticBatch
from .batchbench import BatchScaling, BatchTiming, fit_batch_scaling, time_static_batch
from .model import Llama
from .timing import DEFAULT_CLOCK, Clock

SWEEP_SIZES = (1, 2, 4, 8, 16, 32)
BLOCKING_LENS = (4,) * 7 + (32,)  # Day 29's blocking run: seven rows of 4 tokens behind one of 32

PROMPTS = (
    "The capital of France is",
    "Write a haiku about the sea.",
    "What is two plus two?",
    "Name three colors of the rainbow.",
    "Once upon a time, in a small village by the river,",
    "Explain in one sentence why the sky is blue.",
    "List the days of the week:",
    "A recipe for pancakes needs flour, eggs and",
)
"""Eight short prompts, one per row of the blocking run; the sweep replicates the first."""


@dataclass
class BatchedDecode:
    """One real static batch as two closures: `prefill()` once, then `step()` row_steps-max times."""

    batch: StaticBatch
    prefill: Callable[[], object]
    step: Callable[[], object]
    row_steps: list[int]

    @property
    def tokens(self) -> list[list[int]]:
        """What each row has collected so far: after the whole run, greedy_generate_batch's output."""
        return self.batch.tokens

    def free(self) -> None:
        self.batch.kv.free()


def build_batched_decode(model: Llama, prompts: Sequence[Sequence[int]], stop_steps: Sequence[int],
                         block_size: int = 16, kernels: bool | None = None) -> BatchedDecode:
    """Stand up the batch `greedy_generate_batch(model, prompts, stop_steps=stop_steps)` runs."""
    batch = StaticBatch(model, prompts, list(stop_steps), block_size, kernels)
    return BatchedDecode(batch, batch.prefill, batch.step, list(stop_steps))


def time_model_batch(model: Llama, prompts: Sequence[Sequence[int]], stop_steps: Sequence[int],
                     clock: Clock = DEFAULT_CLOCK, block_size: int = 16,
                     kernels: bool | None = None) -> tuple[BatchTiming, list[list[int]]]:
    """Time one static batch: the prefill, every decode step, and row i's budget of stop_steps[i] steps.

    Rows stop on their step budget, not on EOS; a finished row stays in every forward (it keeps
    its slot and its blocks) until the slowest row is done, which is what the timing charges."""
    run = build_batched_decode(model, prompts, stop_steps, block_size, kernels)
    try:
        timing = time_static_batch(run.prefill, run.step, run.row_steps, clock)
    finally:
        run.free()
    return timing, run.tokens


@dataclass
class Sweep:
    """Uniform batches (every issued token useful), one BatchTiming per batch size."""

    timings: dict[int, BatchTiming]
    tokens: dict[int, list[list[int]]] = field(repr=False)

    @property
    def scaling(self) -> BatchScaling:
        sizes = sorted(self.timings)
        return fit_batch_scaling(sizes, [self.timings[b].median_step_s for b in sizes])


def warm_up(model: Llama, prompt: Sequence[int], batch_size: int, steps: int = 2, kernels: bool | None = None) -> None:
    """A short untimed run of the same shape, so allocator growth is not in the first timed step."""
    time_model_batch(model, [prompt] * batch_size, [steps] * batch_size, kernels=kernels)


def sweep_batch_sizes(model: Llama, prompt: Sequence[int], batch_sizes: Sequence[int] = SWEEP_SIZES,
                      steps: int = 32, warmup: bool = True, clock: Clock = DEFAULT_CLOCK,
                      kernels: bool | None = None) -> Sweep:
    """Throughput against batch size: `prompt` replicated B times, every row decoding `steps` steps."""
    timings, tokens = {}, {}
    for b in batch_sizes:
        if warmup:
            warm_up(model, prompt, b, kernels=kernels)
        timings[b], tokens[b] = time_model_batch(model, [prompt] * b, [steps] * b, clock, kernels=kernels)
    return Sweep(timings, tokens)


# ---- the reference: transformers' static batched generate ----------------------------------------


def load_hf_model(folder: str | Path):
    """transformers' model on the same checkpoint folder, imported only when asked for."""
    try:
        import transformers
    except ImportError as e:
        raise RuntimeError("the transformers baseline needs transformers: pip install 'nanoserve[test]'") from e
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def time_hf_generate(hf_model, prompts: Sequence[Sequence[int]], steps: int, clock: Clock = DEFAULT_CLOCK,
                     pad_id: int = 0) -> tuple[BatchTiming, list[list[int]]]:
    """transformers' `generate` on one static batch (greedy, its own KV cache), `steps` decode steps.

    A logits processor reads the clock each time generate has new logits: once after the prefill,
    then once per decode step, so each step is timed from logits to logits as `StaticBatch.step` is
    (forward plus the loop's own bookkeeping). Prompts are left-padded, as transformers expects."""
    from transformers import LogitsProcessor, LogitsProcessorList

    stamps: list[float] = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(clock())
            return scores

    T = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (T - len(p)) + list(p) for p in prompts])  # (B, T)
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    config = copy.deepcopy(hf_model.generation_config)  # greedy, exactly steps + 1 tokens; [] (not None): no EOS
    config.update(do_sample=False, temperature=None, top_p=None, top_k=None, eos_token_id=[],
                  max_new_tokens=steps + 1, pad_token_id=pad_id)
    start = clock()
    with torch.inference_mode():
        out = hf_model.generate(ids, attention_mask=mask, generation_config=config,
                                logits_processor=LogitsProcessorList([Stamp()]))
    step_s = [b - a for a, b in zip(stamps, stamps[1:])]
    timing = BatchTiming(prefill_s=stamps[0] - start, step_s=step_s, row_steps=[steps] * len(prompts))
    return timing, out[:, T:].tolist()


# ---- the machine's roofline, beside the sweep ------------------------------------------------------


@dataclass(frozen=True)
class StepRoofline:
    """Where a decode step of B rows sits: its FLOPs, its bytes, and the best time the machine allows."""

    batch_size: int
    flops: float  # one step: every row's one new token over `context` keys
    bytes: float  # every weight once, plus each row's K/V
    peak_flops: float
    bandwidth: float

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes

    @property
    def attainable_flops(self) -> float:
        return min(self.peak_flops, self.intensity * self.bandwidth)

    @property
    def best_step_s(self) -> float:
        return self.flops / self.attainable_flops


def step_roofline(model: Llama, batch_size: int, context: int, peak_flops: float, bandwidth: float) -> StepRoofline:
    """The roofline point of one decode step at `batch_size` rows, each attending over `context` keys."""
    from .roofline import forward_flops

    cfg = model.cfg
    kv_bytes = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * context * model.embed.element_size()
    return StepRoofline(batch_size, batch_size * forward_flops(cfg, 1, context - 1),
                        model.weight_bytes() + batch_size * kv_bytes, peak_flops, bandwidth)


# ---- python -m nanoserve.batchbench ---------------------------------------------------------------

CSV_PATH = "data/day-29-batchbench.csv"


def sidecar_path(csv_path: str | Path) -> Path:
    """Where the command, the machine and the roofline of a batchbench CSV are written."""
    return Path(csv_path).with_suffix(".json")


def machine() -> str:
    """Versions, CPU model and threads: the line a measured CSV is only meaningful beside."""
    from .notebook import machine_info

    cpu = ""
    if Path("/proc/cpuinfo").is_file():
        names = [ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                 if ln.startswith("model name")]
        cpu = f" | {names[0]}" if names else ""
    return f"{machine_info()} | cpus {os.cpu_count()}{cpu}"


TORCH_OPS_LABEL = "nanoserve-torch-ops"
"""The CSV's label for our decode step run on torch's ops instead of the compiled kernels."""


def kernels_description(compiled: bool) -> str:
    """What a decode step runs, for the sidecar: the compiled kernels' build, or why torch's ops."""
    from .kernels import build_flags, unavailable_reason

    if compiled:
        name, flags = build_flags()
        return f"compiled kernels {name} ({' '.join(flags)})"
    return f"torch ops ({unavailable_reason() or 'kernels not used'})"


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


def main(argv: list[str] | None = None) -> int:
    """Both Day-29 measurements on the real model, transformers beside them, the roofline beside both."""
    ap = argparse.ArgumentParser(prog="python -m nanoserve.batchbench",
                                 description="Static batching, measured: the blocking run and the batch-size sweep.")
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SWEEP_SIZES), help="sweep batch sizes")
    ap.add_argument("--steps", type=int, default=32, help="decode steps per row in the sweep")
    ap.add_argument("--rounds", type=int, default=3, help="sweep rounds; the median step pools every round")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' generate")
    ap.add_argument("--no-roofline", action="store_true", help="skip measuring the machine")
    ap.add_argument("--no-torch-ops", action="store_true",
                    help="skip timing our step on torch's ops beside the compiled kernels")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    ap.add_argument("--out", default=CSV_PATH)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from . import load
    from .batch import use_kernels
    from .batchbench import write_csv
    from .fetch import ensure_model
    from .roofline import measure_gemm_flops, measure_onednn_gemm_flops, measure_roofline

    model, tok = load()
    compiled = use_kernels(model)
    meta: dict = dict(command=shlex.join(["python", "-m", "nanoserve.batchbench",
                                          *(sys.argv[1:] if argv is None else argv)]),
                      machine=machine(), threads=torch.get_num_threads(), loadavg_start=os.getloadavg()[0],
                      weight_bytes=model.weight_bytes(), kernels=kernels_description(compiled))
    print(f"{meta['machine']}\ndecode step: {meta['kernels']}")
    prompts = [tok.encode(p) for p in PROMPTS]
    blocking = blocking_run(model, prompts)
    print_blocking(blocking)

    hf_model = None if args.no_hf else load_hf_model(ensure_model())
    peaks: list[tuple[float, float | None]] = []  # (torch.matmul, oneDNN) FLOP/s, one pair per round

    def measure_peaks(_round: int) -> None:
        with torch.inference_mode():
            peaks.append((measure_gemm_flops(), measure_onednn_gemm_flops()))

    runs = sweep_beside(model, hf_model, prompts[0], args.sizes, args.steps, args.rounds,
                        None if args.no_roofline else measure_peaks, torch_ops=compiled and not args.no_torch_ops)
    ours, theirs, same = runs.ours, runs.theirs, runs.same
    scaling = fit_batch_scaling(args.sizes, [pooled_median(ours[b]) for b in args.sizes])
    hf_scaling = fit_batch_scaling(args.sizes, [pooled_median(theirs[b]) for b in args.sizes]) if same else None
    plain = fit_batch_scaling(args.sizes, [pooled_median(runs.torch_ops[b]) for b in args.sizes]) \
        if runs.torch_ops else None
    meta.update(sweep_prompt=PROMPTS[0], sweep_prompt_tokens=len(prompts[0]), sweep_steps=args.steps,
                rounds=args.rounds, transformers_same_tokens=all(same.values()) if same else None,
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
    meta["loadavg_end"] = os.getloadavg()[0]
    print(f"\nsweep: {PROMPTS[0]!r} ({len(prompts[0])} tokens) x B rows, {args.steps} decode steps x {args.rounds} "
          f"rounds, median step; transformers' generate interleaved (same tokens: {meta['transformers_same_tokens']})"
          + (f"; ours on torch's ops too (same tokens: {meta['torch_ops_same_tokens']})" if plain else ""))
    print_sweep(model, scaling, hf_scaling, meta, plain)

    paths = lambda b: (("nanoserve", ours[b]), (TORCH_OPS_LABEL, runs.torch_ops.get(b, [])),
                       ("transformers", theirs[b]))
    rows = [("blocking", blocking)] + [(label, t) for b in args.sizes for label, ts in paths(b) for t in ts]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_csv(args.out, rows)
    sidecar_path(args.out).write_text(json.dumps(meta, indent=1) + "\n")
    print(f"-> {args.out} (+ {sidecar_path(args.out).name}); load average {meta['loadavg_start']:.1f} at the "
          f"start, {meta['loadavg_end']:.1f} at the end, on {os.cpu_count()} cpus")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
