"""`python -m nanoserve bench engine`: the scheduled engine against static batching and transformers.

An offline workload, as a user would run one: 32 requests arriving at once, prompts of 20 to 300
tokens cut from ordinary prose (each from its own place, so no two share a prefix), outputs of 8 to
128 tokens with EOS ignored (the length is the request's). Measured in one process, one after the
other, on the same requests:

    nanoserve-engine       LLMEngine: continuous batching, chunked prefill (Days 30-35)
    nanoserve-static-32    one static batch of all 32 (Day 29's greedy_generate_batch)
    nanoserve-static-8     four static batches of 8, one after another
    transformers-static-8  transformers' generate in batches of 8 (left-padded, each to its longest row)
    transformers-cb        transformers' continuous batching (init_continuous_batching, sdpa attention)

Useful tokens are the tokens the requests asked for; useful tok/s is their sum over the wall time.
A request's latency runs from the start to when its answer is handed back: a static batch hands
back every row when its longest is done, the engines each request when it ends. The FLOP bound is
the workload's FLOPs (each prompt once, each useful token once) at the machine's measured peak.
`--uniform` adds a workload where every request has the same prompt and output length, where static
batching wastes nothing.
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import EngineConfig, SchedulerConfig
from ..engine import LLMEngine
from ..model import Llama
from ..sampling import SamplingParams
from ..stages import greedy_generate_batch
from ..tokenizer import Tokenizer
from .batch import PASSAGE
from .machine import add_common_arguments, command_line, csv_header, read_header, use_threads
from .roofline import forward_flops

CSV_PATH = "data/bench-engine.csv"
SYSTEMS = ("nanoserve-engine", "nanoserve-static-32", "nanoserve-static-8", "transformers-static-8",
           "transformers-cb")


@dataclass(frozen=True)
class Workload:
    """Requests as (prompt ids, tokens to generate)."""

    name: str
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def useful_tokens(self) -> int:
        return sum(self.max_tokens)

    def flops(self, cfg) -> float:
        """FLOPs of the useful work: each prompt computed once, each generated token once at its context."""
        total = 0.0
        for p, n in zip(self.prompts, self.max_tokens):
            total += forward_flops(cfg, len(p))  # the prefill gives the first token
            total += sum(forward_flops(cfg, 1, context=len(p) + j) for j in range(n - 1))
        return total


def ragged_workload(tok: Tokenizer, n: int = 32, prompt_range: tuple[int, int] = (20, 300),
                    output_range: tuple[int, int] = (8, 128), seed: int = 0) -> Workload:
    """n requests, prompt and output lengths uniform in their ranges; prompt i starts at its own offset
    into the repeated passage, so no two prompts share a first block."""
    rng = random.Random(seed)
    text = tok.encode(PASSAGE * (prompt_range[1] // 40 + 4), add_special_tokens=False)
    offsets = rng.sample(range(len(tok.encode(PASSAGE, add_special_tokens=False))), n)
    prompts = [text[o:o + rng.randint(*prompt_range)] for o in offsets]
    return Workload("ragged", prompts, [rng.randint(*output_range) for _ in range(n)])


def uniform_workload(tok: Tokenizer, n: int = 32, prompt_tokens: int = 160, max_tokens: int = 68,
                     seed: int = 0) -> Workload:
    """n requests of one prompt length and one output length: the case static batching wastes nothing on."""
    w = ragged_workload(tok, n, (prompt_tokens, prompt_tokens), (max_tokens, max_tokens), seed)
    return Workload("uniform", w.prompts, w.max_tokens)


@dataclass
class Run:
    """One system on one workload: when each request was handed back (seconds from the start), its tokens."""

    system: str
    workload: str
    latency_s: list[float]
    tokens: list[list[int]]
    wall_s: float
    note: str = ""


# ---- the systems ---------------------------------------------------------------------------------------


def run_engine(model: Llama, w: Workload, config: SchedulerConfig) -> tuple[Run, LLMEngine]:
    engine = LLMEngine(model, config=EngineConfig(scheduler=config))
    t0 = time.perf_counter()
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
           for p, n in zip(w.prompts, w.max_tokens)]
    while engine.has_unfinished_requests():
        engine.step()
    wall = time.perf_counter() - t0
    reqs = [engine.requests[i] for i in ids]
    return Run("nanoserve-engine", w.name, [r.finish_time - t0 for r in reqs], [r.output_token_ids for r in reqs],
               wall), engine


def run_static(model: Llama, w: Workload, batch_size: int) -> Run:
    """Static batches of `batch_size` in arrival order, one after another; each row handed back with its batch."""
    t0 = time.perf_counter()
    latency, tokens = [], []
    for i in range(0, len(w.prompts), batch_size):
        out = greedy_generate_batch(model, w.prompts[i:i + batch_size], w.max_tokens[i:i + batch_size])
        tokens += out
        latency += [time.perf_counter() - t0] * len(out)
    return Run(f"nanoserve-static-{batch_size}", w.name, latency, tokens, time.perf_counter() - t0)


def run_hf_static(hf_model, w: Workload, batch_size: int = 8) -> Run:
    """transformers' generate on batches of `batch_size`, left-padded, greedy, EOS off, each batch run to its
    longest request (generate takes one max_new_tokens per call); each row handed back with its batch."""
    t0 = time.perf_counter()
    latency, tokens = [], []
    config = copy.deepcopy(hf_model.generation_config)
    for i in range(0, len(w.prompts), batch_size):
        prompts, wants = w.prompts[i:i + batch_size], w.max_tokens[i:i + batch_size]
        T = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (T - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
        config.update(do_sample=False, temperature=None, top_p=None, top_k=None, eos_token_id=[],
                      max_new_tokens=max(wants), pad_token_id=0)
        with torch.inference_mode():
            out = hf_model.generate(ids, attention_mask=mask, generation_config=config)
        tokens += [row[T:T + n] for row, n in zip(out.tolist(), wants)]
        latency += [time.perf_counter() - t0] * len(prompts)
    return Run("transformers-static-8", w.name, latency, tokens, time.perf_counter() - t0)


def start_hf_manager(hf_model, w: Workload):
    """transformers' continuous batching manager sized for workload w, greedy, EOS off, started and warmed on
    one short request, so its one-time setup is never timed."""
    from transformers.generation.continuous_batching.utils import WorkloadHints

    config = copy.deepcopy(hf_model.generation_config)
    config.update(do_sample=False, temperature=None, top_p=None, top_k=None, eos_token_id=None,
                  max_new_tokens=max(w.max_tokens))
    hints = WorkloadHints(max_prompt_length=max(len(p) for p in w.prompts),
                          max_generated_length=max(w.max_tokens), num_requests=len(w.prompts))
    manager = hf_model.init_continuous_batching(generation_config=config, workload_hints=hints)
    manager.start()
    try:
        _collect(manager, [manager.add_request(w.prompts[0][:8], request_id="warmup", max_new_tokens=2)],
                 time.perf_counter())
    except BaseException:
        manager.stop(block=True)
        raise
    return manager


def run_hf_continuous(hf_model, w: Workload) -> Run:
    """transformers' continuous batching manager, each request with its own max_new_tokens, EOS off."""
    manager = start_hf_manager(hf_model, w)
    try:
        t0 = time.perf_counter()
        ids = [manager.add_request(p, request_id=f"r{i}", max_new_tokens=n)
               for i, (p, n) in enumerate(zip(w.prompts, w.max_tokens))]
        done = _collect(manager, ids, t0)
        wall = time.perf_counter() - t0
    finally:
        manager.stop(block=True)
    return Run("transformers-cb", w.name, [done[i][0] for i in ids], [done[i][1] for i in ids], wall,
               note=f"attention {hf_model.config._attn_implementation}")


def _collect(manager, ids: Sequence[str], t0: float, timeout_s: float = 1800) -> dict[str, tuple[float, list[int]]]:
    done: dict[str, tuple[float, list[int]]] = {}
    deadline = time.perf_counter() + timeout_s
    while len(done) < len(ids):
        if time.perf_counter() > deadline or not manager.is_running():
            raise RuntimeError(f"transformers' continuous batching stopped with {len(done)} of {len(ids)} done")
        r = manager.get_result(timeout=1)
        if r is not None and r.is_finished():
            done[r.request_id] = (time.perf_counter() - t0, list(r.generated_tokens))
    return done


# ---- summaries --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Summary:
    system: str
    workload: str
    useful_tokens: int
    wall_s: float
    p50_latency_s: float
    p90_latency_s: float

    @property
    def useful_tok_s(self) -> float:
        return self.useful_tokens / self.wall_s


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile, linear between order statistics (numpy's default)."""
    s = sorted(values)
    x = q * (len(s) - 1)
    lo = int(x)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (x - lo)


def summarize(rows: Sequence[dict]) -> list[Summary]:
    """Per (workload, system), in the order they first appear: useful tok/s and latency quantiles."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["workload"], r["system"]), []).append(r)
    out = []
    for (workload, system), rs in groups.items():
        lat = [float(r["latency_s"]) for r in rs]
        out.append(Summary(system, workload, sum(int(r["max_tokens"]) for r in rs), float(rs[0]["wall_s"]),
                           quantile(lat, 0.5), quantile(lat, 0.9)))
    return out


def overhead(engine: LLMEngine, min_requests: int) -> dict[str, float]:
    """Host time outside the forward over the step's time, median over the steps of >= min_requests requests."""
    steps = [s for s in engine.history if s.num_requests >= min_requests] or engine.history
    return dict(steps=len(steps), min_requests=min_requests,
                overhead_ms=statistics.median(s.overhead_s for s in steps) * 1e3,
                step_ms=statistics.median(s.total_s for s in steps) * 1e3,
                fraction=statistics.median(s.overhead_s / s.total_s for s in steps))


FIELDS = ["workload", "system", "request", "prompt_tokens", "max_tokens", "latency_s", "wall_s"]


def write_csv(path: str | Path, runs: Sequence[Run], workloads: dict[str, Workload], header: Sequence[str]) -> None:
    with open(path, "w", newline="") as f:
        f.writelines(line + "\n" for line in header)
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for run in runs:
            wl = workloads[run.workload]
            for i, lat in enumerate(run.latency_s):
                w.writerow(dict(workload=run.workload, system=run.system, request=i, prompt_tokens=len(wl.prompts[i]),
                                max_tokens=wl.max_tokens[i], latency_s=f"{lat:.4f}", wall_s=f"{run.wall_s:.4f}"))


def read_csv(path: str | Path) -> tuple[dict[str, str], list[dict]]:
    lines = [line for line in Path(path).read_text().splitlines() if not line.startswith("#")]
    return read_header(path), list(csv.DictReader(lines))


def print_table(summaries: Sequence[Summary], base: str = "transformers-cb") -> None:
    for workload in dict.fromkeys(s.workload for s in summaries):
        rows = [s for s in summaries if s.workload == workload]
        ref = next((s for s in rows if s.system == base), None)
        print(f"\n{workload}: {len(rows)} systems")
        print(f"{'system':24} {'useful tok/s':>12} {'x ' + base if ref else '':>20} {'p50 s':>8} {'p90 s':>8}")
        for s in rows:
            ratio = f"{s.useful_tok_s / ref.useful_tok_s:.2f}" if ref else ""
            print(f"{s.system:24} {s.useful_tok_s:12.1f} {ratio:>20} {s.p50_latency_s:8.2f} {s.p90_latency_s:8.2f}")


def agreement(a: Run, b: Run) -> int:
    """Requests whose tokens agree in full between two runs."""
    return sum(x == y for x, y in zip(a.tokens, b.tokens))


# ---- the command ---------------------------------------------------------------------------------------


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=SchedulerConfig.max_num_batched_tokens)
    ap.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    ap.add_argument("--uniform", action="store_true",
                    help="also run the uniform workload (nanoserve's engine and one static batch)")
    add_common_arguments(ap, CSV_PATH)


def run(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    """Every system on the workloads, one after another in this process; the CSV and a table of ratios."""
    use_threads(args)
    from ..loader import load
    from ..model.fetch import ensure_model
    from .harness import load_hf_model
    from .roofline import measure_roofline

    model, tok = load()
    config = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    workloads = {"ragged": ragged_workload(tok, args.requests, seed=args.seed)}
    if args.uniform:
        workloads["uniform"] = uniform_workload(tok, args.requests, seed=args.seed)
    hf_model = None
    if any(s.startswith("transformers") for s in args.systems):
        hf_model = load_hf_model(ensure_model())
        hf_model.set_attn_implementation("sdpa")
    greedy_generate_batch(model, workloads["ragged"].prompts[:2], 2)  # warm: kernels built, weights touched

    steps: dict[str, Callable[[Workload], Run]] = {
        "nanoserve-static-32": lambda w: run_static(model, w, 32),
        "nanoserve-static-8": lambda w: run_static(model, w, 8),
        "transformers-static-8": lambda w: run_hf_static(hf_model, w),
        "transformers-cb": lambda w: run_hf_continuous(hf_model, w),
    }
    runs: list[Run] = []
    extra: dict[str, object] = dict(scheduler=json.dumps(dict(max_num_seqs=config.max_num_seqs,
                                                              max_num_batched_tokens=config.max_num_batched_tokens)))
    for name, w in workloads.items():
        systems = args.systems if name == "ragged" else [s for s in args.systems if s in SYSTEMS[:2]]
        for system in systems:
            print(f"{name}: {system} ...", flush=True)
            if system == "nanoserve-engine":
                r, engine = run_engine(model, w, config)
                cost = overhead(engine, min_requests=min(32, args.requests))
                extra[f"{name}_engine_overhead"] = json.dumps({k: round(v, 4) for k, v in cost.items()})
                extra[f"{name}_engine_steps"] = engine.steps
                extra[f"{name}_engine_preemptions"] = engine.scheduler.num_preemptions
                extra[f"{name}_engine_prefix_hit_tokens"] = engine.scheduler.prefix_hit_tokens
            else:
                r = steps[system](w)
            runs.append(r)
            print(f"  {w.useful_tokens / r.wall_s:.1f} useful tok/s, {r.wall_s:.1f} s", flush=True)
        by = {r.system: r for r in runs if r.workload == name}
        if "nanoserve-engine" in by and "nanoserve-static-32" in by:
            extra[f"{name}_engine_same_tokens_as_static_32"] = agreement(by["nanoserve-engine"],
                                                                         by["nanoserve-static-32"])
        if "nanoserve-engine" in by and "transformers-cb" in by:
            extra[f"{name}_engine_same_tokens_as_transformers_cb"] = agreement(by["nanoserve-engine"],
                                                                               by["transformers-cb"])
    roof = measure_roofline()
    for name, w in workloads.items():
        extra[f"{name}_flop_bound_tok_s"] = round(w.useful_tokens / (w.flops(model.cfg) / roof.peak_flops), 1)
    extra["roofline"] = roof.describe()
    header = csv_header(command_line(argv), **extra)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_csv(args.out, runs, workloads, header)
    meta, rows = read_csv(args.out)
    print("\n".join(header))
    print_table(summarize(rows))
    print(f"-> {args.out}")
    return 0
