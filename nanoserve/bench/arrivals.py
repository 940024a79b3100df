"""`python -m nanoserve bench arrivals`: `bench engine`'s ragged workload (or `--workload prompt-heavy`) on a
gamma/Poisson trace at each of `--rates`, replayed on the wall clock by each of SYSTEMS; a request's clock starts at
its scheduled arrival, so a system late to admit it pays in TTFT. `--slo-budget both` runs nanoserve with and without
a TPOT target equal to the SLO's (`serve --tpot-slo-ms`). A CSV row per (system, rate) (`--out`), and one per
request beside it."""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import importlib.metadata
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .. import loader
from ..config import EngineConfig, nanoserve_home
from ..engine import LLMEngine
from ..model import Llama
from ..model.fetch import ensure_model, gguf_of, model_folder
from . import csvio
from .clients import LLAMA_KV_CACHE, free_port, llama_server_argv, llama_server_path, llama_server_version, start_server
from .command import common_arguments, csv_header, engine_argv, engine_config, report, start
from .harness import Workload, greedy, load_hf_model, prompt_heavy_workload, ragged_workload, run_requests
from .serving import SLO, arrival_times, serving_metrics
from .timing import RequestTiming

CSV_PATH = "data/bench-arrivals.csv"
SYSTEMS = ("nanoserve-engine", "nanoserve-server", "transformers-cb", "transformers-serve", "llama-server")
WORKLOADS = {"ragged": ragged_workload, "prompt-heavy": prompt_heavy_workload}


@dataclass
class Replay:
    system: str
    rate: float
    timings: list[RequestTiming]
    tokens: list[list[int]]


def replay_engine(engine: LLMEngine, w: Workload, arrivals: Sequence[float], rate: float = math.nan) -> Replay:
    """Each request added when its arrival time comes (`harness.run_requests`), its clock started then. The
    engine's prefix cache is emptied first: prompts replayed at another rate are new to it, not hits."""
    if not engine.reset_prefix_cache():
        raise RuntimeError("replay_engine needs an idle engine: requests in it still hold blocks")
    t0, reqs = run_requests(engine, w.prompts, [greedy(n) for n in w.max_tokens], arrivals)
    timings = [RequestTiming(t0 + a, tuple(r.token_times), r.finish_time) for a, r in zip(arrivals, reqs)]
    return Replay("nanoserve-engine", rate, timings, [r.output_token_ids for r in reqs])


@contextmanager
def start_hf_manager(hf_model, w: Workload) -> Iterator:
    """transformers' continuous batching manager sized for w, greedy, EOS off, started and warmed (not timed), and
    stopped when the `with` ends. Its cache holds every request of w at once, so it never waits for room; left to
    size itself on a CPU, it takes most of the machine's RAM whatever other processes hold, and the kernel can kill
    one of them."""
    from transformers import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    config = copy.deepcopy(hf_model.generation_config)
    config.update(do_sample=False, temperature=None, top_p=None, top_k=None, eos_token_id=None,
                  max_new_tokens=max(w.max_tokens))
    hints = WorkloadHints(max_prompt_length=max(len(p) for p in w.prompts),
                          max_generated_length=max(w.max_tokens), num_requests=len(w.prompts))
    cb = ContinuousBatchingConfig()
    cb.num_blocks = sum(-(-(len(p) + n) // cb.page_size) for p, n in zip(w.prompts, w.max_tokens)) + 1
    manager = hf_model.init_continuous_batching(generation_config=config, continuous_batching_config=cb,
                                                workload_hints=hints)
    manager.start()
    try:
        replay_hf_continuous(manager, Workload("warm", [w.prompts[0][:8]], [2]), [0.0])
        yield manager
    finally:
        manager.stop(block=True)


def replay_hf_continuous(manager, w: Workload, arrivals: Sequence[float], rate: float = math.nan,
                         timeout_s: float = 1800) -> Replay:
    """transformers' manager (started, warm): requests added at their arrivals, results collected as they end."""
    t0 = time.perf_counter()
    ids = []
    done: dict[str, object] = {}
    while len(done) < len(arrivals):
        now = time.perf_counter() - t0
        while len(ids) < len(arrivals) and arrivals[len(ids)] <= now:
            i = len(ids)
            ids.append(manager.add_request(w.prompts[i], request_id=f"{w.name}-r{rate}-{i}",
                                           max_new_tokens=w.max_tokens[i], record_timestamps=True))
        if now > timeout_s or not manager.is_running():
            raise RuntimeError(f"transformers' continuous batching stopped with {len(done)} of {len(arrivals)} done")
        wait = 0.05 if len(ids) == len(arrivals) else max(0.0, min(0.05, arrivals[len(ids)] - now))
        r = manager.get_result(timeout=wait) if wait > 0 else None
        if r is not None and r.is_finished():
            done[r.request_id] = r
    timings = [RequestTiming(t0 + a, tuple(done[i].timestamps), done[i].timestamps[-1]) for a, i in zip(arrivals, ids)]
    return Replay("transformers-cb", rate, timings, [list(done[i].generated_tokens) for i in ids])


def replay_server(port: int, w: Workload, arrivals: Sequence[float], rate: float = math.nan,
                  system: str = "nanoserve-server", tok=None) -> Replay:
    """Each request a streaming completion sent at its arrival, its tokens stamped as the client sees them; where
    no ids come back (llama-server, transformers serve), a chunk with text is a token and usage counts the rest.
    nanoserve's server empties its prefix cache first (`POST /reset_prefix_cache`), as `replay_engine` does."""
    import httpx

    def body(i: int, model: str) -> dict:
        out = dict(model=model, prompt=w.prompts[i], max_tokens=w.max_tokens[i], temperature=0, stream=True)
        if system == "transformers-serve":  # the prompt as text, EOS off through its generation_config
            config = dict(do_sample=False, eos_token_id=-1, max_new_tokens=w.max_tokens[i])
            return out | dict(prompt=tok.decode(w.prompts[i]), generation_config=json.dumps(config))
        return out | dict(ignore_eos=True) | (dict(return_token_ids=True) if system == "nanoserve-server" else {})

    async def one(client, url: str, body: dict, send_at: float) -> tuple[RequestTiming, list[int]]:
        await asyncio.sleep(max(0.0, send_at - time.perf_counter()))
        times, ids, used = [], [], None
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"server answered {resp.status_code}: {(await resp.aread())[:300]!r}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now, chunk = time.perf_counter(), json.loads(line[6:])
                used = chunk["usage"]["completion_tokens"] if chunk.get("usage") else used
                c = chunk["choices"][0] if chunk.get("choices") else {}
                ids += c.get("token_ids", [])
                times += [now] * (len(c["token_ids"]) if "token_ids" in c else int(bool(c.get("text"))))
                if c.get("finish_reason") and used is not None and used > len(times):
                    times += [now] * (used - len(times))
        return RequestTiming(send_at, tuple(times), time.perf_counter()), ids

    async def main() -> list[tuple[RequestTiming, list[int]]]:
        limits = httpx.Limits(max_connections=len(arrivals) + 1, max_keepalive_connections=len(arrivals) + 1)
        async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
            model = (await client.get(f"http://127.0.0.1:{port}/v1/models")).json()["data"][0]["id"]
            if system == "nanoserve-server":
                (await client.post(f"http://127.0.0.1:{port}/reset_prefix_cache")).raise_for_status()
            t0, url = time.perf_counter(), f"http://127.0.0.1:{port}/v1/completions"
            return await asyncio.gather(*[one(client, url, body(i, model), t0 + a) for i, a in enumerate(arrivals)])

    results = asyncio.run(main())
    return Replay(system, rate, [t for t, _ in results], [ids for _, ids in results])


def slot_tokens(w: Workload) -> int:
    """The context each llama-server slot gets: the workload's longest request, prompt and output."""
    return max(len(p) + m for p, m in zip(w.prompts, w.max_tokens))


def peer_threads(threads: int | None) -> int:
    """The threads a peer server is given: the engine's (`--threads`), else every core."""
    return threads or os.cpu_count() or 1


def peer_runs(systems: Sequence[str], slots: Sequence[int] | None) -> list[tuple[str, str, int | None]]:
    """(system, its label in the CSV, llama-server's slots) for each run: llama-server once per slot count, each
    labelled `llama-server -np N` where several are swept."""
    runs: list[tuple[str, str, int | None]] = []
    for system in systems:
        if system == "llama-server" and slots and len(slots) > 1:
            runs += [(system, f"llama-server -np {n}", n) for n in slots]
        else:
            runs.append((system, system, slots[0] if system == "llama-server" and slots else None))
    return runs


def with_kv(args: argparse.Namespace, kv: str) -> argparse.Namespace:
    """The command's flags with one K/V cache dtype: a run's (its engine's model, its server's command line)."""
    return argparse.Namespace(**{**vars(args), "kv_cache_dtype": kv})


def kv_runs(system: str, label: str, kv_dtypes: Sequence[str]) -> list[tuple[str, str]]:
    """(label, K/V cache dtype) of each run of a system: nanoserve once per --kv-cache-dtype (a bf16 cache labelled
    `... kv-bf16`), a peer once, with its own cache."""
    if not system.startswith("nanoserve"):
        return [(label, kv_dtypes[0])]
    return [(label + (" kv-bf16" if kv == "bfloat16" else ""), kv) for kv in kv_dtypes]


def budget_runs(system: str, label: str, config: EngineConfig, options: Sequence[str], budget: str, slo: SLO,
                ) -> list[tuple[str, EngineConfig, list[str]]]:
    """(label, engine config, `serve` options) for each run of a nanoserve system under `--slo-budget`: "off" as
    configured, "on" with a TPOT target equal to the SLO's, "both" one of each (the second labelled `... slo-budget`).
    A peer runs once, as it is."""
    if not system.startswith("nanoserve") or budget == "off":
        return [(label, config, list(options))]
    plain = [o for i, o in enumerate(options) if o != "--tpot-slo-ms" and (i == 0 or options[i - 1] != "--tpot-slo-ms")]
    target = slo.tpot_s * 1e3
    on = (f"{label} slo-budget", dataclasses.replace(config, scheduler=dataclasses.replace(
        config.scheduler, tpot_slo_ms=target)), plain + ["--tpot-slo-ms", f"{target:g}"])
    off = (label, dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, tpot_slo_ms=None)), plain)
    return [off, on] if budget == "both" else [on]


@contextmanager
def serving(system: str, model: Llama, tok, config: EngineConfig, w: Workload,
            server_options: Sequence[str] = (), threads: int | None = None, folder: Path | None = None,
            slots: int | None = None) -> Iterator[Callable[..., Replay]]:
    """One system stood up and warm, as `replay(workload, arrivals, rate)`; `folder`: the checkpoint the peers
    load (its GGUF for llama-server; default: the fetched SmolLM2); `slots`: llama-server's (default: a slot per
    sequence the engine runs at once)."""
    folder = folder or ensure_model()
    warm = Workload("warm", w.prompts[:2], [2, 2])
    if system == "nanoserve-engine":
        engine = LLMEngine(model, tok, config)
        replay_engine(engine, warm, [0.0, 0.0])
        yield lambda w, arrivals, rate: replay_engine(engine, w, arrivals, rate)
    elif system == "transformers-cb":
        with start_hf_manager(load_hf_model(folder, attn="sdpa"), w) as manager:
            yield lambda w, arrivals, rate: replay_hf_continuous(manager, w, arrivals, rate)
    else:
        port, command = free_port(), None
        if system == "llama-server":  # its slots, each fitting the longest request
            parallel = slots or config.scheduler.max_num_seqs
            command = llama_server_argv(llama_server_path(), gguf_of(folder), port, parallel, slot_tokens(w),
                                        peer_threads(threads))
        elif system == "transformers-serve":  # its continuous batching, the model preloaded
            command = [str(Path(sys.executable).with_name("transformers")), "serve", "--continuous-batching",
                       "--host", "127.0.0.1", "--port", str(port), str(folder)]
        # warmed on prompts that share no prefix with the workload's (their ids reversed), so no cache is primed
        warm = Workload("warm", [p[::-1] for p in warm.prompts], warm.max_tokens)

        def up() -> subprocess.Popen:
            proc = start_server(port, server_options if command is None else (), command=command)
            replay_server(port, warm, [0.0, 0.0], system=system, tok=tok)
            return proc

        def down(proc: subprocess.Popen) -> None:
            proc.terminate()
            proc.wait(timeout=30)

        proc, used = up(), False

        def replay(w: Workload, arrivals: Sequence[float], rate: float) -> Replay:
            # nanoserve's server empties its prefix cache over HTTP; a peer's prompt cache (llama-server keeps
            # one per slot and one in RAM) goes with its process, so a peer is restarted before each later replay
            nonlocal proc, used
            if used and command is not None:
                down(proc)
                proc = up()
            used = True
            return replay_server(port, w, arrivals, rate, system=system, tok=tok)

        try:
            yield replay
        finally:
            down(proc)


def write_csvs(out: str | Path, replays: Sequence[Replay], w: Workload, slo: SLO, meta: dict) -> None:
    rows = [dict(system=r.system, rate=r.rate, **{k: round(v, 5) for k, v in serving_metrics(r.timings, slo).row()
                                                  .items()}) for r in replays]
    csvio.write_csv(out, rows, meta)
    requests = [dict(system=r.system, rate=r.rate, request=i, arrival_s=round(t.start - r.timings[0].start, 4),
                     prompt_tokens=len(w.prompts[i]), output_tokens=t.output_len, ttft_s=round(t.ttft, 4),
                     tpot_s="" if t.tpot is None else round(t.tpot, 5), e2e_s=round(t.latency, 4),
                     met_slo=int(slo.met(t.ttft, t.tpot))) for r in replays for i, t in enumerate(r.timings)]
    csvio.write_csv(csvio.beside(out, "requests"), requests, meta)


def read_summary(path: str | Path) -> tuple[dict[str, str], list[dict]]:
    """The header and the summary rows, numbers as floats (as are `read_requests`', TPOT None for one token)."""
    meta, rows = csvio.read_csv(path, parse=True)
    return meta, [{k: float(v) if isinstance(v, int) else v for k, v in r.items()} for r in rows]


def read_requests(path: str | Path) -> list[dict]:
    return read_summary(csvio.beside(path, "requests"))[1]


def goodput_under(summary: Sequence[dict], requests: Sequence[dict], slo: SLO) -> dict[tuple[str, float], float]:
    """Each (system, rate)'s goodput recomputed from its requests under another SLO."""
    duration = {(r["system"], r["rate"]): r["duration_s"] for r in summary}
    good = dict.fromkeys(duration, 0)
    for r in requests:
        good[(r["system"], r["rate"])] += slo.met(r["ttft_s"], r["tpot_s"])
    return {k: good[k] / duration[k] for k in duration}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)")
    ap.add_argument("--systems", nargs="+", choices=SYSTEMS, default=["nanoserve-engine", "transformers-cb"])
    ap.add_argument("--slo-ttft", type=float, default=SLO.ttft_s, help="seconds")
    ap.add_argument("--slo-tpot", type=float, default=SLO.tpot_s, help="seconds")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="ragged",
                    help="ragged: prompts 20-300 tokens, outputs 8-128; prompt-heavy: prompts 100-300, outputs 30-100")
    ap.add_argument("--slo-budget", choices=("off", "on", "both"), default="off",
                    help="nanoserve with a TPOT target equal to --slo-tpot (on), without (off), or one run of each")
    ap.add_argument("--llama-server-slots", type=int, nargs="+", default=None, metavar="N",
                    help="llama-server's --parallel, one run per value (default: --max-num-seqs)")
    common_arguments(ap, CSV_PATH, engine=True, rates=[0.5, 1.0, 1.5, 2.0, 3.0, 4.0], requests=40, seed=0,
                     weights="fp32", several_kv=True)


def run(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    systems = list(args.systems)
    if "llama-server" in systems and llama_server_path() is None:
        print(f"llama-server: skipped, not built (`python -m nanoserve bench clients build-llama-server` builds it "
              f"into {nanoserve_home() / 'llama.cpp'} from the llama-cpp-python sdist)", file=sys.stderr)
        systems.remove("llama-server")
    if not systems:
        return 0
    kv_dtypes = list(dict.fromkeys(args.kv_cache_dtype))
    start(args, model=False)
    models = {kv_dtypes[0]: loader.from_cli(with_kv(args, kv_dtypes[0]))}  # the others when an engine run needs one
    tok = models[kv_dtypes[0]][1]
    slo, config = SLO(args.slo_ttft, args.slo_tpot), engine_config(args)
    w = WORKLOADS[args.workload](tok, args.requests, seed=args.seed)
    traces = {rate: arrival_times(args.requests, rate, args.burstiness, args.seed) for rate in args.rates}
    extra = dict(slo=dict(ttft_s=slo.ttft_s, tpot_s=slo.tpot_s), workload=w.name, requests=args.requests,
                 burstiness=args.burstiness, scheduler=dict(max_num_seqs=config.scheduler.max_num_seqs,
                                                            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
                                                            tpot_slo_ms=config.scheduler.tpot_slo_ms),
                 slo_budget=args.slo_budget,
                 weights=args.weights, dtype=args.dtype, activations=args.activations,
                 kv_cache_dtype=kv_dtypes[0] if len(kv_dtypes) == 1 else kv_dtypes)
    if any(s.startswith("transformers") for s in systems):  # the peer's speed is its release's
        extra["transformers"] = importlib.metadata.version("transformers")
    slots = args.llama_server_slots or [config.scheduler.max_num_seqs]  # llama-server's, one run each
    if "llama-server" in systems:  # the peer's release and how it was run
        extra["llama_server"] = llama_server_version(llama_server_path())
        extra["llama_server_args"] = dict(parallel=slots, ctx_size_per_slot=slot_tokens(w), cont_batching=True,
                                          threads=peer_threads(args.threads), cache_type_k=LLAMA_KV_CACHE,
                                          cache_type_v=LLAMA_KV_CACHE)
    meta = csv_header(argv, **extra)
    threads = ["--threads", str(args.threads)] if args.threads else []
    replays: list[Replay] = []
    runs = [(system, run, parallel, kv) for system, label, parallel in peer_runs(systems, slots)
            for kv_label, kv in kv_runs(system, label, kv_dtypes)
            for run in budget_runs(system, kv_label, config,
                                   engine_argv(args) + loader.cli_argv(with_kv(args, kv)) + threads, args.slo_budget,
                                   slo)]
    for system, (label, run_config, run_options), parallel, kv in runs:
        if system == "nanoserve-engine" and kv not in models:
            models[kv] = loader.from_cli(with_kv(args, kv))
        model = models.get(kv, models[kv_dtypes[0]])[0]  # a server loads its own
        if replays:  # what is done so far is kept, should a later system fail or be stopped
            write_csvs(args.out, replays, w, slo, meta)
        print(f"{label} ...", flush=True)
        with serving(system, model, tok, run_config, w, run_options, args.threads, model_folder(args.model),
                     parallel) as replay:
            for rate, trace in traces.items():
                replays.append(dataclasses.replace(replay(w, trace, rate), system=label))
                m = serving_metrics(replays[-1].timings, slo)
                print(f"  rate {rate:g}: {m.request_throughput:.2f} req/s, goodput {m.goodput:.2f}, TTFT p50 "
                      f"{m.ttft['p50']:.2f} s, TPOT p50 {m.tpot['p50'] * 1e3:.0f} ms", flush=True)
    write_csvs(args.out, replays, w, slo, meta)
    return report(f"{args.out}, {csvio.beside(args.out, 'requests')}", meta, read_summary(args.out)[1], [
        "system", "rate", "request_throughput", "goodput", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "e2e_p50"])
