"""`python -m nanoserve bench decode`: one request on every road, and batched decode (Days 08-25): batch 1 at
each of `--contexts` and each of `--batch-sizes` at the first, after a prompt of prose, the roads interleaved round
by round. The roads: `nanoserve` (the compiled step, any batch), `nanoserve-py` (the blocks on the Python forward),
`nanoserve-engine` (`generate`'s: one request in an LLMEngine), `nanoserve-contiguous` and `nanoserve-nocache` (the
course's stages, Days 13 and 08), `transformers` and `llama.cpp` (batch 1, and each batch size as its own batched
example runs it: one KV cache, a sequence id per copy). Per (road, weights, batch, context): the median
decode step, tok/s, prefill tok/s, weight GB/s against the read bandwidth, and ratios to nanoserve's fp32 step, to
transformers and to llama.cpp, each the median over rounds of that round's ratio."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..config import ModelConfig
from ..kernels import int8, quant
from ..loader import load
from ..model import Llama
from ..model.fetch import gguf_of, model_folder
from ..model.matmul import cpu_flags
from ..stages import CachedSession, NoCacheSession
from . import csvio
from .command import common_arguments, csv_header, report, start
from .harness import load_hf_model, time_hf_generate, time_model_batch, timed_greedy
from .harness import prose as prompt_of  # n tokens of prose: every row's prompt
from .roofline import best_peaks, forward_flops, matching_peak, measure_bandwidth, measure_compute_peaks
from .timing import rounds

CSV_PATH = "data/bench-decode.csv"
NAN = float("nan")
Key = tuple[str, str, int, int]  # (road, weights, batch, context); weights "gguf+int8": the blocks on int8 activations,
# "gguf+int8+kv-bf16": and a bf16 K/V cache (`weights_key`)


@dataclass(frozen=True)
class DecodeRow:
    engine: str  # the road
    weights: str  # fp32, bf16 (the folder's matrices in bf16, `--bf16`), or gguf (the file's blocks)
    batch: int
    context: int
    step_ms: float
    tok_s: float
    weight_mb: float  # bytes of weights one step streams
    weight_gb_s: float
    bandwidth_frac: float  # weight_gb_s over the measured read bandwidth
    vs_nanoserve_fp32: float
    vs_llama_cpp: float  # nan where there is no llama.cpp row to divide by
    activations: str = "fp32"  # what the blocks multiply: fp32, or int8 (x rounded to int8 blocks)
    prefill_tok_s: float = NAN  # the prompt's tokens (all rows') over the time to the first token
    vs_transformers: float = NAN
    kv_cache_dtype: str = "auto"  # the K/V cache: the model's own (auto), or bfloat16
    prefill_peak_frac: float = NAN  # the prefill's FLOP/s over its products' format's measured peak (`peak_format`)
    step_peak_frac: float = NAN  # the decode step's likewise: compute-bound at large batches, not at batch 1


def peak_format(engine: str, activations: str, weights: str = "fp32") -> str:
    """The number format a road's products multiply in: int8 for the blocks on int8 activations and for llama.cpp
    (its own int8 activations), bf16 for bf16 weights, fp32 for the rest (fp32 weights, and blocks expanded to fp32
    as they are read)."""
    if activations == "int8" or engine == "llama.cpp":
        return "int8"
    return "bf16" if weights == "bf16" else "fp32"


def weights_key(activations: str = "fp32", kv_cache_dtype: str = "auto") -> str:
    """The blocks' key in a run: "gguf", then "+int8" for int8 activations, "+kv-bf16" for a bf16 K/V cache."""
    return "gguf" + ("+int8" if activations == "int8" else "") + ("+kv-bf16" if kv_cache_dtype == "bfloat16" else "")


def make_rows(runs: dict[Key, list[tuple[float, float]]], weight_bytes: dict[tuple[str, str], float],
              bandwidth: float, cfg: ModelConfig | None = None, peaks: Mapping[str, float] | None = None,
              ) -> list[DecodeRow]:
    """Rows from each key's (prefill s, decode step s) per round: medians, and each ratio the median over rounds
    of that round's (pairing rounds, so a slow minute falls on both sides of it). With the model's `cfg` and the
    machine's `peaks` (ops/s per format), each row's prefill and step as fractions of their format's peak."""
    tok_s = {key: [key[2] / step for _, step in per_round] for key, per_round in runs.items()}

    def vs(key: Key, other: Key) -> float:
        return statistics.median(a / b for a, b in zip(tok_s[key], tok_s[other])) if other in tok_s else NAN

    rows = []
    for key, per_round in runs.items():
        engine, weights, batch, context = key
        s, wb = statistics.median(step for _, step in per_round), weight_bytes[(engine, weights)]
        fmt, *options = weights.split("+")
        prefill = statistics.median(batch * context / p for p, _ in per_round)
        activations = "int8" if "int8" in options else "fp32"
        peak = (peaks or {}).get(peak_format(engine, activations, fmt), NAN)
        prefill_frac = step_frac = NAN
        if cfg is not None:  # a prompt of `context` tokens per row, its head on the last only; a step one token a row
            prefill_frac = prefill * forward_flops(cfg, context) / context / peak
            step_frac = batch * forward_flops(cfg, 1, context) / s / peak
        rows.append(DecodeRow(engine, fmt, batch, context, s * 1e3, batch / s, wb / 1e6, wb / s / 1e9,
                              wb / s / bandwidth, vs(key, ("nanoserve", "fp32", batch, context)),
                              vs(key, ("llama.cpp", "gguf", batch, context)), activations,
                              prefill, vs(key, ("transformers", "fp32", batch, context)),
                              "bfloat16" if "kv-bf16" in options else "auto", prefill_frac, step_frac))
    return rows


def by_batch(rows: Sequence[DecodeRow]) -> dict[str, dict[int, float]]:
    """nanoserve's tok/s per weights ("fp32", "bf16", "gguf", "gguf+int8", `weights_key`'s) per batch size at the
    smallest context."""
    mine = [r for r in rows if r.engine == "nanoserve"]
    ctx = min(r.context for r in mine)
    out: dict[str, dict[int, float]] = {}
    for r in sorted(mine, key=lambda r: r.batch):
        if r.context == ctx:
            key = r.weights if r.weights in ("fp32", "bf16") else weights_key(r.activations, r.kv_cache_dtype)
            out.setdefault(key, {})[r.batch] = r.tok_s
    return out


def time_nanoserve(model: Llama, prompt: Sequence[int], batch: int, steps: int,
                   compiled: bool | str | None = None) -> tuple[float, float]:
    """(prefill s, median decode step s) of `batch` copies of the prompt on the bare step (`compiled="ops"`:
    the Python forward on the kernels)."""
    timing, _ = time_model_batch(model, [list(prompt)] * batch, [steps] * batch, compiled=compiled)
    return timing.prefill_s, timing.median_step_s


def time_road(model: Llama, prompt: Sequence[int], steps: int, road: str = "nanoserve-engine") -> tuple[float, float]:
    """(TTFT s, TPOT s) of one greedy request of steps + 1 tokens as a user of that road sees them: `generate`'s,
    or a course stage's loop."""
    session = {"nanoserve-engine": lambda: None, "nanoserve-nocache": lambda: NoCacheSession(model),
               "nanoserve-contiguous": lambda: CachedSession(model, len(prompt) + steps + 1)}[road]()
    t = timed_greedy(model, list(prompt), steps + 1, session)[1]
    return t.ttft, t.tpot


def time_transformers(hf_model, prompt: Sequence[int], steps: int) -> tuple[float, float]:
    """(prefill s, median decode step s) of transformers' `generate` on one prompt."""
    timing, _ = time_hf_generate(hf_model, [prompt], steps)
    return timing.prefill_s, timing.median_step_s


# llama-cpp-python built for this CPU less llama.cpp's AMX kernels (GGML_NATIVE names them on an AMX CPU)
LLAMA_CPP_WITHOUT_AMX = ("CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON "
                         "-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON' pip install "
                         "--force-reinstall --no-cache-dir llama-cpp-python")


def crash_hint(returncode: int, flags: set[str]) -> str:
    """What to try when llama.cpp's child died of a signal on a CPU with AMX: llama-cpp-python 0.3.36, built native,
    crashed inside its AMX product (ggml_backend_amx_mul_mat, SIGSEGV) on both models on an AMX Xeon, and a build
    without those kernels ran."""
    if returncode >= 0 or "amx_int8" not in flags:
        return ""
    return (f"; killed by signal {-returncode} on a CPU with AMX; llama.cpp less its AMX kernels: "
            f"{LLAMA_CPP_WITHOUT_AMX}")


def llama_cpp_runner(gguf_path: Path, threads: int, probe: Sequence[int],
                     ) -> tuple[Callable[..., tuple[float, float]] | None, str]:
    """(prompt, steps, batch=1) -> llama.cpp's (prefill s, median decode step s) on the GGUF for `batch` copies of
    the prompt, each in a child process (a crash costs a row, not the run), tried once on `probe`; and the CSV's note
    (None and why where it cannot run)."""
    try:
        import llama_cpp
    except ImportError:
        return None, "llama-cpp-python not installed (pip install llama-cpp-python): llama.cpp rows skipped"

    def run(prompt: Sequence[int], steps: int, batch: int = 1) -> tuple[float, float]:
        job = json.dumps({"path": str(gguf_path), "threads": threads, "prompt": list(prompt), "steps": steps,
                          "batch": batch})
        r = subprocess.run([sys.executable, "-c", "from nanoserve.bench.decode import _llama_cpp_child as f; f()"],
                           input=job, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise RuntimeError(f"llama-cpp-python {llama_cpp.__version__} failed (exit {r.returncode}): "
                               f"{r.stderr.strip()[-300:]}{crash_hint(r.returncode, cpu_flags())}")
        prefill, step = r.stdout.strip().splitlines()[-1].split()
        return float(prefill), float(step)

    try:
        run(probe, 2)  # one short run: does it work here at all?
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        return None, f"{e}; llama.cpp rows skipped".replace("\n", " ")
    return run, f"llama-cpp-python {llama_cpp.__version__}, {threads} threads, same GGUF file"


def _llama_cpp_child() -> None:
    """In the child: the prompt, then `steps` greedy steps of one token; prints the prefill's and the median
    step's seconds. A batch of several copies takes `_llama_cpp_batch`."""
    import llama_cpp
    import numpy as np

    job = json.loads(sys.stdin.read())
    if job.get("batch", 1) > 1:
        return _llama_cpp_batch(job)
    prompt = job["prompt"]
    llm = llama_cpp.Llama(model_path=job["path"], n_ctx=len(prompt) + job["steps"] + 16, n_threads=job["threads"],
                          n_threads_batch=job["threads"], n_batch=512, verbose=False)
    greedy = lambda: int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))
    for _ in range(2):  # the first pass is a warm-up
        llm.reset()
        t = time.perf_counter()
        llm.eval(prompt)
        nxt, step_s = greedy(), []
        prefill_s = time.perf_counter() - t
        for _ in range(job["steps"]):
            t = time.perf_counter()
            llm.eval([nxt])
            nxt = greedy()
            step_s.append(time.perf_counter() - t)
    print(prefill_s, statistics.median(step_s))


def _llama_cpp_batch(job: dict) -> None:
    """`batch` copies of the prompt as llama.cpp's own batched example runs them (its C API: one sequence id per
    copy in one KV cache, every copy's prompt in `llama_decode` calls of up to 2,048 tokens), then `steps` greedy
    steps of one token per copy, each one `llama_decode` and the rows' argmax; prints the prefill's and the median
    step's seconds."""
    import llama_cpp as L
    import numpy as np

    prompt, B, steps, threads = job["prompt"], job["batch"], job["steps"], job["threads"]
    L.llama_backend_init()
    model = L.llama_model_load_from_file(job["path"].encode(), L.llama_model_default_params())
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_seq_max = B * (len(prompt) + steps + 16), 2048, B
    cp.n_threads = cp.n_threads_batch = threads
    ctx = L.llama_init_from_model(model, cp)
    V = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(cp.n_batch, 0, 1)

    def decode(entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """(token, position, copy, wants logits) entries through llama_decode; the argmax of each wanted row."""
        best = []
        for s in range(0, len(entries), cp.n_batch):
            part = entries[s:s + cp.n_batch]
            batch.n_tokens = len(part)
            for i, (t, pos, seq, out) in enumerate(part):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, pos, 1, out
                batch.seq_id[i][0] = seq
            if L.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            rows = sum(out for *_, out in part)  # this call's logits: one row per wanted token, in order
            best += np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(rows, V)).argmax(1).tolist()
        return best

    for _ in range(2):  # the first pass is a warm-up
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        t = time.perf_counter()
        nxt = decode([(tok, p, q, p == len(prompt) - 1) for q in range(B) for p, tok in enumerate(prompt)])
        prefill_s, step_s = time.perf_counter() - t, []
        for i in range(steps):
            t = time.perf_counter()
            nxt = decode([(nxt[q], len(prompt) + i, q, True) for q in range(B)])
            step_s.append(time.perf_counter() - t)
    print(prefill_s, statistics.median(step_s))


def write_csv(path: str | Path, rows: Sequence[DecodeRow], meta: dict) -> Path:
    return csvio.write_csv(path, [{k: f"{v:.4g}" if isinstance(v, float) else v for k, v in asdict(r).items()}
                                  for r in rows], meta)


def read_csv(path: str | Path) -> tuple[dict[str, str], list[DecodeRow]]:
    meta, rows = csvio.read_csv(path)
    return meta, csvio.records(DecodeRow, rows)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", help="a checkpoint folder or a model's name: smollm2-135m, gemma3-270m (default: "
                    "smollm2-135m); its blocks are the GGUF it was converted from")
    ap.add_argument("--no-transformers", action="store_true", help="skip the transformers rows")
    ap.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp rows")
    ap.add_argument("--no-stages", action="store_true", help="skip the course's no-cache and contiguous loops")
    ap.add_argument("--nocache-tokens", type=int, default=4, help="decode steps of the (slow) no-cache loop")
    ap.add_argument("--activations", nargs="+", choices=["fp32", "int8"], default=["fp32"],
                    help="what the blocks multiply: fp32 (exact), int8 (llama.cpp's product); several for rows of each")
    ap.add_argument("--kv-cache-dtype", nargs="+", choices=["auto", "bfloat16"], default=["auto"],
                    help="the blocks' K/V cache: auto (fp32), bfloat16 (half its bytes); several for rows of each")
    ap.add_argument("--bf16", action="store_true",
                    help="also rows of the folder's matrices in bf16 (load(dtype='bfloat16')), held to the bf16 peak")
    common_arguments(ap, CSV_PATH, contexts=[128, 1024], batch_sizes=[8, 32], steps=32, rounds=3)


def run(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    fp32, tok = start(args)
    folder = model_folder(args.model)
    models = {"fp32": fp32} | {weights_key(a, kv): load(folder, weights="gguf", activations=a, kv_cache_dtype=kv)[0]
                               for a in args.activations for kv in args.kv_cache_dtype}  # weights key -> the model
    if args.bf16:
        models = {"fp32": fp32, "bf16": load(folder, dtype="bfloat16")[0]} | models
    threads, n = torch.get_num_threads(), args.steps
    weight_bytes = {(e, key): m.weight_bytes() for key, m in models.items()
                    for e in ("nanoserve", "nanoserve-py", "nanoserve-engine", "nanoserve-contiguous",
                              "nanoserve-nocache")}
    # the same blocks, the same file (whichever activations and cache were asked for)
    weight_bytes[("llama.cpp", "gguf")] = next(m.weight_bytes() for key, m in models.items() if key.startswith("gguf"))
    prompts = {ctx: prompt_of(tok, ctx) for ctx in args.contexts}
    jobs: dict[Key, Callable[[], tuple[float, float]]] = {}
    shapes = [(1, c) for c in args.contexts] + [(b, args.contexts[0]) for b in args.batch_sizes]  # (batch, context)
    for b, ctx in shapes:
        p = prompts[ctx]
        for key, m in models.items():
            jobs[("nanoserve", key, b, ctx)] = lambda p=p, b=b, m=m: time_nanoserve(m, p, b, n)
            if b == 1 and key.startswith("gguf"):
                jobs[("nanoserve-py", key, 1, ctx)] = lambda p=p, m=m: time_nanoserve(m, p, 1, n, "ops")
            if b == 1:  # the public road, beside the bare step above
                jobs[("nanoserve-engine", key, 1, ctx)] = lambda p=p, m=m: time_road(m, p, n)
        if b == 1 and not args.no_stages:
            jobs[("nanoserve-contiguous", "fp32", 1, ctx)] = lambda p=p: time_road(fp32, p, n, "nanoserve-contiguous")
            jobs[("nanoserve-nocache", "fp32", 1, ctx)] = lambda p=p: time_road(fp32, p, args.nocache_tokens,
                                                                                "nanoserve-nocache")
    if not args.no_transformers:
        hf = load_hf_model(folder)
        weight_bytes[("transformers", "fp32")] = sum(p.numel() * p.element_size() for p in hf.parameters())
        for ctx in args.contexts:
            jobs[("transformers", "fp32", 1, ctx)] = lambda p=prompts[ctx]: time_transformers(hf, p, n)
    runner, llama_note = (None, "not asked for (--no-llama-cpp)") if args.no_llama_cpp else llama_cpp_runner(
        gguf_of(folder), threads, prompt_of(tok, 8))
    for b, ctx in shapes if runner else []:
        jobs[("llama.cpp", "gguf", b, ctx)] = lambda p=prompts[ctx], b=b: runner(p, n, b)
    print(f"llama.cpp: {llama_note}", flush=True)
    with torch.inference_mode():
        bandwidth, _ = measure_bandwidth(2**28)
        for m in models.values():  # warm up: builds, first allocations
            time_nanoserve(m, prompt_of(tok, 16), 2, 2)
    before = measure_compute_peaks([threads], best_only=True)  # the formats' peaks at the run's threads
    runs = rounds(jobs, args.rounds, log=print)
    measured = best_peaks(before, measure_compute_peaks([threads], best_only=True))  # and again after: the best
    peaks = {f: p.ops_s for f in ("fp32", "int8", "bf16") if (p := matching_peak(measured, f, threads)) is not None}
    meta = csv_header(argv, model=folder.name, steps=n, rounds=args.rounds,
                      read_bandwidth_gb_s=f"{bandwidth / 1e9:.2f}", block_product=quant.describe(),
                      int8_road=int8.int8_road(), llama_cpp=llama_note,
                      compute_peaks_gops={f"{p.format} {p.road}": round(p.ops_s / 1e9, 1) for p in measured})
    write_csv(args.out, make_rows(runs, weight_bytes, bandwidth, fp32.cfg, peaks), meta)
    return report(args.out, meta, [asdict(r) for r in read_csv(args.out)[1]])
