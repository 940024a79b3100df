"""`python -m nanoserve bench arrivals`: requests arriving over time, served; vLLM's metrics per rate.

The workload is `bench engine`'s ragged one (prompts of 20 to 300 tokens of prose, outputs of 8 to
128 with EOS ignored), sent on a gamma/Poisson trace (`serving.arrival_times`) at each rate in turn.
Each system replays the same trace on the wall clock, one after another in this process:

    nanoserve-engine   LLMEngine, stepped by the replay loop: a request arriving during a step
                       joins at the next one, as it does in the server
    nanoserve-server   the OpenAI-compatible server (`python -m nanoserve serve`, a subprocess),
                       called over loopback by streaming HTTP clients, timed at the client
    transformers-cb    transformers' continuous batching manager (its own background thread), each
                       request added at its arrival, token times from its own timestamps
    transformers-serve `transformers serve --continuous-batching` (a subprocess), the same manager behind
                       its OpenAI-compatible HTTP server, called and timed as nanoserve-server is

A request's clock starts at its scheduled arrival, so a system that is late to admit it pays in TTFT.
Two CSVs: one summary row per (system, rate) (`--out`), one row per request beside it (`-requests`).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import importlib.metadata
import json
import math
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..config import EngineConfig, SchedulerConfig
from ..engine import LLMEngine
from ..model import Llama
from ..sampling import SamplingParams
from .engine import Workload, ragged_workload, start_hf_manager
from .machine import add_common_arguments, command_line, csv_header, read_header, use_threads
from .serving import SLO, ServingMetrics, arrival_times, serving_metrics
from .timing import RequestTiming

CSV_PATH = "data/bench-arrivals.csv"
SYSTEMS = ("nanoserve-engine", "nanoserve-server", "transformers-cb", "transformers-serve")
RATES = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0)


@dataclass
class Replay:
    """One system on one trace: each request's timing (absolute clock readings) and tokens."""

    system: str
    rate: float
    timings: list[RequestTiming]
    tokens: list[list[int]]


def replay_engine(engine: LLMEngine, w: Workload, arrivals: Sequence[float], rate: float = math.nan) -> Replay:
    """Add each request when its arrival time comes, step while anything is unfinished, sleep otherwise."""
    clock = engine.clock
    t0 = clock()
    ids: list[str] = []
    while len(ids) < len(arrivals) or engine.has_unfinished_requests():
        now = clock() - t0
        while len(ids) < len(arrivals) and arrivals[len(ids)] <= now:
            i = len(ids)
            ids.append(engine.add_request(w.prompts[i], SamplingParams(temperature=0, max_tokens=w.max_tokens[i],
                                                                       ignore_eos=True)))
        if engine.has_unfinished_requests():
            engine.step()
        elif len(ids) < len(arrivals):
            time.sleep(max(0.0, arrivals[len(ids)] - (clock() - t0)))
    reqs = [engine.requests.pop(i) for i in ids]
    timings = [RequestTiming(t0 + a, tuple(r.token_times), r.finish_time) for a, r in zip(arrivals, reqs)]
    return Replay("nanoserve-engine", rate, timings, [r.output_token_ids for r in reqs])


def replay_hf_continuous(manager, w: Workload, arrivals: Sequence[float], rate: float = math.nan,
                         timeout_s: float = 1800) -> Replay:
    """transformers' manager (started, warm): requests added at their arrivals, results collected as they end."""
    t0 = time.perf_counter()
    ids = []
    done: dict[str, object] = {}
    deadline = t0 + timeout_s
    while len(done) < len(arrivals):
        now = time.perf_counter() - t0
        while len(ids) < len(arrivals) and arrivals[len(ids)] <= now:
            i = len(ids)
            ids.append(manager.add_request(w.prompts[i], request_id=f"r{rate}-{i}", max_new_tokens=w.max_tokens[i],
                                           record_timestamps=True))
        if time.perf_counter() > deadline or not manager.is_running():
            raise RuntimeError(f"transformers' continuous batching stopped with {len(done)} of {len(arrivals)} done")
        wait = 0.05 if len(ids) == len(arrivals) else max(0.0, min(0.05, arrivals[len(ids)] - now))
        r = manager.get_result(timeout=wait) if wait > 0 else None
        if r is not None and r.is_finished():
            done[r.request_id] = r
    timings, tokens = [], []
    for a, rid in zip(arrivals, ids):
        r = done[rid]
        times = tuple(r.timestamps)
        timings.append(RequestTiming(t0 + a, times, times[-1]))
        tokens.append(list(r.generated_tokens))
    return Replay("transformers-cb", rate, timings, tokens)


# ---- the server, called over HTTP ----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, extra: Sequence[str] = (), timeout_s: float = 180,
                 command: Sequence[str] | None = None) -> subprocess.Popen:
    """A server in a subprocess (`python -m nanoserve serve` unless `command` says otherwise), returned once
    its /health answers."""
    import httpx

    command = list(command or [sys.executable, "-m", "nanoserve", "serve", "--port", str(port)]) + list(extra)
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise RuntimeError(f"the server did not answer /health within {timeout_s} s")


def transformers_serve_command(port: int, model_dir: str | Path) -> list[str]:
    """`transformers serve` with its continuous batching, on loopback, the model preloaded."""
    exe = Path(sys.executable).with_name("transformers")
    return [str(exe), "serve", "--continuous-batching", "--host", "127.0.0.1", "--port", str(port), str(model_dir)]


async def _stream_one(client, url: str, body: dict, send_at: float,
                      clock=time.perf_counter) -> tuple[float, list[float], float, list[int]]:
    """One streaming completion sent at `send_at` (clock reading); returns (start, token times, end, token ids).
    A chunk's tokens are stamped when it arrives. Where the server sends text but no ids (transformers serve),
    each chunk with text is one token, and the final usage count says whether a last one came without text."""
    await asyncio.sleep(max(0.0, send_at - clock()))
    times, ids, used = [], [], None
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"server answered {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = clock()
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                used = chunk["usage"]["completion_tokens"]
            if not chunk.get("choices"):
                continue
            c = chunk["choices"][0]
            if "token_ids" in c:
                times += [now] * len(c["token_ids"])
                ids += c["token_ids"]
            elif c.get("text"):
                times.append(now)
            if c.get("finish_reason") and used is not None and used > len(times):
                times += [now] * (used - len(times))
    return send_at, times, clock(), ids


def replay_server(port: int, w: Workload, arrivals: Sequence[float], rate: float = math.nan,
                  system: str = "nanoserve-server", tok=None) -> Replay:
    """Every request a streaming HTTP client sent at its arrival; timed where the client sees the tokens.
    nanoserve's server takes token ids and ignore_eos; transformers serve takes text (the prompt decoded) and
    EOS turned off through its generation_config field."""
    import httpx

    def body(i: int, model: str) -> dict:
        if system == "nanoserve-server":
            return dict(model=model, prompt=w.prompts[i], max_tokens=w.max_tokens[i], temperature=0,
                        ignore_eos=True, stream=True, return_token_ids=True)
        config = json.dumps(dict(do_sample=False, eos_token_id=-1, max_new_tokens=w.max_tokens[i]))
        return dict(model=model, prompt=tok.decode(w.prompts[i]), max_tokens=w.max_tokens[i], temperature=0,
                    stream=True, generation_config=config)

    async def main() -> list[tuple[float, list[float], float, list[int]]]:
        limits = httpx.Limits(max_connections=len(arrivals) + 1, max_keepalive_connections=len(arrivals) + 1)
        async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
            models = (await client.get(f"http://127.0.0.1:{port}/v1/models")).json()
            model = models["data"][0]["id"]
            t0 = time.perf_counter()
            url = f"http://127.0.0.1:{port}/v1/completions"
            return await asyncio.gather(*[_stream_one(client, url, body(i, model), t0 + a)
                                          for i, a in enumerate(arrivals)])

    results = asyncio.run(main())
    timings = [RequestTiming(start, tuple(times), end) for start, times, end, _ in results]
    return Replay(system, rate, timings, [ids for *_, ids in results])


# ---- CSVs ----------------------------------------------------------------------------------------------

REQUEST_FIELDS = ["system", "rate", "request", "arrival_s", "prompt_tokens", "output_tokens", "ttft_s", "tpot_s",
                  "e2e_s", "met_slo"]


def summary_row(r: Replay, slo: SLO) -> dict:
    m = serving_metrics(r.timings, slo)
    return dict(system=r.system, rate=r.rate, **{k: round(v, 5) for k, v in m.row().items()})


def requests_path(out: str | Path) -> Path:
    out = Path(out)
    return out.with_name(out.stem + "-requests" + out.suffix)


def write_csvs(out: str | Path, replays: Sequence[Replay], w: Workload, slo: SLO, header: Sequence[str]) -> None:
    rows = [summary_row(r, slo) for r in replays]
    with open(out, "w", newline="") as f:
        f.writelines(line + "\n" for line in header)
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    with open(requests_path(out), "w", newline="") as f:
        f.writelines(line + "\n" for line in header)
        writer = csv.DictWriter(f, fieldnames=REQUEST_FIELDS)
        writer.writeheader()
        for r in replays:
            t0 = min(t.start for t in r.timings)
            for i, t in enumerate(r.timings):
                writer.writerow(dict(system=r.system, rate=r.rate, request=i, arrival_s=round(t.start - t0, 4),
                                     prompt_tokens=len(w.prompts[i]), output_tokens=t.output_len,
                                     ttft_s=round(t.ttft, 4), tpot_s="" if t.tpot is None else round(t.tpot, 5),
                                     e2e_s=round(t.latency, 4), met_slo=int(slo.met(t))))


def read_summary(path: str | Path) -> tuple[dict[str, str], list[dict]]:
    """The header and the summary rows, numbers as floats."""
    lines = [ln for ln in Path(path).read_text().splitlines() if not ln.startswith("#")]
    rows = []
    for r in csv.DictReader(lines):
        rows.append({k: (v if k == "system" else float(v)) for k, v in r.items()})
    return read_header(path), rows


def read_requests(path: str | Path) -> list[dict]:
    """The per-request rows beside a summary CSV, numbers as floats (a one-token request's TPOT is None)."""
    lines = [ln for ln in requests_path(path).read_text().splitlines() if not ln.startswith("#")]
    return [{k: (v if k == "system" else None if v == "" else float(v)) for k, v in r.items()}
            for r in csv.DictReader(lines)]


def goodput_under(summary: Sequence[dict], requests: Sequence[dict], slo: SLO) -> dict[tuple[str, float], float]:
    """Each (system, rate)'s goodput recomputed from its requests under another SLO (same runs, same durations)."""
    duration = {(r["system"], r["rate"]): r["duration_s"] for r in summary}
    good: dict[tuple[str, float], int] = dict.fromkeys(duration, 0)
    for r in requests:
        met = r["ttft_s"] <= slo.ttft_s and (r["tpot_s"] is None or r["tpot_s"] <= slo.tpot_s)
        good[(r["system"], r["rate"])] += met
    return {k: good[k] / duration[k] for k in duration}


def print_table(rows: Sequence[dict]) -> None:
    print(f"{'system':18} {'rate':>5} {'req/s':>6} {'goodput':>7} {'ttft p50':>8} {'ttft p99':>8} {'tpot p50':>8} "
          f"{'tpot p99':>8} {'e2e p50':>8}")
    for r in rows:
        print(f"{r['system']:18} {r['rate']:5.2f} {r['request_throughput']:6.2f} {r['goodput']:7.2f} "
              f"{r['ttft_p50']:8.2f} {r['ttft_p99']:8.2f} {r['tpot_p50'] * 1e3:6.0f}ms {r['tpot_p99'] * 1e3:6.0f}ms "
              f"{r['e2e_p50']:8.2f}")


# ---- the command ---------------------------------------------------------------------------------------


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--rates", type=float, nargs="+", default=list(RATES), help="requests/s (inf: all at once)")
    ap.add_argument("--requests", type=int, default=40, help="requests per rate")
    ap.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--systems", nargs="+", choices=SYSTEMS, default=["nanoserve-engine", "transformers-cb"])
    ap.add_argument("--slo-ttft", type=float, default=SLO.ttft_s, help="seconds")
    ap.add_argument("--slo-tpot", type=float, default=SLO.tpot_s, help="seconds")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    add_common_arguments(ap, CSV_PATH)


def run(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    """Each system over every rate, one after another in this process; two CSVs and a table."""
    use_threads(args)
    from ..loader import load

    slo = SLO(args.slo_ttft, args.slo_tpot)
    config = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    model, tok = load()
    w = ragged_workload(tok, args.requests, seed=args.seed)
    traces = {rate: arrival_times(args.requests, rate, args.burstiness, args.seed) for rate in args.rates}
    replays: list[Replay] = []
    extra = dict(slo=json.dumps(dict(ttft_s=slo.ttft_s, tpot_s=slo.tpot_s)), requests=args.requests,
                 burstiness=args.burstiness,
                 scheduler=json.dumps(dict(max_num_seqs=config.max_num_seqs,
                                           max_num_batched_tokens=config.max_num_batched_tokens)))
    if any(s.startswith("transformers") for s in args.systems):  # the peer's speed is its release's
        extra["transformers"] = importlib.metadata.version("transformers")
    header = csv_header(command_line(argv), **extra)  # the machine line: its load when the run started
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for system in args.systems:
        if replays:  # what is done so far is kept, should a later system fail or be stopped
            write_csvs(args.out, replays, w, slo, header)
        print(f"{system} ...", flush=True)
        if system == "nanoserve-engine":
            engine = _warm_engine(model, tok, config, w)
            for rate, trace in traces.items():
                replays.append(replay_engine(engine, w, trace, rate))
                _report(replays[-1], slo)
        elif system == "transformers-cb":
            from ..model.fetch import ensure_model
            from .harness import load_hf_model

            hf_model = load_hf_model(ensure_model())
            hf_model.set_attn_implementation("sdpa")
            manager = start_hf_manager(hf_model, w)
            try:
                for rate, trace in traces.items():
                    replays.append(replay_hf_continuous(manager, w, trace, rate))
                    _report(replays[-1], slo)
            finally:
                manager.stop(block=True)
            del hf_model
        else:
            port = free_port()
            if system == "nanoserve-server":
                proc = start_server(port, ["--max-num-seqs", str(config.max_num_seqs), "--max-num-batched-tokens",
                                           str(config.max_num_batched_tokens)]
                                    + (["--threads", str(args.threads)] if args.threads else []))
            else:
                from ..model.fetch import ensure_model

                proc = start_server(port, command=transformers_serve_command(port, ensure_model()))
            try:
                replay_server(port, Workload("warm", w.prompts[:1], [2]), [0.0], system=system, tok=tok)
                for rate, trace in traces.items():
                    replays.append(replay_server(port, w, trace, rate, system=system, tok=tok))
                    _report(replays[-1], slo)
            finally:
                proc.terminate()
                proc.wait(timeout=30)
    write_csvs(args.out, replays, w, slo, header)
    print("\n".join(header))
    print_table(read_summary(args.out)[1])
    print(f"-> {args.out}, {requests_path(args.out)}")
    return 0


def _warm_engine(model: Llama, tok, config: SchedulerConfig, w: Workload) -> LLMEngine:
    engine = LLMEngine(model, tok, EngineConfig(scheduler=config))
    replay_engine(engine, Workload("warm", w.prompts[:2], [2, 2]), [0.0, 0.0])
    return engine


def _report(r: Replay, slo: SLO) -> ServingMetrics:
    m = serving_metrics(r.timings, slo)
    print(f"  rate {r.rate:g}: {m.request_throughput:.2f} req/s, goodput {m.goodput:.2f}, "
          f"TTFT p50 {m.ttft['p50']:.2f} s, TPOT p50 {m.tpot['p50'] * 1e3:.0f} ms", flush=True)
    return m

