"""`python -m nanoserve bench decode`: decode tok/s on the weights as shipped, beside fp32 and llama.cpp (Day 25).

Rows, all in one run, their rounds interleaved so a shared machine's slow minute falls on every row:

- batch 1 at each `--contexts` length: nanoserve on fp32, nanoserve on the GGUF's blocks (its steps one
  compiled call, `model.compiled`), the same on the Python forward (engine `nanoserve-py`: what the
  compiled step saves), transformers on fp32, and llama.cpp on the same GGUF file (through
  llama-cpp-python, an optional benchmark-only dependency: `pip install llama-cpp-python`; without it that
  row is skipped and the CSV says so);
- each `--batch-sizes` B at the first context: nanoserve fp32 beside the blocks, where expanding a block
  costs compute that B rows share.

A row's step time is the median decode step (every row generates `--steps` tokens after a prompt of
`context` tokens of prose), over the median of its rounds. Beside it: tok/s, the weights' bytes over the
step time (GB/s), that as a fraction of the machine's measured read bandwidth (`roofline`), and ratios to
nanoserve fp32 and to llama.cpp at the same batch size and context.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from ..model import Llama
from ..tokenizer import Tokenizer
from .batch import PASSAGE
from .harness import load_hf_model, time_hf_generate, time_model_batch
from .machine import add_common_arguments, command_line, csv_header, read_header, use_threads
from .roofline import measure_bandwidth

CSV_PATH = "data/bench-decode.csv"


@dataclass(frozen=True)
class Row:
    """One configuration's measurement and what it means. Ratios are tok/s over tok/s, same run."""

    engine: str  # nanoserve, nanoserve-py (blocks on the Python forward), transformers, llama.cpp
    weights: str  # fp32, or gguf (the file's Q4_1/Q8_0 blocks)
    batch: int
    context: int
    step_ms: float
    tok_s: float
    weight_mb: float  # bytes of weights one step streams
    weight_gb_s: float
    bandwidth_frac: float  # weight_gb_s over the measured read bandwidth
    vs_nanoserve_fp32: float
    vs_llama_cpp: float  # nan where there is no llama.cpp row to divide by


def make_rows(steps: dict[tuple[str, str, int, int], float], weight_bytes: dict[tuple[str, str], float],
              bandwidth: float) -> list[Row]:
    """Rows from median step seconds keyed (engine, weights, batch, context), and each engine's weight bytes."""
    def tok_s(key: tuple[str, str, int, int]) -> float:
        return key[2] / steps[key] if key in steps else float("nan")

    rows = []
    for key, s in steps.items():
        engine, weights, batch, context = key
        wb = weight_bytes[(engine, weights)]
        t = batch / s
        rows.append(Row(engine, weights, batch, context, s * 1e3, t, wb / 1e6, wb / s / 1e9, wb / s / bandwidth,
                        t / tok_s(("nanoserve", "fp32", batch, context)),
                        t / tok_s(("llama.cpp", "gguf", batch, context))))
    return rows


def winners(rows: Sequence[Row]) -> dict[int, str]:
    """Per batch size (at the smallest context measured), which of nanoserve's weights decodes faster."""
    out = {}
    for b in sorted({r.batch for r in rows}):
        mine = [r for r in rows if r.engine == "nanoserve" and r.batch == b]
        ctx = min(r.context for r in mine)
        best = max((r for r in mine if r.context == ctx), key=lambda r: r.tok_s)
        out[b] = best.weights
    return out


def by_batch(rows: Sequence[Row]) -> dict[str, dict[int, float]]:
    """nanoserve's tok/s per weights ("fp32", "gguf") per batch size, at the smallest context measured:
    the two curves whose crossing says which weights to serve at which batch size."""
    mine = [r for r in rows if r.engine == "nanoserve"]
    ctx = min(r.context for r in mine)
    out: dict[str, dict[int, float]] = {}
    for r in sorted(mine, key=lambda r: r.batch):
        if r.context == ctx:
            out.setdefault(r.weights, {})[r.batch] = r.tok_s
    return out


# ---- the measurements ------------------------------------------------------------------------------------


def prompt_of(tok: Tokenizer, n_tokens: int) -> list[int]:
    """n_tokens of prose (the passage repeated)."""
    ids = tok.encode(PASSAGE * (n_tokens // 100 + 2), add_special_tokens=False)
    return ids[:n_tokens]


def time_nanoserve(model: Llama, prompt: Sequence[int], batch: int, steps: int,
                   compiled_step: bool | None = None) -> float:
    """Median decode step (s) of a static batch of `batch` copies of the prompt (`compiled_step=False`: on the
    Python forward, for a model on blocks)."""
    timing, _ = time_model_batch(model, [list(prompt)] * batch, [steps] * batch, compiled_step=compiled_step)
    return timing.median_step_s


def time_transformers(hf_model, prompt: Sequence[int], steps: int) -> float:
    timing, _ = time_hf_generate(hf_model, [list(prompt)], steps)
    return timing.median_step_s


def llama_cpp_runner(gguf_path: Path, threads: int) -> Callable[[Sequence[int], int], float] | str:
    """A function timing llama.cpp's batch-1 decode on the GGUF, (prompt, steps) -> median step (s), or why
    there is none. Each call runs in a child process, so a llama.cpp that crashes costs its row, not the run."""
    try:
        import llama_cpp
    except ImportError:
        return "llama-cpp-python not installed (pip install llama-cpp-python): llama.cpp rows skipped"
    version = llama_cpp.__version__

    def run(prompt: Sequence[int], steps: int) -> float:
        job = json.dumps({"path": str(gguf_path), "threads": threads, "prompt": list(prompt), "steps": steps})
        r = subprocess.run([sys.executable, "-c", "from nanoserve.bench.decode import _llama_cpp_child as f; f()"],
                           input=job, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise RuntimeError(f"llama-cpp-python {version} failed (exit {r.returncode}): {r.stderr.strip()[-300:]}")
        return float(r.stdout.strip().splitlines()[-1])

    run.version = version  # type: ignore[attr-defined]
    return run


def _llama_cpp_child() -> None:
    """In a child process: the prompt through llama.cpp, then `steps` greedy decode steps one token at a
    time (llama_decode, argmax of its logits); prints the median step in seconds."""
    import llama_cpp
    import numpy as np

    job = json.loads(sys.stdin.read())
    prompt = job["prompt"]
    llm = llama_cpp.Llama(model_path=job["path"], n_ctx=len(prompt) + job["steps"] + 16, n_threads=job["threads"],
                          n_threads_batch=job["threads"], n_batch=512, verbose=False)
    n_vocab = llm.n_vocab()

    def greedy() -> int:  # the last position's logits, read where llama.cpp left them
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))))

    for _ in range(2):  # the first pass is a warm-up
        llm.reset()
        llm.eval(prompt)
        nxt, step_s = greedy(), []
        for _ in range(job["steps"]):
            t = time.perf_counter()
            llm.eval([nxt])
            nxt = greedy()
            step_s.append(time.perf_counter() - t)
    print(statistics.median(step_s))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 1024], help="prompt lengths for batch 1")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32], help="batched rows at the first context")
    ap.add_argument("--steps", type=int, default=32, help="decode steps per run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-transformers", action="store_true", help="skip the transformers rows")
    ap.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp rows")
    add_common_arguments(ap, CSV_PATH)


def run(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    use_threads(args)
    from ..config import nanoserve_home
    from ..kernels import quant
    from ..loader import load
    from ..model.fetch import default_model_dir, download_gguf

    fp32, tok = load()
    blocks, _ = load(weights="gguf")
    gguf_path = download_gguf(nanoserve_home() / "downloads")
    threads = torch.get_num_threads()
    weight_bytes = {("nanoserve", "fp32"): fp32.weight_bytes(), ("nanoserve", "gguf"): blocks.weight_bytes(),
                    ("nanoserve-py", "gguf"): blocks.weight_bytes(),
                    ("llama.cpp", "gguf"): blocks.weight_bytes()}  # llama.cpp streams the same blocks
    jobs: dict[tuple[str, str, int, int], Callable[[], float]] = {}
    for ctx in args.contexts:
        prompt = prompt_of(tok, ctx)
        for name, model in (("fp32", fp32), ("gguf", blocks)):
            jobs[("nanoserve", name, 1, ctx)] = lambda m=model, p=prompt: time_nanoserve(m, p, 1, args.steps)
        jobs[("nanoserve-py", "gguf", 1, ctx)] = lambda p=prompt: time_nanoserve(blocks, p, 1, args.steps, False)
    for b in args.batch_sizes:
        prompt = prompt_of(tok, args.contexts[0])
        for name, model in (("fp32", fp32), ("gguf", blocks)):
            jobs[("nanoserve", name, b, args.contexts[0])] = lambda m=model, p=prompt, b=b: time_nanoserve(
                m, p, b, args.steps)
    if not args.no_transformers:
        hf = load_hf_model(default_model_dir())
        weight_bytes[("transformers", "fp32")] = sum(p.numel() * p.element_size() for p in hf.parameters())
        for ctx in args.contexts:
            prompt = prompt_of(tok, ctx)
            jobs[("transformers", "fp32", 1, ctx)] = lambda p=prompt: time_transformers(hf, p, args.steps)
    llama_note = "not asked for (--no-llama-cpp)"
    if not args.no_llama_cpp:
        runner = llama_cpp_runner(gguf_path, threads)
        if isinstance(runner, str):
            llama_note = runner
        else:
            try:
                runner(prompt_of(tok, 8), 2)  # one short run: does it work here at all?
                llama_note = f"llama-cpp-python {runner.version}, {threads} threads, same GGUF file"
                for ctx in args.contexts:
                    prompt = prompt_of(tok, ctx)
                    jobs[("llama.cpp", "gguf", 1, ctx)] = lambda p=prompt: runner(p, args.steps)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                llama_note = f"{e}; llama.cpp rows skipped".replace("\n", " ")
    print(f"llama.cpp: {llama_note}", flush=True)
    with torch.inference_mode():
        bandwidth, _ = measure_bandwidth(2**28)
        time_nanoserve(blocks, prompt_of(tok, 16), 2, 2)  # warm up: builds, first allocations
        time_nanoserve(fp32, prompt_of(tok, 16), 2, 2)
    measured: dict[tuple[str, str, int, int], list[float]] = {k: [] for k in jobs}
    for r in range(args.rounds):
        t0 = time.perf_counter()
        for key, job in jobs.items():
            measured[key].append(job())
        print(f"round {r}: {time.perf_counter() - t0:.0f} s", flush=True)
    steps = {k: statistics.median(v) for k, v in measured.items()}
    rows = make_rows(steps, weight_bytes, bandwidth)
    header = csv_header(command_line(argv), steps=args.steps, rounds=args.rounds,
                        read_bandwidth_gb_s=f"{bandwidth / 1e9:.2f}", block_product=quant.describe(),
                        llama_cpp=llama_note)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_csv(args.out, rows, header)
    print("\n".join(header))
    print_table(read_csv(args.out)[1])
    print(f"-> {args.out}")
    return 0


# ---- the CSV ------------------------------------------------------------------------------------------


def write_csv(path: str | Path, rows: Sequence[Row], header: Sequence[str]) -> None:
    names = [f.name for f in fields(Row)]
    with open(path, "w", newline="") as f:
        f.write("\n".join(header) + "\n")
        w = csv.DictWriter(f, names)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in asdict(r).items()})


def read_csv(path: str | Path) -> tuple[dict[str, str], list[Row]]:
    """(header lines as a dict, rows) of a CSV `write_csv` wrote."""
    lines = [ln for ln in Path(path).read_text().splitlines() if not ln.startswith("#")]
    kinds = {"str": str, "int": int, "float": float}  # Row's annotations, as strings
    rows = [Row(**{f.name: kinds[str(f.type)](d[f.name]) for f in fields(Row)}) for d in csv.DictReader(lines)]
    return read_header(path), rows


def print_table(rows: Sequence[Row]) -> None:
    print(f"{'engine':<13}{'weights':<8}{'B':>4}{'ctx':>6}{'step ms':>9}{'tok/s':>8}{'GB/s':>7}{'of bw':>7}"
          f"{'/fp32':>7}{'/llama.cpp':>11}")
    for r in rows:
        print(f"{r.engine:<13}{r.weights:<8}{r.batch:>4}{r.context:>6}{r.step_ms:>9.2f}{r.tok_s:>8.1f}"
              f"{r.weight_gb_s:>7.1f}{r.bandwidth_frac:>7.2f}{r.vs_nanoserve_fp32:>7.2f}{r.vs_llama_cpp:>11.2f}")
