"""`python -m nanoserve bench spec`: prompt-lookup speculative decoding against plain decoding (Day 40).

Two tasks, batch 1, greedy: `copy`, where the answer copies a given paragraph with small edits (the work
prompt lookup is made for), and `chat`, ordinary questions whose answers copy little. Each prompt runs
through the engine plain and speculative (one run per `--k`), the methods interleaved round
by round so a shared machine's slow minute falls on all of them. Decode tok/s = (tokens - 1) / (time from
the first token to the last): the prefill is the same for both and is left out.

A second part times one forward of m query rows after a context of `--context` tokens (m = 1 is a decode
step; m = k+1 is a verify step): what a verification costs next to the decode step it replaces.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from ..attention import Chunk
from ..config import SpeculativeConfig
from ..generate import one_request_engine
from ..model import Llama
from ..sampling import SamplingParams
from ..stages import paged_session
from ..tokenizer import Tokenizer
from .batch import PASSAGE
from .machine import add_common_arguments, command_line, csv_header, read_header, use_threads

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
TASKS: dict[str, list[str]] = {
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
"""task -> user messages, each sent alone in the chat template."""


@dataclass(frozen=True)
class RunRecord:
    """One generation: which prompt and method, what it produced, how many forwards, how long it took."""

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


@dataclass(frozen=True)
class StepRecord:
    """One forward of `rows` query rows after `context` cached tokens."""

    round: int
    rows: int
    context: int
    step_s: float


def prompt_ids(tok: Tokenizer) -> dict[str, list[list[int]]]:
    return {task: [tok.encode_chat([{"role": "user", "content": m}]) for m in msgs] for task, msgs in TASKS.items()}


def run_once(model: Llama, ids: list[int], max_tokens: int, k: int, config: SpeculativeConfig,
             clock: Callable[[], float] = time.perf_counter) -> tuple[list[int], int, int, int, float]:
    """One greedy generation through the engine, plain (k=0) or speculative with k drafts: (tokens, forwards
    after the prefill, proposed, accepted, decode seconds)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    spec = SpeculativeConfig("ngram", k, config.prompt_lookup_max, config.prompt_lookup_min) if k else None
    engine = one_request_engine(model, None, len(ids), params, spec)
    engine.add_request(ids, params)
    tokens, times = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
            times.append(clock())
    steps = list(engine.history)[1:]  # the forwards after the prefill
    return (tokens, len(steps), sum(s.num_draft_tokens for s in steps), sum(s.num_accepted_tokens for s in steps),
            times[-1] - times[0])


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
    out = {m: statistics.median(ts) for m, ts in times.items()}
    session.free()
    return out


# ---- summaries (pure: the notebook and the tests call these) -------------------------------------------


@dataclass(frozen=True)
class Summary:
    """One task and method over its prompts: acceptance, tokens per forward, decode tok/s (median over rounds)
    and its ratio to plain decoding's in the same round (median over rounds)."""

    task: str
    method: str
    k: int
    new_tokens: int
    acceptance: float
    tokens_per_forward: float
    tok_s: float
    speedup: float
    same_as_plain: bool


def summarize(records: Sequence[RunRecord]) -> list[Summary]:
    """Per task and method: counts from round 0 (every round computes the same tokens), tok/s per round
    summed over the task's prompts, and per-round ratios to plain, each reduced to its median."""
    out = []
    rounds = sorted({r.round for r in records})
    for task in dict.fromkeys(r.task for r in records):
        plain = {p.round * 1000 + p.prompt: p for p in records if p.task == task and p.method == "plain"}
        plain_rate = {rd: _rate([p for p in plain.values() if p.round == rd]) for rd in rounds}
        for method in dict.fromkeys(r.method for r in records if r.task == task):
            rs = [r for r in records if r.task == task and r.method == method]
            first = [r for r in rs if r.round == rounds[0]]
            rate = {rd: _rate([r for r in rs if r.round == rd]) for rd in rounds}
            proposed = sum(r.proposed for r in first)
            out.append(Summary(
                task, method, first[0].k, sum(r.new_tokens for r in first),
                sum(r.accepted for r in first) / proposed if proposed else 0.0,
                sum(r.new_tokens - 1 for r in first) / max(1, sum(r.forwards for r in first)),
                statistics.median(rate.values()), statistics.median(rate[rd] / plain_rate[rd] for rd in rounds),
                all(r.token_ids == plain[r.round * 1000 + r.prompt].token_ids for r in rs)))
    return out


def _rate(rs: Sequence[RunRecord]) -> float:
    """Decode tok/s of several generations together: their tokens after the first over their decode time."""
    return sum(r.new_tokens - 1 for r in rs) / sum(r.decode_s for r in rs)


def step_costs(steps: Sequence[StepRecord]) -> dict[int, float]:
    """rows -> a forward's time over the one-row forward's in the same round, median over rounds."""
    rounds = sorted({s.round for s in steps})
    one = {s.round: s.step_s for s in steps if s.rows == 1}
    rows = sorted({s.rows for s in steps})
    return {m: statistics.median(s.step_s / one[s.round] for s in steps if s.rows == m and s.round in one)
            for m in rows if rounds}


# ---- the CSV -------------------------------------------------------------------------------------------

RUN_FIELDS = [f.name for f in fields(RunRecord)]
CSV_FIELDS = ["kind", *RUN_FIELDS, "rows", "context", "step_s"]


def write_csv(path: str | Path, runs: Sequence[RunRecord], steps: Sequence[StepRecord], header: Sequence[str]) -> None:
    """One table: kind "run" rows (a generation) and kind "step" rows (one forward's time by query rows)."""
    with open(path, "w", newline="") as f:
        f.write("\n".join(header) + "\n")
        w = csv.DictWriter(f, CSV_FIELDS)
        w.writeheader()
        for r in runs:
            w.writerow({"kind": "run", **vars(r), "decode_s": f"{r.decode_s:.5f}"})
        for s in steps:
            w.writerow({"kind": "step", "round": s.round, "rows": s.rows, "context": s.context,
                        "step_s": f"{s.step_s:.6f}"})


def read_csv(path: str | Path) -> tuple[dict[str, str], list[RunRecord], list[StepRecord]]:
    """A spec CSV: its header lines, its generations and its step timings."""
    lines = [line for line in Path(path).read_text().splitlines() if not line.startswith("#")]
    runs, steps = [], []
    for row in csv.DictReader(lines):
        if row["kind"] == "run":
            runs.append(RunRecord(int(row["round"]), row["task"], int(row["prompt"]), row["method"], int(row["k"]),
                                  int(row["prompt_tokens"]), int(row["new_tokens"]), int(row["forwards"]),
                                  int(row["proposed"]), int(row["accepted"]), float(row["decode_s"]),
                                  row["token_ids"]))
        else:
            steps.append(StepRecord(int(row["round"]), int(row["rows"]), int(row["context"]), float(row["step_s"])))
    return read_header(path), runs, steps


def print_table(summaries: Sequence[Summary], costs: dict[int, float]) -> None:
    print(f"{'task':>5} {'method':>8} {'tokens':>6} {'accept':>6} {'tok/fwd':>7} {'tok/s':>6} {'x plain':>7} same")
    for s in summaries:
        print(f"{s.task:>5} {s.method:>8} {s.new_tokens:6d} {s.acceptance:6.2f} {s.tokens_per_forward:7.2f} "
              f"{s.tok_s:6.1f} {s.speedup:7.2f} {'yes' if s.same_as_plain else 'NO'}")
    print("one forward of m rows / one decode step: " + "  ".join(f"m={m}: {c:.2f}" for m, c in costs.items()))


# ---- the command ---------------------------------------------------------------------------------------


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--k", type=int, nargs="+", default=[3, 5, 8], help="num_speculative_tokens values to run")
    ap.add_argument("--lookup-max", type=int, default=SpeculativeConfig.prompt_lookup_max)
    ap.add_argument("--lookup-min", type=int, default=SpeculativeConfig.prompt_lookup_min)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--context", type=int, default=256, help="cached tokens before the timed forwards")
    ap.add_argument("--step-rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7, 8, 9])
    add_common_arguments(ap, CSV_PATH)


def run(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    use_threads(args)
    from ..loader import load

    model, tok = load()
    prompts = prompt_ids(tok)
    config = SpeculativeConfig("ngram", max(args.k), args.lookup_max, args.lookup_min)
    run_once(model, prompts["chat"][0], 8, 0, config)  # warm up both roads
    run_once(model, prompts["copy"][0], 8, max(args.k), config)
    runs: list[RunRecord] = []
    steps: list[StepRecord] = []
    for rd in range(args.rounds):
        t0 = time.perf_counter()
        for task, ids_list in prompts.items():
            for i, ids in enumerate(ids_list):
                for k in [0, *args.k]:
                    toks, fwd, prop, acc, dt = run_once(model, ids, args.max_tokens, k, config)
                    runs.append(RunRecord(rd, task, i, f"spec-k{k}" if k else "plain", k, len(ids), len(toks), fwd,
                                          prop, acc, dt, " ".join(map(str, toks))))
        for m, s in time_steps(model, args.context, args.step_rows, reps=5).items():
            steps.append(StepRecord(rd, m, args.context, s))
        print(f"round {rd}: {time.perf_counter() - t0:5.1f} s", flush=True)
    header = csv_header(command_line(argv), max_tokens=args.max_tokens, prompt_lookup_max=args.lookup_max,
                        prompt_lookup_min=args.lookup_min, rounds=args.rounds,
                        tasks=" | ".join(f"{t}: {len(v)} prompts" for t, v in TASKS.items()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_csv(args.out, runs, steps, header)
    _, runs, steps = read_csv(args.out)
    print("\n".join(header))
    print_table(summarize(runs), step_costs(steps))
    print(f"-> {args.out}")
    return 0
