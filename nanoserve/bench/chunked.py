"""`python -m nanoserve bench chunked`: a long prompt arrives while others decode (Day 32).

The scenario: `--decoders` requests with short prompts decode, greedy, EOS ignored. Once every one of
them has sampled `--warm` tokens, a prompt of `--long-tokens` tokens of ordinary prose arrives. Without
chunked prefill the whole prompt is computed in one step and every running request waits for that step;
with it, each step computes the running requests' decode tokens and as much of the prompt as the
token budget (`max_num_batched_tokens`) has left.

One run per configuration (no chunking, then each `--budgets` value), the configurations interleaved
round by round so a shared machine's slow minute falls on all of them. Every sampled token is one CSV
row: its request, index, token id, and its step and clock reading counted from the long prompt's arrival.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..config import CacheConfig, EngineConfig, SchedulerConfig
from ..engine import LLMEngine
from ..model import Llama
from ..sampling import SamplingParams
from ..tokenizer import Tokenizer
from .batch import PASSAGE
from .machine import add_common_arguments, command_line, csv_header, read_header, use_threads

CSV_PATH = "data/bench-chunked.csv"
LONG = "long"  # the long request's id
BLOCK_SIZE = 16
FIELDS = ("round", "label", "budget", "chunked", "request", "token", "token_id", "step", "t_s")


@dataclass
class Run:
    """One run of the scenario. Per request id (the long one is `LONG`): each sampled token's id, its engine
    step and its clock reading, both counted from the long prompt's arrival (its step is step 0)."""

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
    """What the running requests and the long one saw. `stall` gaps: the running requests' inter-token
    gaps that end while the long prompt is being computed (after its arrival, up to its first token)."""

    label: str
    budget: int
    chunked: bool
    prefill_steps: int  # steps from the arrival to the long request's first token, both counted
    ttft_s: float  # the long request's time to first token
    itl_before_s: float  # median gap of the running requests before the arrival: the decode-only pace
    itl_max_s: float  # the longest stall gap
    itl_p90_s: float
    itl_median_s: float


def label_of(config: SchedulerConfig) -> str:
    """A configuration's name in the CSV: its budget, or "no-chunk"."""
    return str(config.max_num_batched_tokens) if config.chunked_prefill else "no-chunk"


def long_prompt(tok: Tokenizer, n_tokens: int) -> list[int]:
    """n_tokens of the passage repeated: ordinary prose, not one token over and over."""
    ids = tok.encode(PASSAGE * (n_tokens // 100 + 2), add_special_tokens=False)
    return ids[:n_tokens]


def short_prompts(tok: Tokenizer, n: int, n_tokens: int = 24) -> list[list[int]]:
    """n prompts of n_tokens, each cut from its own place in the passage, none from its start: no prompt
    shares a first block with another or with `long_prompt` (the prefix cache finds nothing)."""
    ids = tok.encode(PASSAGE, add_special_tokens=False)
    step = (len(ids) - n_tokens) // (n + 1)
    if step < 1:
        raise ValueError(f"{n} prompts of {n_tokens} tokens do not fit the passage's {len(ids)} at distinct places")
    return [ids[(i + 1) * step:(i + 1) * step + n_tokens] for i in range(n)]


def run_scenario(model: Llama, config: SchedulerConfig, shorts: Sequence[Sequence[int]], long: Sequence[int],
                 short_tokens: int = 32, long_tokens: int = 6, warm: int = 4, round_: int = 0,
                 clock: Callable[[], float] = time.perf_counter) -> Run:
    """The scenario once on `model`: the short prompts decode; the long one arrives once each has `warm`
    tokens. Returns every sampled token with its step and time from the long prompt's arrival."""
    if not 0 < warm < short_tokens:
        raise ValueError(f"warm={warm} must be between 1 and short_tokens-1={short_tokens - 1}")
    need = [len(p) + short_tokens for p in shorts] + [len(long) + long_tokens]
    blocks = sum(-(-n // BLOCK_SIZE) for n in need)  # everyone fits: no preemption muddles the timing
    engine = LLMEngine(model, config=EngineConfig(CacheConfig(BLOCK_SIZE, num_blocks=blocks), config), clock=clock)
    params = SamplingParams(temperature=0, max_tokens=short_tokens, ignore_eos=True)
    ids = [engine.add_request(list(p), params) for p in shorts]
    run = Run(label_of(config), config.max_num_batched_tokens, config.chunked_prefill, round_)
    raw: dict[str, list[tuple[int, int, float]]] = {}
    arrived: tuple[int, float] | None = None
    while arrived is None or engine.has_unfinished_requests():
        if arrived is None and all(len(engine.requests[r].output_token_ids) >= warm for r in ids):
            engine.add_request(list(long), SamplingParams(temperature=0, max_tokens=long_tokens, ignore_eos=True),
                               request_id=LONG)
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


# ---- summaries (pure: the notebook and the tests call these) -------------------------------------------


def stall_gaps(run: Run) -> list[float]:
    """The running requests' gaps that end after the long prompt arrived, up to its first token."""
    ttft = run.times[LONG][0]
    return [b - a for r in run.short_ids for a, b in zip(run.times[r], run.times[r][1:]) if 0 < b <= ttft]


def summarize_run(run: Run) -> RunSummary:
    """One run's numbers: the long request's steps and time to first token, the running requests' gaps."""
    before = [b - a for r in run.short_ids for a, b in zip(run.times[r], run.times[r][1:]) if b <= 0]
    gaps = sorted(stall_gaps(run)) or [0.0]
    p90 = statistics.quantiles(gaps, n=10, method="inclusive")[-1] if len(gaps) > 1 else gaps[0]
    return RunSummary(run.label, run.budget, run.chunked, run.steps[LONG][0] + 1, run.times[LONG][0],
                      statistics.median(before) if before else 0.0, gaps[-1], p90, statistics.median(gaps))


def median_summaries(summaries: Sequence[RunSummary]) -> list[RunSummary]:
    """Per configuration, the median of each timed field over its rounds (counts must agree), no chunking
    first, then by budget."""
    out = []
    for label in dict.fromkeys(s.label for s in summaries):
        rs = [s for s in summaries if s.label == label]
        if len({s.prefill_steps for s in rs}) != 1:
            raise ValueError(f"{label}: rounds disagree on the long prompt's steps: {[s.prefill_steps for s in rs]}")

        def med(name: str, rs: list[RunSummary] = rs) -> float:
            return statistics.median(getattr(s, name) for s in rs)

        out.append(RunSummary(label, rs[0].budget, rs[0].chunked, rs[0].prefill_steps, med("ttft_s"),
                              med("itl_before_s"), med("itl_max_s"), med("itl_p90_s"), med("itl_median_s")))
    return sorted(out, key=lambda s: (s.chunked, s.budget))


def same_tokens(a: Run, b: Run) -> bool:
    """Whether every request sampled the same tokens in both runs."""
    return a.tokens == b.tokens


# ---- the CSV -------------------------------------------------------------------------------------------


def write_csv(path: str | Path, runs: Sequence[Run], header: Sequence[str]) -> None:
    with open(path, "w", newline="") as f:
        f.write("\n".join(header) + "\n")
        w = csv.writer(f)
        w.writerow(FIELDS)
        for run in runs:
            for rid in run.tokens:
                for i, (tok, step, t) in enumerate(zip(run.tokens[rid], run.steps[rid], run.times[rid])):
                    w.writerow((run.round, run.label, run.budget, int(run.chunked), rid, i, tok, step, f"{t:.5f}"))


def read_csv(path: str | Path) -> tuple[dict[str, str], list[Run]]:
    """A chunked CSV: its header lines and its runs, in the order they ran."""
    lines = [line for line in Path(path).read_text().splitlines() if not line.startswith("#")]
    runs: dict[tuple[int, str], Run] = {}
    for row in csv.DictReader(lines):
        key = (int(row["round"]), row["label"])
        run = runs.setdefault(key, Run(row["label"], int(row["budget"]), row["chunked"] == "1", key[0]))
        rid = row["request"]
        run.tokens.setdefault(rid, []).append(int(row["token_id"]))
        run.steps.setdefault(rid, []).append(int(row["step"]))
        run.times.setdefault(rid, []).append(float(row["t_s"]))
    return read_header(path), list(runs.values())


def print_table(rows: Sequence[RunSummary]) -> None:
    print(f"{'budget':>9} {'steps':>5} {'TTFT s':>7} | running requests' gap, ms: {'before':>6} "
          f"{'median':>7} {'p90':>7} {'max':>7}")
    for s in rows:
        print(f"{s.label:>9} {s.prefill_steps:5d} {s.ttft_s:7.2f} | {'':27}{s.itl_before_s * 1e3:6.0f} "
              f"{s.itl_median_s * 1e3:7.0f} {s.itl_p90_s * 1e3:7.0f} {s.itl_max_s * 1e3:7.0f}")


# ---- the command ---------------------------------------------------------------------------------------


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256, 512],
                    help="max_num_batched_tokens values to run with chunked prefill")
    ap.add_argument("--decoders", type=int, default=8, help="short requests decoding when the long prompt arrives")
    ap.add_argument("--short-prompt-tokens", type=int, default=24)
    ap.add_argument("--short-tokens", type=int, default=32, help="tokens each short request generates")
    ap.add_argument("--long-tokens", type=int, default=1000, help="the long prompt's length in tokens")
    ap.add_argument("--long-max-tokens", type=int, default=6, help="tokens the long request generates")
    ap.add_argument("--warm", type=int, default=4, help="tokens each short request has when the long one arrives")
    ap.add_argument("--rounds", type=int, default=3)
    add_common_arguments(ap, CSV_PATH)


def run(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    use_threads(args)
    from ..loader import load

    model, tok = load()
    shorts = short_prompts(tok, args.decoders, args.short_prompt_tokens)
    long = long_prompt(tok, args.long_tokens)
    whole = len(long) + args.long_max_tokens  # without chunking the budget must hold the whole request
    configs = [SchedulerConfig(max_num_batched_tokens=max(2048, whole), chunked_prefill=False)]
    configs += [SchedulerConfig(max_num_batched_tokens=b) for b in args.budgets]
    run_scenario(model, configs[0], shorts[:2], long[:64], short_tokens=4, long_tokens=2, warm=1)  # warm up
    runs: list[Run] = []
    for r in range(args.rounds):
        for config in configs:
            t0 = time.perf_counter()
            runs.append(run_scenario(model, config, shorts, long, args.short_tokens, args.long_max_tokens,
                                     args.warm, r))
            print(f"round {r}: {label_of(config):>8} {time.perf_counter() - t0:5.1f} s", flush=True)
            if any(runs[-1].steps[s][-1] < runs[-1].steps[LONG][0] for s in runs[-1].short_ids):
                print("  warning: a short request ended before the long prompt's first token; raise --short-tokens")
    base = runs[0]
    agree = {label_of(c): all(same_tokens(x, base) for x in runs if x.label == label_of(c)) for c in configs}
    header = csv_header(command_line(argv), decoders=args.decoders, short_prompt_tokens=args.short_prompt_tokens,
                        short_tokens=args.short_tokens, long_tokens=len(long), long_max_tokens=args.long_max_tokens,
                        warm=args.warm, rounds=args.rounds, same_tokens_as_no_chunk=json.dumps(agree),
                        long_prefix_hit_tokens=max(x.long_cached_tokens for x in runs))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_csv(args.out, runs, header)
    _, back = read_csv(args.out)
    print("\n".join(header))
    print_table(median_summaries([summarize_run(x) for x in back]))
    print(f"-> {args.out}")
    return 0
