"""`python -m nanoserve bench engine`: the scheduled engine against static batching and transformers (Days 30-35),
on 32 ragged requests at once (and with `--uniform` a workload static batching wastes nothing on). Useful tok/s is
the tokens asked for over the wall time; latency runs to when a request is handed back."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..config import EngineConfig, SchedulerConfig
from ..engine import LLMEngine
from ..model import Llama
from ..model.fetch import model_folder
from ..stages import greedy_generate_batch
from . import csvio
from .arrivals import replay_hf_continuous, start_hf_manager
from .command import common_arguments, csv_header, engine_config, report, start
from .harness import Workload, greedy, hf_generate, load_hf_model, ragged_workload, run_requests, uniform_workload
from .roofline import measure_roofline
from .serving import percentile

CSV_PATH = "data/bench-engine.csv"
SYSTEMS = ("nanoserve-engine", "nanoserve-static-32", "nanoserve-static-8", "transformers-static-8",
           "transformers-cb")


@dataclass
class SystemRun:
    system: str
    workload: str
    latency_s: list[float]
    tokens: list[list[int]]
    wall_s: float


def run_engine(model: Llama, w: Workload, config: EngineConfig | SchedulerConfig | None = None,
               ) -> tuple[SystemRun, LLMEngine]:
    engine = LLMEngine(model, config=engine_config(config))
    t0, reqs = run_requests(engine, w.prompts, [greedy(n) for n in w.max_tokens])
    return SystemRun("nanoserve-engine", w.name, [r.finish_time - t0 for r in reqs],
                     [r.output_token_ids for r in reqs], time.perf_counter() - t0), engine


def _batches(w: Workload, size: int, system: str, run: Callable[[list, list], list[list[int]]]) -> SystemRun:
    """Static batches of `size` in arrival order, one after another; each row handed back with its batch."""
    t0, latency, tokens = time.perf_counter(), [], []
    for i in range(0, len(w.prompts), size):
        tokens += run(w.prompts[i:i + size], w.max_tokens[i:i + size])
        latency += [time.perf_counter() - t0] * (len(tokens) - len(latency))
    return SystemRun(system, w.name, latency, tokens, time.perf_counter() - t0)


def run_static(model: Llama, w: Workload, batch_size: int) -> SystemRun:
    return _batches(w, batch_size, f"nanoserve-static-{batch_size}", lambda p, n: greedy_generate_batch(model, p, n))


def run_hf_static(hf_model, w: Workload, batch_size: int = 8) -> SystemRun:
    """transformers' generate on batches of `batch_size`, each run to its longest request."""
    return _batches(w, batch_size, f"transformers-static-{batch_size}",
                    lambda ps, ns: [row[:n] for row, n in zip(hf_generate(hf_model, ps, max(ns))[2], ns)])


def run_hf_continuous(hf_model, w: Workload) -> SystemRun:
    """transformers' continuous batching manager, every request at once."""
    with start_hf_manager(hf_model, w) as manager:
        r = replay_hf_continuous(manager, w, [0.0] * len(w.prompts))
    t0 = min(t.start for t in r.timings)
    latency = [t.end - t0 for t in r.timings]
    return SystemRun("transformers-cb", w.name, latency, r.tokens, max(latency))


@dataclass(frozen=True)
class SystemSummary:
    system: str
    workload: str
    useful_tokens: int
    wall_s: float
    p50_latency_s: float
    p90_latency_s: float

    @property
    def useful_tok_s(self) -> float:
        return self.useful_tokens / self.wall_s


def summarize(rows: Sequence[dict]) -> list[SystemSummary]:
    """Per (workload, system) of the CSV's rows, in order: useful tokens, wall time, latency percentiles."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["workload"], r["system"]), []).append(r)
    return [SystemSummary(system, workload, sum(int(r["max_tokens"]) for r in rs), float(rs[0]["wall_s"]),
                          *(percentile([float(r["latency_s"]) for r in rs], p) for p in (50, 90)))
            for (workload, system), rs in groups.items()]


def overhead(engine: LLMEngine, min_requests: int) -> dict[str, float]:
    """Host time outside the forward and the step's, medians over steps of >= min_requests requests."""
    steps = [s for s in engine.history if s.num_requests >= min_requests] or list(engine.history)
    return dict(steps=len(steps), min_requests=min_requests,
                overhead_ms=statistics.median(s.overhead_s for s in steps) * 1e3,
                step_ms=statistics.median(s.total_s for s in steps) * 1e3,
                fraction=statistics.median(s.overhead_s / s.total_s for s in steps))


def agreement(a: SystemRun, b: SystemRun) -> int:
    return sum(x == y for x, y in zip(a.tokens, b.tokens))


def write_csv(path: str | Path, runs: Sequence[SystemRun], workloads: dict[str, Workload], meta: dict) -> Path:
    rows = [dict(workload=r.workload, system=r.system, request=i, prompt_tokens=len(workloads[r.workload].prompts[i]),
                 max_tokens=workloads[r.workload].max_tokens[i], latency_s=f"{lat:.4f}", wall_s=f"{r.wall_s:.4f}")
            for r in runs for i, lat in enumerate(r.latency_s)]
    return csvio.write_csv(path, rows, meta)


def read_csv(path: str | Path) -> tuple[dict[str, str], list[dict]]:
    return csvio.read_csv(path, parse=True)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    ap.add_argument("--uniform", action="store_true", help="also the uniform workload (the engine, one static batch)")
    common_arguments(ap, CSV_PATH, engine=True, weights="fp32", requests=32, seed=0)


def run(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    (model, tok), config = start(args), engine_config(args)
    workloads = {"ragged": ragged_workload(tok, args.requests, seed=args.seed)}
    if args.uniform:
        workloads["uniform"] = uniform_workload(tok, args.requests, seed=args.seed)
    if any(s.startswith("transformers") for s in args.systems):
        hf_model = load_hf_model(model_folder(args.model), attn="sdpa")
    greedy_generate_batch(model, workloads["ragged"].prompts[:2], 2)  # warm: kernels built, weights touched
    systems: dict[str, Callable[[Workload], SystemRun]] = {
        "nanoserve-static-32": lambda w: run_static(model, w, 32),
        "nanoserve-static-8": lambda w: run_static(model, w, 8),
        "transformers-static-8": lambda w: run_hf_static(hf_model, w),
        "transformers-cb": lambda w: run_hf_continuous(hf_model, w)}
    extra: dict[str, object] = dict(scheduler=dict(max_num_seqs=config.scheduler.max_num_seqs,
                                                   max_num_batched_tokens=config.scheduler.max_num_batched_tokens))
    runs: list[SystemRun] = []
    for name, w in workloads.items():
        for system in args.systems if name == "ragged" else [s for s in args.systems if s in SYSTEMS[:2]]:
            print(f"{name}: {system} ...", flush=True)
            if system == "nanoserve-engine":
                r, engine = run_engine(model, w, config)
                extra.update({f"{name}_engine_{k}": v for k, v in dict(
                    overhead={k: round(v, 4) for k, v in overhead(engine, min(32, args.requests)).items()},
                    steps=engine.steps, preemptions=engine.scheduler.num_preemptions,
                    prefix_hit_tokens=engine.scheduler.prefix_hit_tokens).items()})
            else:
                r = systems[system](w)
            runs.append(r)
            print(f"  {w.useful_tokens / r.wall_s:.1f} useful tok/s, {r.wall_s:.1f} s", flush=True)
        by = {r.system: r for r in runs if r.workload == name}
        for other, key in (("nanoserve-static-32", "static_32"), ("transformers-cb", "transformers_cb")):
            if "nanoserve-engine" in by and other in by:
                extra[f"{name}_engine_same_tokens_as_{key}"] = agreement(by["nanoserve-engine"], by[other])
    roof = measure_roofline()
    for name, w in workloads.items():
        extra[f"{name}_flop_bound_tok_s"] = round(w.useful_tokens / (w.flops(model.cfg) / roof.peak_flops), 1)
    meta = csv_header(argv, **extra, roofline=roof.describe())
    return report(write_csv(args.out, runs, workloads, meta), meta, [vars(s) | dict(useful_tok_s=s.useful_tok_s)
                                                                     for s in summarize(read_csv(args.out)[1])])
