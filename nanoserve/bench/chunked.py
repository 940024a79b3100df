"""`python -m nanoserve bench chunked`: a long prompt arrives while `--decoders` short requests decode (Day 32);
without chunked prefill it is one step everyone waits for, with it each step takes the decode tokens and as much
prompt as the budget has left. A CSV row per sampled token: its step and time from the long prompt's arrival."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..config import EngineConfig, SchedulerConfig
from ..engine import LLMEngine
from ..model import Llama
from ..tokenizer import Tokenizer
from . import csvio
from .command import common_arguments, csv_header, engine_config, report, start
from .harness import PASSAGE, greedy, prose
from .timing import summarize

CSV_PATH = "data/bench-chunked.csv"
LONG = "long"  # the long request's id
long_prompt = prose  # its prompt: n tokens of the passage
FIELDS = ("round", "label", "budget", "chunked", "request", "token", "token_id", "step", "t_s")


@dataclass
class ScenarioRun:
    """One run: per request id, each sampled token's id, step and time, counted from the long prompt's arrival."""

    label: str
    budget: int
    chunked: bool
    round: int = 0
    long_cached_tokens: int = 0  # the long prompt's tokens found in the prefix cache (none, by design)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    steps: dict[str, list[int]] = field(default_factory=dict)
    times: dict[str, list[float]] = field(default_factory=dict)

    @property
    def short_ids(self) -> list[str]:
        return [r for r in self.tokens if r != LONG]


@dataclass(frozen=True)
class RunSummary:
    """What the long request and the running ones saw (their `stall_gaps`)."""

    label: str
    budget: int
    chunked: bool
    prefill_steps: int  # steps from the arrival to the long request's first token, both counted
    ttft_s: float  # the long request's time to first token
    itl_before_s: float  # median gap of the running requests before the arrival: the decode-only pace
    itl_max_s: float  # the longest stall gap
    itl_p90_s: float
    itl_median_s: float


def label_of(config: EngineConfig | SchedulerConfig) -> str:
    """A configuration's name in a run: its budget, "no-chunk", or its TPOT target ("target 60 ms")."""
    s = engine_config(config).scheduler
    if s.tpot_slo_ms is not None:
        return f"target {s.tpot_slo_ms:g} ms"
    return str(s.max_num_batched_tokens) if s.chunked_prefill else "no-chunk"


def short_prompts(tok: Tokenizer, n: int, n_tokens: int = 24) -> list[list[int]]:
    """n prompts of n_tokens from distinct places in the passage, not its start: the prefix cache finds nothing."""
    step = (len(tok.encode(PASSAGE, add_special_tokens=False)) - n_tokens) // (n + 1)
    if step < 1:
        raise ValueError(f"{n} prompts of {n_tokens} tokens do not fit the passage at distinct places")
    return [prose(tok, n_tokens, (i + 1) * step) for i in range(n)]


def run_scenario(model: Llama, config: EngineConfig | SchedulerConfig, shorts: Sequence[Sequence[int]],
                 long: Sequence[int], short_tokens: int = 32, long_tokens: int = 6, warm: int = 4, round_: int = 0,
                 clock: Callable[[], float] = time.perf_counter) -> ScenarioRun:
    """The scenario once: the short prompts decode, the long one arrives once each has `warm` tokens."""
    if not 0 < warm < short_tokens:
        raise ValueError(f"warm={warm} must be between 1 and short_tokens-1={short_tokens - 1}")
    config = engine_config(config)
    engine = LLMEngine(model, config=config, clock=clock)
    ids = [engine.add_request(list(p), greedy(short_tokens)) for p in shorts]
    run = ScenarioRun(label_of(config), config.scheduler.max_num_batched_tokens, config.scheduler.chunked_prefill,
                      round_)
    raw: dict[str, list[tuple[int, int, float]]] = {}
    arrived: tuple[int, float] | None = None
    while arrived is None or engine.has_unfinished_requests():
        if arrived is None and all(len(engine.requests[r].output_token_ids) >= warm for r in ids):
            engine.add_request(list(long), greedy(long_tokens), request_id=LONG)
            arrived = (engine.steps, engine.requests[LONG].arrival_time)
        step = engine.steps
        for out in engine.step():
            req = engine.requests[out.request_id]
            raw.setdefault(out.request_id, []).append((out.new_token_ids[0], step, req.token_times[-1]))
    s0, t0 = arrived
    run.long_cached_tokens = engine.requests[LONG].num_cached_tokens
    for rid in [*ids, LONG]:
        run.tokens[rid] = [tok for tok, _, _ in raw[rid]]
        run.steps[rid] = [s - s0 for _, s, _ in raw[rid]]
        run.times[rid] = [t - t0 for _, _, t in raw[rid]]
    return run


def stall_gaps(run: ScenarioRun) -> list[float]:
    """The running requests' gaps that end after the long prompt arrived, up to its first token."""
    ttft = run.times[LONG][0]
    return [b - a for r in run.short_ids for a, b in zip(run.times[r], run.times[r][1:]) if 0 < b <= ttft]


def summarize_run(run: ScenarioRun) -> RunSummary:
    before = [b - a for r in run.short_ids for a, b in zip(run.times[r], run.times[r][1:]) if b <= 0]
    gaps = summarize(stall_gaps(run) or [0.0])
    return RunSummary(run.label, run.budget, run.chunked, run.steps[LONG][0] + 1, run.times[LONG][0],
                      statistics.median(before) if before else 0.0, gaps.max, gaps.p90, gaps.median)


def median_summaries(summaries: Sequence[RunSummary]) -> list[RunSummary]:
    """Per configuration, each timed field's median over rounds (counts must agree); no chunking first."""
    out = []
    for label in dict.fromkeys(s.label for s in summaries):
        rs = [s for s in summaries if s.label == label]
        if len({s.prefill_steps for s in rs}) != 1:
            raise ValueError(f"{label}: rounds disagree on the long prompt's steps: {[s.prefill_steps for s in rs]}")
        med = {name: statistics.median(getattr(s, name) for s in rs)
               for name in ("ttft_s", "itl_before_s", "itl_max_s", "itl_p90_s", "itl_median_s")}
        out.append(RunSummary(label, rs[0].budget, rs[0].chunked, rs[0].prefill_steps, **med))
    return sorted(out, key=lambda s: (s.chunked, s.budget))


def write_csv(path: str | Path, runs: Sequence[ScenarioRun], meta: dict) -> Path:
    rows = [dict(zip(FIELDS, (run.round, run.label, run.budget, int(run.chunked), rid, i, tok, step, f"{t:.5f}")))
            for run in runs for rid in run.tokens
            for i, (tok, step, t) in enumerate(zip(run.tokens[rid], run.steps[rid], run.times[rid]))]
    return csvio.write_csv(path, rows, meta, FIELDS)


def read_csv(path: str | Path) -> tuple[dict[str, str], list[ScenarioRun]]:
    meta, rows = csvio.read_csv(path)
    runs: dict[tuple[int, str], ScenarioRun] = {}
    for row in rows:
        key = (int(row["round"]), row["label"])
        run = runs.setdefault(key, ScenarioRun(row["label"], int(row["budget"]), row["chunked"] == "1", key[0]))
        rid = row["request"]
        run.tokens.setdefault(rid, []).append(int(row["token_id"]))
        run.steps.setdefault(rid, []).append(int(row["step"]))
        run.times.setdefault(rid, []).append(float(row["t_s"]))
    return meta, list(runs.values())


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256, 512],
                    help="max_num_batched_tokens values to run with chunked prefill")
    ap.add_argument("--decoders", type=int, default=8, help="short requests decoding when the long prompt arrives")
    ap.add_argument("--short-prompt-tokens", type=int, default=24)
    ap.add_argument("--short-tokens", type=int, default=32, help="tokens each short request generates")
    ap.add_argument("--long-tokens", type=int, default=1000, help="the long prompt's length in tokens")
    ap.add_argument("--long-max-tokens", type=int, default=6, help="tokens the long request generates")
    ap.add_argument("--warm", type=int, default=4, help="tokens each short request has when the long one arrives")
    common_arguments(ap, CSV_PATH, engine=True, rounds=3)


def run(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    (model, tok), base = start(args), engine_config(args)
    shorts, long = short_prompts(tok, args.decoders, args.short_prompt_tokens), long_prompt(tok, args.long_tokens)
    # without chunking one step holds the whole long request beside every running request's decode token
    whole = max(base.scheduler.max_num_batched_tokens, len(long) + args.long_max_tokens + args.decoders)
    budgets = [(whole, False)] + [(b, True) for b in args.budgets]
    configs = [replace(base, scheduler=replace(base.scheduler, max_num_batched_tokens=b, chunked_prefill=c))
               for b, c in budgets]
    run_scenario(model, configs[0], shorts[:2], long[:64], short_tokens=4, long_tokens=2, warm=1)  # warm up
    runs: list[ScenarioRun] = []
    for r in range(args.rounds):
        for config in configs:
            t0 = time.perf_counter()
            runs.append(run_scenario(model, config, shorts, long, args.short_tokens, args.long_max_tokens,
                                     args.warm, r))
            print(f"round {r}: {label_of(config):>8} {time.perf_counter() - t0:5.1f} s", flush=True)
            if any(runs[-1].steps[s][-1] < runs[-1].steps[LONG][0] for s in runs[-1].short_ids):
                print("  warning: a short request ended before the long prompt's first token; raise --short-tokens")
    agree = {label_of(c): all(x.tokens == runs[0].tokens for x in runs if x.label == label_of(c)) for c in configs}
    meta = csv_header(argv, decoders=args.decoders, short_prompt_tokens=args.short_prompt_tokens,
                      short_tokens=args.short_tokens, long_tokens=len(long), long_max_tokens=args.long_max_tokens,
                      warm=args.warm, rounds=args.rounds, same_tokens_as_no_chunk=agree,
                      long_prefix_hit_tokens=max(x.long_cached_tokens for x in runs))
    summaries = median_summaries([summarize_run(x) for x in read_csv(write_csv(args.out, runs, meta))[1]])
    return report(args.out, meta, [{k: v * 1e3 if k.startswith("itl") else v for k, v in vars(s).items()}
                                   for s in summaries])  # gaps in ms
