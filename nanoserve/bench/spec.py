"""`python -m nanoserve bench spec`: prompt-lookup speculative decoding against plain decoding (Day 40), greedy,
on `copy` (answers that copy the prompt) and `chat` tasks, each `--concurrency` at a time, plain and with each `--k`
interleaved; every run's tokens compared with plain's. Beside it: one forward of m query rows over one row's."""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path

from ..attention import Chunk
from ..config import EngineConfig, SpeculativeConfig
from ..engine import LLMEngine
from ..model import Llama
from ..sampling import SamplingParams
from ..stages import paged_session
from . import csvio
from .command import common_arguments, csv_header, engine_config, report, start
from .harness import PASSAGE, run_requests

CSV_PATH = "data/bench-spec.csv"

# A paragraph with spelling mistakes to correct: the answer is the paragraph again, nearly token for token.
MISSPELT = (PASSAGE.replace("granite", "granit").replace("vegetables", "vegatables").replace("weather", "wether")
            .replace("families", "familys").strip())
RIVER = ("The river starts high in the mountians, where snow melts each spring and feeds a hundred small streams. "
         "They join in the valley, turn a mill, pass under an old stone bridge and widen into a slow, brown water "
         "that carries boats, logs and the news of every town along it's banks down to the sea.")
CODE = ("def mean(xs):\n    total = 0\n    for x in xs:\n        total = total + x\n    return total / len(xs)\n\n"
        "def variance(xs):\n    m = mean(xs)\n    total = 0\n    for x in xs:\n        total = total + (x - m) ** 2\n"
        "    return total / len(xs)\n")
TASKS: dict[str, list[str]] = {  # task -> user messages, each sent alone in the chat template
    "copy": [
        "Repeat the following paragraph, correcting its spelling mistakes:\n\n" + MISSPELT,
        "Correct the spelling in this text and write it out again:\n\n" + RIVER,
        "Rewrite this Python code with type hints added:\n\n" + CODE,
    ],
    "chat": [
        "Give me three tips for sleeping better.",
        "Why is the sky blue?",
        "How do I make a good cup of tea?",
        "What should I pack for a weekend hiking trip?",
    ],
}


@dataclass(frozen=True)
class RunRecord:
    round: int
    task: str
    prompt: int
    method: str  # "plain" or "spec-k<k>"
    k: int  # draft length (0 for plain)
    prompt_tokens: int
    new_tokens: int
    forwards: int  # after the prefill
    proposed: int
    accepted: int
    decode_s: float  # first token to last
    token_ids: str  # the output, space-separated: runs are compared with plain's
    concurrency: int  # requests running together


@dataclass(frozen=True)
class ForwardTiming:
    round: int
    rows: int
    context: int
    step_s: float


def with_drafts(config: EngineConfig | None, k: int) -> EngineConfig:
    """`config` with k prompt-lookup drafts per step (k = 0: plain decoding)."""
    config = engine_config(config)
    if not k:
        return replace(config, speculative=None)
    return replace(config, speculative=replace(config.speculative or SpeculativeConfig(), num_speculative_tokens=k))


def run_group(model: Llama, prompts: Sequence[list[int]], max_tokens: int, k: int,
              config: EngineConfig | None = None, clock: Callable[[], float] = time.perf_counter,
              ) -> list[tuple[list[int], int, int, int, float]]:
    """The prompts together through one engine, greedy; per request: (tokens, forwards after its prefill, drafts
    proposed, accepted, seconds from first token to last)."""
    engine = LLMEngine(model, config=with_drafts(config, k), clock=clock)
    _, reqs = run_requests(engine, prompts, [SamplingParams(temperature=0, max_tokens=max_tokens)] * len(prompts))
    prompt_len = {r.seq_id: r.num_prompt_tokens for r in reqs}
    forwards = Counter(seq for step in engine.history for seq, first, _ in step.scheduled if first >= prompt_len[seq])
    return [(r.output_token_ids, forwards[r.seq_id], r.num_draft_tokens, r.num_accepted_tokens,
             r.token_times[-1] - r.token_times[0]) for r in reqs]


def run_once(model: Llama, ids: list[int], max_tokens: int, k: int, config: EngineConfig | None = None,
             clock: Callable[[], float] = time.perf_counter) -> tuple[list[int], int, int, int, float]:
    return run_group(model, [ids], max_tokens, k, config, clock)[0]


def time_steps(model: Llama, context: int, rows: Iterable[int], reps: int,
               clock: Callable[[], float] = time.perf_counter) -> dict[int, float]:
    """Median seconds of one forward of m query rows after `context` cached tokens, for each m."""
    rows = list(rows)
    session = paged_session(model, context + max(rows) + 1)
    session.prefill([(7 * i) % 1000 + 100 for i in range(context)])
    times: dict[int, list[float]] = {m: [] for m in rows}
    for rep in range(reps + 1):  # the rows interleaved, so a slow moment falls on all; rep 0 warms up
        for m in rows:
            new = [42] * m
            session.manager.append_slots(session.table, new)
            t0 = clock()
            session.runner.execute([Chunk(new, context, session.table.blocks)], num_logits=[m])
            if rep:
                times[m].append(clock() - t0)
            session.manager.truncate(session.table, context)
    session.free()
    return {m: statistics.median(ts) for m, ts in times.items()}


@dataclass(frozen=True)
class SpecSummary:
    task: str
    concurrency: int
    method: str
    k: int
    new_tokens: int
    acceptance: float
    tokens_per_forward: float
    tok_s: float
    speedup: float
    same_as_plain: bool


def summarize(records: Sequence[RunRecord]) -> list[SpecSummary]:
    """Per task, concurrency and method: counts from the first round, a request's decode tok/s and its ratio to
    plain's in the same round (medians over rounds), and whether every token equals plain's at the lowest
    concurrency."""
    out = []
    rounds = sorted({r.round for r in records})
    low = min(r.concurrency for r in records)
    greedy = {(r.round, r.task, r.prompt): r.token_ids for r in records if r.method == "plain" and r.concurrency == low}
    groups: dict[tuple[str, int, str], list[RunRecord]] = {}
    for r in records:
        groups.setdefault((r.task, r.concurrency, r.method), []).append(r)
    for (task, c, method), rs in groups.items():
        rate = {rd: _rate([r for r in rs if r.round == rd]) for rd in rounds}
        plain = {rd: _rate([r for r in groups.get((task, c, "plain"), []) if r.round == rd]) for rd in rounds}
        first = [r for r in rs if r.round == rounds[0]]
        proposed = sum(r.proposed for r in first)
        out.append(SpecSummary(
            task, c, method, first[0].k, sum(r.new_tokens for r in first),
            sum(r.accepted for r in first) / proposed if proposed else 0.0,
            sum(r.new_tokens - 1 for r in first) / max(1, sum(r.forwards for r in first)),
            statistics.median(rate.values()), statistics.median(rate[rd] / plain[rd] for rd in rounds),
            all(r.token_ids == greedy.get((r.round, r.task, r.prompt)) for r in rs)))
    return out


def _rate(rs: Sequence[RunRecord]) -> float:
    seconds = sum(r.decode_s for r in rs)
    return sum(r.new_tokens - 1 for r in rs) / seconds if seconds else float("nan")


def step_costs(steps: Sequence[ForwardTiming]) -> dict[int, float]:
    """rows -> a forward's time over the one-row forward's in the same round, median over rounds."""
    one = {s.round: s.step_s for s in steps if s.rows == 1}
    return {m: statistics.median(s.step_s / one[s.round] for s in steps if s.rows == m and s.round in one)
            for m in sorted({s.rows for s in steps})}


CSV_FIELDS = ["kind", *(f.name for f in fields(RunRecord)), "rows", "context", "step_s"]


def write_csv(path: str | Path, runs: Sequence[RunRecord], steps: Sequence[ForwardTiming], meta: dict) -> Path:
    rows = [{"kind": "run", **vars(r), "decode_s": f"{r.decode_s:.5f}"} for r in runs]
    rows += [{"kind": "step", "round": s.round, "rows": s.rows, "context": s.context, "step_s": f"{s.step_s:.6f}"}
             for s in steps]
    return csvio.write_csv(path, rows, meta, CSV_FIELDS)


def read_csv(path: str | Path) -> tuple[dict[str, str], list[RunRecord], list[ForwardTiming]]:
    """The header, the requests and the step timings."""
    meta, rows = csvio.read_csv(path)
    runs = csvio.records(RunRecord, [r for r in rows if r["kind"] == "run"])
    return meta, runs, csvio.records(ForwardTiming, [r for r in rows if r["kind"] == "step"])


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--k", type=int, nargs="+", default=[3, 5, 8], help="num_speculative_tokens values to run")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8], help="requests running together")
    ap.add_argument("--lookup-max", type=int, default=SpeculativeConfig.prompt_lookup_max)
    ap.add_argument("--lookup-min", type=int, default=SpeculativeConfig.prompt_lookup_min)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--context", type=int, default=256, help="cached tokens before the timed forwards")
    ap.add_argument("--step-rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7, 8, 9])
    common_arguments(ap, CSV_PATH, engine=True, rounds=3)


def run(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    model, tok = start(args)
    prompts = {task: [tok.encode_chat([{"role": "user", "content": m}]) for m in msgs] for task, msgs in TASKS.items()}
    spec = SpeculativeConfig("ngram", max(args.k), args.lookup_max, args.lookup_min)
    config = replace(engine_config(args), speculative=spec)  # --k sets the drafts, run by run
    run_once(model, prompts["chat"][0], 8, 0, config)  # warm up both roads
    run_once(model, prompts["copy"][0], 8, max(args.k), config)
    runs: list[RunRecord] = []
    steps: list[ForwardTiming] = []
    for rd in range(args.rounds):
        t0 = time.perf_counter()
        for task, ids_list in prompts.items():
            for c in args.concurrency:  # every prompt, c at a time, cycled to fill the last group
                slots = [i % len(ids_list) for i in range(-(-len(ids_list) // c) * c)]
                for group in [slots[j:j + c] for j in range(0, len(slots), c)]:
                    for k in [0, *args.k]:
                        out = run_group(model, [ids_list[i] for i in group], args.max_tokens, k, config)
                        runs += [RunRecord(rd, task, i, f"spec-k{k}" if k else "plain", k, len(ids_list[i]), len(toks),
                                           fwd, prop, acc, dt, " ".join(map(str, toks)), c)
                                 for i, (toks, fwd, prop, acc, dt) in zip(group, out)]
        steps += [ForwardTiming(rd, m, args.context, s)
                  for m, s in time_steps(model, args.context, args.step_rows, reps=5).items()]
        print(f"round {rd}: {time.perf_counter() - t0:5.1f} s", flush=True)
    summaries = summarize(runs)
    meta = csv_header(argv, max_tokens=args.max_tokens, prompt_lookup_max=args.lookup_max,
                      prompt_lookup_min=args.lookup_min, rounds=args.rounds, concurrency=args.concurrency,
                      tasks=" | ".join(f"{t}: {len(v)} prompts" for t, v in TASKS.items()),
                      same_tokens_as_plain=all(s.same_as_plain for s in summaries))
    _, runs, steps = read_csv(write_csv(args.out, runs, steps, meta))
    print("one forward of m rows / one decode step: " + "  ".join(f"m={m}: {c:.2f}" for m, c in
                                                                  step_costs(steps).items()))
    return report(args.out, meta, [vars(s) for s in summarize(runs)])
